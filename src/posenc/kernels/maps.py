"""Score maps through the fused kernel: each map over only its own keys, merged by log-sum-exp.

An encoding whose ``q·k`` term is several score maps picked by positions (ReRoPE, Leaky ReRoPE,
Self-Extend, Dual Chunk Attention: :class:`posenc.terms.ScoreMap`) gives each map its own
queries and keys. On contiguous positions every query row reads one interval of keys per map,
``[first_key(p), last_key(p)]``, both ends non-decreasing in ``p``, so for a block of query rows
a map's keys fall into

* a part every row of the block reads whole: one fused call without a mask;
* the causal triangle on the diagonal (where the map reaches up to the query itself): one
  call with the kernel's own causal flag;
* edges where the rows' intervals start or end at different keys: one call with an additive
  mask, at most a block wide.

The parts' normalised outputs and log-sum-exps are merged into one softmax exactly
(:func:`posenc.kernels.flash.merge_into`, FlashAttention's split-KV merge), so the maps cost
what their pairs cost: ReRoPE's near band and far triangle together are one causal triangle,
plus the triangles' halves the kernel skips. Each map's keys are placed (rotated) once per call,
over only the keys it reads, on the grouped heads; a part every row reads whole stacks the query
heads of a key head as rows of one call, the smaller parts repeat their keys.

Only causal calls on one run of positions (every batch row alike: ``k_pos = k0 + arange(Lk)``,
the queries the last ``Lq`` keys), with no padding, window, chunk or documents, and on the CPU:
:func:`score_map_attention` returns None otherwise and the caller runs the general backend.
No gradient (the caller runs the general backend when one is needed).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..mask import AttentionMask
from ..terms import ScoreMap
from .flash import flash_forward, merge_into

__all__ = ["MAP_ROWS", "score_map_attention", "one_run"]

# query rows of one block: the edges where two maps meet cost a strip of this width per block,
# and every fused call costs a fixed overhead (a thread wake-up, a merge)
MAP_ROWS = 256


def one_run(q_pos: Tensor, k_pos: Tensor, mask: AttentionMask, q_len: int, k_len: int) -> int | None:
    """The position of key 0 when the call is one causal run of positions (module docstring), else None."""
    if not mask.causal or mask.offset != k_len - q_len or q_len > k_len:
        return None
    if mask.window is not None or mask.chunk is not None or mask.documents is not None or mask.sink_tokens:
        return None
    if mask.selected is not None:  # (DeepSeek Sparse Attention's top-k: chunked reads it)
        return None
    if mask.query_documents is not None or (mask.key_padding is not None and not bool(mask.key_padding.all())):
        return None
    if q_pos.shape[-1] != q_len or k_pos.shape[-1] != k_len or q_pos.dim() != 2 or k_pos.dim() != 2:
        return None
    k0 = int(k_pos[0, 0])
    run = torch.arange(k0, k0 + k_len, device=k_pos.device)
    if not bool((k_pos == run).all()) or not bool((q_pos == run[k_len - q_len :]).all()):
        return None
    return k0


def _blocks(m: ScoreMap, p_first: int, n: int, rows: int) -> list[tuple[int, int]]:
    """Query row blocks ``[r0, r1)`` of at most ``rows`` rows, none across a multiple of ``m.unit``."""
    out, r = [], 0
    while r < n:
        p = p_first + r
        end = min(n, r + rows, r + m.unit - p % m.unit) if m.unit > 1 else min(n, r + rows)
        out.append((r, end))
        r = end
    return out


def _parts(m: ScoreMap, p0: int, p1: int, k0: int) -> list[tuple[int, int, str]]:
    """Key positions ``[a, b]`` (inclusive) and how the rows ``p0 .. p1`` read them: ``"full"``;
    ``"causal"``: row ``t`` reads ``a .. a + t`` (the kernel's causal flag); ``"flipped"``: row ``t``
    reads ``a + t .. b`` (the causal flag on rows and keys in reverse order); ``"masked"``."""
    a0, a1 = max(k0, m.first_key(p0)), max(k0, m.first_key(p1))
    b0, b1 = m.last_key(p0), m.last_key(p1)
    if b1 < a0:
        return []
    if a1 > b0:  # no key every row reads
        return [(a0, b1, "masked")]
    # an end that moves one key per row: a triangle the kernel's causal flag skips by itself
    slide_hi = m.unit == 1 or m.lo is None or m.lo <= 0  # last_key(p) = p - max(lo, 0)
    slide_lo = m.unit == 1 and m.hi is not None and m.first_key(p0) >= k0 and (a1 < b0 or not slide_hi)
    parts = []
    if a0 < a1:
        parts.append((a0, a1, "flipped") if slide_lo else (a0, a1 - 1, "masked"))
    start = a1 + 1 if a0 < a1 and slide_lo else a1
    if slide_hi:
        parts += [(start, b0 - 1, "full"), (b0, b1, "causal")]
    else:
        parts += [(start, b0, "full"), (b0 + 1, b1, "masked")]
    return [(a, b, how) for a, b, how in parts if a <= b]


def _row_bounds(m: ScoreMap, pos: Tensor, k0: int) -> tuple[Tensor, Tensor]:
    """First and last key position of every query position ``pos`` ``(R,)`` (vectorised ``first_key``/``last_key``)."""
    if m.hi is None:
        first = torch.full_like(pos, k0)
    else:
        first = ((torch.div(pos, m.unit, rounding_mode="floor") - m.hi) * m.unit).clamp(min=k0)
    if m.lo is None:
        return first, pos
    return first, torch.minimum(pos, (torch.div(pos, m.unit, rounding_mode="floor") - m.lo + 1) * m.unit - 1)


def _grouped(q: Tensor, k: Tensor, v: Tensor, g: int, scale: float) -> tuple[Tensor, Tensor]:
    """One unmasked fused call of ``q`` ``(B, H, R, Dh)`` over grouped ``k``, ``v`` ``(B, H/g, n, Dh)``: the
    ``g`` query heads of a key head stacked as rows of one call (no copy of the keys)."""
    if g == 1:
        return flash_forward(q, k, v, scale=scale, causal=False)
    B, H, R, D = q.shape
    o, s = flash_forward(q.reshape(B, H // g, g * R, D), k, v, scale=scale, causal=False)
    return o.reshape(B, H, R, -1), s.reshape(B, H, R)


def score_map_attention(enc, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, mask: AttentionMask,
                        *, rows: int = MAP_ROWS) -> Tensor | None:  # fmt: skip
    """Attention of ``enc``'s score maps (``enc.score_maps()``) over ``q`` ``(B, H, Lq, Dh)``, ``k``,
    ``v`` ``(B, Hk, Lk, Dh)`` (``Hk`` dividing ``H``) -> ``(B, H, Lq, Dh)`` in ``q``'s dtype, or None
    where it does not apply (module docstring)."""
    maps = enc.score_maps()
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    if not maps or q.device.type != "cpu":
        return None
    k0 = one_run(q_pos, k_pos, mask, Lq, Lk)
    if k0 is None:
        return None
    p_first = k0 + Lk - Lq
    run = torch.arange(p_first, p_first + Lq, device=q.device)
    out = q.new_zeros(B, H, Lq, v.shape[-1], dtype=torch.float32)
    lse = q.new_full((B, H, Lq), float("-inf"), dtype=torch.float32)
    g = H // k.shape[1]  # grouped heads: query head h reads key head h // g (HF's repeat_kv)
    for m in maps:
        lo, hi = max(k0, m.first_key(p_first)), m.last_key(p_first + Lq - 1)  # the keys this map reads
        if hi < lo:
            continue
        qm = m.query(q, run[None]).to(q.dtype)
        km, vm = k[:, :, lo - k0 : hi - k0 + 1], v[:, :, lo - k0 : hi - k0 + 1]
        if m.key is not None:  # placed on the grouped heads
            km = m.key(km, torch.arange(lo, hi + 1, device=q.device)[None])
        km = km.to(q.dtype)
        for r0, r1 in _blocks(m, p_first, Lq, rows):
            for a, b, how in _parts(m, p_first + r0, p_first + r1 - 1, k0):
                kb, vb, qb = km[:, :, a - lo : b - lo + 1], vm[:, :, a - lo : b - lo + 1], qm[:, :, r0:r1]
                if how == "full":
                    o, s = _grouped(qb, kb, vb, g, enc.scale)
                    merge_into(out, lse, slice(r0, r1), o, s)
                    continue
                if g > 1:  # a part at most a block (and a window) wide: its keys repeated
                    kb, vb = kb.repeat_interleave(g, 1), vb.repeat_interleave(g, 1)
                add, empty = None, None
                if how == "masked":
                    first, last = _row_bounds(m, run[r0:r1], k0)
                    cols = torch.arange(a, b + 1, device=q.device)
                    keep = (cols >= first[:, None]) & (cols <= last[:, None])  # (R, b - a + 1)
                    add = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill_(~keep, float("-inf"))
                    empty = ~keep.any(-1)
                if how == "flipped":  # row t reads keys t.. of the part: in reverse order, top-left causal
                    o, s = flash_forward(qb.flip(2), kb.flip(2), vb.flip(2), scale=enc.scale, causal=True)
                    o, s = o.flip(2), s.flip(-1)
                else:
                    o, s = flash_forward(qb, kb, vb, scale=enc.scale, causal=how == "causal", mask=add)
                if empty is not None and bool(empty.any()):  # the kernel gives a row without keys lse 0
                    s = s.masked_fill(empty, float("-inf"))
                merge_into(out, lse, slice(r0, r1), o, s)
    return out.to(q.dtype)
