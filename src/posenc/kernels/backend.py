"""The ``blockwise`` backend's kernel call: an encoding's distance terms through
:func:`~posenc.kernels.distance_attention`, when the call allows it.

It applies when the tensors are on the CPU, the encoding gives its terms per distance
(:meth:`posenc.PositionEncoding.distance_terms`), the mask is causal and/or key padding
with an offset (no other :class:`~posenc.AttentionMask` field set), and the positions
are consecutive in every batch row with one distance between the first key and the
first query for all rows (the default positions, a KV cache, left padding with shifted
positions). Otherwise :func:`blockwise_attention` returns None and
:func:`posenc.attend.backends.blockwise` runs the general backend (this module stands below
the backends: it imports none of them).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..context import Context
from .relative import distance_attention

__all__ = ["blockwise_attention", "consecutive_delta", "kernel_mask", "BLOCK"]

# query rows per block, by kind of terms: strips are cheap per row, bands pay per row
# for their rectangle, linear terms pay per block for one more pair of fused calls
BLOCK = {"clamp": 64, "linear": 512, "none": 128}

_KERNEL_MASK_FIELDS = ("causal", "offset", "key_padding")  # what distance_attention understands


def kernel_mask(mask) -> bool:
    """True when ``mask`` (a :class:`posenc.AttentionMask`) sets no field beyond causal,
    offset and key padding: later kinds of masks (windows, documents, ...) fall back."""
    for f in dataclasses.fields(mask):
        if f.name in _KERNEL_MASK_FIELDS:
            continue
        value = getattr(mask, f.name)
        if isinstance(value, Tensor) or f.default is dataclasses.MISSING or value != f.default:
            return False
    return True


def consecutive_delta(q_pos: Tensor, k_pos: Tensor) -> int | None:
    """``k_pos[:, 0] - q_pos[:, 0]`` when both are consecutive in every row and that difference
    is the same for every row; else None. ``q_pos`` ``(B|1, Lq)``, ``k_pos`` ``(B|1, Lk)``."""
    if q_pos.dim() != 2 or k_pos.dim() != 2:
        return None  # positions with several axes
    for p in (q_pos, k_pos):
        if p.shape[-1] > 1 and not bool((p[:, 1:] - p[:, :-1] == 1).all()):
            return None
    delta = k_pos[:, :1] - q_pos[:, :1]  # (B|1, 1)
    if delta.numel() > 1 and not bool((delta == delta[0]).all()):
        return None
    return int(delta[0, 0])


def blockwise_attention(
    enc,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    mask,
    *,
    ctx=None,
    qk_proj=None,
    max_block=None,
    keep_bytes: int = 256 * 2**20,
) -> Tensor | None:
    """``(B, H, Lq, Dh)``, or None when the kernel does not apply (see the module docstring).

    ``mask``: a :class:`posenc.AttentionMask`; ``ctx``: the call's :class:`posenc.Context`
    (``qk_proj``: the layer's ``(W_Q, W_K)``, when ``ctx`` does not carry them); ``max_block``: at most this many query rows
    per block (default :data:`BLOCK`); ``keep_bytes``: the explicit parts' probabilities are
    kept for backward when they fit in this many bytes, else recomputed."""
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    if not kernel_mask(mask):
        return None
    delta = consecutive_delta(q_pos, k_pos)
    if delta is None:
        return None
    if ctx is None or (qk_proj is not None and ctx.qk_proj is None):
        ctx = Context(q_pos, k_pos, qk_proj=qk_proj) if ctx is None else dataclasses.replace(ctx, qk_proj=qk_proj)
    terms = enc.distance_terms(q, k, ctx=ctx)
    if terms is None:
        return None
    kpm = mask.key_padding
    if kpm is not None and kpm.shape[0] != q.shape[0]:
        kpm = kpm.expand(q.shape[0], -1)
    block = BLOCK[terms.kind] if max_block is None else min(BLOCK[terms.kind], max_block)
    return distance_attention(
        q,
        k,
        v,
        terms,
        scale=enc.scale,
        causal=mask.causal,
        offset=mask.offset,
        delta=delta,
        key_padding_mask=kpm,
        block=block,
        keep_bytes=keep_bytes,
    )
