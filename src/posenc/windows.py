"""Which keys a query sees under windows, chunks and sink tokens: one rule, three forms.

Masks are by *logical index* (the token's place in the stream, ``0, 1, 2, ...``), not by
position: a rolling KV cache keeps the logical indices of the keys it holds, and
positions only feed the encoding. For a query at index ``i`` and a key at index ``j``::

    causal        j <= i
    window W      i - j < W                (causal: the W keys j = i-W+1 .. i, the query included)
                  |i - j| < W              (bidirectional: 2W - 1 keys)
    chunk C       i // C == j // C         (Llama 4: aligned chunks of C tokens)
    sink tokens S j < S  overrides window and chunk (StreamingLLM keeps the first S tokens),
                  never causality

The same rule is written three times, for three consumers that need it in different
shapes, and :func:`visible` is the reference the tests hold the other two to:

* :func:`visible` — a dense boolean ``(..., Lq, Lk)`` mask (eager, dense, SDPA backends);
* the same function applied to FlexAttention's scalar indices is the ``mask_mod``;
* :func:`key_ranges` — for a block of consecutive queries, the few contiguous runs of
  keys that can be visible at all, so the CPU backends never touch fully masked key
  blocks (cost O(L·W) instead of O(L²) with a window).

Conventions follow HF ``masking_utils`` (``sliding_window_overlay``: ``kv > q - W``;
``chunked_overlay``: ``kv // C == q // C``) and Gemma / gpt-oss / Mistral.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Window", "visible", "key_ranges"]


@dataclass(frozen=True)
class Window:
    """Restrictions on top of causal / bidirectional attention (all optional).

    Args:
        window: ``W`` keys around the query (see the module docstring); None: no limit.
        chunk: aligned chunks of ``C`` tokens; None: no chunks.
        sink_tokens: the first ``S`` tokens of the stream stay visible (StreamingLLM).
    """

    window: int | None = None
    chunk: int | None = None
    sink_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("window", "chunk"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        s = self.sink_tokens
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise ValueError(f"sink_tokens must be an int >= 0, got {s!r}")

    @property
    def limited(self) -> bool:
        """True when some causal-visible key may be masked (a window or chunks)."""
        return self.window is not None or self.chunk is not None

    def span(self) -> int | None:
        """Most keys before (and including) a causal query it can see, sinks aside; None: all.

        What a rolling KV cache must keep: ``span - 1`` past keys for the next query.
        """
        spans = [v for v in (self.window, self.chunk) if v is not None]
        return min(spans) if spans else None


def visible(i: Tensor, j: Tensor, *, causal: bool, win: Window) -> Tensor:
    """``True`` where query index ``i`` sees key index ``j`` (broadcasting, int tensors).

    Dense use: ``visible(qi[:, None], kj[None, :], ...)`` -> ``(Lq, Lk)``. FlexAttention's
    ``mask_mod`` calls it on scalar index tensors.
    """
    keep = j <= i if causal else torch.ones_like(i - j, dtype=torch.bool)
    near = None
    if win.window is not None:
        d = i - j
        near = d < win.window if causal else d.abs() < win.window
    if win.chunk is not None:
        same = torch.div(i, win.chunk, rounding_mode="floor") == torch.div(j, win.chunk, rounding_mode="floor")
        near = same if near is None else near & same
    if near is not None:
        if win.sink_tokens:
            near = near | (j < win.sink_tokens)
        keep = keep & near
    return keep


def key_ranges(
    q_lo: int, q_hi: int, k_index: Tensor | int, n_keys: int, *, causal: bool, win: Window
) -> list[tuple[int, int]]:
    """Contiguous runs ``[a, b)`` of key *slots* that queries ``q_lo..q_hi`` (logical, inclusive) may see.

    Args:
        q_lo, q_hi: logical indices of the first and last query of the block.
        k_index: logical index of each key slot, ascending ``(Lk,)``, or an int ``k0`` when
            the slots hold ``k0, k0 + 1, ...`` (no tensor needed, no host sync).
        n_keys: number of key slots ``Lk``.

    Returns at most two runs (the sink prefix, then the window / chunk / causal run); a key
    outside them is masked for every query of the block. Keys inside may still be masked
    for some queries: the dense mask of the block does that.
    """
    lo, hi = None, None  # logical bounds
    if causal:
        hi = q_hi
    if win.window is not None:
        lo = q_lo - win.window + 1
        if not causal:
            hi = q_hi + win.window - 1
    if win.chunk is not None:
        c = win.chunk
        lo = max(lo if lo is not None else -(2**62), (q_lo // c) * c)
        chunk_end = (q_hi // c + 1) * c - 1
        hi = chunk_end if hi is None else min(hi, chunk_end)

    def slot(logical: int, side: str) -> int:
        if isinstance(k_index, int):
            return min(max(logical - k_index + (1 if side == "right" else 0), 0), n_keys)
        return int(torch.searchsorted(k_index, torch.tensor(logical, device=k_index.device), right=side == "right"))

    a = 0 if lo is None else slot(lo, "left")
    b = n_keys if hi is None else slot(hi, "right")
    runs = [(a, b)] if b > a else []
    if win.sink_tokens and win.limited and a > 0:
        s = slot(win.sink_tokens - 1, "right")  # slots holding indices < S
        if causal and hi is not None:
            s = min(s, slot(hi, "right"))
        s = min(s, a)
        if s > 0:
            runs.insert(0, (0, s))
    return runs
