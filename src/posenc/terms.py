"""Shared term types on the ground floor: an encoding's terms as functions of the distance.

:class:`DistanceTerms` is what an encoding's ``distance_terms`` returns and what
:func:`posenc.kernels.distance_attention` consumes; :class:`ScoreMap` is what its
``score_maps`` returns and :func:`posenc.kernels.maps.score_map_attention` consumes. They live
here, below both, so the encodings do not import the kernels (DESIGN.md, "Floors").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["DistanceTerms", "ScoreMap", "Table", "saturation"]

Table = Callable[[Tensor], Tensor]


@dataclass
class DistanceTerms:
    """An encoding's score and value terms as functions of ``d = k_pos - q_pos``::

        s_ij = scale·(q_i·k_j + q_rel_i·rel_k[row(d)] + k_j·rel_q[row(d)]) + bias[row(d)]
        o_i  = Σ_j p_ij·(v_j + rel_v[row(d)])

    ``rows(d)``: the table row of each distance (a bucket, a clipped distance), int64
    ``(n,)``; the tables are then called with rows (int64 ``(m,)``). Without ``rows`` they
    are called with the distances themselves. ``bias`` -> ``(H, m)`` float32; ``rel_k``,
    ``rel_q``, ``rel_v`` -> ``(H|1, m, Dh)``.

    ``q``: the query in ``q_i·k_j`` (the ``q`` argument when None; Transformer-XL's
    ``q + u``); ``q_rel``: the query dotted with ``rel_k`` (the same ``q`` when None).

    ``kind``: ``"clamp"``: every term is constant for ``d <= far[0]`` and for
    ``d >= far[1]``; ``"linear"``: only a bias, equal to ``slopes[0]·d`` for ``d <= far[0]``
    and ``slopes[1]·d`` for ``d >= far[1]`` (``(H,)`` each, no gradient); ``"none"``.
    """

    bias: Table | None = None
    rel_k: Table | None = None
    rel_q: Table | None = None
    rel_v: Table | None = None
    rows: Table | None = None
    q: Tensor | None = None
    q_rel: Tensor | None = None
    kind: str = "none"
    far: tuple[int, int] | None = None
    slopes: tuple[Tensor, Tensor] | None = None

    def at(self, d: Tensor) -> tuple[Tensor, Tensor | None]:
        """``(argument of the tables, table row of each distance or None)`` for distances ``d``."""
        if self.rows is None:
            return d, None
        return torch.unique(self.rows(d), return_inverse=True)


@dataclass(frozen=True)
class ScoreMap:
    """One score map of an encoding whose ``q·k`` term is several maps, each over the pairs its
    positions pick (ReRoPE, Self-Extend, Dual Chunk Attention)::

        pair (i, j), j <= i, takes this map where  lo <= i // unit - j // unit <= hi
        s_ij = query(q, q_pos)_i · key(k, k_pos)_j        (before scale)

    ``lo``/``hi`` None: unbounded. The maps of an encoding give every causal pair exactly one
    map. ``query``/``key`` take ``(B, H, L, Dh)`` and positions ``(B|1, L)`` int64 and return the
    map's queries/keys, the same shape (any float dtype); ``key`` None: the keys as they are.
    """

    unit: int
    lo: int | None
    hi: int | None
    query: Callable[[Tensor, Tensor], Tensor]
    key: Callable[[Tensor, Tensor], Tensor] | None = None

    def first_key(self, p: int) -> int:
        """The first key position a query at position ``p`` reads in this map (may be negative)."""
        return -(1 << 62) if self.hi is None else (p // self.unit - self.hi) * self.unit

    def last_key(self, p: int) -> int:
        """The last key position a query at position ``p`` reads in this map (causal: at most ``p``)."""
        return p if self.lo is None else min(p, (p // self.unit - self.lo + 1) * self.unit - 1)


def saturation(rows: Table, limit: int, device=None) -> tuple[int, int]:
    """``(lo, hi)`` with ``rows(d)`` constant for ``d <= lo`` and for ``d >= hi``, given that it
    is constant beyond ``±limit``: the far field of a clipped or bucketed table."""
    d = torch.arange(-limit, limit + 1, device=device)
    r = rows(d)
    left = int((r != r[0]).nonzero()[0, 0]) if bool((r != r[0]).any()) else r.numel()
    right = int((r != r[-1]).nonzero()[-1, 0]) if bool((r != r[-1]).any()) else -1
    return int(d[left - 1]), int(d[right + 1])
