"""posenc compare: config and CLI, output files, checkpoints and resume after a kill, shards."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import posenc
from posenc.cli import main, make_parser
from posenc.compare import CompareConfig, from_dict, preset_config
from posenc.compare.cli import build_config
from posenc.compare.evaluate import EvalSettings, evaluate
from posenc.compare.runner import make_source
from posenc.compare.train import build_model
from posenc.train import cosine_schedule

# a model and a run small enough for a test
TINY = ["--dim", "16", "--depth", "1", "--heads", "2", "--train-len", "16", "--batch-size", "4", "--warmup", "2",
        "--eval-lens", "16,32", "--eval-tokens", "256", "--position-buckets", "4", "--no-progress", "--workers", "1"]  # fmt: skip
SRC = str(Path(__file__).resolve().parents[1] / "src")


def run_cli(*argv: str) -> int:
    return main(["compare", *argv])


def load(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


# ------------------------------------------------------------------ config
def test_presets_and_overrides():
    q = preset_config("quick")
    assert q.encodings == ["nope", "learned", "sinusoidal", "rope", "alibi", "t5", "shaw"]
    s = preset_config("standard", steps=7)
    assert s.preset == "standard" and s.steps == 7 and s.dim > q.dim
    args = make_parser().parse_args(
        [
            "compare",
            "--preset",
            "standard",
            "--encodings",
            "rope,alibi",
            "--eval-lens",
            "8,16",
            "--lr",
            "0.01",
            "--randomized-positions",
            "--task",
            "copy",
            "--train-len",
            "8",
            "--encoding-options",
            "alibi.alibi_num_heads=2,rope.base=500.5,rope.layout=interleaved",
        ]
    )
    cfg = build_config(args)
    assert cfg.encodings == ["rope", "alibi"] and cfg.eval_lens == [8, 16] and cfg.lr == 0.01
    assert cfg.randomized_positions and cfg.task == "copy" and cfg.dim == s.dim  # rest from the preset
    assert cfg.encoding_options == {"alibi": {"alibi_num_heads": 2}, "rope": {"base": 500.5, "layout": "interleaved"}}
    assert from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # serialisable round trip


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(steps=0), "steps"),
        (dict(task="add"), "task"),
        (dict(text="a", task="copy"), "at most one"),
        (dict(shard="3/2"), "shard"),
        (dict(eval_lens=[]), "eval_lens"),
        (dict(max_pos=4), "max_pos"),
        (dict(preset="huge"), "preset"),
        (dict(warmup=-1), "warmup"),
    ],  # fmt: skip
)
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        CompareConfig(**kw)
    with pytest.raises(ValueError, match="unknown config field"):
        from_dict({"stepz": 3})


def test_lr_schedule():
    cfg = CompareConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
    lr_at = cosine_schedule(cfg.lr, cfg.steps, cfg.warmup, cfg.min_lr_ratio)
    assert lr_at(0) == pytest.approx(0.1) and lr_at(9) == pytest.approx(1.0)
    assert lr_at(10) == pytest.approx(1.0) and lr_at(100) == pytest.approx(0.1)


def test_encoding_options_reach_the_model():
    cfg = preset_config("quick", dim=16, depth=1, heads=2, train_len=16, encoding_options={"t5": {"max_distance": 20}})
    src = make_source(cfg)
    assert build_model(cfg, src, "t5").blocks[0].attn.encoding.max_distance == 20
    assert preset_config("quick").encoding_options == {"t5": {"max_distance": 64}}
    with pytest.raises(ValueError, match="unknown option"):
        build_model(preset_config("quick", encoding_options={"t5": {"nope": 1}}), src, "t5")


def test_same_init_for_shared_weights():
    cfg = preset_config("quick", dim=16, depth=1, heads=2, train_len=16)
    src = make_source(cfg)
    a, b = build_model(cfg, src, "nope"), build_model(cfg, src, "learned")
    sa, sb = a.state_dict(), b.state_dict()
    shared = [k for k in sa if k in sb]
    assert len(shared) > 5 and all(torch.equal(sa[k], sb[k]) for k in shared)


# ------------------------------------------------------------------ a full run
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run")
    assert run_cli(*TINY, "--encodings", "learned,alibi", "--steps", "6", "--out", str(out)) == 0
    return out


def test_output_files(tiny_run):
    for f in ("config.json", "results.json", "results.csv", "table.md", "extrapolation.png", "per_position.png"):
        assert (tiny_run / f).stat().st_size > 0, f
    for f in ("extrapolation.png", "per_position.png"):
        assert (tiny_run / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = load(tiny_run)
    assert res["config"] == json.loads((tiny_run / "config.json").read_text())
    assert [r["encoding"] for r in res["runs"]] == ["learned", "alibi"]
    for r in res["runs"]:
        assert {"encoding", "params", "train_seconds", "eval"} <= set(r) and len(r["train_loss"]) == 6
        assert [e["length"] for e in r["eval"]] == [16, 32]
    learned, alibi = res["runs"]
    assert learned["params"] == alibi["params"] + 16 * 16  # the learned table is visible
    e16 = alibi["eval"][0]
    assert e16["ppl"] == pytest.approx(torch.tensor(e16["loss"]).exp().item())
    assert e16["bpb"] == pytest.approx(e16["loss"] / torch.log(torch.tensor(2.0)).item())
    assert len(e16["per_position"]) == 4 and e16["per_position"][-1]["end"] == 16
    # learned cannot run past its table: reported, not skipped
    assert learned["eval"][1] == {**learned["eval"][1], "applicable": False, "ppl": None}
    assert "max_len=16" in learned["eval"][1]["reason"]
    rows = list(csv.DictReader((tiny_run / "results.csv").open()))
    assert len(rows) == 4 and rows[1]["applicable"] == "False"
    table = (tiny_run / "table.md").read_text()
    assert "| `learned` |" in table and "n/a" in table and "L=16 (train)" in table


def test_checkpoint_loads_for_analysis(tiny_run):
    model, extra = posenc.load_checkpoint(tiny_run / "checkpoints" / "alibi.pt")
    assert extra["done"] and extra["encoding"] == "alibi" and model.encoding_name == "alibi"
    cfg = from_dict(extra["compare_config"])
    e = evaluate(model.eval(), make_source(cfg), 32, device=torch.device("cpu"), settings=EvalSettings.from_config(cfg))
    assert e.loss == pytest.approx(load(tiny_run)["runs"][1]["eval"][1]["loss"], rel=1e-6)


def test_bad_data_source_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert run_cli(*TINY, "--dataset", "wikitext", "--out", str(tmp_path)) == 2
    assert "pip install datasets" in capsys.readouterr().err
    assert run_cli(*TINY, "--encodings", "nosuch", "--out", str(tmp_path)) == 2
    assert "unknown encoding 'nosuch'" in capsys.readouterr().err


def test_synthetic_task_accuracy(tmp_path):
    out = tmp_path / "copy"
    argv = [*TINY, "--task", "copy", "--train-len", "4", "--eval-lens", "4,8", "--eval-samples", "16"]
    assert run_cli(*argv, "--encodings", "learned,rope", "--steps", "4", "--out", str(out)) == 0
    learned, rope = load(out)["runs"]
    for e in rope["eval"]:
        assert 0 <= e["accuracy"] <= 1 and 0 <= e["token_accuracy"] <= 1 and "ppl" not in e
    assert learned["eval"][1]["applicable"] is False  # 2n = 16 tokens > max_len 8
    assert "accuracy" in (out / "table.md").read_text()


def test_bfloat16_and_sliding_windows(tmp_path):
    out = tmp_path / "bf16"
    argv = [*TINY, "--encodings", "t5", "--steps", "2", "--dtype", "bfloat16", "--sliding", "--stride", "8"]
    assert run_cli(*argv, "--out", str(out)) == 0
    (run,) = load(out)["runs"]
    for e in run["eval"]:
        # 256 // 8 = 32 windows: the first scores all its tokens, the others their last 8
        assert e["tokens"] == e["length"] + 31 * 8 and torch.isfinite(torch.tensor(e["loss"]))


def test_randomized_positions_make_learned_applicable(tmp_path):
    out = tmp_path / "rnd"
    assert run_cli(*TINY, "--encodings", "learned", "--steps", "3", "--randomized-positions", "--out", str(out)) == 0
    (run,) = load(out)["runs"]
    assert all(e["applicable"] for e in run["eval"])  # max_len = L_max = 32
    model, _ = posenc.load_checkpoint(out / "checkpoints" / "learned.pt")
    assert model.max_len == 32


# ------------------------------------------------------------------ resume and shards
@pytest.mark.slow
def test_resume_after_kill_matches_uninterrupted(tmp_path):
    argv = [*TINY, "--encodings", "rope,t5", "--steps", "16", "--checkpoint-every", "2"]
    ref = tmp_path / "ref"
    assert run_cli(*argv, "--out", str(ref)) == 0

    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen([sys.executable, "-m", "posenc.cli", "compare", *argv, "--out", str(out)], env=env)
    ckpt = out / "checkpoints" / "rope.pt"
    deadline = time.time() + 300
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run finished before it could be killed"
    _, extra = posenc.load_checkpoint(ckpt)
    assert not extra["done"] and 0 < extra["step"] < 16  # killed mid-training

    assert run_cli("--resume", "--out", str(out), "--no-progress") == 0
    a, b = load(ref), load(out)
    for ra, rb in zip(a["runs"], b["runs"], strict=True):
        assert ra["train_loss"] == rb["train_loss"]
        assert [e["loss"] for e in ra["eval"]] == [e["loss"] for e in rb["eval"]]
    assert run_cli("--resume", "--out", str(out), "--steps", "9") == 2  # config comes from the run


@pytest.mark.slow
def test_shards_merge_to_the_full_run(tmp_path, tiny_run):
    argv = [*TINY, "--encodings", "learned,alibi", "--steps", "6"]
    assert run_cli(*argv, "--shard", "1/2", "--out", str(tmp_path / "a")) == 0
    assert run_cli(*argv, "--shard", "2/2", "--out", str(tmp_path / "b")) == 0
    assert [r["encoding"] for r in load(tmp_path / "a")["runs"]] == ["learned"]
    assert run_cli("--merge", str(tmp_path / "b"), str(tmp_path / "a"), "--out", str(tmp_path / "m")) == 0
    merged, full = load(tmp_path / "m"), load(tiny_run)
    assert [r["encoding"] for r in merged["runs"]] == ["learned", "alibi"]
    for rm, rf in zip(merged["runs"], full["runs"]):
        assert rm["eval"] == rf["eval"]
    assert (tmp_path / "m" / "extrapolation.png").exists()
    assert run_cli(*TINY, "--encodings", "rope", "--steps", "5", "--out", str(tmp_path / "c")) == 0
    assert run_cli("--merge", str(tmp_path / "a"), str(tmp_path / "c"), "--out", str(tmp_path / "x")) == 2


def test_package_docstring_example_uses_only_names_it_imports():
    """Issue 16: posenc.compare's example called ``preset_config`` without importing it."""
    import ast
    import textwrap

    import posenc.compare

    code = textwrap.dedent(posenc.compare.__doc__.split("Python use::", 1)[1])
    tree = ast.parse(code)
    imports = [n for n in tree.body if isinstance(n, ast.ImportFrom)]
    namespace: dict = {}
    exec(compile(ast.Module(body=imports, type_ignores=[]), "<example>", "exec"), namespace)  # the imports only
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert used and used <= set(namespace), sorted(used - set(namespace))
