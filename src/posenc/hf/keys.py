"""Rotated keys in HF's cache: a converted model decodes at a stock model's cost.

A converted model's rotary embedding is switched off, so HF's attention modules write their
new keys to the cache unrotated, and the attention function receives every key of the layer
(cached and new) before posenc's encoding has seen them. Rotating all of them again at every
decoding step is exact but costs ``O(cached · Dh)`` per layer and step, which grows with the
cache while the weights' cost does not.

For an encoding whose rotation of a key depends only on that key's position
(``needs.raw_keys`` False: RoPE and its static scalings, M-RoPE, proportional RoPE, ...), the
attention function rotates only the new keys and writes them back into the cache's own key
tensor (:class:`RotatedRows`, the cache policy :func:`posenc.layer.attention.encode` writes
through), so HF's cache holds rotated keys as a stock model's does. The cache layer is marked
with the encoding that rotated its keys; a later call rotates only its own keys when the mark
is that encoding's. Crop and reorder (beam search, assisted decoding) keep the mark true: they
move rows, they do not make raw ones.

The backends' rule for non-finite input (a NaN or an infinity in ``q``, ``k`` or ``v`` makes
the head's output NaN: :func:`posenc.kernels.flash.propagate_nonfinite`) would read the whole
cache again at every step; instead each call checks the rows it writes, keeps the result on
the cache layer (per batch row and key head) and adds what earlier calls found to its output,
and the backends read only the new rows (``AttentionMask.checked_keys``). On CPU, where reading
a sum back costs no device sync, rows known finite (:func:`posenc.kernels.flash.known_finite`)
keep the flag ``CLEAN`` and nothing is added. When the layer's tensor is not the one posenc last
wrote (HF reordered the batch for beam search, or cropped it), the call checks every row again
and keeps that. A caller that moves rows to other positions (StreamingLLM's eviction) asks for
raw keys with :func:`keep_raw_keys`.

It applies to HF's dynamic caches (:class:`~transformers.cache_utils.DynamicLayer`,
``DynamicSlidingWindowLayer``), whose update returns the tensor the layer keeps (or a tensor
the kept one is a view of). Any other cache (static, quantized, offloaded layers of other
kinds), a cache filled before conversion, an encoding that needs raw keys (dynamic NTK,
LongRoPE's switch, xPos, PoPE), one that reads the hidden state or rotates values, and a model
whose layers share keys (Gemma 4) keep the exact path: raw keys in the cache, all rotated again.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import Tensor, nn

from ..base import PositionEncoding
from ..kernels.flash import known_finite
from ..layer.cache import CachePolicy
from .history import cache_of

__all__ = ["MARK", "RotatedRows", "capture_cache", "keep_raw_keys", "keeps_rotated", "rotated_rows"]

MARK = "posenc_rotated_by"  # the attribute of an HF cache layer: the encoding whose rotation its keys carry
FLAG = "posenc_nonfinite"  # and (B, Hk, 1, 1) float32: NaN where a row written held a NaN or an inf, or CLEAN
CLEAN = "finite"  # FLAG's value when every row written was known finite (posenc.kernels.flash.known_finite)
WROTE = "posenc_wrote"  # and a weak reference to the key tensor it held after posenc's last write
_CAPTURED = "posenc_cache"
RAW = "posenc_raw_keys"  # the attribute of an HF cache whose keys stay raw (keep_raw_keys)  # the attribute of an attention module: the cache of its current call


def keeps_rotated(enc: PositionEncoding, shares_keys: bool) -> bool:
    """Whether a layer of ``enc`` may keep rotated keys in HF's cache (``shares_keys``: some layer
    of the model reads another layer's cached keys)."""
    return (
        not shares_keys
        and enc.defines("rotate")
        and not enc.needs.raw_keys
        and not enc.needs.per_head_keys
        and not enc.defines("rotate_value")
        and not enc.defines("read_input")
    )


def capture_cache(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of an attention module that keeps rotated keys: the call's cache, for the
    attention function of the same call (HF does not hand it the cache)."""
    cache = cache_of(args, kwargs)
    index, layers = getattr(module, "layer_idx", None), getattr(cache, "layers", None)
    intact = False  # the cache layer holds, before this call's update, the key tensor posenc last wrote
    if layers is not None and index is not None and 0 <= index < len(layers):
        layer = layers[index]
        wrote = layer.__dict__.get(WROTE)
        intact = wrote is not None and wrote() is getattr(layer, "keys", None)
    # (a flag, not the tensor: holding the old keys through HF's update would keep them from being
    # freed before the values' update allocates, a fresh allocation per layer and step)
    module.__dict__[_CAPTURED] = (cache, intact)


def keep_raw_keys(cache):
    """``cache`` (an HF cache, before its first call), set to hold raw keys: every call rotates
    every key again at the positions it is given. For a caller that moves rows to other
    positions between calls (StreamingLLM's eviction with positions inside the cache, as
    ``posenc extend``'s ``sink-window`` runs it), which rotated keys would not follow."""
    if any(layer.__dict__.get(MARK) is not None for layer in getattr(cache, "layers", ())):
        raise ValueError("keep_raw_keys: this cache already holds rotated keys; call it before the cache's first call")
    setattr(cache, RAW, True)
    return cache


@functools.cache
def _dynamic_layers() -> tuple[type, ...]:
    """HF's dynamic cache layer classes (imported on first use: transformers is the adapter's, not posenc's)."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    return DynamicLayer, DynamicSlidingWindowLayer


class RotatedRows(CachePolicy):
    """The cache policy of one call that writes its rotated keys into HF's key tensor.

    ``key``/``value`` ``(B, Hk, c + Lq, Dh)``: what HF's cache update returned (the ``c`` cached
    keys already rotated); ``k_pos`` ``(B|1, c + Lq[, A])``: the positions of every key;
    ``layer``: the HF cache layer that keeps (a view of) ``key``.
    """

    def __init__(self, key: Tensor, value: Tensor, k_pos: Tensor, cached: int, layer, enc: PositionEncoding, intact):
        self.key, self.value, self.k_pos, self.cached, self.layer, self.enc = key, value, k_pos, cached, layer, enc
        # what the checks of the calls that wrote the cached rows found, while the layer holds the
        # tensor posenc wrote (None: nothing cached, or HF moved the rows since: all are checked again)
        self.checked = layer.__dict__.get(FLAG) if cached and intact else None

        self.found: Tensor | str | None = None  # and after check: what every row the layer holds held
        self.queries_finite = False  # check read the queries with the rows, and all were finite
        self.written: Tensor | None = None

    @property
    def checked_keys(self) -> int:
        """Key rows the backends need not check (``AttentionMask.checked_keys``): all, once
        :meth:`check` read the rows :meth:`update` wrote (and, with the layer's tensor moved, every row)."""
        return self.key.shape[2] if self.found is not None else 0

    @property
    def checked_queries(self) -> bool:
        """:meth:`check` read the queries too, and found them finite (``AttentionMask.checked_queries``)."""
        return self.queries_finite

    def mark_nonfinite(self, out: Tensor) -> Tensor:
        """``out`` ``(B, H, Lq, Dh)`` with NaN in the heads whose key head's rows (every row the layer
        holds) held a NaN or an inf, ``+ 0`` elsewhere (bit for bit): what the backends, which read
        only the new rows, leave out; ``out`` as it is before :meth:`check`."""
        flag = self.found
        if flag is None or flag is CLEAN:
            return out
        B, H, Lq, Dh = out.shape
        Hk = flag.shape[1]
        flag = flag.to(out.dtype)
        return out + flag if Hk == H else (out.view(B, Hk, H // Hk, Lq, Dh) + flag[:, :, None]).view(B, H, Lq, Dh)

    def update(self, k: Tensor, v: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Write the new rotated keys ``k`` over the raw ones; returns every key, value and position.
        The layer's check flag is dropped until :meth:`check` reads the rows written."""
        c, key = self.cached, self.key
        if torch.is_grad_enabled() and (key.requires_grad or k.requires_grad):
            # (autograd: a new tensor; the layer keeps its last rows, as HF's update kept them)
            kept = self.layer.keys.shape[2]
            key = torch.cat((key[:, :, :c], k.to(key.dtype)), 2)
            self.key = key
            self.layer.keys = key[:, :, key.shape[2] - kept :]
        else:
            key[:, :, c:] = k
        self.written = k if k.dtype == key.dtype else None  # (the rows just written, in the cache's dtype)
        self.layer.__dict__.pop(FLAG, None)  # (a call that stops before check leaves every row to be checked)
        self.layer.__dict__[WROTE] = weakref.ref(self.layer.keys)
        self.layer.__dict__[MARK] = self.enc
        return key, self.value, self.k_pos

    def check(self, q: Tensor) -> None:
        """Check the rows not checked before (the new ones, or every row) for NaN and infinities,
        with the queries ``q`` after the q/k stage in the same host read when the rows checked before
        were finite (:func:`known_finite`); keep what was found on the layer for the calls to come."""
        c = self.cached
        start = c if self.checked is not None else 0
        k_new = self.written if start == c and self.written is not None else self.key[:, :, start:]
        v_new = self.value[:, :, start:]
        if (self.checked is None or self.checked is CLEAN) and known_finite(q, k_new, v_new):
            found, self.queries_finite = CLEAN, True  # (CPU: every row finite, nothing to add to any output)
        elif (self.checked is None or self.checked is CLEAN) and known_finite(k_new, v_new):
            found = CLEAN  # (a non-finite query: the backends' own rule reads it)
        else:
            with torch.no_grad():
                found = k_new.sum((2, 3), keepdim=True, dtype=torch.float32)
                found += v_new.sum((2, 3), keepdim=True, dtype=torch.float32)
                found.mul_(0.0)  # (B, Hk, 1, 1): NaN where a new row held a NaN or an inf
                if isinstance(self.checked, Tensor):
                    found += self.checked
        self.found = found
        self.layer.__dict__[FLAG] = found

    def update_state(self, state: dict) -> dict:
        return state


def rotated_rows(
    module: nn.Module, enc: PositionEncoding, key: Tensor, value: Tensor, k_pos: Tensor, mask
) -> RotatedRows | None:
    """The :class:`RotatedRows` of ``module``'s call, or None for the exact path (every key raw).

    Raises:
        ValueError: a cache layer whose keys this encoding rotated, in a call that cannot add
            rotated keys to it (rows cut off the call, a layer HF changed in between).
    """
    cache, intact = module.__dict__.pop(_CAPTURED, (None, False))
    index = getattr(module, "layer_idx", None)
    layers = getattr(cache, "layers", None)
    if cache is None or index is None or layers is None or not 0 <= index < len(layers) or cache.__dict__.get(RAW):
        return None
    layer = layers[index]
    if type(layer) not in _dynamic_layers():
        return None
    c, mark = mask.cached, layer.__dict__.get(MARK)
    held = getattr(layer, "keys", None)
    fits = (
        mask.dropped == 0
        and key.shape[2] == c + mask.q_length
        and isinstance(held, Tensor)
        and held.untyped_storage().data_ptr() == key.untyped_storage().data_ptr()
    )
    if c and mark is not None:
        if mark is not enc or not fits:
            raise ValueError(
                f"layer {index}'s cache holds keys rotated by {mark.name!r}, and this call cannot continue it with "
                f"{enc.name!r} (an encoding swapped, or the cache changed, since): start from an empty cache"
            )
        return RotatedRows(key, value, k_pos, c, layer, enc, intact)
    if c or not fits:  # raw keys cached before (a cache filled elsewhere): keep them raw
        return None
    return RotatedRows(key, value, k_pos, 0, layer, enc, False)
