"""Shared term types on the ground floor: an encoding's terms as functions of the distance.

:class:`DistanceTerms` is what an encoding's ``distance_terms`` returns and what
:func:`posenc.kernels.distance_attention` consumes; it lives here, below both, so the
encodings do not import the kernels (DESIGN.md, "Floors").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["DistanceTerms", "Table", "saturation"]

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


def saturation(rows: Table, limit: int, device=None) -> tuple[int, int]:
    """``(lo, hi)`` with ``rows(d)`` constant for ``d <= lo`` and for ``d >= hi``, given that it
    is constant beyond ``±limit``: the far field of a clipped or bucketed table."""
    d = torch.arange(-limit, limit + 1, device=device)
    r = rows(d)
    left = int((r != r[0]).nonzero()[0, 0]) if bool((r != r[0]).any()) else r.numel()
    right = int((r != r[-1]).nonzero()[-1, 0]) if bool((r != r[-1]).any()) else -1
    return int(d[left - 1]), int(d[right + 1])
