"""Attention backends: public functions with one signature, in one registry.

API reference (what :class:`posenc.Attention` calls, and what other code may call)::

    posenc.scores(enc, q, k, q_pos, k_pos, *, qk_proj=None, parts=False)
        # the pre-softmax score sum  s = scale·(q̃·k̃ + score_terms) + bias, float32 (B, H, Lq, Lk);
        # parts=True: {"qk": scale·q̃·k̃, "terms": scale·score_terms, "bias": bias}, the stages it has
    posenc.BACKENDS[name](enc, q, k, v, q_pos, k_pos, mask, *, qk_proj=None, options=None, sinks=None) -> (B, H, Lq, Dh)
        # q (B, H, Lq, Dh), k, v (B, H, Lk, Dh): after the q/k stage (Attention.project);
        # q_pos (B|1, Lq), k_pos (B|1, Lk) int64; mask: a posenc.AttentionMask;
        # qk_proj: the layer's (W_Q, W_K) for encodings with uses_layer_projections;
        # options: a BlockOptions (query block sizes, recompute budget)
        # sinks: (H,) learned sink logits (gpt-oss, posenc.sinks) or None
    posenc.supported_backends(enc) -> list[str]     # every one of them equals "eager"
    posenc.select_backend(enc, device_type, q_len=None, k_len=None, *, causal=None) -> str
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

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import PositionEncoding, Stage
from .kernels.backend import blockwise
from .kernels.flash import needs_upcast, propagate_nonfinite
from .mask import AttentionMask
from .mask import in_query_blocks as _in_query_blocks
from .sinks import append_sink_key, sink_bias, sink_mods, sink_softmax
from .validate import check_device_type

__all__ = [
    "BLOCKWISE_MIN_SCORES",
    "BLOCKWISE_MIN_SCORES_BIDIR",
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
]

# (W_Q, W_K) of the layer, for encodings that project their own tables with them
QKProj = tuple[nn.Module, nn.Module]


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


AttendFn = Callable[..., Tensor]  # (enc, q, k, v, q_pos, k_pos, mask, *, qk_proj=None, options=None, sinks=None)


# ============================================================================ the score sum
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


def _materialized(enc, q, k, v, q_pos, k_pos, mask: AttentionMask, qk_proj=None, sinks=None) -> Tensor:
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


def _saved_score_bytes(q: Tensor, k: Tensor, mask: AttentionMask) -> int:
    """Bytes autograd keeps for the math kernel: ~3 float32 score-sized tensors."""
    B, H, Lq, _ = q.shape
    return B * H * Lq * k.shape[2] * 4 * 3 // (2 if mask.causal else 1)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, **kw) -> Tensor:
    """``F.scaled_dot_product_attention``, run in float32 (and cast back) for CPU bfloat16
    where the CPU's fused kernel cannot run it (:func:`posenc.kernels.flash.needs_upcast`)."""
    if needs_upcast(q):
        mask = kw.get("attn_mask")
        if mask is not None and mask.is_floating_point():
            kw["attn_mask"] = mask.float()
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, **kw)


def _needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ============================================================================ backends
def sdpa(enc, q, k, v, q_pos, k_pos, mask: AttentionMask, *, qk_proj=None, options=None, sinks=None) -> Tensor:
    """``F.scaled_dot_product_attention``: input and q/k stages only (a window or chunk: in query
    blocks of ``options.dense_chunk`` rows that read only the keys they can see)."""

    def block(q, k, v, q_pos, k_pos, m: AttentionMask):
        (B, H, Lq, _), Lk, scale = q.shape, k.shape[2], enc.scale
        if sinks is not None:  # one zero key whose score is the sink logit
            bias = sink_bias(None, m.dense(Lq, Lk, q.device), sinks, (B, H, Lq, Lk)).to(q.dtype)
            return _sdpa(q, *append_sink_key(k, v), attn_mask=bias, scale=scale)
        if m.is_causal_square(Lq, Lk):
            return _sdpa(q, k, v, is_causal=True, scale=scale)
        return _sdpa(q, k, v, attn_mask=m.dense(Lq, Lk, q.device), scale=scale)

    c = (options or BlockOptions()).dense_chunk if mask.limited else q.shape[2]
    return propagate_nonfinite(_in_query_blocks(block, c, False, q, k, v, q_pos, k_pos, mask), q, k, v)


def dense(enc, q, k, v, q_pos, k_pos, mask: AttentionMask, *, qk_proj=None, options=None, sinks=None) -> Tensor:
    """SDPA with the bias as a float mask, in query blocks of ``options.dense_chunk`` rows.

    Blocking bounds the bias at ``(B|1, H, chunk, Lk)`` and drops the keys a block cannot
    see (about half the work when causal). A 4-D bias that needs no gradient runs the
    fused (flash) kernel; a learned bias (T5) needs ``dS`` per (i, j), which only the math
    kernel returns: its blocks are recomputed in backward when their saved scores would
    exceed ``options.checkpoint_bytes``.
    """
    o = options or BlockOptions()
    scale = enc.scale

    def block(qb, kb, vb, qp, kp, m: AttentionMask):
        bias = enc.bias(qp, kp)  # (B|1, H, Lq_b, Lk_b) float32
        keep = m.dense(qb.shape[2], kb.shape[2], qb.device)
        if sinks is not None:
            bias = sink_bias(bias, keep, sinks, (*qb.shape[:3], kb.shape[2]))
            kb, vb = append_sink_key(kb, vb)
        elif keep is not None:
            bias = bias.masked_fill(~keep, float("-inf"))
        return _sdpa(qb, kb, vb, attn_mask=bias.to(qb.dtype), scale=scale)

    learned_bias = _needs_grad(q, k, v) and any(p.requires_grad for p in enc.parameters())
    recompute = learned_bias and _saved_score_bytes(q, k, mask) > o.checkpoint_bytes
    out = _in_query_blocks(block, min(o.chunk_size, o.dense_chunk), recompute, q, k, v, q_pos, k_pos, mask)
    return propagate_nonfinite(out, q, k, v)


# ``chunked`` blocks: at most CHUNKED_ROWS query rows and CHUNKED_SCORES scores per head
# (rows x keys the block sees; at least 8 rows). Each of its steps is an elementwise pass
# over the block's (B, H, rows, keys) scores, and blocks that stay near the cache cut the
# passes' cost. fwd+bwd of one causal layer, H = 8, Dh = 64, 2 threads, ms with rows
# 1024 / 256 / 128 / 64: cope L=1024: 539 / 188 / 161 / 151, L=2048: 1558 / 686 / 576 / -,
# L=4096: 7522 / 3736 / 2254 / 2249; xl L=1024: 148 / 109 / 114 / -; deberta L=1024: 158 /
# 155 / 200 / - (its per-block table products favour larger blocks). Bounding the scores
# (not only the rows) also gives the blocks of a causal call one size, which keeps the C
# heap from fragmenting (posenc.mask.in_query_blocks).
CHUNKED_ROWS = 256
CHUNKED_SCORES = 256 * 1024


def chunked_rows(k_len: int, chunk_size: int) -> int:
    """Query rows of a ``chunked`` block whose rows all see ``k_len`` keys (at most ``chunk_size``)."""
    return min(chunk_size, CHUNKED_ROWS, max(8, CHUNKED_SCORES // max(k_len, 1)))


def chunked(enc, q, k, v, q_pos, k_pos, mask: AttentionMask, *, qk_proj=None, options=None, sinks=None) -> Tensor:
    """:func:`scores`, softmax and values in query blocks of :func:`chunked_rows` rows.

    Each block sees only the keys the mask lets it see. With gradients, the blocks are
    recomputed in backward when the saved scores of the whole call would exceed
    ``options.checkpoint_bytes``.
    """
    o = options or BlockOptions()
    recompute = _needs_grad(q, k, v) and _saved_score_bytes(q, k, mask) > o.checkpoint_bytes

    def block(qb, kb, vb, qp, kp, m):
        return _materialized(enc, qb, kb, vb, qp, kp, m, qk_proj, sinks)

    rows = min(o.chunk_size, CHUNKED_ROWS)
    out = _in_query_blocks(block, rows, recompute, q, k, v, q_pos, k_pos, mask, scores=CHUNKED_SCORES)
    return propagate_nonfinite(out, q, k, v)


def eager(enc, q, k, v, q_pos, k_pos, mask: AttentionMask, *, qk_proj=None, options=None, sinks=None) -> Tensor:
    """The oracle: every term materialised at once, float32 throughout."""
    out = _materialized(enc, q.float(), k.float(), v.float(), q_pos, k_pos, mask, qk_proj, sinks)
    return propagate_nonfinite(out, q, k, v).to(q.dtype)


_compiled_flex = None


def _flex_attention(device_type: str):
    """FlexAttention: compiled on CUDA (fused kernel); the eager reference elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if device_type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def flex(enc, q, k, v, q_pos, k_pos, mask: AttentionMask, *, qk_proj=None, options=None, sinks=None) -> Tensor:
    """FlexAttention with the encoding's ``score_mod`` and the mask's ``mask_mod``."""
    from torch.nn.attention.flex_attention import create_block_mask

    (B, _, Lq, _), Lk = q.shape, k.shape[2]
    score_mod = enc.score_mod(q_pos.expand(B, Lq), k_pos.expand(B, Lk))
    mask_mod = mask.mask_mod()
    if sinks is not None:  # key Lk: the sink key
        score_mod, mask_mod = sink_mods(score_mod, mask_mod, sinks, Lk)
        k, v = append_sink_key(k, v)
    batch, dev = B if mask.batched else None, q.device.type
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, batch, None, Lq, k.shape[2], device=dev)
    with warnings.catch_warnings():
        # off CUDA the unfused reference runs on purpose (FlexAttention has no CPU backward)
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        attend = _flex_attention(q.device.type)
        out = attend(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=enc.scale)
    return propagate_nonfinite(out, q, k, v)


BACKENDS: dict[str, AttendFn] = {
    "sdpa": sdpa,
    "flex": flex,
    "blockwise": blockwise,
    "dense": dense,
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


def supported_backends(enc: PositionEncoding) -> list[str]:
    """Backends able to run ``enc`` (every one of them equals ``eager``)."""
    st = enc.stages
    vector = bool(st & (Stage.TERMS | Stage.VALUE | Stage.SCORES)) or enc.rotates_value
    out = []
    if not st & Stage.BIAS and not vector:
        out.append("sdpa")
    if type(enc).distance_terms is not PositionEncoding.distance_terms and not enc.rotates_value:
        out.append("blockwise")
    if st & Stage.BIAS and not vector:
        out += ["flex", "dense"]
    return out + ["chunked", "eager"]


# ``blockwise`` pays for its per-block fused calls only from about this many scores per
# head (q_len * k_len); below it the one-shot dense/chunked backends are faster. Measured
# fwd+bwd, causal, 1 thread (docs/bench.md, "When auto picks blockwise"): at 64x64
# (compare's quick preset) blockwise is 1.2-4.8x slower for alibi/t5/kerple/shaw/xl; at
# 512x512 it is faster or level for all of them.
BLOCKWISE_MIN_SCORES = 512 * 512
# Bidirectional calls pay more for blockwise's explicit parts (a band or strip on both
# sides of the diagonal, and the right far field's own fused calls), against a baseline
# kernel that skips nothing: there the one-shot backends win up to about 2048 x 2048.
# Measured fwd+bwd of one bidirectional Attention, B = 1, H = 8, Dh = 64, 2 threads, ratios
# to plain SDPA at L = 512 / 1024 / 2048, blockwise against dense (scalar bias) or chunked:
# alibi 1.30 / 1.46 / 1.34 vs 1.06 / 1.27 / 1.29, t5 2.03 / 1.71 / 1.52 vs 1.27 / 1.54 /
# 1.69, kerple 1.23 / 1.39 / 1.43 vs 1.14 / 1.30 / 1.54, shaw 2.11 / 1.80 / 1.45 vs 1.29 /
# 1.55 / 1.75, xl 1.88 / 2.01 / 2.04 vs 1.79 / 2.07 / 2.68, deberta 6.83 / 4.70 / 2.76 vs
# 2.48 / 2.84 / 5.19 (docs/bench.md, "When auto picks blockwise").
BLOCKWISE_MIN_SCORES_BIDIR = 2048 * 2048


def select_backend(
    enc: PositionEncoding,
    device_type: str,
    q_len: int | None = None,
    k_len: int | None = None,
    *,
    causal: bool | None = None,
) -> str:
    """The backend ``"auto"`` runs for ``enc`` on ``device_type`` (``"cpu"``, ``"cuda"``, ...)
    for ``q_len`` queries over ``k_len`` keys (None: long; the choice for long sequences).

    FlexAttention is chosen on CUDA only: on CPU it has no backward, and its compiled
    forward costs a long compile for each new shape. ``blockwise`` is chosen on CPU only
    (its fused calls are CPU SDPA's flash kernel), and only from
    :data:`BLOCKWISE_MIN_SCORES` scores per head (:data:`BLOCKWISE_MIN_SCORES_BIDIR` when
    ``causal`` is False), where it measured faster. ``causal=None`` (not known) takes the
    causal rule.
    """
    if causal is not None and not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool or None, got {causal!r}")
    check_device_type(device_type)
    ok = supported_backends(enc)
    if "sdpa" in ok:
        return "sdpa"
    if "flex" in ok and enc.has_score_mod and device_type == "cuda":
        return "flex"
    least = BLOCKWISE_MIN_SCORES_BIDIR if causal is False else BLOCKWISE_MIN_SCORES
    short = q_len is not None and k_len is not None and q_len * k_len < least
    if "blockwise" in ok and device_type == "cpu" and not short:
        return "blockwise"
    if "dense" in ok:
        return "dense"
    return "chunked"
