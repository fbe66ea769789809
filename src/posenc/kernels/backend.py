"""The ``blockwise`` backend's kernel call: an encoding's distance terms through
:func:`~posenc.kernels.distance_attention`, when the call allows it.

It applies when the tensors are on the CPU, the encoding gives its terms per distance
(:meth:`posenc.PositionEncoding.distance_terms`), and the positions are consecutive in every
batch row with one distance between the first key and the first query for all rows (the
default positions, a KV cache, left padding with shifted positions). Otherwise
:func:`blockwise_attention` returns None and the caller runs its general backend.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .relative import distance_attention

__all__ = ["blockwise_attention", "consecutive_delta", "BLOCK"]

# query rows per block, by kind of terms: strips are cheap per row, bands pay per row
# for their rectangle, linear terms pay per block for one more pair of fused calls
BLOCK = {"clamp": 64, "linear": 512, "none": 128}


def consecutive_delta(q_pos: Tensor, k_pos: Tensor) -> int | None:
    """``k_pos[:, 0] - q_pos[:, 0]`` when both are consecutive in every row and that difference
    is the same for every row; else None. ``q_pos`` ``(B|1, Lq)``, ``k_pos`` ``(B|1, Lk)``."""
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
    *,
    causal: bool,
    offset: int,
    key_padding_mask: Tensor | None,
    max_block: int | None = None,
) -> Tensor | None:
    """``(B, H, Lq, Dh)``, or None when the kernel does not apply (see the module docstring).

    ``max_block``: at most this many query rows per block (default :data:`BLOCK`)."""
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    terms = enc.distance_terms(q, k)
    if terms is None:
        return None
    delta = consecutive_delta(q_pos, k_pos)
    if delta is None:
        return None
    kpm = key_padding_mask
    if kpm is not None and kpm.shape[0] != q.shape[0]:
        kpm = kpm.expand(q.shape[0], -1)
    return distance_attention(
        q,
        k,
        v,
        terms,
        scale=enc.scale,
        causal=causal,
        offset=offset,
        delta=delta,
        key_padding_mask=kpm,
        block=min(BLOCK[terms.kind], max_block or BLOCK[terms.kind]),
    )
