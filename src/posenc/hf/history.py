"""Multimodal positions of the tokens an HF cache holds (Qwen2-VL / Qwen3-VL under ``generate``).

The adapter rotates keys in the attention function, so the cache holds them unrotated and every
decoding step rotates the cached keys again at their positions. For 1-D positions those run
contiguously up to the first new token (:meth:`posenc.hf.attention.PosencMask.positions`);
M-RoPE's ``(t, h, w)`` rows do not (an image's patches share ``t`` and spread over ``h``/``w``).
A :class:`PositionHistory` hooks the language model: before a forward it hands the rotary
stand-in the positions of every token the call's cache already holds (``RotaryOff.past``,
``(A, B, c)``); after it, it appends the call's own. A cache it has not followed from empty
(or that was cropped or reordered: beam search) gets no history, and the contiguous rule applies.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

__all__ = ["PositionHistory"]


def cache_of(args: tuple, kwargs: dict):
    """The HF ``Cache`` among a module call's arguments (its ``cache`` keyword first), or None."""
    from transformers.cache_utils import Cache

    cache = kwargs.get("cache")
    if isinstance(cache, Cache):
        return cache
    for a in (*args, *kwargs.values()):
        if isinstance(a, Cache):
            return a
    return None


class PositionHistory:
    """The ``(A, B, tokens)`` position ids seen by each cache, kept for ``rotary`` (a ``RotaryOff``)."""

    def __init__(self, rotary: nn.Module) -> None:
        self.rotary = rotary
        self.by_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._call: tuple | None = None  # (cache, tokens it held before this forward)

    def attach(self, base: nn.Module) -> list:
        """Hook ``base`` (the language model); returns the hook handles."""
        return [
            base.register_forward_pre_hook(self._before, with_kwargs=True),
            base.register_forward_hook(self._after, with_kwargs=True),
        ]

    def _before(self, module, args, kwargs) -> None:
        self.rotary.past = None
        cache = cache_of(args, kwargs)
        self._call = None if cache is None else (cache, cache.get_seq_length())
        if self._call is not None and self._call[1]:
            past = self.by_cache.get(cache)
            if past is not None and past.shape[-1] == self._call[1]:
                self.rotary.past = past

    def _after(self, module, args, kwargs, output) -> None:
        call, self._call = self._call, None
        past, self.rotary.past = self.rotary.past, None
        if call is None:
            return
        cache, seen = call
        new = self.rotary.positions
        if new is None or (seen and past is None):
            self.by_cache.pop(cache, None)
        else:
            self.by_cache[cache] = new if not seen else torch.cat((past, new), dim=-1)
