"""The near keys of clipped or bucketed terms: a strip of ``W`` keys per row.

Row ``i``'s column ``t`` is key ``j = i + first + t``, at distance ``d = first + delta + t``
whatever the row, so the terms are per column::

    s_it = scale·(q_i·k_j + q_rel_i·rel_k[t] + k_j·rel_q[t]) + bias[t] + mask
    o_i  = Σ_t p_it·(v_j + rel_v[t])

``bias`` ``(H, W)``, ``rel_k/rel_q/rel_v`` ``(H|1, W, Dh)`` are already the rows of the
strip's distances (gathered by the caller, with gradients). For a block of ``c`` rows the
keys form a rectangle of ``c + W - 1``; ``q·k`` and ``p·v`` are matmuls against it and the
strip is its diagonal band, a strided view (``[r, t] -> [r, r + t]``). The key-side term
``k_j·rel_q[t]`` is one ``(Lk, W)`` matmul for the whole call (:func:`key_logits`), read
along its diagonals (``[r, t] -> [r + t, t]``). ``k`` and ``v`` are
given padded with ``pad`` zero rows in front (and enough behind), so the rectangle never
leaves them; keys outside ``[0, Lk)`` are masked. All float32, like the eager oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .flash import safe_lse

__all__ = ["StripTables", "key_logits", "key_logits_backward", "strip_forward", "strip_backward"]


@dataclass
class StripTables:
    bias: Tensor | None = None  # (H, W) float32, after scale
    rel_k: Tensor | None = None  # (H|1, W, Dh)
    rel_q: Tensor | None = None
    rel_v: Tensor | None = None


def _diag(t: Tensor, width: int) -> Tensor:
    """``(..., c, c + W - 1)`` contiguous -> ``(..., c, W)`` view, ``out[r, t] = t[r, r + t]``."""
    c, n = t.shape[-2:]
    return t.as_strided((*t.shape[:-2], c, width), (*t.stride()[:-2], n + 1, 1), t.storage_offset())


def _diag_keys(t: Tensor, c: int) -> Tensor:
    """``(..., c + W - 1, W)`` contiguous -> ``(..., c, W)`` view, ``out[r, t] = t[r + t, t]``."""
    n, width = t.shape[-2:]
    return t.as_strided((*t.shape[:-2], c, width), (*t.stride()[:-2], width, width + 1), t.storage_offset())


@dataclass
class _Block:
    q: Tensor  # (B, H, c, Dh) float32
    q_rel: Tensor
    k: Tensor  # (B, H, c + W - 1, Dh) float32: the rectangle
    v: Tensor
    k0: int  # first key of the rectangle in the padded tensors
    allowed: Tensor | None  # (B|1, 1, c, W) bool


def _block(x, strip, geom, pad: int, kpm_padded: Tensor | None) -> _Block:
    q, k, v, q_rel = x  # k, v padded
    c, W = strip.r1 - strip.r0, strip.width
    k0 = strip.r0 + strip.first + pad
    n = c + W - 1
    j = torch.arange(strip.r0, strip.r1, device=q.device)[:, None] + strip.first + torch.arange(W, device=q.device)
    allowed = None
    if bool(((j < 0) | (j >= geom.Lk)).any()):
        allowed = ((j >= 0) & (j < geom.Lk))[None, None]
    if kpm_padded is not None:  # (B, pad + Lk + ...) bool: the keys of the diagonal band
        band = _diag(kpm_padded[:, None, None, k0 : k0 + n].expand(-1, 1, c, n).contiguous(), W)
        allowed = band if allowed is None else allowed & band
    qb = q[:, :, strip.r0 : strip.r1].float()
    qr = qb if q_rel is None else q_rel[:, :, strip.r0 : strip.r1].float()
    return _Block(qb, qr, k[:, :, k0 : k0 + n].float(), v[:, :, k0 : k0 + n].float(), k0, allowed)


def key_logits(k_padded: Tensor, tables: StripTables) -> Tensor | None:
    """``k_j·rel_q[t]`` for every (padded) key and strip column: ``(B, H, Lk + pads, W)`` float32."""
    if tables.rel_q is None:
        return None
    return k_padded.float() @ tables.rel_q.float().transpose(-1, -2)


def _scores(b: _Block, tables: StripTables, scale: float, W: int, rk: Tensor | None) -> Tensor:
    c = b.q.shape[-2]
    s = _diag(b.q @ b.k.transpose(-1, -2), W).contiguous()  # (B, H, c, W)
    if tables.rel_k is not None:
        s.add_(b.q_rel @ tables.rel_k.float().transpose(-1, -2))
    if rk is not None:
        s.add_(_diag_keys(rk[:, :, b.k0 : b.k0 + b.k.shape[-2]], c))
    s.mul_(scale)
    if tables.bias is not None:
        s.add_(tables.bias.float().unsqueeze(-2))
    if b.allowed is not None:
        s.masked_fill_(~b.allowed, float("-inf"))
    return s


def _spread(p: Tensor, n: int) -> Tensor:
    """``(B, H, c, W)`` -> the ``(B, H, c, n)`` rectangle with ``p`` on its diagonal band."""
    out = p.new_zeros(*p.shape[:-1], n)
    _diag(out, p.shape[-1]).copy_(p)
    return out


def strip_forward(x, strip, tables: StripTables, *, scale, geom, pad, kpm_padded, keep: bool, rk=None):
    """``(out (B, H, c, Dh), lse (B, H, c), p or None)`` of one strip block, float32.

    ``rk``: :func:`key_logits` of the call."""
    b = _block(x, strip, geom, pad, kpm_padded)
    s = _scores(b, tables, scale, strip.width, rk)
    lse = torch.logsumexp(s, dim=-1)
    p = s.sub_(safe_lse(lse).unsqueeze(-1)).exp_()
    out = _spread(p, b.k.shape[-2]) @ b.v
    if tables.rel_v is not None:
        out += p @ tables.rel_v.float()
    return out, lse, (p if keep else None)


def _sum_to(g: Tensor, like: Tensor) -> Tensor:
    """Sum a ``(B, H, ...)`` gradient down to a ``(H|1, ...)`` table's shape."""
    g = g.sum(0)
    return g.sum(0, keepdim=True) if like.shape[0] == 1 else g


def strip_backward(
    x, strip, tables: StripTables, grads, *, do, lse, delta_rows, scale, geom, pad, kpm_padded, p, own_lse, rk, d_rk
):
    """Add one strip block's gradients into ``grads`` (``k``/``v`` buffers are the padded ones);
    the key-side term's gradient goes into ``d_rk`` (the shape of :func:`key_logits`)."""
    b = _block(x, strip, geom, pad, kpm_padded)
    W, n = strip.width, b.k.shape[-2]
    rows, keys = slice(strip.r0, strip.r1), slice(b.k0, b.k0 + n)
    if p is None:
        p = _scores(b, tables, scale, W, rk).sub_(safe_lse(lse).unsqueeze(-1)).exp_()
    else:  # renormalise the strip's own softmax to the whole row's
        p = p * torch.exp(own_lse - safe_lse(lse)).nan_to_num_(0.0).unsqueeze(-1)
    do = do.float()
    dp = _diag(do @ b.v.transpose(-1, -2), W).contiguous()
    if tables.rel_v is not None:
        dp.add_(do @ tables.rel_v.float().transpose(-1, -2))
        if grads["rel_v"] is not None:
            grads["rel_v"] += _sum_to(p.transpose(-1, -2) @ do, tables.rel_v)
    if grads["v"] is not None:
        grads["v"][:, :, keys] += _spread(p, n).transpose(-1, -2) @ do
    ds = p.mul_(dp.sub_(delta_rows.unsqueeze(-1)))  # dS = P ∘ (dP - D)
    if grads["bias"] is not None:
        grads["bias"] += ds.sum((0, 2))
    ds.mul_(scale)
    rect = _spread(ds, n)
    if grads["q"] is not None:
        grads["q"][:, :, rows] += rect @ b.k
    if grads["k"] is not None:
        grads["k"][:, :, keys] += rect.transpose(-1, -2) @ b.q
    if tables.rel_k is not None:
        key = "q" if x[3] is None else "q_rel"
        if grads[key] is not None:
            grads[key][:, :, rows] += ds @ tables.rel_k.float()
        if grads["rel_k"] is not None:
            grads["rel_k"] += _sum_to(ds.transpose(-1, -2) @ b.q_rel, tables.rel_k)
    if d_rk is not None:
        _diag_keys(d_rk[:, :, keys], ds.shape[-2]).add_(ds)


def key_logits_backward(d_rk: Tensor, k_padded: Tensor, tables: StripTables, grads) -> None:
    """Gradients of :func:`key_logits` into ``grads["k"]`` (padded) and ``grads["rel_q"]``."""
    if grads["k"] is not None:
        grads["k"] += d_rk @ tables.rel_q.float()
    if grads["rel_q"] is not None:
        grads["rel_q"] += _sum_to(d_rk.transpose(-1, -2) @ k_padded.float(), tables.rel_q)
