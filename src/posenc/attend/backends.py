"""Attention backends: public functions with one signature, in one registry.

API reference (what :class:`posenc.Attention` calls, and what other code may call)::

    posenc.scores(enc, q, k, q_pos, k_pos, *, qk_proj=None, parts=False)
        # the pre-softmax score sum  s = scale·(q̃·k̃ + score_terms) + bias, float32 (B, H, Lq, Lk);
        # parts=True: {"qk": scale·q̃·k̃, "terms": scale·score_terms, "bias": bias}, the stages it has
    posenc.BACKENDS[name](enc, q, k, v, q_pos, k_pos, mask, *, ctx=None, qk_proj=None, options=None, sinks=None,
                          dropout=0.0)
        # -> (B, H, Lq, Dh)
        # q (B, H, Lq, Dh), k, v (B, H, Lk, Dh): after the q/k stage (Attention.project);
        # q_pos (B|1, Lq), k_pos (B|1, Lk) int64; mask: a posenc.AttentionMask;
        # ctx: the call's posenc.Context (what the encoding may read: the layer input rows,
        #   per-token state, the layer's projections, the per-forward tables); None: a bare one
        # qk_proj: the layer's (W_Q, W_K), when ctx does not carry them;
        # options: a BlockOptions (query block sizes, recompute budget)
        # sinks: (H,) learned sink logits (gpt-oss, posenc.attend.sinks) or None
        # dropout: attention-probability dropout (training only; flex has none and refuses it)
    posenc.supported_backends(enc) -> list[str]     # every one of them equals "eager"
        # an encoding with a softcap (enc.set_scores): flex (no vector stage), chunked, eager
    posenc.select_backend(enc, device_type, q_len=None, k_len=None, *, causal=None, dropout=False) -> str
        # what backend="auto" runs

============  ======================================  =====================================
backend       runs                                    how
============  ======================================  =====================================
``sdpa``      input and q/k stages only               ``F.scaled_dot_product_attention``
                                                      (flash / memory-efficient kernels)
``flex``      + scalar ``bias`` with a ``score_mod``   FlexAttention, no L×L tensor
                                                      (compiled on CUDA; CPU: forward only)
``blockwise`` terms given per distance               :mod:`posenc.kernels` (CPU): fused
              (``distance_terms``)                    calls on far fields and linear
                                                      biases, explicit bands near the
                                                      diagonal, recomputed in backward
``dense``     + scalar ``bias``                       SDPA with the bias as a float mask,
                                                      in query blocks
``maps``      ``score_maps`` (ReRoPE, Self-Extend,    :mod:`posenc.kernels.maps` (CPU): each
              DCA: the ``SCORES`` stage as maps       map fused over only its own keys,
              picked by positions)                    merged by log-sum-exp
``chunked``   every stage                             :func:`scores` in query blocks:
                                                      per-distance logits gathered into
                                                      place (memory O(chunk·Lk + L·Dh),
                                                      never L²·Dh)
``eager``     every stage                             :func:`scores` over all queries at
                                                      once, in float32: the oracle
============  ======================================  =====================================

``chunked`` was called ``relative`` before; that name is still accepted
(:data:`BACKEND_ALIASES`). Every backend takes its masking from the
:class:`~posenc.AttentionMask` alone, and gives a query row that sees no key a zero
output (never NaN, in forward or backward).

A NaN or infinity in ``q``, ``k`` or ``v`` makes that (batch row, head)'s whole output NaN on
every backend (:func:`posenc.kernels.flash.propagate_nonfinite`), never a silent zero.

A new backend is one function with this signature added to :data:`BACKENDS` and a
clause in :func:`supported_backends`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..base import PositionEncoding
from ..kernels.backend import blockwise_attention
from ..kernels.flash import needs_upcast, propagate_nonfinite
from ..kernels.maps import score_map_attention
from ..mask import AttentionMask
from ..mask import in_query_blocks as _in_query_blocks
from ..validate import check_dropout
from .choice import (
    BLOCKWISE_MIN_SCORES,
    BLOCKWISE_MIN_SCORES_BIDIR,
    FLEX_MIN_HEAD_DIM,
    FLEX_MIN_QUERIES,
    require_backend,
    select_backend,
    supported_backends,
)
from .flex import flex
from .scores import expand_kv, materialized, saved_score_bytes, scores
from .sinks import append_sink_key, sink_bias

__all__ = [
    "BLOCKWISE_MIN_SCORES",
    "BLOCKWISE_MIN_SCORES_BIDIR",
    "FLEX_MIN_HEAD_DIM",
    "FLEX_MIN_QUERIES",
    "CHUNKED_ROWS",
    "CHUNKED_SCORES",
    "chunked_rows",
    "AttendFn",
    "BACKENDS",
    "BACKEND_ALIASES",
    "BlockOptions",
    "backend_names",
    "canonical_backend",
    "scores",
    "select_backend",
    "supported_backends",
    "require_backend",
    "attend",
    "check_dropout",
]


@dataclass(frozen=True)
class BlockOptions:
    """How the blocked backends cut the work.

    Attributes:
        chunk_size: the most query rows in one block of any blocked backend; each uses its
            own block below it: ``chunked`` :func:`chunked_rows`, ``dense`` ``dense_chunk``,
            ``blockwise`` :data:`posenc.kernels.backend.BLOCK`.
        dense_chunk: query block of ``dense`` (at most ``chunk_size``): small blocks let
            causal attention skip most masked keys while the fused kernel still sees long rows.
        checkpoint_bytes: saved-score budget of one call above which ``dense``/``chunked``
            recompute their blocks in backward.
    """

    chunk_size: int = 1024
    dense_chunk: int = 256
    checkpoint_bytes: int = 2 * 2**30

    def __post_init__(self) -> None:
        for name in ("chunk_size", "dense_chunk"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")


AttendFn = Callable[
    ..., Tensor
]  # (enc, q, k, v, q_pos, k_pos, mask, *, ctx=None, qk_proj=None, options=None, sinks=None, dropout=0.0)


# ============================================================================ helpers
def _sdpa(q: Tensor, k: Tensor, v: Tensor, **kw) -> Tensor:
    """``F.scaled_dot_product_attention``, run in float32 (and cast back) for CPU bfloat16
    where the CPU's fused kernel cannot run it (:func:`posenc.kernels.flash.needs_upcast`)."""
    if needs_upcast(q):
        mask = kw.get("attn_mask")
        if mask is not None and mask.is_floating_point():
            kw["attn_mask"] = mask.float()
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, **kw)


def _one_row_packed(q: Tensor, k: Tensor, kw: dict) -> Tensor | None:
    """A one-row query ``(B, H, 1, Dh)`` of grouped heads as ``(B, Hkv, H/Hkv, Dh)``: each key
    head's ``H/Hkv`` query heads as rows of one call, which reads each key and value once (a
    decoding step; HF's ``pack_gqa`` does the same). None where that is not the same attention:
    more rows, ungrouped heads, a causal flag, dropout, or a mask that differs by head.
    Measured on CPU against ``enable_gqa`` (SmolLM2's 9 query / 3 key heads, one thread): 0.7× the
    time at 2 048 keys, 0.5× at 8 192 (docs/hf.md, "Decoding speed")."""
    (B, H, Lq, D), Hk = q.shape, k.shape[1]
    if Lq != 1 or Hk == H or H % Hk or kw.get("is_causal") or kw.get("dropout_p"):
        return None
    mask = kw.get("attn_mask")
    if mask is not None and mask.shape[1] != 1:
        return None
    return q.reshape(B, Hk, H // Hk, D)


def _sdpa_kv(q: Tensor, k: Tensor, v: Tensor, masked: bool) -> tuple[Tensor, Tensor, dict]:
    """Grouped ``k``/``v`` for SDPA: as they are with ``enable_gqa=True`` (no copy), except on CUDA
    with an explicit mask, where only the math kernel takes grouped keys: repeated there, so the
    memory-efficient kernel runs."""
    if k.shape[1] == q.shape[1]:
        return k, v, {}
    if masked and q.device.type == "cuda" or q.shape[1] % k.shape[1]:  # (expand_kv names a bad count)
        return (*expand_kv(k, v, q.shape[1]), {})
    return k, v, {"enable_gqa": True}


def _needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ============================================================================ backends
def sdpa(
    enc, q, k, v, q_pos, k_pos, mask: AttentionMask, *, ctx=None, qk_proj=None, options=None, sinks=None, dropout=0.0
) -> Tensor:
    """``F.scaled_dot_product_attention``: input and q/k stages only (a window or chunk: in query
    blocks of ``options.dense_chunk`` rows that read only the keys they can see)."""

    def block(q, k, v, q_pos, k_pos, m: AttentionMask, _ctx):
        (B, H, Lq, _), Lk, kw = q.shape, k.shape[2], {"scale": enc.scale, "dropout_p": dropout}
        if sinks is not None:  # one zero key whose score is the sink logit
            kw["attn_mask"] = sink_bias(None, m.dense(Lq, Lk, q.device), sinks, (B, H, Lq, Lk)).to(q.dtype)
            k, v = append_sink_key(k, v)
        elif m.is_causal_square(Lq, Lk):
            kw["is_causal"] = True
        else:
            kw["attn_mask"] = m.dense(Lq, Lk, q.device)
        packed = _one_row_packed(q, k, kw)
        if packed is not None:
            return _sdpa(packed, k, v, **kw).reshape(B, H, 1, -1)
        k, v, gqa = _sdpa_kv(q, k, v, kw.get("attn_mask") is not None)
        return _sdpa(q, k, v, **kw, **gqa)

    c = (options or BlockOptions()).dense_chunk if mask.limited else q.shape[2]
    return propagate_nonfinite(
        _in_query_blocks(block, c, False, q, k, v, q_pos, k_pos, mask), q, k, v, mask.checked_keys, mask.checked_queries
    )


def dense(
    enc, q, k, v, q_pos, k_pos, mask: AttentionMask, *, ctx=None, qk_proj=None, options=None, sinks=None, dropout=0.0
) -> Tensor:
    """SDPA with the bias as a float mask, in query blocks of ``options.dense_chunk`` rows.

    Blocking bounds the bias at ``(B|1, H, chunk, Lk)`` and drops the keys a block cannot
    see (about half the work when causal). A 4-D bias that needs no gradient runs the
    fused (flash) kernel; a learned bias (T5) needs ``dS`` per (i, j), which only the math
    kernel returns: its blocks are recomputed in backward when their saved scores would
    exceed ``options.checkpoint_bytes``.
    """
    o = options or BlockOptions()
    scale = enc.scale

    def block(qb, kb, vb, qp, kp, m: AttentionMask, bctx):
        bias = enc.bias(qp, kp, ctx=bctx)  # (B|1, H, Lq_b, Lk_b) float32
        keep = m.dense(qb.shape[2], kb.shape[2], qb.device)
        if sinks is not None:
            bias = sink_bias(bias, keep, sinks, (*qb.shape[:3], kb.shape[2]))
            kb, vb = append_sink_key(kb, vb)
        elif keep is not None:
            bias = bias.masked_fill(~keep, float("-inf"))
        return _sdpa(qb, kb, vb, attn_mask=bias.to(qb.dtype), scale=scale, dropout_p=dropout)

    learned_bias = _needs_grad(q, k, v) and any(p.requires_grad for p in enc.parameters())
    recompute = learned_bias and saved_score_bytes(q, k, mask) > o.checkpoint_bytes
    out = _in_query_blocks(block, min(o.chunk_size, o.dense_chunk), recompute, q, k, v, q_pos, k_pos, mask, ctx=ctx)
    return propagate_nonfinite(out, q, k, v, mask.checked_keys, mask.checked_queries)


# ``chunked`` blocks: at most CHUNKED_ROWS query rows and CHUNKED_SCORES scores per head
# (rows x keys the block sees; at least 8 rows). Each of its steps is an elementwise pass
# over the block's (B, H, rows, keys) scores, and blocks that stay near the cache cut the
# passes' cost (timings by block size: docs/bench.md, "CoPE: small blocks"). Bounding the
# scores (not only the rows) also gives the blocks of a causal call one size, which keeps
# the C heap from fragmenting (posenc.mask.in_query_blocks).
CHUNKED_ROWS = 256
CHUNKED_SCORES = 256 * 1024


def chunked_rows(k_len: int, chunk_size: int) -> int:
    """Query rows of a ``chunked`` block whose rows all see ``k_len`` keys (at most ``chunk_size``)."""
    return min(chunk_size, CHUNKED_ROWS, max(8, CHUNKED_SCORES // max(k_len, 1)))


def chunked(
    enc, q, k, v, q_pos, k_pos, mask: AttentionMask, *, ctx=None, qk_proj=None, options=None, sinks=None, dropout=0.0
) -> Tensor:
    """:func:`scores`, softmax and values in query blocks of :func:`chunked_rows` rows.

    Each block sees only the keys the mask lets it see. With gradients, the blocks are
    recomputed in backward when the saved scores of the whole call would exceed
    ``options.checkpoint_bytes``.
    """
    o = options or BlockOptions()
    recompute = _needs_grad(q, k, v) and saved_score_bytes(q, k, mask) > o.checkpoint_bytes

    def block(qb, kb, vb, qp, kp, m, bctx):
        return materialized(enc, qb, kb, vb, qp, kp, m, qk_proj, sinks, bctx, dropout=dropout)

    rows = min(o.chunk_size, CHUNKED_ROWS)
    out = _in_query_blocks(block, rows, recompute, q, k, v, q_pos, k_pos, mask, scores=CHUNKED_SCORES, ctx=ctx)
    return propagate_nonfinite(out, q, k, v, mask.checked_keys, mask.checked_queries)


def eager(
    enc, q, k, v, q_pos, k_pos, mask: AttentionMask, *, ctx=None, qk_proj=None, options=None, sinks=None, dropout=0.0
) -> Tensor:
    """The oracle: every term materialised at once, float32 throughout."""
    out = materialized(enc, q.float(), k.float(), v.float(), q_pos, k_pos, mask, qk_proj, sinks, ctx, dropout=dropout)
    return propagate_nonfinite(out, q, k, v, mask.checked_keys, mask.checked_queries).to(q.dtype)


def blockwise(
    enc, q, k, v, q_pos, k_pos, mask: AttentionMask, *, ctx=None, qk_proj=None, options=None, sinks=None, dropout=0.0
) -> Tensor:
    """:mod:`posenc.kernels` for encodings with ``distance_terms``: no ``L×L`` tensor, the fused
    kernel wherever the terms fold into ``q``/``k``/``v``. Where
    :func:`~posenc.kernels.backend.blockwise_attention` does not apply (or with learned
    ``sinks``, or attention dropout), the general backend runs (``dense`` for a scalar bias,
    else ``chunked``)."""
    o = options or BlockOptions()
    if sinks is None and not dropout:  # (learned sinks, dropout: the general backend)
        # the explicit parts' probabilities are kept for backward within the layer's
        # saved-score budget (BlockOptions.checkpoint_bytes), as dense/chunked keep their
        # scores (what recomputing them cost: docs/bench.md, "Kept probabilities")
        out = blockwise_attention(
            enc,
            q,
            k,
            v,
            q_pos,
            k_pos,
            mask,
            ctx=ctx,
            qk_proj=qk_proj,
            max_block=o.chunk_size,
            keep_bytes=o.checkpoint_bytes,
        )
        if out is not None:
            return propagate_nonfinite(
                out, q, k, v, mask.checked_keys, mask.checked_queries
            )  # the fused calls would hide a NaN row
    general = dense if "dense" in supported_backends(enc) else chunked
    kw = {"ctx": ctx, "qk_proj": qk_proj, "options": options, "sinks": sinks, "dropout": dropout}
    return general(enc, q, k, v, q_pos, k_pos, mask, **kw)


def maps(
    enc, q, k, v, q_pos, k_pos, mask: AttentionMask, *, ctx=None, qk_proj=None, options=None, sinks=None, dropout=0.0
) -> Tensor:
    """The encoding's score maps (``score_maps``) through the CPU's fused kernel, each over only the
    keys it holds, merged by log-sum-exp (:mod:`posenc.kernels.maps`); ``k``/``v`` may be grouped.
    Where that does not apply (another device, positions that are not one causal run, padding,
    a window, a top-k selection, learned ``sinks``, dropout, a gradient), ``chunked`` runs."""
    if sinks is None and not dropout and not _needs_grad(q, k, v):
        out = score_map_attention(enc, q, k, v, q_pos, k_pos, mask)
        if out is not None:
            return propagate_nonfinite(out, q, k, v, mask.checked_keys, mask.checked_queries)
    k, v = expand_kv(k, v, q.shape[1])
    kw = {"ctx": ctx, "qk_proj": qk_proj, "options": options, "sinks": sinks, "dropout": dropout}
    return chunked(enc, q, k, v, q_pos, k_pos, mask, **kw)


BACKENDS: dict[str, AttendFn] = {
    "sdpa": sdpa,
    "flex": flex,
    "blockwise": blockwise,
    "dense": dense,
    "maps": maps,
    "chunked": chunked,
    "eager": eager,
}
BACKEND_ALIASES: dict[str, str] = {"relative": "chunked"}  # old name -> current name


def backend_names() -> tuple[str, ...]:
    """Every name ``backend=`` accepts: ``"auto"``, the registered backends, their aliases."""
    return ("auto", *BACKENDS, *BACKEND_ALIASES)


def canonical_backend(name: str) -> str:
    """``name`` with aliases resolved; ``ValueError`` for an unknown name."""
    if not isinstance(name, str) or name not in backend_names():
        raise ValueError(f"backend must be one of {backend_names()}, got {name!r}")
    return BACKEND_ALIASES.get(name, name)


def attend(
    enc: PositionEncoding,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    mask: AttentionMask,
    *,
    ctx=None,
    backend: str = "auto",
    options: BlockOptions | None = None,
    sinks: Tensor | None = None,
    dropout: float = 0.0,
) -> Tensor:
    """The attend step every caller runs (:class:`posenc.Attention`, so :class:`posenc.TransformerLM`,
    and ``posenc.hf``): ``backend`` (``"auto"``: :func:`select_backend` for this call's
    device, lengths and mask) on ``q`` ``(B, H, Lq, Dh)``, ``k``, ``v`` ``(B, H, Lk, Dh)``
    after the q/k stage -> ``(B, H, Lq, Dh)``. ``k``/``v`` may have ``Hk`` heads, ``Hk`` dividing
    ``H`` (grouped- and multi-query attention): query head ``h`` reads key head ``h // (H/Hk)``;
    this is the one place they are expanded (:func:`posenc.attend.scores.expand_kv`; ``sdpa`` passes
    ``enable_gqa=True`` instead, ``maps`` places the grouped keys first and repeats them after), so
    every backend and every encoding's score side sees ``H``.

    ``dropout``: attention-probability dropout in ``[0, 1)``, applied as given (the caller passes
    0 outside training, as HF's attention modules do); every backend but ``flex`` runs it.
    """
    check_dropout(dropout)
    name = canonical_backend(backend)
    if name == "auto":
        name = select_backend(enc, q.device.type, q.shape[2], k.shape[2], causal=mask.causal, dropout=dropout > 0)
    else:
        require_backend(enc, name)
    if k.shape[1] != q.shape[1] and name not in ("sdpa", "maps"):  # grouped k/v (sdpa: enable_gqa; maps: its own)
        k, v = expand_kv(k, v, q.shape[1])
    extra = {"dropout": dropout} if dropout else {}  # (a backend written before dropout existed still runs)
    return BACKENDS[name](enc, q, k, v, q_pos, k_pos, mask, ctx=ctx, options=options, sinks=sinks, **extra)
