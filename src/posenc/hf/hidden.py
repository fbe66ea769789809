"""Encodings that read the layer's hidden state (``read_input``: FoX, Inkling) inside HF models.

HF's attention function gets the projected ``q, k, v``, not the hidden state, and HF's cache
holds the raw keys and values. So:

* a forward pre-hook on the attention module (:func:`capture`) keeps the module's input
  ``hidden_states`` and the call's cache for the attention function of the same call;
* :meth:`HiddenReads.read` runs the encoding's ``read_input`` on the rows this call adds, as
  posenc's own :class:`posenc.Attention` does: on the new keys/values and rows, continuing the
  encoding's ``carry`` of the same cache. Keys/values the encoding transforms (Inkling's
  short convolutions) and its per-key state (FoX's cumulative forget gate) are kept per cache
  and layer here, beside HF's cache, for the keys HF's cache still holds (a sliding-window
  layer drops the oldest; so are they here).

A cache this module did not follow from empty, or one cropped or reordered (beam search,
assisted decoding), is refused; so are static caches and key/value-sharing layers.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..base import PositionEncoding
from .history import cache_of

__all__ = ["HiddenReads", "capture"]


def capture(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of an attention module: keep its hidden states and cache for this call."""
    x = args[0] if args else kwargs.get("hidden_states")
    cache = cache_of(args, kwargs)
    module.__dict__["posenc_input"] = (x, cache)


@dataclass
class _Entry:
    k: Tensor  # (B, Hk, n, Dh): the keys HF's cache holds for this layer, as the encoding gave them
    v: Tensor
    state: dict
    carry: object
    seen: int  # tokens this layer has seen on the cache


class HiddenReads:
    """Per cache and layer, what ``read_input`` gave the keys HF's cache holds."""

    def __init__(self) -> None:
        self.by_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def read(self, module: nn.Module, enc: PositionEncoding, key: Tensor, value: Tensor, mask, documents):
        """``(key, value, q_state, k_state, x)`` for the attention function of ``module``'s call.

        Shapes: ``key``/``value`` ``(B, Hk, Lk, Dh)`` as HF passes them (raw; cached ones first).

        Raises:
            ValueError: no captured input, a static cache, a key/value-sharing layer, rows cut off
                the call, or a cache whose tokens this layer did not see (cropped, reordered).
        """
        got = module.__dict__.pop("posenc_input", None)
        name = enc.name
        if got is None or got[0] is None:
            raise ValueError(f"encoding {name!r} reads the layer's hidden state, which this call did not capture")
        x, cache = got
        Lq, c = x.shape[1], mask.cached
        layer = getattr(module, "layer_idx", id(module))
        if mask.dropped or getattr(module, "is_kv_shared_layer", False):
            raise ValueError(f"encoding {name!r} needs the layer's own keys for its rows (layer {layer} shares them)")
        if key.shape[2] != c + Lq:
            raise ValueError(
                f"encoding {name!r} reads the hidden state of every key: it runs with HF's dynamic caches, not "
                f"static ones (got {key.shape[2]} key slots for {c} cached + {Lq} new tokens)"
            )
        keep = None if mask.padding is None else mask.padding[:, c:]
        k_new, v_new = key[:, :, c:], value[:, :, c:]
        if enc.needs.per_head_keys and k_new.shape[1] != enc.heads:  # per-head key-side parameters
            r = enc.heads // k_new.shape[1]
            k_new, v_new = k_new.repeat_interleave(r, 1), v_new.repeat_interleave(r, 1)
        per_layer = None if cache is None else self.by_cache.setdefault(cache, {})
        entry = None if per_layer is None or mask.q_offset == 0 else per_layer.get(layer)
        if per_layer is not None and mask.q_offset and (entry is None or entry.seen != mask.q_offset):
            raise ValueError(
                f"encoding {name!r} saw {0 if entry is None else entry.seen} tokens of this cache but it holds "
                f"{mask.q_offset}: caches that are cropped or reordered (beam search, assisted decoding), or "
                "filled before conversion, are not supported with it"
            )
        if c and entry is None:  # (no cache object: the keys before these rows are not HF's)
            raise ValueError(f"encoding {name!r} needs HF's cache object for cached keys")
        read = enc.read_input(x, k_new, v_new, None if entry is None else entry.carry, keep=keep, documents=documents)
        k, v, state = read.k, read.v, dict(read.state)
        if entry is not None:  # the cached keys HF still holds are the last c this layer saw
            k = torch.cat((entry.k[:, :, entry.k.shape[2] - c :].to(k.dtype), k), 2)
            v = torch.cat((entry.v[:, :, entry.v.shape[2] - c :].to(v.dtype), v), 2)
            state = {
                n: torch.cat((entry.state[n][:, :, entry.state[n].shape[2] - c :], t), 2) for n, t in state.items()
            }
        if per_layer is not None:
            per_layer[layer] = _Entry(
                k.detach(), v.detach(), {n: t.detach() for n, t in state.items()}, read.carry, mask.q_offset + Lq
            )
        q_state = {n: t[:, :, t.shape[2] - Lq :] for n, t in state.items()}
        return k, v, q_state, state, x
