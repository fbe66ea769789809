"""Independent training jobs on several CPU worker processes.

The models of a comparison do not talk to each other, so on a CPU with ``C`` cores,
``C`` one-thread processes each training its own encoding do more work per second than one
process spreading each small model's matmuls over ``C`` threads (whose per-op overhead and
synchronisation dominate at this size; see docs/compare.md for the measurement).

:func:`run_jobs` runs ``fn(job)`` for every job, in worker processes started with
``spawn`` (no fork of a process that holds torch's thread pools), each limited to
``threads`` intra-op threads, and hands every result to ``on_done`` as soon as it
arrives. With ``workers == 1`` everything runs here, in order. A failing job cancels the
ones not started and re-raises in the caller; Ctrl-C stops the workers.

Workers die with the process that started them, even when it is killed with SIGKILL (the
OOM killer's signal, which runs no cleanup): on Linux the kernel sends each worker SIGKILL
when its parent dies (``prctl(PR_SET_PDEATHSIG)``), and everywhere a watchdog thread in
each worker exits it once its parent is gone (:mod:`posenc.train.lifeline`). A worker that
outlived its run would go on writing checkpoints into a folder whose lock it does not hold.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..train.lifeline import die_with

J = TypeVar("J")
R = TypeVar("R")

__all__ = ["run_jobs", "cpu_cores", "plan_workers"]


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def plan_workers(workers: int, jobs: int, cores: int | None = None) -> tuple[int, int]:
    """``(processes, threads per process)`` for ``jobs`` jobs: ``workers`` 0 means one per core
    (at most one per job); the cores are shared out so that processes × threads <= cores."""
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise ValueError(f"workers must be an int >= 0 (0: one per CPU core), got {workers!r}")
    cores = cores or cpu_cores()
    n = max(1, min(workers or cores, jobs))
    return n, max(1, cores // n)


def _init_worker(threads: int, parent: int) -> None:
    import signal

    import torch

    die_with(parent)
    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops the workers


def _call(item):
    fn, i, job = item
    return i, fn(job)


def run_jobs(
    jobs: Sequence[J],
    fn: Callable[[J], R],
    *,
    workers: int,
    threads: int,
    on_done: Callable[[int, R], Any] | None = None,
) -> list[R]:
    """``[fn(job) for job in jobs]``, on ``workers`` processes of ``threads`` threads each.

    ``fn`` and the jobs must be picklable (a module-level function and plain data). Jobs
    start in the given order, each on the next free worker; ``on_done(index, result)``
    runs here, in the order results arrive.
    """
    out: list[Any] = [None] * len(jobs)
    if workers <= 1 or len(jobs) <= 1:
        for i, job in enumerate(jobs):
            out[i] = fn(job)
            if on_done is not None:
                on_done(i, out[i])
        return out
    import multiprocessing as mp

    # leaving the block terminates the workers: after an error, a Ctrl-C, or the last result
    with mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(threads, os.getpid())) as pool:
        for i, result in pool.imap_unordered(_call, [(fn, i, job) for i, job in enumerate(jobs)], chunksize=1):
            out[i] = result  # a worker's exception is re-raised by the iterator, here
            if on_done is not None:
                on_done(i, result)
    return out
