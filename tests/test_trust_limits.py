"""Issue 61: nothing wrong is reported as fine. Defaults that fit a short run, sizes bounded
in the tokens a task really generates, JSON options kept whole, and SIGTERM handled as
Ctrl-C is (one line, the resume hint)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posenc.cli import main, make_parser
from posenc.compare.checks import MAX_LEN, parse_encoding_options
from posenc.compare.cli import build_config
from posenc.compare.config import CompareConfig, preset_config
from posenc.compare.train import lr_schedule, val_steps
from posenc.train import cosine_schedule

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = ["--dim", "16", "--depth", "1", "--heads", "2", "--train-len", "16", "--eval-lens", "16", "--eval-tokens",
        "64", "--batch-size", "2", "--no-progress"]  # fmt: skip


# ------------------------------------------------------------------ items 1 and 3: warmup, val_points
def test_the_preset_warmup_and_val_points_fit_a_short_run():
    """The preset's 100 warmup steps and 5 validation points are cut to the steps of a
    shorter run (the rates are those the schedule gave before: it ran min(warmup, steps));
    a value given is refused instead."""
    short = preset_config("quick", steps=20)
    assert (short.warmup, short.val_points) == (20, 5)
    assert [lr_schedule(short)(n) for n in range(20)] == [cosine_schedule(1e-2, 20, 100, 0.0)(n) for n in range(20)]
    tiny = preset_config("quick", steps=2)
    assert (tiny.warmup, tiny.val_points) == (2, 2) and val_steps(tiny) == {1}
    assert preset_config("standard", steps=7).warmup == 7
    assert (preset_config("quick").warmup, preset_config("quick").val_points) == (100, 5)  # a full run: as before
    args = make_parser().parse_args(["compare", "--encodings", "rope", "--steps", "2"])
    assert (build_config(args).warmup, build_config(args).val_points) == (2, 2)
    with pytest.raises(ValueError, match=r"warmup must be an int in \[0, steps=20\] .*got 1000"):
        preset_config("quick", steps=20, warmup=1000)
    with pytest.raises(ValueError, match=r"warmup must be an int in \[0, steps=20\] .*got 100"):
        CompareConfig(steps=20)  # the dataclass's own default is a value like any other
    with pytest.raises(ValueError, match=r"val_points must be an int in \[0, steps=20\] .*got 21"):
        CompareConfig(steps=20, warmup=0, val_points=21)
    CompareConfig(steps=20, warmup=20, val_points=20)  # the peak at the last step; a point after every step


# ------------------------------------------------------------------ item 6: the tokens a task generates
@pytest.mark.parametrize(
    "task, field, value, tokens",
    [
        ("count", "eval_lens", [16, 300000], 4 * 300000 + 2),
        ("grid", "eval_lens", [8, 2000], 2000 * 2001),
        ("grid", "train_len", 1100, 1100 * 1101),
        ("kaz-sort-multi", "eval_lens", [110000], 10 * 110000 + 12),
    ],
)
def test_task_lengths_are_bounded_in_the_tokens_they_generate(task, field, value, tokens):
    """``--task count --eval-lens 100000`` ran; the bound of 2^20 tokens counted statements."""
    with pytest.raises(ValueError, match=rf"{field} .*{tokens} tokens.*at most {MAX_LEN}"):
        preset_config("quick", task=task, **{field: value})
    preset_config("quick", task="count", eval_lens=[16, (MAX_LEN - 2) // 4])  # the longest that fits


# ------------------------------------------------------------------ item 5: JSON inside --encoding-options
def test_encoding_options_keep_json_values_whole():
    """``rope.rope_scaling={"rope_type":"yarn","factor":4}`` was split at its comma."""
    yarn = {"rope_type": "yarn", "factor": 4}
    text = 'rope.rope_scaling={"rope_type":"yarn","factor":4},t5.max_distance=64'
    assert parse_encoding_options(text) == {"rope": {"rope_scaling": yarn}, "t5": {"max_distance": 64}}
    assert parse_encoding_options('x.a=[1, 2],x.b="p,q",x.c="}{,",x.d=abc') == {
        "x": {"a": [1, 2], "b": "p,q", "c": "}{,", "d": "abc"}
    }
    assert parse_encoding_options(r'x.e="a\",b"') == {"x": {"e": 'a",b'}}
    args = make_parser().parse_args(["compare", "--encodings", "rope", "--encoding-options", text[: text.index(",t5")]])
    assert build_config(args).encoding_options["rope"]["rope_scaling"] == yarn


# ------------------------------------------------------------------ item 10: SIGTERM
def test_sigterm_is_handled_as_ctrl_c(tmp_path, capsys, monkeypatch):
    def terminated(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("SIGTERM did not stop the run")

    def unhandled(signum, frame):  # what the test process does when the command does not handle it
        raise AssertionError("the command left SIGTERM to the process's default (death, no line)")

    monkeypatch.setattr("posenc.compare.runner.train_encoding", terminated)
    before = signal.signal(signal.SIGTERM, unhandled)
    out = tmp_path / "out"
    try:
        rc = main(["compare", *TINY, "--encodings", "rope", "--steps", "2", "--workers", "1", "--out", str(out)])
        assert signal.getsignal(signal.SIGTERM) is unhandled  # the command's handler is its own only
    finally:
        signal.signal(signal.SIGTERM, before)
    err = capsys.readouterr().err.strip()
    assert rc == 143 and f"posenc compare --resume --out {out}" in err and "Traceback" not in err, err


@pytest.mark.slow  # ~8 s: two spawned workers import torch and train before the signal
def test_sigterm_stops_worker_processes_with_the_resume_hint(tmp_path):
    """SIGTERM to ``posenc compare --workers 2`` was the default death (-15 here, 143 from a
    shell) with no line: now the line and the resume hint Ctrl-C gives, exit 143."""
    out = tmp_path / "term"
    argv = [*TINY, "--encodings", "rope,alibi", "--steps", "100000", "--workers", "2", "--checkpoint-every", "1"]
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen([sys.executable, "-m", "posenc.cli", "compare", *argv, "--out", str(out)], env=env,
                            text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.time() + 300
    while not (out / "checkpoints" / "rope.pt").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)  # the workers are training
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert f"posenc compare --resume --out {out}" in err and "Traceback" not in err, err


def test_resuming_a_folder_whose_config_this_posenc_refuses_says_what_to_do(tmp_path, capsys):
    """222d208 wrote warmup 100 into a 2-step run's config.json (the schedule cut it to the
    steps); that config is refused now, and --resume says how to go on (issue 62: old run
    folders load or are refused with one line saying why and what to do)."""
    import json

    out = tmp_path / "run"
    out.mkdir()
    cfg = preset_config("quick", steps=2, encodings=["rope"]).to_dict() | {"warmup": 100}
    (out / "config.json").write_text(json.dumps(cfg))
    assert main(["compare", "--resume", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "warmup" in err and "start the run over with --overwrite" in err, err
