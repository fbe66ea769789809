"""Jobs on worker processes (posenc.compare.runner)."""

from __future__ import annotations

import os

import pytest

from posenc.compare.runner import plan_workers, run_jobs


def _square_and_threads(x: int):
    import torch

    if x < 0:
        raise ValueError(f"negative job {x}")
    return x * x, torch.get_num_threads(), os.getpid()


def test_plan_workers():
    assert plan_workers(0, 7, cores=2) == (2, 1)  # one per core
    assert plan_workers(0, 1, cores=4) == (1, 4)  # one job: all cores to it
    assert plan_workers(3, 2, cores=8) == (2, 4)  # never more processes than jobs
    assert plan_workers(1, 7, cores=2) == (1, 2)
    with pytest.raises(ValueError, match="workers must be an int >= 0"):
        plan_workers(-1, 3)


def test_inline_keeps_order_and_reports_each():
    seen = []
    out = run_jobs([3, 1, 2], _square_and_threads, workers=1, threads=1, on_done=lambda i, r: seen.append(i))
    assert [r[0] for r in out] == [9, 1, 4] and seen == [0, 1, 2] and {r[2] for r in out} == {os.getpid()}


@pytest.mark.slow
def test_workers_run_elsewhere_with_their_threads_and_fail_loudly():
    seen = []
    out = run_jobs([1, 2, 3, 4], _square_and_threads, workers=2, threads=1, on_done=lambda i, r: seen.append(i))
    assert [r[0] for r in out] == [1, 4, 9, 16] and sorted(seen) == [0, 1, 2, 3]
    assert {r[1] for r in out} == {1} and os.getpid() not in {r[2] for r in out}
    with pytest.raises(ValueError, match="negative job -1"):
        run_jobs([1, -1, 2], _square_and_threads, workers=2, threads=1)


def test_slowest_encodings_start_first():
    """Longest job first on the workers: the bias encodings (clipped-relative's tables, then T5's
    bucket biases, then ALiBi's fixed slopes); SDPA encodings last, in list order."""
    from posenc.compare import preset_config
    from posenc.compare.runner import _slow_first

    cfg = preset_config("quick")
    assert _slow_first(cfg, cfg.encodings) == ["shaw", "t5", "alibi", "learned", "nope", "sinusoidal", "rope"]
    # an encoding whose options do not fit keeps its place among the fast ones, no error
    assert _slow_first(cfg, ["rope", "shaw"]) == ["shaw", "rope"]
