"""The pre-softmax score sum, and one block of attention computed from it.

``posenc.scores(enc, q, k, q_pos, k_pos, *, qk_proj=None, parts=False)`` is the sum
``s = scale·(q̃·k̃ + score_terms) + bias`` that every backend equals (float32
``(B, H, Lq, Lk)``), soft-capped to ``c·tanh(s/c)`` when the encoding's ``softcap`` is set; :func:`materialized` adds mask, softmax and values for the backends
that hold the scores (``chunked``, ``eager`` in :mod:`posenc.attend.backends`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..base import PositionEncoding, Stage
from ..context import Context
from ..mask import AttentionMask
from .sinks import sink_softmax

__all__ = ["QKProj", "expand_kv", "materialized", "saved_score_bytes", "scores", "softcapped"]

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
    ctx: Context | None = None,
) -> Tensor | dict[str, Tensor]:
    """Pre-softmax scores ``s = scale·(q̃·k̃ + score_terms) + bias``: float32 ``(B, H, Lq, Lk)``;
    with ``enc.softcap = c`` set, ``c·tanh(s/c)`` (Gemma 2; mask and sinks come after).

    ``q``/``k`` are after the q/k stage (``k`` may have fewer heads, grouped: :func:`expand_kv`); the encoding's ``score_terms`` and ``bias`` run if
    it declares them, and its ``qk_scores`` replaces ``q̃·k̃`` if it declares ``Stage.SCORES``.
    With ``parts=True`` the separate terms come back as a dict (``"qk"``, and
    ``"terms"``/``"bias"`` where the encoding has them, ``"softcap"``: capped minus uncapped
    sum, with a cap), each float32 ``(B, H, Lq, Lk)``; they sum to the scores. ``ctx``: the call's :class:`~posenc.Context` (a bare one of these
    positions when None); ``mask``: the call's bool ``(B|1, 1, Lq, Lk)`` (True = attend) or
    None, and ``qk_proj`` the layer's ``(W_Q, W_K)``, both handed to the stages in the
    context, with the plain ``q·kᵀ`` as ``ctx.qk`` where the score sum has it.
    """
    st = enc.stages
    k = expand_kv(k, None, q.shape[1])[0]  # grouped keys: one per query head
    ctx = Context(q_pos, k_pos) if ctx is None else ctx
    ctx = replace(ctx, q_pos=q_pos, k_pos=k_pos, mask=mask, qk_proj=qk_proj if qk_proj is not None else ctx.qk_proj)
    plain = not st & Stage.SCORES  # the matmul below is the plain q·kᵀ the terms may read
    if parts:
        qk = _qk(enc, q, k, q_pos, k_pos, ctx)
        out = {"qk": qk.float() * enc.scale}  # (B, H, Lq, Lk)
        if st & Stage.TERMS:
            terms = enc.score_terms(q, k, q_pos, k_pos, ctx=replace(ctx, qk=qk if plain else None))
            out["terms"] = terms.float() * enc.scale
        if st & Stage.BIAS:
            out["bias"] = enc.bias(q_pos, k_pos, ctx=ctx).float().expand_as(out["qk"])
        if enc.softcap is not None:  # what the cap takes off the sum, so the parts still sum
            total = sum(out.values())
            out["softcap"] = softcapped(total.clone(), enc.softcap) - total
        return out
    # in place from the matmul on: none of these intermediates is saved for backward,
    # and each L×L pass that allocates costs as much as the arithmetic on CPU
    s = _qk(enc, q, k, q_pos, k_pos, ctx)  # (B, H, Lq, Lk)
    if st & Stage.TERMS:
        # a stage that reads ctx.qk reads s but saves none of it: the in-place add is safe
        s.add_(enc.score_terms(q, k, q_pos, k_pos, ctx=replace(ctx, qk=s if plain else None)))
    s = s.float().mul_(enc.scale)
    if st & Stage.BIAS:
        s.add_(enc.bias(q_pos, k_pos, ctx=ctx))
    return s if enc.softcap is None else softcapped(s, enc.softcap)


def softcapped(s: Tensor, cap: float) -> Tensor:
    """Gemma 2's logit soft-capping ``cap·tanh(s/cap)``, in place on ``s`` where autograd allows.

    With gradients the ``tanh`` runs out of place: its backward reads its output, which an
    in-place ``mul_`` would overwrite.
    """
    s = s.div_(cap)
    if s.requires_grad:
        return torch.tanh(s) * cap
    return s.tanh_().mul_(cap)


def expand_kv(k: Tensor, v: Tensor | None, heads: int) -> tuple[Tensor, Tensor | None]:
    """Grouped keys/values ``(B, Hk, L, Dh)`` for ``heads`` query heads: ``(B, heads, L, Dh)``,
    query head ``h`` reading key head ``h // (heads / Hk)`` (HF's ``repeat_kv``); unchanged
    when ``Hk == heads``. ``ValueError`` unless ``Hk`` divides ``heads``."""
    kv = k.shape[1]
    if kv == heads:
        return k, v
    if kv < 1 or heads % kv:
        raise ValueError(f"keys have {kv} heads for {heads} query heads; the query heads must be a multiple of them")
    g = heads // kv

    def rep(t: Tensor) -> Tensor:
        B, _, L, D = t.shape
        return t[:, :, None].expand(B, kv, g, L, D).reshape(B, heads, L, D)

    return rep(k), None if v is None else rep(v)


def _qk(enc: PositionEncoding, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, ctx: Context) -> Tensor:
    """The ``q̃·k̃`` term ``(B, H, Lq, Lk)``: the encoding's own ``qk_scores`` where it has them."""
    if enc.stages & Stage.SCORES:
        return enc.qk_scores(q, k, q_pos, k_pos, ctx=ctx)
    return q @ k.transpose(-1, -2)


def materialized(
    enc, q, k, v, q_pos, k_pos, mask: AttentionMask, qk_proj=None, sinks=None, ctx=None, *, dropout: float = 0.0
) -> Tensor:
    """Scores, mask, softmax and output for a block of queries against the keys given;
    ``dropout``: attention-probability dropout (HF's eager attention: after the softmax,
    before the values and, here, the value stage)."""
    Lq, Lk = q.shape[2], k.shape[2]
    dense = mask.dense(Lq, Lk, q.device)
    s = scores(enc, q, k, q_pos, k_pos, qk_proj=qk_proj, mask=dense, ctx=ctx)
    blind = None  # query rows that see no key at all (a fully padded row)
    if dense is not None:
        s.masked_fill_(~dense, float("-inf"))
        if mask.may_hide_rows:
            blind = ~dense.any(-1, keepdim=True)  # (B|1, 1, Lq, 1)
            s.masked_fill_(blind, 0.0)  # a finite row: no NaN in forward or backward
    if enc.stages & Stage.NORM:  # the encoding's own normaliser (stick-breaking)
        if sinks is not None:
            raise ValueError(f"encoding {enc.name!r} has its own normaliser; learned sinks are a softmax feature")
        attn = enc.weights(s, ctx=ctx)
    else:
        attn = torch.softmax(s, dim=-1) if sinks is None else sink_softmax(s, sinks)
    if blind is not None:
        attn = attn.masked_fill(blind, 0.0)  # output 0, as SDPA and FlexAttention give
    if dropout:
        attn = F.dropout(attn, dropout)
    attn = attn.to(v.dtype)
    out = attn @ v  # (B, H, Lq, Dh)
    if enc.stages & Stage.VALUE:
        out = out + enc.value_term(attn, q_pos, k_pos, ctx=ctx).to(out.dtype)
    return out


def saved_score_bytes(q: Tensor, k: Tensor, mask: AttentionMask) -> int:
    """Bytes autograd keeps for the math kernel: ~3 float32 score-sized tensors."""
    B, H, Lq, _ = q.shape
    return B * H * Lq * k.shape[2] * 4 * 3 // (2 if mask.causal else 1)
