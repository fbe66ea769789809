"""The two-map extension methods against plain RoPE through the same path, as ``posenc extend`` runs them.

``posenc bench --extension`` builds one :class:`posenc.Attention` layer with SmolLM2-135M's
attention (width 576, 9 query heads, 3 key/value heads of 64, RoPE θ 1e5) per method and runs,
for every length ``L``, a chunked prefill: ``chunk`` tokens per call appended to the layer's
KV cache, as ``posenc extend`` scores a window (:mod:`posenc.extend.evaluate`). The methods take
``posenc extend``'s settings for a 2× extension of a model trained at ``L / 2``
(:func:`posenc.extend.methods.method_options`): ReRoPE and Self-Extend with a window of
``L / 4``, DCA with chunks of ``3L/8``.

Each row is one method on one backend: ``auto`` (what the layer picks: ``sdpa`` for ``rope``,
``maps`` for the others on CPU) and ``chunked`` (every score map materialised in query blocks:
the path before the ``maps`` backend). Times are the CPU time of the calling thread per scored
token (``time.thread_time``; CUDA: synchronised wall time); ``ratio`` is the row's time over
``rope``'s (``auto``) at the same length, the median of the rounds' ratios, each round timing
every row once, interleaved, so a change of load hits all. Nothing is asserted: the table is the result.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

__all__ = ["EXTENSION_METHODS", "ExtensionConfig", "extension_markdown", "extension_table", "run_extension"]

EXTENSION_METHODS = ("rerope", "self-extend", "dca")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ExtensionConfig:
    """The run: ``lengths`` (tokens), ``chunk`` tokens per call, ``rounds`` interleaved rounds; the layer's
    shape (SmolLM2-135M's attention by default); ``factor``: the extension (trained length ``L / factor``)."""

    lengths: tuple[int, ...] = (2048, 4096, 8192)
    chunk: int = 512
    rounds: int = 2
    methods: tuple[str, ...] = EXTENSION_METHODS
    backends: tuple[str, ...] = ("auto", "chunked")
    dim: int = 576
    heads: int = 9
    kv_heads: int = 3
    base: float = 1e5
    factor: int = 2
    device: str = "cpu"
    dtype: str = "float32"


def _layer(cfg: ExtensionConfig, method: str, length: int):
    from ..extend.methods import method_classes, method_options
    from ..layer.attention import Attention

    opts = {} if method == "rope" else method_options(method, train_tokens=max(2, length // cfg.factor),
                                                      longest_tokens=length)  # fmt: skip
    name = method_classes(method).get("rope", "rope") if method != "rope" else "rope"
    torch.manual_seed(0)
    attn = Attention(cfg.dim, cfg.heads, name, kv_heads=cfg.kv_heads, causal=True, base=cfg.base, **opts)
    return attn.to(device=cfg.device, dtype=_DTYPES[cfg.dtype]).eval()


def _clock(device: torch.device) -> Callable[[], float]:
    if device.type == "cuda":

        def wall() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return wall
    return time.thread_time


def _prefill(attn, x: torch.Tensor, chunk: int, backend: str, clock) -> float:
    """Seconds of one chunked prefill of ``x`` ``(1, L, D)`` through a fresh cache."""
    cache = attn.init_cache(1, x.shape[1], dtype=x.dtype, device=x.device)
    kw = {} if backend == "auto" else {"backend": backend}
    with torch.no_grad():
        start = clock()
        for s in range(0, x.shape[1], chunk):
            attn(x[:, s : s + chunk], cache=cache, **kw)
        return clock() - start


def run_extension(cfg: ExtensionConfig, progress: Callable[[str], None] | None = None) -> list[dict]:
    """One row per length × (``rope``, then each method × backend): ms per token and the ratio to ``rope``."""
    device, rows = torch.device(cfg.device), []
    clock = _clock(device)
    cases = [("rope", "auto")] + [(m, b) for m in cfg.methods for b in cfg.backends]
    for n in cfg.lengths:
        if progress:
            progress(f"extension: {len(cases)} cases at {n} tokens, chunks of {cfg.chunk} ({cfg.rounds} rounds)")
        x = torch.randn(1, n, cfg.dim, generator=torch.Generator().manual_seed(n)).to(device, _DTYPES[cfg.dtype])
        layers, status = {}, {}
        for m, b in cases:
            try:
                if m not in layers:
                    layers[m] = _layer(cfg, m, n)
                _prefill(layers[m], x[:, : min(n, cfg.chunk)], cfg.chunk, b, clock)  # warm-up
                status[m, b] = "ok"
            except (ValueError, RuntimeError) as e:
                status[m, b] = f"error: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
        times: dict[tuple[str, str], list[float]] = {c: [] for c in cases if status[c] == "ok"}
        for _ in range(cfg.rounds):
            for c in times:
                times[c].append(_prefill(layers[c[0]], x, cfg.chunk, c[1], clock))
        base = times.get(("rope", "auto"))
        for c in cases:
            t = times.get(c)
            ratio = statistics.median(a / r for a, r in zip(t, base) if r > 0) if t and base else None
            rows.append(_row(cfg, c, n, None if not t else statistics.median(t) / n, ratio, status[c]))
    return rows


def _row(cfg: ExtensionConfig, case: tuple[str, str], n: int, per_token, ratio, status: str) -> dict:
    keep = {k: v for k, v in asdict(cfg).items() if k not in ("lengths", "methods", "backends")}
    return {**keep, "method": case[0], "backend": case[1], "tokens": n,
            "ms_per_token": None if per_token is None else round(per_token * 1000, 4),
            "ratio": None if ratio is None else round(ratio, 3), "status": status}  # fmt: skip


def extension_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the report's table."""
    head = ["method", "backend", "tokens", "ms / token", "/ rope", "status"]
    body = [[f"`{r['method']}`", r["backend"], str(r["tokens"]),
             "—" if r["ms_per_token"] is None else f"{r['ms_per_token']:.4f}",
             "—" if r["ratio"] is None else f"{r['ratio']:.2f}×", r["status"]] for r in rows]  # fmt: skip
    return head, body


def extension_markdown(rows: list[dict], table: str) -> list[str]:
    """The Markdown section of the report around ``table`` (the rows rendered)."""
    r = rows[0]
    return [
        "## Two-map extension methods against plain RoPE",
        "",
        f"One attention layer (width {r['dim']}, {r['heads']} query / {r['kv_heads']} key-value heads, RoPE θ "
        f"{r['base']:g}) runs a chunked prefill of each length in chunks of {r['chunk']} tokens through its KV "
        f"cache, as `posenc extend` scores a window; the methods take `extend`'s settings for a {r['factor']}× "
        "extension. CPU time of the calling thread per token (CUDA: synchronised wall time), interleaved rounds; "
        "`/ rope` is the median of the rounds' ratios to `rope` on `auto` (SDPA) at the same length. `auto` runs "
        "the `maps` backend on CPU; `chunked` materialises every score map.",
        "",
        table,
        "",
    ]
