"""Kazemnejad et al.'s ordering over the suite (``posenc.studies.kazemnejad2023.suite``,
``posenc study kazemnejad-suite``): ranks computed by hand, the verdict flips with the numbers,
tasks nobody learned are not counted, bad input is one line and exit 2."""

from __future__ import annotations

import json

import pytest
from tests.test_compare_paper_findings import AS_PUBLISHED
from tests.test_compare_reading import _results, _summary

from posenc.cli import main
from posenc.studies.kazemnejad2023.suite import suite_finding, suite_ranks, suite_table_md

# a second task, 20 points between neighbours (over 256 samples no intervals overlap): alibi
# best at 128, rope best at 512
SECOND = {"nope": [1.0, 0.5, 0.5], "t5": [1.0, 0.7, 0.7], "alibi": [1.0, 0.9, 0.1],
          "rope": [1.0, 0.2, 0.9], "learned": [0.5, None, None]}  # fmt: skip


def test_ranks_by_hand_over_two_tasks():
    suite = suite_ranks([_summary(_results(AS_PUBLISHED, task="kaz-copy")), _summary(_results(SECOND, task="kaz-sum"))])
    # kaz-copy, at 128: nope = t5 (1.5), alibi 3, rope 4, learned 5 (n/a); at 512 the same.
    # kaz-sum, at 128: alibi 1, t5 2, nope 3, rope 4, learned 5; at 512: rope 1, t5 2, nope 3,
    # alibi 4, learned 5 (learned did not learn kaz-sum, but the paper ranks every model)
    assert suite.rank == {"nope": (1.5 + 1.5 + 3 + 3) / 4, "t5": (1.5 + 1.5 + 2 + 2) / 4,
                             "alibi": (3 + 3 + 1 + 4) / 4, "rope": (4 + 4 + 4 + 1) / 4, "learned": 5.0}  # fmt: skip
    assert suite.mrr["rope"] == pytest.approx((1 / 4 + 1 / 4 + 1 / 4 + 1) / 4)
    assert suite.cells == dict.fromkeys(AS_PUBLISHED, 4)
    f = suite_finding(suite)
    # t5 1.75 < nope 2.25 < alibi 2.75 < rope 3.25 < learned 5: every tier pair in order
    assert f.verdict == "agrees"
    assert f.evidence.startswith("mean rank over 2 task(s) (kaz-copy, kaz-sum), past the training length")
    table = suite_table_md(suite)
    assert table.splitlines()[0] == "| encoding | `kaz-copy` | `kaz-sum` | suite rank | suite MRR |"
    assert "| `t5` | 1.50 | 2.00 | 1.75 | 0.58 |" in table


def test_reversed_suite_disagrees_and_unlearned_tasks_are_not_counted():
    reversed_ = {"nope": [1.0, 0.1, 0.05], "t5": [1.0, 0.1, 0.05], "alibi": [1.0, 0.5, 0.4],
                 "rope": [1.0, 0.9, 0.8], "learned": [1.0, 0.95, 0.9]}  # fmt: skip
    nobody = {e: [0.3, 0.0, 0.0] for e in AS_PUBLISHED}  # a task no encoding learned
    suite = suite_ranks(
        [_summary(_results(reversed_, task="kaz-copy")), _summary(_results(nobody, task="kaz-addition"))]
    )
    f = suite_finding(suite)
    assert f.verdict == "disagrees"
    assert f.evidence.endswith("not counted: kaz-addition (no encoding reached 90% exact match at n=64)")
    assert "`kaz-addition`" not in suite_table_md(suite).splitlines()[0]


def test_a_task_where_all_tie_is_not_counted_and_unfinished_models_are_named():
    """A task every encoding fails past the training length (kaz-copy here at this scale: all
    0 %) ranks nothing; a counted task's unconverged encodings are named in the evidence."""
    tie = {e: [1.0, 0.0, 0.0] for e in AS_PUBLISHED}
    suite = suite_ranks(
        [_summary(_results(tie, task="kaz-copy")), _summary(_results(SECOND, task="kaz-sum", converged=False))]
    )
    assert [t.task for t in suite.tasks if not t.skipped] == ["kaz-sum"]
    assert suite.cells == dict.fromkeys(AS_PUBLISHED, 2)
    f = suite_finding(suite)
    assert (
        "still improving when training stopped (ranked unfinished): kaz-sum: nope, t5, alibi, rope, learned"
        in f.evidence
    )
    assert f.evidence.endswith("not counted: kaz-copy (every encoding ties at every length past n=64)")
    assert "still improving" not in suite_finding(suite_ranks([_summary(_results(SECOND, task="kaz-sum"))])).evidence


def test_one_run_per_kazemnejad_task():
    with pytest.raises(ValueError, match="one run per task: 'kaz-copy' is given 2 times"):
        suite_ranks([_summary(_results(AS_PUBLISHED, task="kaz-copy"))] * 2)
    with pytest.raises(ValueError, match="got task 'count'"):
        suite_ranks([_summary(_results(AS_PUBLISHED, task="count"))])


def _study(*argv, capsys):
    try:
        code = main(["study", "kazemnejad-suite", *map(str, argv)])
    except SystemExit as e:  # argparse's refusals
        code = e.code
    return code, capsys.readouterr()


def test_command_prints_the_table_and_refuses_a_folder_without_results(tmp_path, capsys):
    for task, table in (("kaz-copy", AS_PUBLISHED), ("kaz-sum", SECOND)):
        (tmp_path / task).mkdir()
        (tmp_path / task / "results.json").write_text(json.dumps(_results(table, task=task)))
    code, out = _study(tmp_path / "kaz-copy", tmp_path / "kaz-sum", capsys=capsys)
    assert code == 0, out.err
    assert out.out.startswith("| encoding | `kaz-copy` | `kaz-sum` | suite rank | suite MRR |")
    assert "Reading: **agrees**" in out.out
    for argv, what in (((tmp_path / "nothing",), "nothing/results.json"),
                       ((tmp_path / "kaz-copy", tmp_path / "kaz-copy"), "one run per task: 'kaz-copy'"),
                       ((), "the following arguments are required: RUN")):  # fmt: skip
        code, out = _study(*argv, capsys=capsys)
        assert code == 2 and out.out == ""
        assert len(out.err.strip().splitlines()) == 1 and what in out.err, out.err
        assert out.err.startswith("posenc study kazemnejad-suite: error: ")
