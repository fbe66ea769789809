"""The papers' claims about their own tasks, read from the numbers (issue 28; each study of
``posenc.studies`` registers its reading with ``posenc.compare.reading``): each reading
agrees when the numbers do and flips when they are reversed."""

from __future__ import annotations

import pytest
from tests.test_compare_reading import _results, _summary

from posenc.compare.reading import STUDY_FINDINGS, findings
from posenc.studies import cope2024, kazemnejad2023, press2022
from posenc.studies.kazemnejad2023 import mean_ranks

AS_PUBLISHED = {  # accuracy at n = 64 (training), 128, 512
    "nope": [1.0, 0.9, 0.8],
    "t5": [1.0, 0.85, 0.8],
    "alibi": [1.0, 0.5, 0.4],
    "rope": [1.0, 0.2, 0.1],
    "learned": [1.0, None, None],  # cannot run past its max_len
}


def _one(results, source):
    found = [f for f in findings(_summary(results)) if f.source.startswith(source)]
    assert len(found) == 1
    return found[0]


def test_kazemnejad_mean_rank_as_published():
    res = _results(AS_PUBLISHED, task="kaz-copy")
    # by hand: at 128 nope and t5 tie (Wilson intervals over 256 samples overlap), then alibi,
    # rope, learned (n/a: 0 %); at 512 nope = t5 again
    assert mean_ranks(_summary(res), list(AS_PUBLISHED)) == {
        "nope": 1.5, "t5": 1.5, "alibi": 3.0, "rope": 4.0, "learned": 5.0}  # fmt: skip
    f = _one(res, "Kazemnejad et al. 2023, Fig. 3")
    assert f.verdict == "agrees"
    assert f.evidence == ("mean rank past L=64 (1 = best): nope 1.50, t5 1.50, alibi 3.00, rope 4.00, "
                             "learned 5.00; mean reciprocal rank: nope 0.67, t5 0.67, alibi 0.33, rope 0.25, "
                             "learned 0.20; n/a past its length limit, ranked as 0 %: learned")  # fmt: skip


def test_kazemnejad_reversed_and_mixed():
    reversed_ = {"nope": [1.0, 0.1, 0.05], "t5": [1.0, 0.1, 0.05], "alibi": [1.0, 0.5, 0.4],
                 "rope": [1.0, 0.9, 0.8], "learned": [1.0, 0.95, 0.9]}  # fmt: skip
    assert _one(_results(reversed_, task="kaz-sum"), "Kazemnejad et al. 2023, Fig. 3").verdict == "disagrees"
    mixed = {**AS_PUBLISHED, "alibi": [1.0, 0.05, 0.0]}  # alibi below rope: that pair reversed
    f = _one(_results(mixed, task="kaz-lego"), "Kazemnejad et al. 2023, Fig. 3")
    assert f.verdict == "partly"
    assert [c.pair for c in f.checks if c.agrees is False] == [("alibi", "rope")]


def test_kazemnejad_leaves_out_what_was_not_learned():
    res = _results({**AS_PUBLISHED, "alibi": [0.5, 0.4, 0.3]}, task="kaz-parity")
    f = _one(res, "Kazemnejad et al. 2023, Fig. 3")
    assert "alibi" not in f.evidence.split(";")[0]
    assert f.evidence.endswith("left out (failed, diverged or < 90 % at the training length): alibi")
    # the suite's own tasks get no mean-rank reading (only the task's own paper is read)
    assert not [f for f in findings(_summary(_results(AS_PUBLISHED, task="copy"))) if "Fig. 3" in f.source]


def test_kazemnejad_undecided_says_why():
    # two encodings learned the task, but only one can run past the training length
    # (as kaz-parity at 8 000 steps: alibi and learned learned it, learned is n/a past L)
    few = {"nope": [0.6, 0.5, 0.4], "t5": [0.5, 0.5, 0.5], "alibi": [1.0, 0.6, 0.3], "learned": [1.0, None, None]}
    (f,) = [f for f in findings(_summary(_results(few, task="kaz-parity"))) if f.source == "Kazemnejad et al. 2023"]
    assert f.verdict == "undecided"
    assert f.evidence == ("of the encodings that learned the task at the training length (alibi, learned), "
                             "fewer than two have an answer at any one length past it (n/a past the training length: learned) "
                             "(left out, not learned at the training length: nope, t5)")  # fmt: skip
    (f,) = [f for f in findings(_summary(_results({**few, "learned": [0.5, None, None]}, task="kaz-parity")))
            if f.source == "Kazemnejad et al. 2023"]  # fmt: skip
    assert f.evidence.startswith("fewer than two of its encodings learned the task at the training length (")


@pytest.mark.parametrize("rope, verdict, rope_agrees", [([1.0, 0.3, 0.1], "agrees", True),
                                                        ([1.0, 0.99, 0.99], "partly", False),
                                                        ([1.0, 0.9, 0.8], "partly", None)])  # fmt: skip
def test_cope_counts_better(rope, verdict, rope_agrees):
    res = _results({"cope": [1.0, 0.9, 0.8], "nope": [1.0, 0.5, 0.2], "rope": rope}, task="count")
    f = _one(res, "Golovneva et al. 2024")
    assert f.verdict == verdict  # better than every other: a tie (rope = cope) does not confirm it
    assert {c.agrees for c in f.checks if c.pair == ("cope", "rope")} == {rope_agrees}
    assert f.evidence.startswith("n=128: cope 90.0% vs best other")
    # cope not learned at the training length: nothing to read
    res = _results({"cope": [0.5, 0.5, 0.5], "rope": rope}, task="count")
    assert not [f for f in findings(_summary(res)) if f.source.startswith("Golovneva")]


def _flip_flop(per_enc: dict[str, tuple[float, float, float]]) -> dict:
    runs = []
    for enc, (mid, sparse, dense) in per_enc.items():
        depths = [
            {"depth": 0.8, "accuracy": mid},
            {"depth": 0.98, "accuracy": sparse},
            {"depth": 0.1, "accuracy": dense},
        ]
        acc = (mid + sparse + dense) / 3
        runs.append({"encoding": enc, "seed": 0, "convergence": {"converged": True},
                     "eval": [{"length": 16, "applicable": True, "accuracy": acc, "depths": depths},
                              {"length": 32, "applicable": True, "accuracy": acc, "depths": depths}]})  # fmt: skip
    return {"config": {"train_len": 16, "task": "flip-flop", "seeds": [0], "eval_samples": 256}, "runs": runs}


def test_flip_flop_sparse_and_dense_errors():
    f = _one(_flip_flop({"rope": (1.0, 0.7, 0.8), "alibi": (1.0, 0.9, 0.95)}), "Liu et al. 2023")
    assert f.verdict == "agrees"
    assert (
        f.evidence == "at n=16, p(ignore) 0.8 / 0.98 / 0.1: rope: 100.0% / 70.0% / 80.0%; alibi: 100.0% / 90.0% / 95.0%"
    )
    f = _one(_flip_flop({"rope": (0.95, 1.0, 1.0)}), "Liu et al. 2023")
    assert f.verdict == "disagrees"  # 95 % vs 100 % over 256 samples: Wilson intervals apart
    f = _one(_flip_flop({"rope": (0.97, 0.98, 0.99)}), "Liu et al. 2023")
    assert f.verdict == "undecided"  # within 2 points over 256 samples: Wilson intervals overlap
    f = _one(_flip_flop({"rope": (0.92, 1.0, 0.5)}), "Liu et al. 2023")
    assert f.verdict == "partly"
    text = _summary(_results(AS_PUBLISHED, lengths=(64, 128, 256)))
    assert [study(text, None) for study in STUDY_FINDINGS] == [[], [], []]  # text < 8x: none


@pytest.mark.parametrize("alibi, verdict", [([5.6, 5.3, 5.2, 5.1], "agrees"), ([5.6, 5.3, 5.2, 5.4], "partly"),
                                            ([5.6, 5.3, 5.5, 5.9], "disagrees"),
                                            ([5.6, 5.9, 6.5, 7.0], "disagrees")])  # fmt: skip
def test_press_table5_shape(alibi, verdict):
    res = _results({"alibi": alibi, "rope": [5.2, 5.1, 12.0, 40.0]}, lengths=(16, 32, 128, 768))
    f = _one(res, "Press et al. 2022, Table 5")
    assert f.verdict == verdict
    assert f.evidence.startswith(f"alibi ppl at 1x {alibi[0]:.3f}, 2x {alibi[1]:.3f}, 8x {alibi[2]:.3f}, 48x")
    # shorter than 8x the training length: no Table 5 reading
    assert not [
        f for f in findings(_summary(_results({"alibi": alibi}, lengths=(16, 32, 64, 112)))) if "Table 5" in f.source
    ]


def test_every_study_registers_its_reading():
    """Importing ``posenc.compare`` registers each study's reading once (``posenc.studies``)."""
    assert STUDY_FINDINGS == [cope2024.findings, kazemnejad2023.findings, press2022.findings]
