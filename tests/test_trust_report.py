"""A comparison never reports a broken model as fine (issue 24 items 7 and 8).

Item 7: a model whose loss rose, or ended above chance (ln(vocab)), is *diverged* in the
terminal table, table.md, report.md and the reading: never ranked, never read against a
finding, never called converged. Item 8: a model with a NaN loss is *failed* (a row that
says so, no interval, not ranked) and every other model is reported as usual: tables,
report and plots are written, also on ``--resume`` and ``--merge``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from posenc import TransformerLM
from posenc.cli import main
from posenc.compare import plots
from posenc.compare.diagnostics import chance_loss, convergence, run_health, still_improving
from posenc.compare.evaluate import EvalSettings, evaluate
from posenc.compare.reading import Summary, caveats, findings, summarize
from posenc.compare.report import merge_results, notes_json, report_markdown, results_table, table_rows, write_outputs
from posenc.compare.results import ModelRun, RunResults
from posenc.data import load_source

TINY = ["--dim", "16", "--depth", "1", "--heads", "2", "--train-len", "16", "--eval-lens", "16,32",
        "--eval-tokens", "256", "--batch-size", "4", "--val-points", "0", "--workers", "1", "--no-progress",
        "--position-buckets", "4"]  # fmt: skip
FALLING = [max(4.7, 5.5 - 0.05 * i) for i in range(50)]  # fell from chance to 4.7, then flat
ROSE = [5.5 + 0.5 * i for i in range(50)]  # the --lr 3 shape: 5.5 -> 30


# ------------------------------------------------------------------ the rule
def _run(enc, train_loss, ppl16, ppl32, seed=0, loss=True):
    def entry(n, p):
        e = {"length": n, "applicable": True, "ppl": p, "per_position": [{"start": 0, "end": n, "loss": 1.0}]}
        if loss:
            e["loss"] = None if p is None or not math.isfinite(p) else math.log(p)
        return e

    return {"encoding": enc, "seed": seed, "params": 1000, "train_seconds": 1.0, "train_tokens_per_s": 100.0,
            "train_loss": train_loss, "convergence": convergence(train_loss, []),
            "eval": [entry(16, ppl16), entry(32, ppl32)]}  # fmt: skip


def _results(*runs, seeds=(0,)) -> RunResults:
    cfg = {"train_len": 16, "eval_lens": [16, 32], "task": None, "seeds": list(seeds), "steps": 50, "preset": "quick"}
    return RunResults.from_json({"config": cfg, "runs": list(runs)})


def _summary(*runs) -> Summary:
    return summarize(_results(*runs))


def _health(run: dict, config: dict) -> dict:
    return run_health(ModelRun.from_json(run), config)


def test_health_rule_rise_chance_and_nan():
    text = {"train_len": 16, "task": None}
    assert chance_loss(text) == pytest.approx(math.log(256)) and chance_loss({"task": "copy"}) == pytest.approx(
        math.log(17)
    )
    assert _health(_run("rope", FALLING, 90.0, 95.0), text) == {"state": "ok", "why": None}
    rose = _health(_run("rope", ROSE, 1e18, 1e18), text)
    assert rose["state"] == "diverged" and rose["why"].startswith("training loss rose 427% (5.50 at step 1 -> 29.00")
    # a loss that fell in training but ends above a uniform guess at the training length
    above = _health(_run("rope", FALLING, 300.0, 310.0), text)
    assert above["state"] == "diverged" and "above chance ln(256) = 5.55" in above["why"]
    assert "loss 5.70 at L=16" in above["why"]
    # a loss 4 % up is noise, not divergence (the rule: more than 5 % above the first step's)
    assert _health(_run("rope", [5.0] * 45 + [5.2] * 5, 90.0, 95.0), text)["state"] == "ok"
    assert _health(_run("rope", [5.0] * 45 + [5.3] * 5, 90.0, 95.0), text)["state"] == "diverged"
    nan_eval = _health(_run("rope", FALLING, None, None), text)
    assert nan_eval == {"state": "failed", "why": "loss NaN at L=16, 32"}
    nan_train = _health(_run("rope", FALLING[:3] + [float("nan")] * 47, float("nan"), float("nan")), text)
    assert nan_train["state"] == "failed" and nan_train["why"].startswith("training loss NaN from step 4")
    # results.json writes NaN as null
    assert _health(_run("rope", FALLING[:3] + [None] * 47, None, None), text)["state"] == "failed"
    # a task: chance is ln(vocab) of the task (copy: 17 tokens, ln 17 = 2.83)
    task = {"train_len": 16, "task": "copy"}
    run = {"encoding": "rope", "train_loss": [2.8, 2.0, 1.0], "eval": [{"length": 16, "loss": 3.0, "accuracy": 0.0}]}
    assert _health(run, task)["state"] == "diverged" and "ln(17) = 2.83" in _health(run, task)["why"]


def test_convergence_never_calls_a_diverged_run_converged():
    c = convergence(ROSE, [])
    assert c["converged"] is False and c["decided_by"] == "diverged" and c["diverged"].startswith("training loss rose")
    assert still_improving([c]) is None  # not "train longer": training made it worse
    nan = convergence(FALLING[:10] + [float("nan")] * 40, [])
    assert nan["converged"] is False and nan["diverged"] == "training loss NaN from step 11"
    assert convergence(FALLING, [])["diverged"] is None


# ------------------------------------------------------------------ item 7: diverged in every output
def test_diverged_model_is_flagged_and_never_ranked_or_read():
    # rope diverged (its loss rose) yet has the lowest numbers everywhere: it must not win
    s = _summary(
        _run("sinusoidal", FALLING, 90.0, 270.0),
        _run("rope", ROSE, 80.0, 80.5),
        _run("t5", FALLING, 91.0, 120.0),
        _run("alibi", FALLING, 92.0, 93.0),
    )
    heads, rows, notes = table_rows(s)
    rope = next(r for r in rows if r[0] == "rope")
    assert rope[-1].startswith("diverged: training loss rose") and rope[-1] != "ok"
    assert [r[-1] for r in rows if r[0] != "rope"] == ["ok", "ok", "ok"]
    assert next(r for r in rows if r[0] == "alibi")[4:6] == ["92.00", "93.00"]  # healthy numbers kept
    assert "diverged" in results_table(s).markdown()
    assert s.flagged == {"rope": "diverged"} and s.converged["rope"] is None
    assert "rope" not in s.at(16) and s.ranking(16) == [["sinusoidal", "t5", "alibi"]]
    for f in findings(s):  # the reading compares healthy models only
        assert "rope x" not in f.evidence and "rope " not in f.evidence.split("(left out")[0]
    press = next(f for f in findings(s) if "then rotary" in f.claim)
    assert "(left out, diverged: rope)" in press.evidence
    assert any(c.startswith("failed or diverged: rope (diverged: training loss rose") for c in caveats(s))
    assert notes_json(s)["diverged"] == ["rope"] and "rope" not in notes_json(s)["not_converged"]
    md = report_markdown(s, [])
    assert "- L=16: sinusoidal = t5 = alibi" in md and "- not ranked: rope (diverged)" in md
    assert "| `rope` | 0 | - | - |" in md and "converged |" not in md.split("| `rope` | 0 |")[1].split("\n")[0]
    assert "L=16: rope" not in md and "L=32: rope" not in md


def test_diverged_models_end_to_end(tmp_path, capsys):
    """The issue's command: ``--lr 3`` (perplexities 1e18-1e44) said "ok" and ranked rope first."""
    out = tmp_path / "lr3"
    assert main(["compare", *TINY, "--steps", "20", "--encodings", "rope,alibi", "--lr", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    table, report = (out / "table.md").read_text(), (out / "report.md").read_text()
    for text in (printed, table, report):
        assert "diverged: training loss rose" in text and "│ ok " not in text and "| ok |" not in text
    assert "- not ranked: rope (diverged), alibi (diverged)" in report and "- L=16: rope" not in report
    res = json.loads((out / "results.json").read_text())
    assert res["summary"]["diverged"] == ["rope", "alibi"] and res["summary"]["not_converged"] == []
    assert all(r["health"]["state"] == "diverged" for r in res["runs"])
    assert all(r["convergence"]["converged"] is False for r in res["runs"])
    assert (out / "extrapolation.png").is_file() and (out / "per_position.png").is_file()


# ------------------------------------------------------------------ item 8: one NaN model
def test_nan_model_is_a_failed_row_and_the_rest_is_reported(tmp_path):
    nan = float("nan")
    for bad in (
        _run("alibi", FALLING[:5] + [nan] * 45, nan, nan),
        _run("alibi", FALLING[:5] + [None] * 45, None, None),
    ):
        res = _results(_run("rope", FALLING, 90.0, 95.0), bad)  # in memory (NaN) and as read back (null)
        heads, rows, _ = table_rows(summarize(res))
        assert rows[0][4:] == ["90.00", "95.00", "ok"]
        assert rows[1][4:6] == ["NaN", "NaN"] and rows[1][6].startswith("failed: training loss NaN from step 6")
        assert summarize(res).ranking(16) == [["rope"]]
        assert any("alibi (failed: training loss NaN" in c for c in caveats(summarize(res)))
    out = tmp_path / "nan"
    table = write_outputs(out, res)
    assert "failed" in table.markdown() and "90.00" in table.markdown()
    assert "- not ranked: alibi (failed)" in (out / "report.md").read_text()
    assert json.loads((out / "results.json").read_text())["summary"]["failed"] == ["alibi"]
    assert (out / "extrapolation.png").is_file() and (out / "per_position.png").is_file()


def test_plots_skip_a_failed_model_with_a_legend_note(tmp_path, monkeypatch):
    labels: dict[str, list[str]] = {}
    save = plots.save_figure

    def spy(fig, path, **kw):
        labels[Path(path).name] = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().texts]
        return save(fig, path, **kw)

    monkeypatch.setattr(plots, "save_figure", spy)
    nan = float("nan")
    res = _summary(_run("rope", FALLING, 90.0, 95.0), _run("alibi", [5.5] + [nan] * 49, nan, nan))
    assert plots.draw_figures(tmp_path, res) == ["extrapolation.png", "per_position.png"]
    assert "rope" in labels["extrapolation.png"] and "alibi: not drawn (failed)" in labels["extrapolation.png"]
    assert "alibi: not drawn (failed)" in labels["per_position.png"]
    # every model broken: still a figure, no log axis over nothing
    plots.draw_figures(tmp_path, _summary(_run("alibi", [5.5] + [nan] * 49, nan, nan)))


def _nan_model(monkeypatch, name="alibi"):
    """Build ``name``'s model with NaN weights: its training and evaluation losses are NaN."""
    import posenc.compare.train as train

    build = train.build_model

    def build_model(cfg, source, encoding, seed=None):
        model = build(cfg, source, encoding, seed)
        if encoding == name:
            with torch.no_grad():
                model.head.weight.fill_(float("nan"))
        return model

    monkeypatch.setattr(train, "build_model", build_model)


def test_nan_model_end_to_end_resume_and_merge(tmp_path, monkeypatch, capsys):
    _nan_model(monkeypatch)
    out = tmp_path / "nan"
    argv = ["compare", *TINY, "--steps", "6", "--out", str(out)]
    assert main([*argv[:-2], "--encodings", "rope,alibi", *argv[-2:]]) == 0
    printed = capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    rope = res["runs"][0]["eval"]
    assert res["summary"]["failed"] == ["alibi"] and res["runs"][1]["health"]["state"] == "failed"
    table, report = (out / "table.md").read_text(), (out / "report.md").read_text()
    for text in (printed, table, report):
        assert "failed: training loss NaN from step 1" in text and f"{rope[0]['ppl']:.2f}" in text
    assert "- L=16: rope" in report and "- not ranked: alibi (failed)" in report
    assert (out / "extrapolation.png").is_file() and (out / "per_position.png").is_file()
    # --resume reads the finished models back (their NaN from the checkpoints) and reports again
    (out / "table.md").unlink()
    assert main(["compare", "--resume", "--no-progress", "--out", str(out)]) == 0
    assert "failed: training loss NaN" in (out / "table.md").read_text()
    # --merge with a shard holding the NaN run
    other = tmp_path / "nope"
    assert main([*argv[:-2], "--encodings", "nope", "--out", str(other)]) == 0
    merged = tmp_path / "merged"
    assert main(["compare", "--merge", str(out), str(other), "--out", str(merged)]) == 0
    assert [r["encoding"] for r in merge_results([out, other])["runs"]] == ["rope", "alibi", "nope"]
    md = (merged / "report.md").read_text()
    assert "- not ranked: alibi (failed)" in md and "| `alibi` |" in md and (merged / "extrapolation.png").is_file()


def test_extend_leaves_out_a_failed_model_with_a_note(tmp_path, monkeypatch, capsys):
    _nan_model(monkeypatch, "xpos")
    out = tmp_path / "ext"
    argv = [*TINY, "--steps", "4", "--encodings", "rope,xpos", "--extend", "none,ntk", "--out", str(out)]
    assert main(["compare", *argv]) == 0
    res = json.loads((out / "results.json").read_text())
    assert [(e["encoding"], e["method"]) for e in res["extend"]] == [("rope", "none"), ("rope", "ntk")]
    md = (out / "extend.md").read_text()
    assert "not extended: xpos seed 0, failed (training loss NaN from step 1" in md and "`rope`" in md
    assert "not extended: xpos" in capsys.readouterr().out and (out / "extend.png").is_file()
    assert "the spread, --extend and the intervals" in (out / "report.md").read_text()


# ------------------------------------------------------------------ no OverflowError past 709 nats
def test_perplexity_of_a_huge_loss_is_inf_not_an_error():
    torch.manual_seed(0)
    model = TransformerLM(256, 16, 1, 2, encoding="rope", max_len=16, tie_embeddings=False).eval()
    with torch.no_grad():
        model.head.weight.mul_(1e6)  # logits of 1e6: a loss far past exp's range
    e = evaluate(model, load_source(longest=16), 16, device=torch.device("cpu"), settings=EvalSettings(tokens=64))
    assert e.loss > 709 and e.ppl is None  # inf, held as results.json holds it (null); the table reads "inf"


@pytest.mark.parametrize("task, vocab", [(None, 256), ("passkey", 256), ("copy", 17), ("grid", 17),
                                         ("count", 43), ("flip-flop", 5)])  # fmt: skip
def test_chance_is_known_for_every_task(task, vocab):
    """The "above chance" half of the divergence rule needs every task's vocabulary (the
    papers' tasks included): a model worse than a uniform guess is diverged on each."""
    import math

    from posenc.compare.diagnostics import chance_loss, vocab_size

    assert vocab_size({"task": task}) == vocab and chance_loss({"task": task}) == pytest.approx(math.log(vocab))
