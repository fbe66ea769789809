"""posenc compare under torchrun: 2 CPU processes (gloo) match 1 process with the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from posenc.cli import main

SRC = str(Path(__file__).resolve().parents[1] / "src")
ARGS = ["--dim", "16", "--depth", "1", "--heads", "2", "--train-len", "16", "--batch-size", "4", "--warmup", "2",
        "--eval-lens", "16,32", "--eval-tokens", "256", "--steps", "8", "--encodings", "rope,t5",
        "--no-progress"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_two_gloo_processes_match_one(tmp_path):
    single = tmp_path / "single"
    assert main(["compare", *ARGS, "--out", str(single)]) == 0
    # no --out: both ranks must write into rank 0's default folder (issue 11), not one each
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "posenc.cli", "compare", *ARGS]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (ddp,) = (cwd / "runs").iterdir()
    assert proc.stdout.count("wall time") == 1  # rank 0 prints the table, once
    a = json.loads((single / "results.json").read_text())
    b = json.loads((ddp / "results.json").read_text())
    assert b["processes"] == 2 and a["processes"] == 1
    for ra, rb in zip(a["runs"], b["runs"], strict=True):
        assert ra["encoding"] == rb["encoding"]
        # same global batch, gradients averaged over 2 halves: the same loss curve
        assert ra["train_loss"] == pytest.approx(rb["train_loss"], rel=1e-4)
        assert [e["loss"] for e in ra["eval"]] == pytest.approx([e["loss"] for e in rb["eval"]], rel=1e-4)


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_every_rank_leaves_the_process_group_at_exit(tmp_path):
    # A rank that exits still in the group can abort in interpreter finalization (gloo's
    # threads; SIGABRT), and torchrun then kills rank 0, perhaps mid-write: setup() leaves
    # the group in an atexit handler.
    script = tmp_path / "leave.py"
    script.write_text(
        "import atexit\n"
        "import torch.distributed as dist\n"
        "from posenc.train import setup\n"
        "rt = setup('cpu')\n"
        "assert dist.is_initialized() and rt.world == 2\n"
        "atexit._run_exitfuncs()\n"
        "print('left' if not dist.is_initialized() else 'still joined', flush=True)\n"
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the two ranks' lines may interleave on the shared stdout
    assert proc.stdout.count("left") == 2 and "still joined" not in proc.stdout, proc.stdout
