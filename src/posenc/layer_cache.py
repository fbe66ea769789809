"""The empty KV cache of one attention layer, chosen by its mask and cache policy."""

from __future__ import annotations

from .base import PositionEncoding, Stage
from .cache import KVCache, SinkWindow, WindowKVCache

__all__ = ["layer_cache"]


def layer_cache(
    enc: PositionEncoding, batch_size: int, max_len: int, heads: int, head_dim: int, *,
    window: int | None, chunk: int | None, causal: bool, policy=None, dtype=None, device=None,
) -> KVCache:  # fmt: skip
    """The empty cache of one attention layer (:meth:`posenc.Attention.init_cache`): a rolling
    :class:`WindowKVCache` for a causal layer with a ``window``/``chunk``, StreamingLLM's
    with ``policy=SinkWindow(...)``, else a :class:`KVCache` of ``max_len`` tokens."""
    kw = {"dtype": dtype, "device": device}
    if policy is not None:
        if not isinstance(policy, SinkWindow):
            raise TypeError(f"policy must be a posenc.SinkWindow or None, got {type(policy).__name__}")
        if window is not None or chunk is not None or not causal:
            raise ValueError("a SinkWindow cache is for causal layers without their own window or chunk")
        if enc.stages & Stage.INPUT or enc.needs.axes != 1:
            raise ValueError(
                f"encoding {enc.name!r} cannot have its positions re-assigned in the cache "
                "(an input stage or several axes); SinkWindow needs q/k, score or bias stages"
            )
        keep = {"keep_first": policy.sinks, "keep_last": policy.window - 1, "policy": policy}
        return WindowKVCache(batch_size, heads, head_dim, **keep, **kw)
    span = [n for n in (window, chunk) if n is not None]
    if span and causal and enc.needs.axes == 1:
        return WindowKVCache(batch_size, heads, head_dim, keep_last=min(span) - 1, **kw)
    return KVCache(batch_size, max_len, heads, head_dim, axes=enc.needs.axes, **kw)
