"""What a comparison of the papers' tasks writes (issue 28): the per-position figure marks the
training length where each task's training sequences end (``posenc.data.tasks.sequence_length``),
and flip-flop's accuracies per p(ignore) reach results.csv and a heatmap, as passkey's depths do."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from tests.test_compare import TINY, run_cli

from posenc.compare import plots
from posenc.compare.reading import summarize
from posenc.compare.report import csv_rows
from posenc.compare.results import RunResults
from posenc.data import TASK_NAMES, CountTask, load_source
from posenc.data.lengths import sequence_length
from posenc.data.tasks import depth_axis

# input tokens of a sequence of size n, written out from each generator's format
EXPECTED = {
    None: lambda n: n,  # text: n tokens
    "passkey": lambda n: n,
    "copy": lambda n: 2 * n,  # x_1..x_n SEP y_1..y_n, the last y never an input
    "reverse": lambda n: 2 * n,
    "sort": lambda n: 2 * n,
    "associative-recall": lambda n: 2 * n + 2,  # n pairs, SEP, k_q (v_q the answer)
    "grid": lambda n: n * (n + 1),
    "count": lambda n: 4 * n + 2,  # n 4-word SETs, "print v" (the value the answer)
    "flip-flop": lambda n: 2 * n - 1,  # n pairs, the last bit the answer
    # Kazemnejad et al.'s longest sample of size n, prompt + target + </s>, less the last token
    "kaz-copy": lambda n: 2 * n + 3,  # Copy : x.. [SEP] x.. </s>
    "kaz-reverse": lambda n: 2 * n + 3,
    "kaz-copy-2x": lambda n: 3 * n + 4,  # Copy : x.. [SEP] x.. [NEXT] x.. </s>
    "kaz-reverse-2x": lambda n: 3 * n + 4,
    "kaz-addition": lambda n: 3 * n + 8,  # Compute a + b ? The answer is s . </s>: n, n, n + 1 digits
    "kaz-poly": lambda n: 8 * n + 12,  # Evaluate at x = - 2 in, n terms "- 3 * x * * 3" and n - 1 "+", ? ...
    "kaz-sort": lambda n: 4 * n + 12,  # Sort the following list [ n items, n - 1 commas ] . The sorted ...
    "kaz-sort-multi": lambda n: 10 * n + 12,  # as kaz-sort with 4 digits an item
    "kaz-sum": lambda n: 2 * n + 8,  # Compute : n digits, n - 1 "+" . [SEP] The answer is d . </s>
    "kaz-parity": lambda n: 2 * n + 18,  # Is the number of 1 ' s even in the sequence [ ... ] ? ...
    "kaz-lego": lambda n: 5 * n + 16,  # If, n clauses "v = - w" and n - 1 commas . Then , what ...
}


@pytest.mark.parametrize("task", [None, *TASK_NAMES])
def test_sequence_length_is_the_tasks_sequence(task):
    n = 18 if task == "kaz-addition" else 24  # addition: numpy's int64 draws stop at 18 digits
    src = load_source(task=task, seed=0)
    length = sequence_length(task, n)
    assert length == EXPECTED[task](n) == src.seq_len(n)
    # the per-position x axis: the evaluation batches' positions
    assert next(iter(src.eval_batches(n, 2, 2))).tokens.shape[1] == length
    widths = {src.train_batch(step, 2, n).tokens.shape[1] for step in range(8)}
    assert max(widths) <= length
    if task in (None, "passkey", "flip-flop"):  # every training sequence is exactly that long
        assert widths == {length}
    if task == "count":  # the longest program of n statements (every one a SET) reaches it
        assert CountTask().batch([["a", "=", "0", ";"] * n + ["print", "a", "0"]]).tokens.shape[1] == length


def test_sequence_length_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown task 'nope'; tasks: copy"):
        sequence_length("nope", 4)
    with pytest.raises(ValueError, match="n must be a positive int, got 0"):
        sequence_length("copy", 0)
    with pytest.raises(ValueError, match="n must be a positive int, got True"):
        sequence_length("copy", True)


def test_depth_axis_names_each_tasks_variants():
    assert depth_axis("passkey").label == "key depth" and depth_axis("passkey").column == "depth"
    assert depth_axis("flip-flop").label == "p(ignore)" and depth_axis("flip-flop").column == "p_ignore"
    assert depth_axis("flip-flop").tick.format(0.98) == "0.98" and depth_axis("passkey").tick.format(0.25) == "25%"
    assert depth_axis("copy").label == "variant"


def _spy(monkeypatch) -> dict[str, list]:
    """Per figure file: its axes (the figure is still open when save_figure gets it)."""
    seen: dict[str, list] = {}
    save = plots.save_figure

    def spy(fig, path, **kw):
        seen[Path(path).name] = list(fig.axes)
        return save(fig, path, **kw)

    monkeypatch.setattr(plots, "save_figure", spy)
    return seen


def _train_line(axes) -> set[float]:
    return {float(ln.get_xdata()[0]) for ax in axes for ln in ax.get_lines() if ln.get_label() == "train length"}


def _task_results(task: str, n: int, depths=None) -> RunResults:
    def entry(m):
        L = sequence_length(task, m)
        e = {
            "length": m,
            "applicable": True,
            "loss": 0.5,
            "accuracy": 0.5,
            "token_accuracy": 0.5,
            "tokens": 8,
            "per_position": [{"start": 0, "end": L // 2, "loss": 0.4}, {"start": L // 2, "end": L, "loss": 0.6}],
        }
        if depths:
            e["depths"] = [{"depth": d, "accuracy": a} for d, a in depths]
        return e

    run = {"encoding": "rope", "seed": 0, "params": 10, "train_seconds": 1.0, "train_tokens_per_s": 1.0,
           "train_loss": [2.0, 1.0], "eval": [entry(n), entry(2 * n)]}  # fmt: skip
    cfg = {"train_len": n, "eval_lens": [n, 2 * n], "task": task, "seeds": [0], "steps": 2, "preset": "quick"}
    return RunResults.from_json({"config": cfg, "runs": [run]})


@pytest.mark.parametrize("task", ["count", "associative-recall"])
def test_per_position_marks_the_training_sequence_length(tmp_path, monkeypatch, task):
    seen = _spy(monkeypatch)
    assert plots.draw_figures(tmp_path, summarize(_task_results(task, 6))) == ["extrapolation.png", "per_position.png"]
    assert _train_line(seen["per_position.png"]) == {float(EXPECTED[task](6))}  # count: 26, not 2 n = 12


def test_depth_columns_follow_the_task():
    passkey = _task_results("passkey", 32, depths=[(d, 0.5) for d in (0.0, 0.25, 0.5, 0.75, 1.0)])
    rows, cols = csv_rows(passkey)
    assert cols[-5:] == [f"accuracy_depth_{d}" for d in (0, 25, 50, 75, 100)]  # passkey's, as before
    flip = _task_results("flip-flop", 6, depths=[(0.8, 0.75), (0.98, 0.5), (0.1, 0.25)])
    rows, cols = csv_rows(flip)
    assert cols[-3:] == ["accuracy_p_ignore_10", "accuracy_p_ignore_80", "accuracy_p_ignore_98"]
    assert [rows[0][c] for c in cols[-3:]] == [0.25, 0.75, 0.5]
    assert "accuracy_depth_0" not in cols and "depths" not in rows[0]


def test_flip_flop_run_writes_its_densities(tmp_path, monkeypatch):
    seen = _spy(monkeypatch)
    argv = [*TINY[: TINY.index("--train-len")], "--batch-size", "4", "--warmup", "2", "--eval-samples", "6",
            "--no-progress", "--task", "flip-flop", "--train-len", "6", "--eval-lens", "6,8", "--steps", "2",
            "--encodings", "rope,alibi", "--out", str(tmp_path)]  # fmt: skip
    assert run_cli(*argv) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    with open(tmp_path / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    cols = ["accuracy_p_ignore_10", "accuracy_p_ignore_80", "accuracy_p_ignore_98"]
    assert len(rows) == 4 and all(c in rows[0] for c in cols)
    for row, (enc, e) in zip(rows, [(r["encoding"], e) for r in res["runs"] for e in r["eval"]]):
        assert (row["encoding"], int(row["length"])) == (enc, e["length"])
        by = {f"accuracy_p_ignore_{round(100 * d['depth'])}": d["accuracy"] for d in e["depths"]}
        assert {c: float(row[c]) for c in cols} == pytest.approx(by)
    assert (tmp_path / "flip-flop.png").read_bytes()[:4] == b"\x89PNG"
    report = (tmp_path / "report.md").read_text()
    assert "flip-flop.png" in report
    # report.md has the per-density table, as it has passkey's per-depth one
    assert "## Flip-flop by p(ignore)" in report and "| encoding | length | 0.1 | 0.8 | 0.98 |" in report
    heat = [ax for ax in seen["flip-flop.png"] if ax.get_xlabel()]
    assert {ax.get_xlabel() for ax in heat} == {"p(ignore)"} and len(heat) == 2  # one panel per encoding
    assert [t.get_text() for t in heat[0].get_xticklabels()] == ["0.1", "0.8", "0.98"]
    assert _train_line(seen["per_position.png"]) == {11.0}  # 6 instructions: 11 input tokens


def test_a_run_lists_its_depth_heatmap_and_old_checkpoints_get_the_sequence_length():
    """The run folder's manifest lists the heatmap of every task scored at several depths or
    densities (flip-flop's was written but not listed), and an old compare checkpoint without
    `train_len` gets the task's sequence length (grid, passkey, count, flip-flop raised)."""
    import posenc
    from posenc.analysis.models import train_len_of
    from posenc.compare.report import outputs_of

    assert "flip-flop.png" in outputs_of({"task": "flip-flop"}) and "passkey.png" in outputs_of({"task": "passkey"})
    assert not any(o.endswith("count.png") for o in outputs_of({"task": "count"}))
    lm = posenc.TransformerLM(16, 8, 1, 2, "rope")
    for task in ("count", "flip-flop", "grid", "copy"):
        cfg = {"compare_config": {"task": task, "train_len": 6}}
        assert train_len_of(lm, cfg) == sequence_length(task, 6)
