"""Timing, peak memory and the machine record.

* Time: the median of ``repeats`` wall-clock runs after ``warmup`` untimed ones
  (``torch.cuda.synchronize`` around each run on CUDA).
* Profile: one run under ``torch.profiler``; the operators with the most self time
  (:func:`top_operators`) are what bounds a step.
* Peak memory, CUDA: ``torch.cuda.max_memory_allocated`` during one run, minus what was
  allocated before it.
* Peak memory, CPU: there is no allocator high-water mark on CPU, so one run is recorded
  with ``torch.profiler`` (``profile_memory=True``); its allocation/free events are summed
  in time order and the maximum of that running sum is the peak. This counts every
  tensor byte allocated by torch during the run (activations, saved tensors, gradients,
  temporaries) above what was alive before it, not the process RSS (no allocator
  caching, no Python objects). Frees of blocks allocated before the recording are not
  seen by the profiler, so the caller frees what it can (gradients) before the run.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone

import torch
from torch import Tensor

from ..allocator import allocator_settings

__all__ = ["layer_step", "time_runs", "peak_memory", "machine_record", "top_operators", "thread_clock"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def thread_clock(device: torch.device) -> Callable[[], float]:
    """The clock of the real-model and extension rows: the calling thread's CPU time on CPU (another
    job on the machine does not enter it), synchronised wall time on CUDA."""
    if device.type == "cuda":

        def wall() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return wall
    return time.thread_time


def time_runs(
    fn: Callable[[], object],
    *,
    device: torch.device,
    warmup: int = 2,
    repeats: int = 5,
    max_seconds: float | None = None,
) -> list[float]:
    """Seconds of each of ``repeats`` runs of ``fn`` after ``warmup`` untimed runs.

    With ``max_seconds``, stops early (keeping at least one timed run) once the timed runs
    have used that much time.
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"warmup must be >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    for _ in range(warmup):
        fn()
    _sync(device)
    times: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
        if max_seconds is not None and sum(times) > max_seconds:
            break
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs)


@contextlib.contextmanager
def _quiet_native_output():
    """Silence the profiler's native start/stop lines (written by C++ to fds 1 and 2)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def _cpu_peak_bytes(fn: Callable[[], object]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with _quiet_native_output():
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        prof.start()
    try:
        fn()
    finally:
        with _quiet_native_output():
            prof.stop()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        if e.device_type() != torch.autograd.DeviceType.CPU:
            continue
        live += e.nbytes()  # positive for an allocation, negative for a free
        peak = max(peak, live)
    return peak


def peak_memory(fn: Callable[[], object], *, device: torch.device) -> int:
    """Peak bytes allocated by one run of ``fn`` above what was allocated before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    return _cpu_peak_bytes(fn)


def top_operators(fn: Callable[[], object], *, device: torch.device, n: int = 8) -> list[dict]:
    """The ``n`` operators with the most self time in one run of ``fn`` (after the caller's
    warm-up): ``{"name", "self_s", "share", "calls"}``, share of the summed self time.
    CPU time on CPU, device time on CUDA."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with _quiet_native_output():
        prof = profile(activities=acts)
        prof.start()
    try:
        fn()
        _sync(device)
    finally:
        with _quiet_native_output():
            prof.stop()
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr) > 0]
    total = sum(getattr(e, attr) for e in events) or 1.0
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    return [
        {"name": e.key, "self_s": getattr(e, attr) / 1e6, "share": getattr(e, attr) / total, "calls": e.count}
        for e in events[:n]
    ]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_record(device: torch.device) -> dict:
    """CPU model, core count, torch threads, versions, device, date (UTC)."""
    rec = {
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "allocator": allocator_settings(),  # None: the C library's defaults
    }
    if device.type == "cuda":
        rec["gpu"] = torch.cuda.get_device_name(device)
        rec["cuda"] = torch.version.cuda
    try:
        rec["loadavg_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    return rec


def layer_step(module, fn: Callable[[Tensor], Tensor], x: Tensor, grad: Tensor, mode: str) -> Callable[[], None]:
    """One timed step of ``module``: ``fn(x)`` under no_grad (``mode="fwd"``), or forward and
    backward with ``grad`` after clearing the parameters' gradients (``"fwd+bwd"``)."""
    params = [p for p in module.parameters() if p.requires_grad]

    if mode == "fwd":

        def run():
            with torch.no_grad():
                fn(x)

        return run

    def run():
        for p in params:
            p.grad = None
        fn(x).backward(grad)

    return run
