"""One forward call, as every layer of it sees it: :class:`Call`.

A model's forward (or a bare :class:`posenc.Attention`) builds one :class:`Call` with
:func:`make_call`, the one place where positions, key padding, packed documents, the KV
cache and the Transformer-XL memory are checked against each other. Every layer then
takes ``(x, call, cache)``::

    call.pos          # (B|1, L[, A]) int64: the positions of the tokens the call adds, checked
    call.batch        # B
    call.past         # tokens before them in every layer's cache (or memory)
    call.key_padding  # (B, past + L) bool, True = a real token, over every key; or None
    call.documents    # (B|1, L) int64: packed sequences (no cache, no memory); or None
    call.tables       # the position tables the layers share (posenc.context.Tables)
    call.mask(...)    # the posenc.AttentionMask of a layer, made once per kind of layer

A layer's cache decides which keys it attends to (:mod:`posenc.layer.cache`: rotated or raw keys,
a rolling window, StreamingLLM's sinks, or Transformer-XL's memory rows followed by the new
ones); the call only says what the tokens of this forward are.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from ..context import Tables
from ..functional import as_positions, check_lengths
from ..mask import AttentionMask
from ..positions import document_positions

__all__ = ["Call", "make_call"]


@dataclass(frozen=True, eq=False)
class Call:
    """One forward call (see the module docstring); build it with :func:`make_call`."""

    pos: Tensor
    batch: int
    past: int = 0
    key_padding: Tensor | None = None
    documents: Tensor | None = None
    tables: Tables = field(default_factory=Tables)
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def length(self) -> int:
        """Tokens the call adds, ``L``."""
        return self.pos.shape[1]

    def mask(self, *, causal: bool, window: int | None, chunk: int | None, k_len: int, cache=None) -> AttentionMask:
        """The :class:`~posenc.AttentionMask` of a layer (``causal``, ``window``, ``chunk``) whose
        queries are these tokens, the last of ``k_len`` keys its ``cache`` returned.

        Layers with the same settings over a cache that drops nothing share one mask object.
        """
        padding, fields = self.key_padding, {}
        if cache is not None:
            fields = cache.mask_fields(k_len)
            if padding is not None:
                padding = cache.select_keys(padding)
        key = (causal, window, chunk, k_len, tuple(sorted(fields.items())))
        shared = cache is None or not cache.selects_keys
        if shared and key in self._masks:
            return self._masks[key]
        given = {"window": window, "chunk": chunk, **fields}  # the cache's own fields win (SinkWindow)
        m = AttentionMask(
            causal=causal, offset=k_len - self.length, key_padding=padding, documents=self.documents, **given
        )
        m.check(self.batch, self.length, k_len)
        if shared:
            self._masks[key] = m
        return m

    def piece(self, start: int, end: int) -> Call:
        """The call of tokens ``start:end`` only (a cache fed in pieces), sharing the tables."""
        padding = None if self.key_padding is None else self.key_padding[:, : self.past + end]
        return replace(self, pos=self.pos[:, start:end], past=self.past + start, key_padding=padding, _masks={})


def make_call(
    batch: int,
    length: int,
    *,
    encodings,
    pos: Tensor | None = None,
    past: int = 0,
    device=None,
    key_padding_mask: Tensor | None = None,
    document_ids: Tensor | None = None,
    cache: bool = False,
    memory: bool = False,
    tables: Tables | None = None,
) -> Call:
    """The :class:`Call` of ``length`` new tokens in ``batch`` rows, ``past`` tokens after the
    start of the stream (a cache's or memory's length; default positions continue from it).

    ``encodings``: those of every layer (positions are checked against each one's limit, and
    read with the first one's ``axes``); ``cache``/``memory``: whether a KV cache or a
    Transformer-XL memory holds the earlier tokens.

    Raises:
        ValueError: a cache and a memory together; ``document_ids`` with either, or not
            ``(L,)``/``(B|1, L)``; ``key_padding_mask`` with a memory, or not bool ``(B, past + L)``;
            bad positions (:func:`posenc.functional.check_positions`) or past an encoding's limit.
        TypeError: non-integer positions or document ids.
    """
    if cache and memory:
        raise ValueError("memory and cache cannot be used together")
    axes = encodings[0].needs.axes if encodings else 1
    if document_ids is not None:
        document_ids = _documents(document_ids, batch, length)
        if cache or memory:
            raise ValueError("document_ids (packed sequences) cannot be used with a cache or memory")
        if pos is None and axes == 1:
            pos = document_positions(document_ids)  # (B|1, L): each document from 0
    if key_padding_mask is not None:
        if memory:
            raise ValueError("key_padding_mask is not supported together with memory")
        kpm = key_padding_mask
        if not isinstance(kpm, Tensor) or kpm.dtype != torch.bool or kpm.dim() != 2 or kpm.shape[0] not in (1, batch):
            raise ValueError(
                f"key_padding_mask must be a bool tensor of shape ({batch}, {past + length}) over every key, got "
                f"{getattr(kpm, 'dtype', type(kpm).__name__)} {tuple(getattr(kpm, 'shape', ()))}"
            )
    pos = as_positions(pos, length, offset=past, device=device, batch=batch, axes=axes)  # (B|1, L[, A])
    check_lengths(encodings, pos)  # once, for every layer
    return Call(pos, batch, past, key_padding_mask, document_ids, Tables() if tables is None else tables)


def _documents(ids, batch: int, length: int) -> Tensor:
    """``document_ids`` as ``(B|1, L)``; ``ValueError``/``TypeError`` naming what is wrong."""
    if not isinstance(ids, Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"document_ids must be an integer tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[-1] != length or ids.shape[0] not in (1, batch):
        raise ValueError(f"document_ids must have shape ({length},) or ({batch}, {length}), got {tuple(ids.shape)}")
    return ids
