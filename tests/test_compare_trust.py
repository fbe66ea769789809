"""posenc compare gives an answer one can trust (issue 17): seeds and intervals, convergence
diagnostics, MFU, worker processes, passkey retrieval, report.md, the preset's task budgets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posenc.cli import main
from posenc.compare import CompareConfig, from_dict, preset_config

TINY = ["--dim", "16", "--depth", "1", "--heads", "2", "--train-len", "16", "--batch-size", "4", "--warmup", "2",
        "--eval-lens", "16,32", "--eval-tokens", "256", "--position-buckets", "4", "--no-progress"]  # fmt: skip


def run_cli(*argv: str) -> int:
    return main(["compare", *argv])


def load(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize(
    "kw, match",
    [(dict(seeds=[]), "seeds must be a non-empty"), (dict(seeds=[0, 0]), "distinct"), (dict(seeds=[-1]), r"ints in \[0, 2147483647\]"),
     (dict(workers=-1), "workers"), (dict(val_points=-2), "val_points")],
)  # fmt: skip
def test_new_fields_validate(kw, match):
    with pytest.raises(ValueError, match=match):
        CompareConfig(**kw)


def test_old_config_with_one_seed_still_loads():
    d = CompareConfig().to_dict()
    d.pop("seeds")
    assert from_dict({**d, "seed": 3}).seeds == [3]


def test_task_presets_set_lengths_unless_given():
    copy = preset_config("quick", task="copy")
    text = preset_config("quick")
    assert copy.train_len < text.train_len and max(copy.eval_lens) == 4 * copy.train_len
    assert preset_config("quick", task="copy", train_len=8).train_len == 8  # the command line wins
    pk = preset_config("quick", task="passkey")
    assert pk.train_len == text.train_len and pk.eval_lens == text.eval_lens
    assert pk.encoding_options == text.encoding_options
    assert pk.lr == text.lr / 2 and preset_config("quick", task="passkey", lr=1e-2).lr == 1e-2


def test_seeds_intervals_convergence_mfu_and_report(tmp_path, capsys):
    out = tmp_path / "seeds"
    steady = ["--min-lr-ratio", "1"]  # no decay: the loss is still falling at the end
    argv = [*TINY, "--encodings", "rope,alibi", "--steps", "10", "--seeds", "0,1,2", "--workers", "1", *steady]
    assert run_cli(*argv, "--out", str(out)) == 0
    res = load(out)
    assert [(r["encoding"], r["seed"]) for r in res["runs"]] == [(e, s) for e in ("rope", "alibi") for s in (0, 1, 2)]
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == sorted(f"{e}.seed{s}.pt" for e in ("rope", "alibi") for s in (0, 1, 2))
    r0, r1 = res["runs"][:2]
    assert r0["train_loss"] != r1["train_loss"]  # seeds differ in weights and data order
    # validation at the training length after each fifth of the steps; the last is the table's number
    assert [p["step"] for p in r0["val_curve"]] == [2, 4, 6, 8, 10]
    assert r0["val_curve"][-1]["ppl"] == pytest.approx(r0["eval"][0]["ppl"])
    assert {"converged", "train_slope", "val_drop", "threshold"} <= set(r0["convergence"])
    # FLOPs from the model, the peak measured in the same process, MFU in [0, 1]
    assert r0["train_flops"] == pytest.approx(r0["flops_per_token"] * 10 * 4 * 16)
    assert res["environment"]["matmul_peak_flops"] > 0 and res["environment"]["torch"] == torch.__version__
    m = res["summary"]["mfu"]  # the numbers under the table, in results.json
    assert 0 < m["mfu"] < 1 and m["peak_flops_per_s"] == res["environment"]["matmul_peak_flops"]
    spread = res["summary"]["train_spread"]
    assert spread["max_over_min"] == pytest.approx(spread["max"][1] / spread["min"][1]) and spread["limit"] == 1.15
    assert sorted(res["summary"]["not_converged"]) == ["alibi", "rope"]
    table = (out / "table.md").read_text()
    assert "mean ± 95 % t-interval of 3 seeds" in table and " ± " in table and "note: MFU " in table
    printed = capsys.readouterr().out
    assert "MFU" in printed and "t-interval" in printed
    report = (out / "report.md").read_text()
    for part in ("# posenc compare: report", "## Command", "posenc compare --dim 16", "--seeds 0,1,2",
                 "## Reading", "## Results", "## Ranking at each length", "- L=32: ", "## Convergence",
                 "![extrapolation.png](extrapolation.png)", "## Environment", "## Config", '"seeds": ['):  # fmt: skip
        assert part in report, part
    # a run this short is still improving: the table, the report and the terminal say so
    assert "not converged: train longer" in table and "not converged: train longer" in report
    assert "not converged: train longer" in printed


def test_worker_processes_give_the_numbers_of_one_process(tmp_path):
    argv = [*TINY, "--encodings", "nope,rope,t5", "--steps", "4", "--val-points", "2"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' thread count, so that the sums are ordered alike
    try:
        assert run_cli(*argv, "--workers", "1", "--out", str(tmp_path / "one")) == 0
    finally:
        torch.set_num_threads(threads)
    assert run_cli(*argv, "--workers", "2", "--out", str(tmp_path / "two")) == 0
    one, two = load(tmp_path / "one"), load(tmp_path / "two")
    assert [r["encoding"] for r in two["runs"]] == ["nope", "rope", "t5"]  # the config's order, whoever finished first
    for a, b in zip(one["runs"], two["runs"]):
        assert a["train_loss"] == b["train_loss"] and a["eval"] == b["eval"] and a["val_curve"] == b["val_curve"]
    assert two["environment"]["worker_processes"] == 2 and two["environment"]["threads_per_process"] >= 1


def test_passkey_task_scores_every_depth_and_draws_the_heatmap(tmp_path):
    out = tmp_path / "pk"
    argv = [*TINY, "--task", "passkey", "--train-len", "24", "--eval-lens", "24,48", "--eval-samples", "8"]
    assert run_cli(*argv, "--encodings", "learned,alibi", "--steps", "3", "--workers", "1", "--out", str(out)) == 0
    learned, alibi = load(out)["runs"]
    e = alibi["eval"][1]
    assert [d["depth"] for d in e["depths"]] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert e["accuracy"] == pytest.approx(sum(d["accuracy"] for d in e["depths"]) / 5)
    assert learned["eval"][1]["applicable"] is False  # 48 tokens > its table of 24
    assert (out / "passkey.png").read_bytes()[:4] == b"\x89PNG"
    report = (out / "report.md").read_text()
    assert "![passkey.png](passkey.png)" in report and "## Passkey retrieval by depth" in report
    assert "| `alibi` | 48 |" in report and "accuracy_depth_50" in (out / "results.csv").read_text()


def test_merge_joins_seeds_of_two_runs(tmp_path):
    from posenc.compare.report import merge_results

    argv = [*TINY, "--encodings", "rope", "--steps", "2", "--workers", "1", "--val-points", "0"]
    assert run_cli(*argv, "--seeds", "0", "--out", str(tmp_path / "a")) == 0
    assert run_cli(*argv, "--seeds", "1", "--out", str(tmp_path / "b")) == 0
    merged = merge_results([tmp_path / "a", tmp_path / "b"])
    assert merged["config"]["seeds"] == [0, 1] and [r["seed"] for r in merged["runs"]] == [0, 1]
    with pytest.raises(ValueError, match="seed 0 appears in more than one run"):
        merge_results([tmp_path / "a", tmp_path / "a"])


def test_merge_joins_runs_of_other_encodings_with_the_presets_options(tmp_path, capsys):
    """The quick preset keeps T5's options only where T5 is compared: a T5 run and a NoPE run
    of one preset merge (the union of encodings and options); T5 run with other options does not."""
    from posenc.compare.report import merge_results

    argv = [*TINY, "--steps", "2", "--workers", "1", "--val-points", "0"]
    assert run_cli(*argv, "--encodings", "t5", "--out", str(tmp_path / "t5")) == 0
    assert run_cli(*argv, "--encodings", "nope,rope", "--seeds", "1", "--out", str(tmp_path / "rest")) == 0
    assert load(tmp_path / "t5")["config"]["encoding_options"] == {"t5": {"max_distance": 64}}
    assert (
        "encoding_options" not in load(tmp_path / "rest")["config"]
        or not load(tmp_path / "rest")["config"]["encoding_options"]
    )
    capsys.readouterr()
    assert run_cli("--merge", str(tmp_path / "t5"), str(tmp_path / "rest"), "--out", str(tmp_path / "m")) == 0
    assert "merged 3 models from 2 run folders" in capsys.readouterr().out
    merged = load(tmp_path / "m")
    assert merged["config"]["encodings"] == ["t5", "nope", "rope"]
    assert merged["config"]["encoding_options"] == {"t5": {"max_distance": 64}}
    assert [(r["encoding"], r["seed"]) for r in merged["runs"]] == [("t5", 0), ("nope", 1), ("rope", 1)]
    # T5 at another max_distance is another model: refused, both folders and both options named
    other = ["--encoding-options", "t5.max_distance=32", "--seeds", "1"]
    assert run_cli(*argv, "--encodings", "t5", *other, "--out", str(tmp_path / "t5b")) == 0
    with pytest.raises(ValueError, match=r"'t5' was run with options \{'max_distance': 64\} in .*t5 but "
                                         r"\{'max_distance': 32\} in .*t5b"):  # fmt: skip
        merge_results([tmp_path / "t5", tmp_path / "t5b"])
    # and so is a T5 run without the preset's options (T5's own max_distance, 128)
    bare = load(tmp_path / "t5b")
    bare["config"].pop("encoding_options")
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "results.json").write_text(json.dumps(bare))
    with pytest.raises(ValueError, match=r"'t5' was run with options \{'max_distance': 64\} in .*t5 but \{\} in"):
        merge_results([tmp_path / "t5", tmp_path / "bare"])


def test_merge_of_an_all_shard_with_named_models_keeps_them(tmp_path):
    """A shard that ran ``--encodings all`` beside one that ran a named pattern: the merged
    config lists every registered encoding and the named model (it loads), and the runs follow
    that order, seed within encoding."""
    from posenc.compare.report import merge_results
    from posenc.registry import available

    def shard(name: str, encodings: list[str], runs: list[tuple[str, int]]) -> Path:
        cfg = CompareConfig(encodings=encodings, seeds=sorted({s for _, s in runs})).to_dict()
        (tmp_path / name).mkdir()
        body = {"config": cfg, "runs": [{"encoding": e, "seed": s} for e, s in runs]}
        (tmp_path / name / "results.json").write_text(json.dumps(body))
        return tmp_path / name

    names = list(available())
    a = shard("a", ["all"], [(n, 1) for n in reversed(names)])
    b = shard("b", ["short=rope,alibi", "rope"], [("short", 0), ("rope", 0)])
    merged = merge_results([b, a])
    assert merged["config"]["encodings"] == [*names, "short=rope,alibi"]
    assert from_dict(merged["config"]).encoding_names() == [*names, "short"]  # the merged config loads
    expect = [(n, s) for n in names for s in ((0, 1) if n == "rope" else (1,))] + [("short", 0)]
    assert [(r["encoding"], r["seed"]) for r in merged["runs"]] == expect
    # shards that all ran "all" stay "all"
    assert merge_results([a])["config"]["encodings"] == ["all"]
