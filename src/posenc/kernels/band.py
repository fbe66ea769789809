"""The explicit part of a block: scores with distance terms, softmax, and their gradients.

For query rows ``[r0, r1)`` and keys ``[k0, k1)`` (``c`` rows, ``n`` keys), with
``d = j - i + delta`` and ``row(d)`` the table row of distance ``d``::

    s_ij = scale·(q_i·k_j + q_rel_i·rel_k[row(d)] + k_j·rel_q[row(d)]) + bias[row(d)] + mask_ij
    o_i  = Σ_j p_ij·(v_j + rel_v[row(d)])

The ``c + n - 1`` distances of the block form a window. A vector table is multiplied
once per distinct row of the window (a clipped or bucketed table has few), the products
are spread over the window and laid onto the ``(c, n)`` grid by a strided view
(Transformer-XL's rel-shift as a view: no index tensor per pair, no copy); gradients go
back the same way. Everything is float32, like the eager oracle; a block holds a few
``(B, H, c, n)`` tensors at most.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .flash import safe_lse

__all__ = ["Tables", "band_forward", "band_backward"]


@dataclass
class Tables:
    """Distance ``lo + t`` (``t < n``) reads row ``rows[t]`` of every table (row ``t`` when
    ``rows`` is None); ``clamp``: distances outside ``[lo, lo + n)`` read the end ones."""

    lo: int
    n: int
    clamp: bool
    rows: Tensor | None = None
    bias: Tensor | None = None  # (H, R) float32, added after scale
    rel_k: Tensor | None = None  # (H|1, R, Dh): scale·q_rel_i·rel_k
    rel_q: Tensor | None = None  # (H|1, R, Dh): scale·k_j·rel_q
    rel_v: Tensor | None = None  # (H|1, R, Dh): Σ_j p_ij·rel_v

    def window(self, d_min: int, n_w: int, device) -> Tensor:
        """Table rows of distances ``d_min .. d_min + n_w - 1``: ``(n_w,)`` int64."""
        t = torch.arange(d_min - self.lo, d_min - self.lo + n_w, device=device)
        if self.clamp:
            t.clamp_(0, self.n - 1)
        elif d_min < self.lo or d_min + n_w > self.lo + self.n:
            raise ValueError(
                f"distances [{d_min}, {d_min + n_w - 1}] outside the table [{self.lo}, {self.lo + self.n - 1}]"
            )
        return t if self.rows is None else self.rows[t]


class _Rows:
    """The window's table rows, and its distinct rows when there are repeats."""

    def __init__(self, rows: Tensor):
        self.rows = rows
        self.uniq, self.inv = torch.unique(rows, return_inverse=True)
        if self.uniq.numel() * 4 > rows.numel() * 3:  # few repeats: multiply every column
            self.uniq, self.inv = rows, None

    def logits(self, x: Tensor, table: Tensor, reverse: bool = False) -> Tensor:
        """``x (B, H, m, Dh)`` dotted with the table row of every window column: ``(B, H, m, n_w)``."""
        out = x @ table.float().index_select(-2, self.uniq).transpose(-1, -2)
        if self.inv is not None:
            out = out.index_select(-1, self.inv)
        return out.flip(-1) if reverse else out

    def reduce(self, per_column: Tensor) -> Tensor:
        """``(..., n_w)`` -> ``(..., n_u)``: sum the columns that read one row."""
        if self.inv is None:
            return per_column
        out = per_column.new_zeros(*per_column.shape[:-1], self.uniq.numel())
        return out.index_add_(-1, self.inv, per_column)


def _skew(t: Tensor, n: int) -> Tensor:
    """``(..., c, c + n - 1)`` contiguous -> ``(..., c, n)`` view, ``out[r, u] = t[r, u - r + c - 1]``."""
    c, n_w = t.shape[-2:]
    return t.as_strided((*t.shape[:-2], c, n), (*t.stride()[:-2], n_w - 1, 1), t.storage_offset() + c - 1)


def _skew_keys(t: Tensor, c: int) -> Tensor:
    """``(..., n, c + n - 1)`` contiguous, window reversed -> ``(..., c, n)`` view,
    ``out[r, u] = t[u, (c + n - 1) - c - u + r]`` (the key-side rel-shift)."""
    n, n_w = t.shape[-2:]
    return t.as_strided((*t.shape[:-2], c, n), (*t.stride()[:-2], 1, n_w - 1), t.storage_offset() + n_w - c)


@dataclass
class _Block:
    """The inputs of one band, sliced and in float32."""

    q: Tensor
    k: Tensor
    v: Tensor
    q_rel: Tensor
    rows: _Rows
    allowed: Tensor | None  # (B|1, 1, c, n) bool


def _block(x, band, geom, kpm, tables) -> _Block:
    q, k, v, q_rel = x
    r0, r1, k0, k1 = band.r0, band.r1, band.k0, band.k1
    allowed = None
    if geom.causal and k1 - 1 > r0 + geom.offset:
        i = torch.arange(r0, r1, device=q.device).unsqueeze(-1)
        j = torch.arange(k0, k1, device=q.device)
        allowed = (j <= i + geom.offset)[None, None]
    if kpm is not None:
        pad = kpm[:, None, None, k0:k1]
        allowed = pad if allowed is None else allowed & pad
    rows = _Rows(tables.window(k0 - (r1 - 1) + geom.delta, (r1 - r0) + (k1 - k0) - 1, q.device))
    qb = q[:, :, r0:r1].float()
    qr = qb if q_rel is None else q_rel[:, :, r0:r1].float()
    return _Block(qb, k[:, :, k0:k1].float(), v[:, :, k0:k1].float(), qr, rows, allowed)


def _scores(b: _Block, tables: Tables, scale: float) -> Tensor:
    """Masked float32 scores ``(B, H, c, n)``."""
    c, n = b.q.shape[-2], b.k.shape[-2]
    s = b.q @ b.k.transpose(-1, -2)
    if tables.rel_k is not None:
        s.add_(_skew(b.rows.logits(b.q_rel, tables.rel_k), n))
    if tables.rel_q is not None:
        s.add_(_skew_keys(b.rows.logits(b.k, tables.rel_q, reverse=True).contiguous(), c))
    s.mul_(scale)
    if tables.bias is not None:
        s.add_(tables.bias.float().index_select(-1, b.rows.rows).unfold(-1, n, 1).flip(-2))  # (H, c, n)
    if b.allowed is not None:
        s.masked_fill_(~b.allowed, float("-inf"))
    return s


def _mass(p: Tensor) -> Tensor:
    """Attention mass of every window distance: ``(B, H, c, c + n - 1)``."""
    mass = p.new_zeros(*p.shape[:-1], p.shape[-2] + p.shape[-1] - 1)
    _skew(mass, p.shape[-1]).copy_(p)
    return mass


def band_forward(x, band, tables: Tables, *, scale, geom, kpm, keep: bool):
    """``(out (B, H, c, Dh), lse (B, H, c), p or None)`` of one band, float32.

    ``keep``: also return the band's probabilities (normalised by its own ``lse``) for
    :func:`band_backward`, which then skips recomputing the scores.
    """
    b = _block(x, band, geom, kpm, tables)
    s = _scores(b, tables, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = s.sub_(safe_lse(lse).unsqueeze(-1)).exp_()
    out = p @ b.v
    if tables.rel_v is not None:
        out += b.rows.reduce(_mass(p)) @ tables.rel_v.float().index_select(-2, b.rows.uniq)
    return out, lse, (p if keep else None)


def _sum_to(g: Tensor, like: Tensor) -> Tensor:
    """Sum a ``(B, H, ...)`` gradient down to a ``(H|1, ...)`` table's shape."""
    g = g.sum(0)
    return g.sum(0, keepdim=True) if like.shape[0] == 1 else g


def _add_rows(grad: Tensor | None, rows: Tensor, value: Tensor) -> None:
    if grad is not None:
        grad.index_add_(-2, rows, value)


def band_backward(x, band, tables: Tables, grads, *, do, lse, delta_rows, scale, geom, kpm, p=None, band_lse=None):
    """Add one band's gradients into ``grads`` (float32 buffers of ``q, k, v, q_rel`` and tables).

    ``do``: ``(B, H, c, Dh)`` output gradient of the band's rows; ``lse``: the global
    log-sum-exp of those rows; ``delta_rows``: ``Σ_d dO·O`` per row, ``(B, H, c)``;
    ``p``, ``band_lse``: the band's kept probabilities and its own log-sum-exp, if kept.
    """
    b = _block(x, band, geom, kpm, tables)
    r0, r1, k0, k1 = band.r0, band.r1, band.k0, band.k1
    c, n = r1 - r0, k1 - k0
    if p is None:
        p = _scores(b, tables, scale).sub_(safe_lse(lse).unsqueeze(-1)).exp_()
    else:  # renormalise the band's own softmax to the whole row's
        p = p * torch.exp(band_lse - safe_lse(lse)).nan_to_num_(0.0).unsqueeze(-1)
    do = do.float()
    dp = do @ b.v.transpose(-1, -2)
    if tables.rel_v is not None:
        dp.add_(_skew(b.rows.logits(do, tables.rel_v), n))
        if grads["rel_v"] is not None:
            mass = b.rows.reduce(_mass(p))
            _add_rows(grads["rel_v"], b.rows.uniq, _sum_to(mass.transpose(-1, -2) @ do, tables.rel_v))
    if grads["v"] is not None:
        grads["v"][:, :, k0:k1] += p.transpose(-1, -2) @ do
    ds = p.mul_(dp.sub_(delta_rows.unsqueeze(-1)))  # dS = P ∘ (dP - D), in place of p
    if grads["bias"] is not None:
        acc = ds.new_zeros(ds.shape[1], c, c + n - 1)
        _skew(acc, n).copy_(ds.sum(0))
        grads["bias"].index_add_(-1, b.rows.rows, acc.sum(-2))
    ds.mul_(scale)
    if grads["q"] is not None:
        grads["q"][:, :, r0:r1] += ds @ b.k
    if grads["k"] is not None:
        grads["k"][:, :, k0:k1] += ds.transpose(-1, -2) @ b.q
    if tables.rel_k is not None:
        d_rel = ds.new_zeros(*ds.shape[:-1], c + n - 1)
        _skew(d_rel, n).copy_(ds)
        d_rel = b.rows.reduce(d_rel)  # (B, H, c, n_u)
        key = "q" if x[3] is None else "q_rel"
        if grads[key] is not None:
            grads[key][:, :, r0:r1] += d_rel @ tables.rel_k.float().index_select(-2, b.rows.uniq)
        _add_rows(grads["rel_k"], b.rows.uniq, _sum_to(d_rel.transpose(-1, -2) @ b.q_rel, tables.rel_k))
    if tables.rel_q is not None:
        d_rel = ds.new_zeros(*ds.shape[:-2], n, c + n - 1)
        _skew_keys(d_rel, c).copy_(ds)
        d_rel = b.rows.reduce(d_rel.flip(-1))  # back to window order, then per distinct row
        if grads["k"] is not None:
            grads["k"][:, :, k0:k1] += d_rel @ tables.rel_q.float().index_select(-2, b.rows.uniq)
        _add_rows(grads["rel_q"], b.rows.uniq, _sum_to(d_rel.transpose(-1, -2) @ b.k, tables.rel_q))
