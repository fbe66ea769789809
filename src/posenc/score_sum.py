"""The pre-softmax score sum, and one block of attention computed from it.

``posenc.scores(enc, q, k, q_pos, k_pos, *, qk_proj=None, parts=False)`` is the sum
``s = scale·(q̃·k̃ + score_terms) + bias`` that every backend equals (float32
``(B, H, Lq, Lk)``); :func:`materialized` adds mask, softmax and values for the backends
that hold the scores (``chunked``, ``eager`` in :mod:`posenc.backends`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import PositionEncoding, Stage
from .mask import AttentionMask
from .sinks import sink_softmax

__all__ = ["QKProj", "materialized", "saved_score_bytes", "scores"]

# (W_Q, W_K) of the layer, for encodings that project their own tables with them
QKProj = tuple[nn.Module, nn.Module]


def scores(
    enc: PositionEncoding,
    q: Tensor,
    k: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    *,
    qk_proj: QKProj | None = None,
    parts: bool = False,
    mask: Tensor | None = None,
) -> Tensor | dict[str, Tensor]:
    """Pre-softmax scores ``s = scale·(q̃·k̃ + score_terms) + bias``: float32 ``(B, H, Lq, Lk)``.

    ``q``/``k`` are after the q/k stage; the encoding's ``score_terms`` and ``bias`` run if
    it declares them, and its ``qk_scores`` replaces ``q̃·k̃`` if it declares ``Stage.SCORES``. With ``parts=True`` the separate terms come back as a dict
    (``"qk"``, and ``"terms"``/``"bias"`` where the encoding has them), each float32
    ``(B, H, Lq, Lk)``; they sum to the scores. ``mask``: the call's bool ``(B|1, 1, Lq, Lk)``
    (True = attend) or None, given to ``score_terms`` of an encoding with ``terms_read_mask``.
    """
    st = enc.stages
    extra = {"qk_proj": qk_proj} if enc.uses_layer_projections else {}
    if enc.terms_read_mask:
        extra["mask"] = mask
    share_qk = enc.terms_read_qk and not st & Stage.SCORES  # the terms read the plain q·kᵀ
    if parts:
        qk = _qk(enc, q, k, q_pos, k_pos)
        out = {"qk": qk.float() * enc.scale}  # (B, H, Lq, Lk)
        if st & Stage.TERMS:
            if share_qk:
                extra["qk"] = qk
            out["terms"] = enc.score_terms(q, k, q_pos, k_pos, **extra).float() * enc.scale
        if st & Stage.BIAS:
            out["bias"] = enc.bias(q_pos, k_pos).float().expand_as(out["qk"])
        return out
    # in place from the matmul on: none of these intermediates is saved for backward,
    # and each L×L pass that allocates costs as much as the arithmetic on CPU
    s = _qk(enc, q, k, q_pos, k_pos)  # (B, H, Lq, Lk)
    if st & Stage.TERMS:
        if share_qk:  # the terms' graph reads s but saves none of it: the in-place add is safe
            extra["qk"] = s
        s.add_(enc.score_terms(q, k, q_pos, k_pos, **extra))
    s = s.float().mul_(enc.scale)
    if st & Stage.BIAS:
        s.add_(enc.bias(q_pos, k_pos))
    return s


def _qk(enc: PositionEncoding, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """The ``q̃·k̃`` term ``(B, H, Lq, Lk)``: the encoding's own ``qk_scores`` where it has them."""
    if enc.stages & Stage.SCORES:
        return enc.qk_scores(q, k, q_pos, k_pos)
    return q @ k.transpose(-1, -2)


def materialized(enc, q, k, v, q_pos, k_pos, mask: AttentionMask, qk_proj=None, sinks=None) -> Tensor:
    """Scores, mask, softmax and output for a block of queries against the keys given."""
    Lq, Lk = q.shape[2], k.shape[2]
    dense = mask.dense(Lq, Lk, q.device)
    s = scores(enc, q, k, q_pos, k_pos, qk_proj=qk_proj, mask=dense)
    blind = None  # query rows that see no key at all (a fully padded row)
    if dense is not None:
        s.masked_fill_(~dense, float("-inf"))
        if mask.may_hide_rows:
            blind = ~dense.any(-1, keepdim=True)  # (B|1, 1, Lq, 1)
            s.masked_fill_(blind, 0.0)  # a finite row: no NaN in forward or backward
    attn = torch.softmax(s, dim=-1) if sinks is None else sink_softmax(s, sinks)
    if blind is not None:
        attn = attn.masked_fill(blind, 0.0)  # output 0, as SDPA and FlexAttention give
    attn = attn.to(v.dtype)
    out = attn @ v  # (B, H, Lq, Dh)
    if enc.stages & Stage.VALUE:
        out = out + enc.value_term(attn, q_pos, k_pos).to(out.dtype)
    return out


def saved_score_bytes(q: Tensor, k: Tensor, mask: AttentionMask) -> int:
    """Bytes autograd keeps for the math kernel: ~3 float32 score-sized tensors."""
    B, H, Lq, _ = q.shape
    return B * H * Lq * k.shape[2] * 4 * 3 // (2 if mask.causal else 1)
