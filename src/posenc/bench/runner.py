"""Run the layer benchmark: every case at every length, forward and forward+backward.

Each row of the result is one (case, length, mode, mask) with the median time, the peak
memory, and both as ratios to the baseline (plain SDPA, no position) measured at the
same length, in the same masking mode, in the same run. At ``memory_lengths`` the
posenc cases and the baseline run one profiled forward+backward each (peak memory, not
timed: ``kind="memory"``); with ``profile``, each posenc case at the longest timed length
also gets the operators that bound its step (``Row.profile``, from one profiled run).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..allocator import allocator_settings
from ..registry import get_class
from .layers import Case, baseline_case, posenc_case, reference_cases, resolved_backend
from .measure import layer_step, median, peak_memory, time_runs, top_operators
from .rss import peak_rss

__all__ = ["BenchConfig", "MASKS", "MEMORY_METHODS", "MODES", "Row", "run_layers", "resolved_backend"]

MODES = ("fwd", "fwd+bwd")
MASKS = ("causal", "bidir")
MEMORY_METHODS = ("profiler", "rss")


@dataclass
class BenchConfig:
    encodings: list[str]
    lengths: list[int]
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    masks: tuple[str, ...] = ("causal",)  # "causal" and/or "bidir"
    device: str = "cpu"
    dtype: str = "float32"
    modes: tuple[str, ...] = MODES
    warmup: int = 1
    repeats: int = 5
    backends: tuple[str, ...] = ("auto",)
    references: bool = True
    memory: bool = True
    chunk_size: int = 1024
    max_seconds: float = 60.0  # a case that takes longer per run skips its longer lengths
    memory_lengths: list[int] = field(default_factory=list)  # peak memory only (one profiled fwd+bwd)
    memory_method: str = "profiler"  # CPU: "profiler" (live tensor bytes) or "rss" (a fresh process per case)
    windows: list[int] = field(default_factory=list)  # also each posenc layer with a sliding window of W keys
    profile: bool = False  # the top operators of each posenc case (one profiled run per mode at the longest L)
    seed: int = 0

    def __post_init__(self) -> None:
        counts = dict(batch=(self.batch, 1), heads=(self.heads, 1), head_dim=(self.head_dim, 1),
                      warmup=(self.warmup, 0), repeats=(self.repeats, 1), chunk_size=(self.chunk_size, 1))  # fmt: skip
        for name, (v, lo) in counts.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        for name in ("lengths", "memory_lengths", "windows"):
            vals = getattr(self, name)
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in vals):
                raise ValueError(f"{name} must be positive integers, got {vals!r}")
        if not self.lengths and not self.memory_lengths:
            raise ValueError("nothing to measure: lengths and memory_lengths are both empty")
        if not self.encodings:
            raise ValueError("encodings is empty: name at least one")
        if not self.modes or any(m not in MODES for m in self.modes):
            raise ValueError(f"modes must be a non-empty subset of {MODES}, got {self.modes!r}")
        if not self.backends:
            raise ValueError("backends is empty: give at least one (e.g. 'auto')")
        if not (
            isinstance(self.max_seconds, (int, float)) and math.isfinite(self.max_seconds) and self.max_seconds > 0
        ):
            raise ValueError(f"max_seconds must be a finite number > 0, got {self.max_seconds!r}")
        bad = [m for m in self.masks if m not in MASKS]
        if bad or not self.masks:
            raise ValueError(f"masks must be a non-empty subset of {MASKS}, got {self.masks!r}")
        if self.memory_method not in MEMORY_METHODS:
            raise ValueError(f"memory_method must be one of {MEMORY_METHODS}, got {self.memory_method!r}")
        if self.memory_method == "rss" and self.device != "cpu":
            raise ValueError(f"memory_method 'rss' measures a CPU process; got device {self.device!r}")


@dataclass
class Row:
    label: str
    impl: str
    encoding: str
    backend: str
    causal: bool
    L: int
    mode: str
    time_s: float | None = None
    times_s: list[float] = field(default_factory=list)
    ratio: float | None = None  # time / baseline time
    peak_bytes: int | None = None
    peak_ratio: float | None = None
    status: str = "ok"
    kind: str = "time"  # "time": timed (and peak memory); "memory": peak memory only
    memory_method: str = "profiler"  # how peak_bytes was measured (memory rows): "profiler" or "rss"
    profile: list[dict] = field(default_factory=list)  # top operators: name, self_s, share


def _cases(cfg: BenchConfig, device, dtype, causal: bool, encodings: list[str]) -> list[Case]:
    kw = dict(heads=cfg.heads, head_dim=cfg.head_dim, device=device, dtype=dtype)
    cases = [baseline_case(causal=causal, **kw)]
    for e in encodings:
        for b in cfg.backends:
            for w in [None, *cfg.windows]:
                opts = {"window": w} if w else {}
                max_len = max([*cfg.lengths, *cfg.memory_lengths])
                cases.append(
                    posenc_case(e, causal=causal, max_len=max_len, backend=b, chunk_size=cfg.chunk_size, **opts, **kw)
                )
    if cfg.references:
        cases += [c for c in reference_cases(encodings, **kw) if c.causal == causal]
    return cases


def run_layers(cfg: BenchConfig, progress: Callable[[str], None] | None = None) -> list[Row]:
    """Measure every case; returns one :class:`Row` per (case, length, mode)."""
    device = torch.device(cfg.device)
    dtype = getattr(torch, cfg.dtype)
    D = cfg.heads * cfg.head_dim

    # DeBERTa's reference is bidirectional: run it (and posenc's deberta) in that mode too.
    groups: list[tuple[bool, list[str]]] = []
    for m in cfg.masks:
        causal = m == "causal"
        groups.append((causal, [e for e in cfg.encodings if causal or not get_class(e).causal_only]))
    if "bidir" not in cfg.masks and cfg.references and "deberta" in cfg.encodings:
        groups.append((False, ["deberta"]))

    rows: list[Row] = []
    for causal, encs in groups:
        cases = _cases(cfg, device, dtype, causal, encs)
        too_slow: set[tuple[str, str]] = set()
        for L in cfg.lengths:
            rows += _run_length(cfg, cases, causal, L, device, dtype, D, too_slow, progress)
        mine = [c for c in cases if c.impl == "posenc"]  # the references hold L×L tensors: not at long L
        for L in cfg.memory_lengths:
            rows += _memory_length(cfg, mine, causal, L, device, dtype, D, progress)
    return rows


def _run_length(cfg, cases, causal, L, device, dtype, D, too_slow, progress) -> list[Row]:
    """Every case at one length, runs interleaved round-robin so that load changes on a
    shared machine hit the baseline and the cases alike; the ratio is the median of the
    per-round ratios to the baseline run of the same round."""
    g = torch.Generator(device="cpu").manual_seed(cfg.seed + L)
    x = torch.randn(cfg.batch, L, D, generator=g).to(device=device, dtype=dtype)
    grad = torch.randn(cfg.batch, L, D, generator=g).to(device=device, dtype=dtype)
    rows: list[Row] = []
    built = []
    for case in cases:
        try:
            torch.manual_seed(cfg.seed)
            module, fn = case.make(L)
        except Exception as e:  # an encoding that cannot be built with these settings
            for mode in cfg.modes:
                rows.append(
                    Row(case.label, case.impl, case.encoding, case.backend, causal, L, mode, status=f"error: {e}")
                )
            continue
        built.append((case, module, fn))

    for mode in cfg.modes:
        live = []  # (case, module, run, row)
        for case, module, fn in built:
            row = Row(
                case.label,
                case.impl,
                case.encoding,
                resolved_backend(case, module, device, L),
                causal,
                L,
                mode,
            )
            rows.append(row)
            if (case.label, mode) in too_slow:
                row.status = f"skipped: a shorter length took over {cfg.max_seconds:g} s per run"
                continue
            run = layer_step(module, fn, x, grad, mode)
            try:
                if progress:
                    progress(f"warm-up {case.label} L={L} {mode}{'' if causal else ' bidir'}")
                time_runs(run, device=device, warmup=0, repeats=max(cfg.warmup, 1))
            except Exception as e:
                row.status = f"error: {type(e).__name__}: {str(e)[:200]}"
                continue
            live.append((case, module, run, row))
        base = next((item for item in live if item[0].encoding == "none"), None)
        ratios: dict[int, list[float]] = {id(r): [] for *_, r in live}
        for rep in range(cfg.repeats):
            if progress:
                progress(f"round {rep + 1}/{cfg.repeats} L={L} {mode}{'' if causal else ' bidir'}")
            t_base = None
            for case, _module, run, row in live:
                if row.status != "ok" or (rep > 0 and sum(row.times_s) > cfg.max_seconds and case.encoding != "none"):
                    continue
                try:
                    t = time_runs(run, device=device, warmup=0, repeats=1)[0]
                except Exception as e:
                    row.status = f"error: {type(e).__name__}: {str(e)[:200]}"
                    continue
                row.times_s.append(t)
                if case.encoding == "none":
                    t_base = t
                elif t_base is not None:
                    ratios[id(row)].append(t / t_base)
        for case, module, run, row in live:
            if row.status != "ok" or not row.times_s:
                continue
            row.time_s = median(row.times_s)
            if row.time_s > cfg.max_seconds:
                too_slow.add((case.label, mode))
            if case.encoding == "none":
                row.ratio = 1.0
            elif ratios[id(row)]:
                row.ratio = median(ratios[id(row)])
            if cfg.memory:
                try:
                    module.zero_grad(set_to_none=True)  # frees before the recorded run, not in it
                    row.peak_bytes = peak_memory(run, device=device)
                except Exception as e:
                    row.status = f"error: {type(e).__name__}: {str(e)[:200]}"
            if cfg.profile and case.impl == "posenc" and L == max(cfg.lengths):
                module.zero_grad(set_to_none=True)
                row.profile = top_operators(run, device=device)
        if base is not None and base[3].peak_bytes:
            for *_, row in live:
                if row.peak_bytes is not None:
                    row.peak_ratio = row.peak_bytes / base[3].peak_bytes
    return rows


def _memory_length(cfg, cases, causal, L, device, dtype, D, progress) -> list[Row]:
    """Peak memory of one forward+backward of each case at ``L`` (not timed)."""
    g = torch.Generator(device="cpu").manual_seed(cfg.seed + L)
    x = torch.randn(cfg.batch, L, D, generator=g).to(device=device, dtype=dtype)
    grad = torch.randn(cfg.batch, L, D, generator=g).to(device=device, dtype=dtype)
    rows: list[Row] = []
    base_peak = None
    for case in cases:
        if progress:
            progress(f"memory {case.label} L={L}{'' if causal else ' bidir'}")
        row = Row(case.label, case.impl, case.encoding, "", causal, L, "fwd+bwd", kind="memory")
        row.memory_method = cfg.memory_method
        rows.append(row)
        try:
            if cfg.memory_method == "rss":
                spec = dict(
                    encoding=case.encoding,
                    backend=case.backend,
                    options=case.options,
                    causal=causal,
                    L=L,
                    heads=cfg.heads,
                    head_dim=cfg.head_dim,
                    dtype=cfg.dtype,
                    batch=cfg.batch,
                    seed=cfg.seed,
                    chunk_size=cfg.chunk_size,
                    max_len=max([*cfg.lengths, *cfg.memory_lengths]),
                    threads=torch.get_num_threads(),
                    allocator=allocator_settings(),  # the child sets the C allocator as this process has it
                )
                got = peak_rss(spec)
                row.backend, row.peak_bytes = got["backend"], got["peak_bytes"]
            else:
                torch.manual_seed(cfg.seed)
                module, fn = case.make(L)
                row.backend = resolved_backend(case, module, device, L)
                row.peak_bytes = peak_memory(layer_step(module, fn, x, grad, "fwd+bwd"), device=device)
        except Exception as e:
            row.status = f"error: {type(e).__name__}: {str(e)[:200]}"
            continue
        if case.encoding == "none":
            base_peak = row.peak_bytes
    for row in rows:
        if base_peak and row.peak_bytes is not None:
            row.peak_ratio = row.peak_bytes / base_peak
    return rows
