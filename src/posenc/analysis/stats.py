"""Numbers the analyses report: distances, masked entries, the share of a matrix that is a
function of ``j - i``, relative change."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["diagonal_share", "distances", "masked_values", "rel_change"]


def distances(L: int) -> Tensor:
    """``(L, L)`` int64 ``i - j`` (query minus key): ``>= 0`` on and below the diagonal."""
    i = torch.arange(L)
    return i[:, None] - i[None, :]


def masked_values(t: Tensor, mask: Tensor | None) -> Tensor:
    """Entries of ``(..., L, L)`` where ``mask`` ``(L, L)`` is True, flattened."""
    if mask is None:
        return t.reshape(-1)
    return t[..., mask].reshape(-1)


def diagonal_share(m: Tensor, *, skip_main: bool = False, keep: Tensor | None = None) -> float | None:
    """Share of the variance of a square matrix explained by its mean along each diagonal.

    ``1 - Σ (m_ij - mean_{j-i}(m))² / Σ (m_ij - mean(m))²``: 1 for a Toeplitz matrix (a
    function of ``j - i`` alone). ``skip_main`` drops ``i = j`` (a Gram matrix's norms);
    ``keep`` ``(L, L)`` bool restricts it to some entries (the causal triangle).
    For an ``L×L`` matrix of i.i.d. noise the expected share is about ``(2L-1)/L²``.
    None for a constant matrix (nothing to explain).
    """
    m = m.double()
    L = m.shape[-1]
    d = distances(L) + (L - 1)  # (L, L) diagonal index in [0, 2L-2]
    keep = torch.ones(L, L, dtype=torch.bool) if keep is None else keep.clone()
    if skip_main:
        keep &= d != L - 1
    vals, idx = m[keep], d[keep]
    sums = torch.zeros(2 * L - 1, dtype=torch.float64).index_add_(0, idx, vals)
    counts = torch.zeros(2 * L - 1, dtype=torch.float64).index_add_(0, idx, torch.ones_like(vals))
    fit = (sums / counts.clamp(min=1))[idx]
    total = ((vals - vals.mean()) ** 2).sum()
    if total <= 1e-20 * max(1.0, float((vals**2).sum())):
        return None
    return float(1 - ((vals - fit) ** 2).sum() / total)


def rel_change(new: Tensor, ref: Tensor) -> float:
    """``‖new - ref‖ / ‖ref‖`` (Frobenius), 0 when both are 0."""
    den = float(ref.double().norm())
    num = float((new.double() - ref.double()).norm())
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)
