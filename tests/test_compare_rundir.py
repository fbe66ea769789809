"""posenc compare loses nothing and mixes nothing (issue 11): run folders, fingerprints,
locks, option merging, one-line errors, Ctrl-C, help, progress lines and the plots."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tests.test_compare import SRC, TINY, load, run_cli

import posenc
from posenc.cli import make_parser
from posenc.compare import CompareConfig, preset_config
from posenc.compare.cli import build_config
from posenc.compare.plots import per_position_absent, run_subtitle
from posenc.compare.results import load_results
from posenc.output import readable_log_axis
from posenc.output.rundir import RunDir, default_out

FAST = [*TINY, "--steps", "2", "--eval-lens", "16"]


def _err(capsys) -> str:
    return capsys.readouterr().err


# ------------------------------------------------------------------ a folder belongs to one config
def test_new_run_into_a_finished_folder_is_refused_then_overwrite_starts_over(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(*FAST, "--encodings", "rope,alibi", "--out", str(out)) == 0
    before = (out / "results.json").read_text()
    assert run_cli(*FAST, "--encodings", "t5", "--out", str(out)) == 2
    err = _err(capsys)
    assert "is not empty" in err and "--resume" in err and "--overwrite" in err
    assert (out / "results.json").read_text() == before  # nothing touched
    (out / "notes.txt").write_text("mine")
    assert run_cli(*FAST, "--encodings", "t5", "--overwrite", "--out", str(out)) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["t5.pt"]  # old checkpoints gone
    assert [r["encoding"] for r in load(out)["runs"]] == ["t5"]
    assert (out / "notes.txt").read_text() == "mine"  # not ours: left alone


def test_resume_refuses_checkpoints_of_another_config(tmp_path, capsys):
    """Issue: run A (3 steps), then B (more steps) into the same folder, kill B, resume: the
    table mixed B's numbers with A's. Every checkpoint carries the config's fingerprint."""
    out = tmp_path / "run"
    assert run_cli(*TINY, "--encodings", "rope", "--steps", "3", "--out", str(out)) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert load(out)["fingerprint"] and posenc.load_checkpoint(out / "checkpoints" / "rope.pt")[1]["fingerprint"]
    cfg["steps"] = 50
    (out / "config.json").write_text(json.dumps(cfg))
    assert run_cli("--resume", "--out", str(out), "--no-progress") == 2
    err = _err(capsys)
    assert "rope.pt" in err and "another config" in err and "steps: 3 -> 50" in err


def test_concurrent_runs_on_one_folder_are_prevented(tmp_path, capsys):
    out = tmp_path / "busy"
    with RunDir(out):
        assert run_cli(*FAST, "--encodings", "rope", "--out", str(out)) == 2
        assert "in use by another posenc compare" in _err(capsys)
    assert run_cli(*FAST, "--encodings", "rope", "--out", str(out)) == 0  # the lock died with its holder


def test_lock_is_released_when_the_holder_dies(tmp_path):
    out = tmp_path / "held"
    code = f"import sys, time; sys.path.insert(0, {SRC!r}); from posenc.output.rundir import RunDir; "
    code += f"RunDir({str(out)!r}).__enter__(); print('held', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    with pytest.raises(ValueError, match="in use"):
        RunDir(out).__enter__()
    proc.kill()
    proc.wait()
    with RunDir(out, overwrite=True):  # no stale lock after a kill
        pass


def test_default_output_names_are_unique():
    names = {default_out() for _ in range(50)}
    assert len(names) == 50 and all(n.startswith("runs/20") for n in names)


# ------------------------------------------------------------------ options
def test_encoding_options_merge_with_the_preset_per_key():
    args = make_parser().parse_args(["compare", "--encoding-options", "t5.num_buckets=16"])
    assert build_config(args).encoding_options["t5"] == {"max_distance": 64, "num_buckets": 16}
    args = make_parser().parse_args(["compare", "--encoding-options", "t5.max_distance=32"])
    assert build_config(args).encoding_options["t5"] == {"max_distance": 32}
    # the preset's t5 options are dropped when t5 is not compared
    assert preset_config("quick", encodings=["rope"]).encoding_options == {}


@pytest.mark.parametrize(
    "opts, match",
    [
        ("bogus.x=1", "'bogus', which is not compared"),
        ("alibi.base=3", "which is not compared"),
        ("rope.nosuch=1", r"unknown option\(s\) \['nosuch'\] for encoding 'rope'; valid options: .*base"),
    ],
)
def test_options_for_other_or_unknown_encodings_are_errors(opts, match, capsys):
    assert run_cli(*FAST, "--encodings", "rope,t5", "--encoding-options", opts) == 2
    err = _err(capsys)
    assert err.count("\n") == 1 and __import__("re").search(match, err), err


# ------------------------------------------------------------------ one sentence, not a traceback
@pytest.mark.parametrize("where", ["file", "under_file", "proc"])
def test_unusable_out_is_one_line(where, tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("x")
    out = {"file": f, "under_file": f / "sub", "proc": Path("/proc/posenc-test")}[where]
    assert run_cli(*FAST, "--encodings", "rope", "--out", str(out)) == 2
    err = _err(capsys)
    assert err.count("\n") == 1 and str(out) in err and err.startswith("posenc compare: error: --out")


def test_unwritable_out_is_one_line(tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes through permissions")
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    assert run_cli(*FAST, "--encodings", "rope", "--out", str(ro / "x")) == 2
    assert "permission denied" in _err(capsys)


def test_missing_or_bad_config_file(tmp_path, capsys):
    assert run_cli("--config", str(tmp_path / "nope.json")) == 2
    assert "config file" in (err := _err(capsys)) and "nope.json" in err and "not found" in err
    (tmp_path / "bad.json").write_text("{not json")
    assert run_cli("--config", str(tmp_path / "bad.json")) == 2
    assert "not valid JSON" in _err(capsys)


@pytest.mark.parametrize("damage", ["truncated", "random"])
def test_damaged_checkpoint_on_resume(damage, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(*FAST, "--encodings", "rope", "--out", str(out)) == 0
    ckpt = out / "checkpoints" / "rope.pt"
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2] if damage == "truncated" else os.urandom(2000))
    assert run_cli("--resume", "--out", str(out), "--no-progress") == 2
    err = _err(capsys)
    assert err.count("\n") == 1 and "rope.pt" in err and "unreadable" in err and "--overwrite" in err


def test_bad_text_files(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert run_cli(*FAST, "--text", str(empty), "--out", str(tmp_path / "a")) == 2
    assert "empty.txt" in (err := _err(capsys)) and "is empty" in err and "buffer" not in err
    assert run_cli(*FAST, "--text", str(tmp_path), "--out", str(tmp_path / "b")) == 2
    assert "is a directory" in _err(capsys)
    short = tmp_path / "short.txt"
    short.write_text("hello world " * 5)  # a 6-byte validation split < the 17 bytes an L=16 window needs
    assert run_cli(*FAST, "--text", str(short), "--out", str(tmp_path / "c")) == 2
    assert "short.txt" in (err := _err(capsys)) and "validation split" in err


def test_token_id_out_of_range_names_id_and_vocab():
    lm = posenc.TransformerLM(10, 16, 1, 2, "rope")
    with pytest.raises(ValueError, match=r"token id 12 is out of range for vocab_size=10"):
        lm(torch.tensor([[1, 12]]))
    with pytest.raises(ValueError, match=r"token id -1 is out of range"):
        lm(torch.tensor([[-1, 2]]))


@pytest.mark.slow
def test_ctrl_c_says_how_to_resume_and_resume_finishes(tmp_path):
    out = tmp_path / "int"
    argv = [*TINY, "--encodings", "rope", "--steps", "400", "--checkpoint-every", "5"]
    env = {**os.environ, "PYTHONPATH": SRC}
    # a shell starts a background job with SIGINT ignored, and a child inherits that (Python then
    # installs no KeyboardInterrupt handler): give the child the default, as a terminal would
    proc = subprocess.Popen([sys.executable, "-m", "posenc.cli", "compare", *argv, "--out", str(out)], env=env,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    deadline = time.time() + 300
    while not (out / "checkpoints" / "rope.pt").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert f"posenc compare --resume --out {out}" in err and "Traceback" not in err
    assert run_cli("--resume", "--out", str(out), "--no-progress") == 0
    assert len(load(out)["runs"][0]["train_loss"]) == 400


# ------------------------------------------------------------------ help, version, progress
def test_every_compare_flag_has_help_and_a_default(capsys):
    with pytest.raises(SystemExit):
        make_parser().parse_args(["compare", "--help"])
    text = capsys.readouterr().out
    group = text.split("configuration (", 1)[1]
    flags = [ln.split()[0] for ln in group.splitlines() if ln.startswith("  --")]
    assert len(flags) == len(dataclasses.fields(CompareConfig))
    blocks = group.split("\n  --")[1:]
    for b in blocks:
        assert "(default: " in " ".join(b.split()), b.split()[0]


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        make_parser().parse_args(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"posenc {posenc.__version__}"


def test_progress_lines_when_not_a_terminal(tmp_path):
    out = tmp_path / "p"
    env = {**os.environ, "PYTHONPATH": SRC}
    argv = [*TINY, "--encodings", "rope,alibi", "--steps", "20", "--eval-lens", "16", "--out", str(out)]
    argv.remove("--no-progress")
    proc = subprocess.run([sys.executable, "-m", "posenc.cli", "compare", *argv], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert "\r" not in text
    assert "[1/2] rope: step 20/20" in text and "[2/2] alibi: step 2/20" in text
    assert "[2/2] alibi: evaluating at 16" in text


# ------------------------------------------------------------------ plots
def test_log_axis_labels_every_plotted_value_and_subtitle():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    values = [4.1, 4.9, 8.4, 14.9, 32.1, 58.4]
    ax.plot(range(6), values)
    readable_log_axis(ax, values)
    fig.canvas.draw()
    lo, hi = ax.get_ylim()
    ticks = [t for t in ax.get_yticks() if lo <= t <= hi]
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert len(labels) >= 6 and all(lbl.replace(".", "").isdigit() for lbl in labels)
    # between two consecutive labels the value at most doubles: any curve can be read off
    assert all(b / a <= 2.0 + 1e-9 for a, b in zip(ticks, ticks[1:]))
    plt.close(fig)
    cfg = preset_config("quick").to_dict()
    assert run_subtitle(cfg) == f"preset quick, {cfg['steps']} steps, seed 0, embedded pydoc corpus, trained at 64"


def test_per_position_plot_has_a_difference_panel_and_says_why_learned_is_absent(tmp_path):
    from PIL import Image

    out = tmp_path / "pp"
    assert run_cli(*TINY, "--encodings", "nope,learned,alibi", "--steps", "2", "--out", str(out)) == 0
    w, h = Image.open(out / "per_position.png").size
    assert h > 900  # two panels: the losses and their difference from nope
    absent = per_position_absent(load_results(out).runs, 32)
    assert list(absent) == ["learned"] and "max_len=16" in absent["learned"]  # printed under the plot


def test_merge_of_a_damaged_results_file_names_it(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(*FAST, "--encodings", "rope", "--out", str(out)) == 0
    (out / "results.json").write_text('{"config": ')
    assert run_cli("--merge", str(out), "--out", str(tmp_path / "m")) == 2
    err = _err(capsys)
    assert err.count("\n") == 1 and "results.json" in err and "not valid JSON" in err
