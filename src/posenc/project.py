"""The step between the projections and a backend, written once: :func:`encode` and :class:`Projection`.

Both posenc's layer (:meth:`posenc.Attention.project`) and the Hugging Face adapter
(:func:`posenc.hf.attention.attention_forward`) run it on their projected ``q, k, v``::

    q, k, v, ctx = encode(enc, q, k, v, q_pos, k_pos, ctx, norms=..., cache=..., new_pos=...)

It runs the encoding's key/value side (``rotate_value``), the q/k stage (``rotate``) and a
q/k norm placed after it, and, with a posenc KV cache, writes the keys where the cache
wants them: after the q/k stage (the cache then returns every rotated key), or before it
(an encoding whose keys depend on the whole call, ``cache_raw_keys``, or a cache that counts
positions inside itself): every cached key is then rotated again. HF's own cache always
holds raw keys, so the adapter passes every key and no cache.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from torch import Tensor, nn

from .base import PositionEncoding
from .context import Context

__all__ = ["Projection", "encode"]


class Projection(NamedTuple):
    """What :meth:`posenc.Attention.project` returns: the inputs of a backend.

    ``q`` ``(B, H, Lq, Dh)``, ``k``/``v`` ``(B, Hk, Lk, Dh)`` after the q/k stage (with a cache:
    every cached key; ``Hk``: the layer's ``key_heads``, grouped k/v that the backends
    expand), ``q_pos`` ``(B|1, Lq)``, ``k_pos`` ``(B|1, Lk)`` int64, ``ctx`` the call's
    :class:`~posenc.Context` (what the score side may read). A backend takes
    ``BACKENDS[name](enc, *p[:5], mask, ctx=p.ctx)``.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    q_pos: Tensor
    k_pos: Tensor
    ctx: Context


def encode(
    enc: PositionEncoding,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ctx: Context,
    *,
    norms: tuple[nn.Module, nn.Module] | None = None,
    cache=None,
) -> Projection:
    """The encoding's q/k side on projected ``q`` ``(B, H, Lq, Dh)``, ``k``/``v`` ``(B, Hk, Lk, Dh)``
    at ``ctx.q_pos``/``ctx.k_pos``, then the q/k ``norms`` that run after it (None: none).

    ``cache``: the layer's posenc KV cache that stores keys, or None (no cache, a memory, or
    HF's cache, which hands every raw key in ``k``). With one, ``k``/``v``/``ctx.k_state``
    are the new tokens' and the projection holds every key the cache returns.
    """
    if enc.rotates_value:  # values carry their own key position (RoFormer's rotary_value)
        v = enc.rotate_value(v, ctx.k_pos, ctx=ctx)
    if cache is None:
        q, k = _qk(enc, q, k, ctx, norms)
    elif enc.cache_raw_keys or cache.reassigns_positions:  # rotate every cached key again
        L = q.shape[2]
        k, v, k_pos = cache.update(k, v, ctx.k_pos)
        state = cache.update_state(ctx.k_state)
        q_pos = k_pos[:, k_pos.shape[1] - L :] if cache.reassigns_positions else ctx.q_pos  # (SinkWindow)
        ctx = replace(ctx, q_pos=q_pos, k_pos=k_pos, k_state=state)
        q, k = _qk(enc, q, k, ctx, norms)
    else:
        q, k = _qk(enc, q, k, ctx, norms)
        k, v, k_pos = cache.update(k, v, ctx.k_pos)
        ctx = replace(ctx, k_pos=k_pos, k_state=cache.update_state(ctx.k_state))
    return Projection(q, k.to(q.dtype), v.to(q.dtype), ctx.q_pos, ctx.k_pos, ctx)


def _qk(enc: PositionEncoding, q: Tensor, k: Tensor, ctx: Context, norms) -> tuple[Tensor, Tensor]:
    q, k = enc.rotate(q, k, ctx.q_pos, ctx.k_pos, ctx=ctx)  # (the identity without a q/k stage)
    if norms is not None:
        q, k = norms[0](q), norms[1](k)
    return q, k
