"""Decoding memory of grouped k/v: the KV cache of a ``kv_heads = H/4`` model against full heads.

Two :class:`posenc.TransformerLM` of the same shape but ``kv_heads`` decode the same
``tokens`` one at a time from an empty cache. Both figures are measured, not computed
from the shapes:

* ``cache_bytes``: the bytes of the storages the cache holds after decoding (every
  layer's keys, values, positions and per-key state, read from the tensors themselves);
* ``peak_bytes``: the peak allocation of the whole decode (cache creation included) above
  what was allocated before it: ``torch.cuda.max_memory_allocated`` on CUDA, the profiler's
  live torch tensor bytes on CPU (:func:`posenc.bench.measure.peak_memory`).

``ratio`` is full heads over grouped, per figure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from ..model import TransformerLM
from .measure import peak_memory

__all__ = ["KVCacheConfig", "cache_bytes", "kv_cache_table", "run_kv_cache"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KVCacheConfig:
    """The decoding run: a ``depth``-layer model of width ``dim`` with ``heads`` heads, its
    grouped twin with ``kv_heads`` (None: ``heads // 4``, at least 1), ``tokens`` decoded
    one at a time for ``batch`` sequences."""

    encoding: str = "rope"
    dim: int = 256
    depth: int = 4
    heads: int = 4
    kv_heads: int | None = None
    tokens: int = 256
    batch: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    vocab_size: int = 256

    @property
    def grouped(self) -> int:
        return max(1, self.heads // 4) if self.kv_heads is None else self.kv_heads


def cache_bytes(cache) -> int:
    """Bytes of every distinct storage a :class:`posenc.layer.cache.ModelCache` holds (counted once)."""
    seen: dict[int, int] = {}

    def add(t) -> None:
        if isinstance(t, Tensor):
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()

    for layer in cache.layers:
        for t in (layer.k, layer.v, layer.pos, *layer.state.values()):
            add(t)
    return sum(seen.values())


def _decode(lm: TransformerLM, cfg: KVCacheConfig, device: torch.device, out: dict) -> Callable[[], None]:
    tokens = torch.randint(0, cfg.vocab_size, (cfg.batch, cfg.tokens), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)

    def run() -> None:
        with torch.no_grad():
            cache = lm.init_cache(cfg.batch, cfg.tokens)
            for i in range(cfg.tokens):
                lm(tokens[:, i : i + 1], cache=cache)
            out["cache_bytes"] = cache_bytes(cache)
            out["length"] = cache.length

    return run


def run_kv_cache(cfg: KVCacheConfig, progress: Callable[[str], None] | None = None) -> list[dict]:
    """One row per model (full heads, then grouped): ``kv_heads``, ``cache_bytes``,
    ``peak_bytes``, their ratio to the grouped row's (full / grouped), and a ``status``."""
    device, dtype = torch.device(cfg.device), _DTYPES[cfg.dtype]
    rows = []
    for kv in (cfg.heads, cfg.grouped):
        if progress:
            progress(f"kv cache: {cfg.encoding} kv_heads={kv}/{cfg.heads}, {cfg.tokens} tokens")
        row = {**asdict(cfg), "kv_heads": kv, "cache_bytes": None, "peak_bytes": None, "status": "ok"}
        try:
            torch.manual_seed(0)
            lm = TransformerLM(cfg.vocab_size, cfg.dim, cfg.depth, cfg.heads, cfg.encoding, kv_heads=kv)
            lm = lm.to(device=device, dtype=dtype).eval()
            got: dict = {}
            row["peak_bytes"] = peak_memory(_decode(lm, cfg, device, got), device=device)
            row["cache_bytes"] = got["cache_bytes"]
            if got["length"] != cfg.tokens:
                row["status"] = f"error: the cache holds {got['length']} tokens after decoding {cfg.tokens}"
        except (RuntimeError, ValueError) as e:  # out of memory, an encoding that cannot decode
            row["status"] = f"error: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
        rows.append(row)
    full = rows[0]
    for r in rows:
        for key in ("cache_bytes", "peak_bytes"):
            ok = full[key] is not None and r[key]
            r[f"{key}_ratio"] = round(full[key] / r[key], 3) if ok else None
    return rows


def kv_cache_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the report's table (MiB, and full heads / this row)."""
    head = ["model", "kv_heads", "tokens", "KV cache MiB", "full / this", "decode peak MiB", "full / this", "status"]

    def mib(b):
        return "—" if b is None else f"{b / 2**20:.2f}"

    def ratio(x):
        return "—" if x is None else f"{x:.2f}×"

    body = []
    for r in rows:
        model = f"`{r['encoding']}` D={r['dim']} depth={r['depth']} H={r['heads']} {r['dtype']} B={r['batch']}"
        body.append([model, str(r["kv_heads"]), str(r["tokens"]), mib(r["cache_bytes"]),
                     ratio(r["cache_bytes_ratio"]), mib(r["peak_bytes"]), ratio(r["peak_bytes_ratio"]),
                     r["status"]])  # fmt: skip
    return head, body
