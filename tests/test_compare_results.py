"""``results.json`` as typed records (``posenc.compare.results``, issue 62 item 3): what a run
writes is read back and written again byte for byte, by this version and as the version before
the records wrote it; the outputs rebuilt from a results.json are the run's own."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from tests.test_compare import TINY, run_cli

from posenc.compare.reading import summarize
from posenc.compare.report import write_outputs
from posenc.compare.results import Evaluation, ModelRun, RunResults, ValPoint, load_results
from posenc.output import clean

# results.json files written by the code before the records (commit b0f45ad): a merge of two
# --extend shards (rope and alibi / learned, n/a at 32) and a flip-flop run (three densities)
FIXTURES = Path(__file__).parent / "data" / "compare_results"


def _as_written(d: dict) -> str:
    """``d`` as :func:`posenc.output.write_json` writes it."""
    return json.dumps(clean(d), indent=1, allow_nan=False) + "\n"


@pytest.mark.parametrize("name", ["merged.json", "flip_flop.json"])
def test_a_results_json_of_the_code_before_round_trips_unchanged(name):
    text = (FIXTURES / name).read_text()
    assert _as_written(RunResults.from_json(json.loads(text)).to_json()) == text


def test_the_fixtures_read_as_checked_by_hand():
    merged = load_results(FIXTURES / "merged.json")
    assert [(r.encoding, r.seed) for r in merged.runs] == [("rope", 0), ("learned", 0), ("alibi", 0)]
    assert merged.fingerprint is None and merged.wall_seconds is None  # a merge records neither
    assert merged.environment["merged_from"] == ["a", "b"] and merged.config["shard"] is None
    na = merged.runs[1].at(32)  # learned, past its max_len
    assert not na.applicable and na.reason == "learned supports positions < 16 (max_len=16); needs 32"
    assert na.loss is None and na.ppl is None and na.has("bpb") and not na.has("tokens") and na.per_position == []
    rope = merged.runs[0]
    assert rope.at(16).ppl == pytest.approx(math.exp(rope.at(16).loss)) and rope.at(16).tokens == 64
    assert [(b.start, b.end) for b in rope.at(32).per_position] == [(0, 16), (16, 32)]
    assert [p.step for p in rope.val_curve] == [2, 3] and len(rope.train_loss) == 3 and rope.health["state"] == "ok"
    assert [(e.encoding, e.method, e.setting) for e in merged.extend] == [("rope", "none", "as trained"),
                                                                          ("rope", "linear", "factor 2")]  # fmt: skip
    assert merged.notes["train_spread"]["limit"] == 1.15
    flip = load_results(FIXTURES / "flip_flop.json")
    e = flip.runs[0].at(16)
    assert [(d.depth, d.accuracy) for d in e.depths] == [(0.8, 0.375), (0.98, 0.875), (0.1, 0.0)]
    assert e.accuracy == pytest.approx((0.375 + 0.875 + 0.0) / 3) and e.ppl is None and not e.has("ppl")
    assert flip.metric == "accuracy" and flip.command.startswith("posenc compare --dim 16")
    assert [(p.step, p.accuracy) for p in flip.runs[0].val_curve][-1] == (3, e.accuracy)
    s = summarize(flip)
    assert set(s.depths["rope"][16]) == {0.8, 0.98, 0.1} and s.cells["learned"][32] is None


def test_a_fresh_run_round_trips_and_its_outputs_rebuild_from_results_json(tmp_path):
    out = tmp_path / "run"
    argv = [*TINY, "--encodings", "rope,learned", "--steps", "3", "--val-points", "2", "--extend", "none"]
    assert run_cli(*argv, "--out", str(out)) == 0
    text = (out / "results.json").read_text()
    results = load_results(out)
    assert _as_written(results.to_json()) == text
    assert list(json.loads(text)) == ["config", "fingerprint", "runs", "wall_seconds", "device", "processes",
                                      "command", "environment", "extend", "summary"]  # fmt: skip
    # one place reads results.json: the files written from what it holds are the run's files
    again = tmp_path / "again"
    write_outputs(again, results)
    for name in ("results.json", "results.csv", "table.md", "report.md", "config.json"):
        assert (again / name).read_text() == (out / name).read_text(), name


def test_unknown_keys_stay_where_they_were_and_numbers_are_held_as_written():
    d = {"config": {"train_len": 16}, "from_the_future": [1, 2],
         "runs": [{"encoding": "rope", "note": "kept", "train_loss": [1.0, float("nan")],
                   "eval": [{"length": 16, "ppl": float("inf"), "loss": 800.0}]}]}  # fmt: skip
    r = RunResults.from_json(d)
    assert list(r.to_json()) == ["config", "from_the_future", "runs"] and r.to_json()["from_the_future"] == [1, 2]
    run = r.runs[0]
    assert run.seed == 0 and run.train_loss == [1.0, None] and run.evals[0].ppl is None  # NaN, inf: null
    assert run.to_json() == {"encoding": "rope", "note": "kept", "train_loss": [1.0, None],
                             "eval": [{"length": 16, "ppl": None, "loss": 800.0}]}  # fmt: skip
    # built in code, a record writes its fields in order, the optional ones when set
    assert ValPoint(5, 1.5).to_json() == {"step": 5, "loss": 1.5}
    assert list(ModelRun("nope").to_json())[-2:] == ["train_loss", "eval"]
    with pytest.raises(ValueError, match="Evaluation: missing 1 required positional argument: 'length'"):
        Evaluation.from_json({"ppl": 3.0})


def test_a_bad_results_json_is_one_line_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"results.json' not found \(is .* a finished run\?\)"):
        load_results(tmp_path)
    (tmp_path / "results.json").write_text('{"config": ')
    with pytest.raises(ValueError, match=r"results.json' is not valid JSON \(Expecting value"):
        load_results(tmp_path)
    (tmp_path / "results.json").write_text('{"runs": []}')
    with pytest.raises(ValueError, match=r"is not a comparison's results \(RunResults: missing .* 'config'\)"):
        load_results(tmp_path / "results.json")
