"""The paper preset at tiny sizes on a stand-in WikiText corpus, under torchrun with two gloo
processes on the CPU: it equals one process with the same tokens per update (gradient
accumulation makes up the other process), and resumes exactly after a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

import posenc
from conftest import tolerance
from posenc.cli import main
from posenc.output.rundir import is_locked
from test_paper_preset_data import write_corpus

SRC = str(Path(__file__).resolve().parents[1] / "src")
# 8 sequences of 16 tokens per update: one process runs 4 micro-batches of 2, two run 2 each.
# Dropout 0 (residual, attention, activation): each process draws its own dropout masks, so with
# the preset's 0.3/0.1/0.1 the two runs would differ by their masks, not by their arithmetic
TINY = ["--preset", "paper", "--dropout", "0", "--attn-dropout", "0", "--activation-dropout", "0", "--dim", "16", "--depth", "1", "--heads", "2", "--train-len", "16", "--batch-size", "8",
        "--tokens-per-update", "128", "--micro-batch", "2", "--warmup", "2", "--eval-lens", "16,32",
        "--eval-tokens", "256", "--eval-batch-size", "4", "--adaptive-cutoffs", "20,80", "--dtype", "float32",
        "--device", "cpu", "--encodings", "rope,alibi", "--no-progress"]  # fmt: skip
GLOO = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


def _torchrun(args, **kw):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "posenc.cli", "compare", *args]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    return cmd, env


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (every thread's), read from ``/proc`` (Linux)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return out


def gone(pid: int) -> bool:
    """Whether ``pid`` has died: no such process, or a zombie with every thread ended. (A killed
    process's main thread turns zombie while its other threads still exit, and the files it
    holds open, the run folder's lock among them, close only when the last of them has.)"""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return True
    for task in tasks:
        try:
            if (task / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                return False
        except FileNotFoundError:  # that thread has just gone
            pass
    return True


def wait_gone(pids: list[int], seconds: float) -> list[int]:
    """Wait up to ``seconds`` for every pid to die; the ones still alive."""
    deadline = time.time() + seconds
    while time.time() < deadline and not all(gone(q) for q in pids):
        time.sleep(0.02)
    return [q for q in pids if not gone(q)]


def _kill_all(p: subprocess.Popen) -> list[int]:
    """SIGKILL ``torchrun`` (started in a session of its own) and every rank it started, at
    once, as the OOM killer or a scheduler would; returns the ranks' pids once all are dead."""
    ranks = children(p.pid)
    os.killpg(p.pid, signal.SIGKILL)
    for r in ranks:
        try:
            os.killpg(r, signal.SIGKILL)  # each rank leads its own session and group
        except ProcessLookupError:
            pass
    p.wait()
    assert not wait_gone(ranks, 30), "a rank outlived SIGKILL"
    return ranks


def _why(proc: subprocess.CompletedProcess) -> str:
    """What a failed torchrun said: posenc's own one-line errors (rank 0's exit 2 is one), then
    the end of its output (torchrun's summary names only the exit codes)."""
    lines = proc.stderr.splitlines()
    said = [ln for ln in lines if "error" in ln.lower() and "Traceback" not in ln][:20]
    return "\n".join([*said, "...", proc.stderr[-3000:]])


def _load(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


@pytest.mark.slow
@GLOO
@pytest.mark.parametrize("sharding", [[], ["--fsdp"]], ids=["ddp", "fsdp"])
def test_two_processes_equal_one_with_the_same_tokens_per_update_and_resume_exactly(tmp_path, sharding):
    """DDP replicates the model; FSDP (``fully_shard``, gloo on the CPU) shards weights,
    gradients and optimizer state, gathers them into each checkpoint and resumes from it."""
    data = write_corpus(tmp_path / "wt", lines=(400, 80, 80))
    args = [*TINY, "--data-dir", str(data), "--steps", "8", "--checkpoint-every", "1"]
    one = tmp_path / "one"
    assert main(["compare", *args, "--out", str(one)]) == 0
    two = tmp_path / "two"
    cmd, env = _torchrun([*args, *sharding, "--out", str(two)])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, _why(proc)
    a, b = _load(one), _load(two)
    assert (a["processes"], b["processes"]) == (1, 2) and b["config"].get("fsdp", False) == bool(sharding)
    saved, _ = posenc.load_checkpoint(two / "checkpoints" / "rope.pt")  # full weights: a plain model loads them
    assert saved.num_params() == a["runs"][0]["params"]
    # a step's loss sums, on its path, the input projection (D), q.k and the output (D each
    # at most), the softmax over the bands (<= V) and the mean over 128 tokens; the processes
    # sum the gradients in another order, and each of the 8 steps carries the last one's
    # rounding on (measured: 7e-8 relative; with the preset's dropout 0.3, 1e-3)
    vocab = len(json.loads((one / "vocab.json").read_text())["symbols"])
    tol = tolerance(n=8 * (2 * 16 + vocab + 128), magnitude=1.0)
    for ra, rb in zip(a["runs"], b["runs"], strict=True):
        assert ra["encoding"] == rb["encoding"]
        assert ra["train_loss"] == pytest.approx(rb["train_loss"], rel=tol["rtol"], abs=tol["atol"])
        assert [e["loss"] for e in ra["eval"]] == pytest.approx(
            [e["loss"] for e in rb["eval"]], rel=tol["rtol"], abs=tol["atol"]
        )
        assert ra["train_loss"][-1] < ra["train_loss"][0]  # it learns

    # kill the two-process run mid-training, resume it with two processes: the same numbers, bit for bit
    killed = tmp_path / "killed"
    cmd, env = _torchrun([*args, *sharding, "--out", str(killed)])
    p = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = killed / "checkpoints" / "rope.pt"
    deadline = time.time() + 240
    while p.poll() is None and time.time() < deadline:
        if ckpt.exists():
            try:
                _, extra = posenc.load_checkpoint(ckpt)
            except Exception:  # noqa: BLE001  mid-rename: try again
                continue
            if extra["step"] >= 3:
                break
        time.sleep(0.02)
    ranks = _kill_all(p)  # torchrun and both ranks, at once: the ranks sit in sessions of their own
    assert len(ranks) == 2, ranks
    assert not is_locked(killed), "a killed rank still holds the run folder"
    _, extra = posenc.load_checkpoint(ckpt)
    assert not extra["done"] and 0 < extra["step"] < 8, "the run finished before it could be killed"
    cmd, env = _torchrun(["--resume", "--out", str(killed), "--no-progress"])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, _why(proc)
    c = _load(killed)
    for rb, rc in zip(b["runs"], c["runs"], strict=True):
        assert rb["train_loss"] == rc["train_loss"]
        assert [e["loss"] for e in rb["eval"]] == [e["loss"] for e in rc["eval"]]


@pytest.mark.slow
@GLOO
def test_the_ranks_die_with_torchrun(tmp_path):
    """``torchrun`` starts each rank in a session of its own, so a SIGKILL of its process group
    (what the OOM killer or a scheduler sends) does not reach them: without a watchdog they
    train on, rank 0 holding the folder's lock, and the ``--resume`` the user runs next is
    refused. Each rank ends itself once its launcher is gone (``train.runtime.setup``)."""
    data = write_corpus(tmp_path / "wt", lines=(400, 80, 80))
    out = tmp_path / "run"
    cmd, env = _torchrun(
        [*TINY, "--data-dir", str(data), "--steps", "5000", "--checkpoint-every", "1", "--out", str(out)]
    )
    p = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = out / "checkpoints" / "rope.pt"
    deadline = time.time() + 240
    while p.poll() is None and time.time() < deadline and not ckpt.exists():
        time.sleep(0.02)
    assert p.poll() is None, "torchrun ended before the test could kill it"
    ranks = children(p.pid)
    try:
        assert len(ranks) == 2, ranks
        os.killpg(p.pid, signal.SIGKILL)  # torchrun alone: the ranks are not in its group
        p.wait()
        assert not wait_gone(ranks, 20), "a rank outlived its torchrun"
        assert not is_locked(out)
    finally:
        for r in ranks:
            if not gone(r):
                os.killpg(r, signal.SIGKILL)
