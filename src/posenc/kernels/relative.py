"""Attention with terms that depend on the distance ``d = k_pos - q_pos``: the public entry.

:func:`distance_attention` takes what an encoding adds as functions of ``d``
(:class:`DistanceTerms`), picks the plan (:mod:`.plan`), evaluates the tables over the
distances the plan needs (O(L) of them, never one per pair), folds the far-field
constants into ``k`` and ``v``, and runs :class:`~.segments.SegmentAttention`. Peak
memory is O(L·(block + keys of a band) + L·Dh) per head: no ``L×L`` tensor.

Positions must be consecutive and shared by the batch (``q_pos = q0 + i``,
``k_pos = k0 + j``); callers check that and fall back to a dense path otherwise.
CPU only (it calls the CPU flash kernel).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..terms import DistanceTerms, Table
from .band import Tables
from .plan import Geometry, make_plan
from .segments import SegmentAttention, SegmentConfig

__all__ = ["distance_attention"]

# keys per band for a bias without vector terms (Kerple); vector terms (Transformer-XL) are
# not split: each band pays for its own window of table products (the measurements:
# docs/bench.md, "Kerple: bands of at most 1024 keys")
BIAS_BAND_KEYS = 1024


def _table(terms: DistanceTerms, f: Table, d: Tensor) -> Tensor:
    """Table ``f`` at each distance of ``d`` (through ``terms.rows`` when given)."""
    return f(d if terms.rows is None else terms.rows(d))


def _per_head(x: Tensor) -> Tensor:
    """``(H|1, Dh)`` -> ``(1, H|1, 1, Dh)``."""
    return x[None, :, None, :]


def _far_variant(terms, d: int, q, k, v, scale, const: Tensor | None):
    """``(q, k, v)`` of a far field where every term is its value at ``d`` (None: the base)."""
    dist = torch.tensor([d], device=q.device)
    kx, vx, col = k, v, None
    if terms.rel_k is not None:
        kx = k + _per_head(_table(terms, terms.rel_k, dist)[:, 0]).to(k.dtype)
    if terms.rel_v is not None:
        vx = v + _per_head(_table(terms, terms.rel_v, dist)[:, 0]).to(v.dtype)
    if terms.rel_q is not None:
        col = (k * _per_head(_table(terms, terms.rel_q, dist)[:, 0]).to(k.dtype)).sum(-1, keepdim=True)  # (B, H, Lk, 1)
    if const is not None:  # a per-head constant beside the far-left one: (H,) -> column
        c = (const / scale).to(k.dtype).view(1, -1, 1, 1)
        col = c.expand(*k.shape[:-1], 1) if col is None else col + c
    if col is None:
        return (None, None if kx is k else kx, None if vx is v else vx)
    ones = q.new_ones(*q.shape[:-1], 1)
    return torch.cat([q, ones], -1), torch.cat([kx, col], -1), torch.cat([vx, vx.new_zeros(*vx.shape[:-1], 1)], -1)


def distance_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    terms: DistanceTerms,
    *,
    scale: float,
    causal: bool,
    offset: int = 0,
    delta: int | None = None,
    key_padding_mask: Tensor | None = None,
    block: int = 128,
    keep_bytes: int = 256 * 2**20,
) -> Tensor:
    """Attention of ``q`` ``(B, H, Lq, Dh)`` over ``k, v`` ``(B, H, Lk, Dh)`` with distance terms.

    ``offset``: keys cached before the call (causal query ``i`` sees ``j <= i + offset``);
    ``delta``: ``k_pos[0] - q_pos[0]`` (``-offset`` by default); ``key_padding_mask``:
    ``(B, Lk)`` bool, True = attend; ``block``: query rows per block; ``keep_bytes``: the
    band probabilities are kept for backward when they fit, else recomputed.
    Returns ``(B, H, Lq, Dh)`` in ``q``'s dtype; a row that sees no key is 0.
    """
    if q.device.type != "cpu":
        raise ValueError(f"distance_attention runs the CPU flash kernel; got device {q.device}")
    Lq, Lk = q.shape[2], k.shape[2]
    geom = Geometry(Lq, Lk, causal, offset, -offset if delta is None else delta)
    kind = terms.kind
    if kind == "clamp" and terms.q_rel is not None:
        kind = "none"  # a far field folds rel_k into k only when it multiplies q itself
    if kind == "linear" and (terms.rel_k or terms.rel_q or terms.rel_v or terms.slopes is None):
        raise ValueError("linear terms are a bias only, with slopes=(left, right)")
    bias_only = not (terms.rel_k or terms.rel_q or terms.rel_v)
    plan = make_plan(geom, kind, terms.far if kind != "none" else None, block, BIAS_BAND_KEYS if bias_only else None)
    qq = q if terms.q is None else terms.q
    left = right = (None, None, None)
    fns = (terms.bias, terms.rel_k, terms.rel_q, terms.rel_v)
    if kind == "clamp":
        lo, hi = terms.far
        base = None
        if terms.bias is not None:  # relative to the far-left constant (softmax is shift-invariant per row)
            base = _table(terms, terms.bias, torch.tensor([lo], device=q.device))
        if any(c.side == "left" for c in plan.calls):
            left = _far_variant(terms, lo, qq, k, v, scale, None)
        if any(c.side == "right" for c in plan.calls):
            const = (
                None if base is None else (_table(terms, terms.bias, torch.tensor([hi], device=q.device)) - base)[:, 0]
            )
            right = _far_variant(terms, hi, qq, k, v, scale, const)
        tables = [None] * 4
        if plan.strips:  # one row per strip column: distance first + delta + t
            s0 = plan.strips[0]
            d = torch.arange(s0.first + geom.delta, s0.first + geom.delta + s0.width, device=q.device)
            tables = [None if f is None else _table(terms, f, d) for f in fns]
            if base is not None:
                tables[0] = tables[0] - base
        meta = Tables(0, 1, True)
    else:
        rng = plan.distance_range() or (0, 0)
        arg, rows = terms.at(torch.arange(rng[0], rng[1] + 1, device=q.device))
        tables = [None if f is None else f(arg) for f in fns]
        meta = Tables(rng[0], rng[1] - rng[0] + 1, False, rows)
    slopes = terms.slopes if kind == "linear" else (None, None)
    kpm = key_padding_mask
    if kpm is not None:
        if kpm.dtype != torch.bool or kpm.shape != (q.shape[0], Lk):
            raise ValueError(
                f"key_padding_mask must be bool (B, Lk) = {(q.shape[0], Lk)}, got {kpm.dtype} {tuple(kpm.shape)}"
            )
    cfg = SegmentConfig(plan, meta, scale, kpm, *[None if s is None else s.detach() for s in slopes], keep_bytes)
    return SegmentAttention.apply(cfg, qq, k, v, *left, *right, terms.q_rel, *tables)
