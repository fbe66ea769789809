"""The mask side of ``attn_implementation="posenc"``: :class:`PosencMask` and :func:`mask_interface`.

HF's mask functions (``create_causal_mask``, ``create_sliding_window_causal_mask``,
``create_bidirectional_mask``, ``create_bidirectional_sliding_window_mask``) call
:func:`mask_interface`, registered under ``"posenc"`` with ``AttentionMaskInterface``. It
returns a :class:`PosencMask` rather than a tensor: what HF knows about the call (query and key
offsets into the layer's cache, key length, 2-D padding, the kind of mask and its window),
which every layer of that layer type receives unchanged; the attention function turns it into
a :class:`posenc.AttentionMask` and the positions of queries and keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor
from transformers.masking_utils import (
    bidirectional_mask_function,
    causal_mask_function,
    find_packed_sequence_indices,
    prepare_padding_mask,
)

from .. import functional as PF
from ..context import Tables
from ..mask import AttentionMask

__all__ = ["PosencMask", "mask_interface"]


@dataclass(eq=False)
class PosencMask:
    """The mask of one forward call (of one layer type), as HF's mask machinery describes it.

    Shapes: ``padding`` ``(B, Lk)`` bool, True = a real token, or None when nothing is
    padded. ``q_offset`` tokens came before the ``q_length`` new ones; the layer's cache
    holds ``kv_length`` key slots, slot ``s`` holding token ``kv_offset + s`` (a sliding-window
    cache drops the first ``kv_offset`` tokens; a static cache holds more slots than tokens:
    the unused ones lie in the causal future and are never seen). ``window``: HF's sliding
    window in posenc's terms (:class:`posenc.AttentionMask`: ``W`` keys up to the query
    included, causal; ``|i - j| < W`` bidirectional); None: none. ``dropped``: query rows a
    model cut off the front of the call (``mask[:, :, -n:, :]``: Gemma 4 runs its key/value-sharing
    layers on the last ``logits_to_keep`` rows only); their keys stay. ``numbering`` ``(B, Lk)``
    int64: the position of the token in each key slot as ``generate`` numbers a padded batch (the
    real tokens before it in the 2-D mask, counting those a sliding-window cache dropped; pads
    0), or None when nothing is padded; what :meth:`positions` uses when HF passes no position ids.
    ``device``: where HF builds the call's masks (:meth:`dense`'s tensor).
    """

    batch_size: int
    q_length: int
    kv_length: int
    q_offset: int
    padding: Tensor | None
    causal: bool = True
    kv_offset: int = 0
    window: int | None = None
    dropped: int = 0
    numbering: Tensor | None = None
    device: torch.device | str | None = None
    _memo: dict = field(default_factory=dict, repr=False)

    # HF's generate and create_causal_mask treat a prepared mask like a 4-D tensor
    ndim = 4

    def contiguous(self) -> PosencMask:
        return self

    def __getitem__(self, index) -> PosencMask | Tensor:
        """``mask[:, :, rows, :]`` with ``rows`` a slice keeping the last queries (``slice(-n, None)``):
        a :class:`PosencMask`; ``mask[:, h]`` / ``mask[:, h, :, :]`` with an int head ``h``: the boolean
        mask :meth:`dense` ``[:, h]``, for a module that reads its mask as a tensor outside the
        attention function (the DSA indexer of Mistral Large 4 / DeepSeek-V3.2 masks its scores with it).

        Raises:
            ValueError: any other indexing (posenc's masks are built from positions, not sliced).
        """
        full = slice(None)
        if (
            isinstance(index, tuple)
            and 2 <= len(index) <= 4
            and isinstance(index[1], int)
            and all(i == full for i in index[:1] + index[2:])
        ):
            return self.dense()[index]
        if (
            isinstance(index, tuple)
            and len(index) == 4
            and index[0] == full
            and index[1] == full
            and index[3] == full
            and isinstance(index[2], slice)
            and index[2].stop is None
            and index[2].step in (None, 1)
        ):
            start = range(self.q_length)[index[2]].start if self.q_length else 0
            start = min(start, self.q_length)
            return replace(
                self,
                q_length=self.q_length - start,
                q_offset=self.q_offset + start,
                dropped=self.dropped + start,
                _memo={},
            )
        raise ValueError(f"a PosencMask takes only [:, :, -n:, :] (the last query rows), got {index!r}")

    def dense(self) -> Tensor:
        """``(B, 1, Lq, Lk)`` bool, True = attend: what HF's SDPA mask function builds for this call
        (causality from the cache offset, padded keys, the window), as :class:`posenc.AttentionMask` states it."""
        if "dense" not in self._memo:
            rule = AttentionMask(  # (the call as HF made it: rows a model cut off are cut after)
                causal=self.causal,
                offset=self.cached - self.dropped,
                key_padding=self.padding,
                window=self.window,
                key_start=self.kv_offset,
            )
            device = self.padding.device if self.padding is not None else self.device
            mask = rule.dense(self.q_length + self.dropped, self.kv_length, device)
            if mask is None:
                mask = torch.ones(1, 1, self.q_length + self.dropped, self.kv_length, dtype=torch.bool, device=device)
            self._memo["dense"] = mask.expand(self.batch_size, -1, -1, -1)[:, :, self.dropped :]
        return self._memo["dense"]

    @property
    def cached(self) -> int:
        """Key slots before the first query (cached keys this layer still holds)."""
        return self.q_offset - self.kv_offset

    @property
    def tables(self) -> Tables:
        """The position tables of this call (cos/sin, buckets), shared by every layer that gets this
        mask: HF hands each layer of a forward the same mask, so a table is made once per forward."""
        return self._memo.setdefault("tables", Tables())

    def positions(
        self,
        position_ids: Tensor | None,
        batch: int,
        kwargs: dict,
        axes: Tensor | None = None,
        past: Tensor | None = None,
        multimodal: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(q_pos (B|1, Lq[, A]), k_pos (B|1, Lk[, A]), documents (B, L) or None)``, computed once per call.

        ``axes``: HF's multimodal ``(A, B, Lq)`` position ids (Qwen2-VL's ``(t, h, w)``, read off
        the model's rotary embedding) for an encoding with ``A`` coordinates per position;
        ``past`` ``(B, c[, A])``: the positions of the ``c`` cached keys, when known
        (:mod:`posenc.hf.history`), else they run contiguously up to the first new token.
        ``multimodal``: the positions are a multimodal row (an image's patches repeat ``t``), so
        packed documents come only from the collator's ``cu_seq_lens``, never from restarts.
        Every layer gets the same ``position_ids`` tensor, so the result is memoised on it.
        """
        key = (position_ids, axes, past)
        memo = self._memo.get("positions")
        if memo is not None and all(a is b for a, b in zip(memo[0], key)):
            return memo[1]
        Lq, c = self.q_length + self.dropped, self.cached - self.dropped  # (the call as HF made it)
        if axes is not None:
            q_pos = PF.check_positions(axes.permute(1, 2, 0), Lq, name="position_ids", batch=batch, axes=axes.shape[0])
        elif self.numbering is not None and past is None and not multimodal and self._unnumbered(position_ids, Lq):
            # a padded call without position ids: number the tokens from the mask, cached ones too
            q_pos, past = self.numbering[:, c : c + Lq], self.numbering[:, :c]
        elif position_ids is None:
            q_pos = PF.default_positions(Lq, offset=self.q_offset - self.dropped).unsqueeze(0)
        else:
            q_pos = PF.check_positions(position_ids, Lq, name="position_ids", batch=batch)
        q_pos = q_pos.to(self.padding.device if self.padding is not None else q_pos.device)
        k_pos = q_pos
        steps = torch.arange(c, device=q_pos.device)
        if c:  # cached keys: as recorded, or contiguous up to the first new token (on every axis)
            if past is None:
                past = (q_pos[:, :1] - c + (steps if q_pos.dim() == 2 else steps[:, None])).clamp(min=0)
            k_pos = torch.cat((past.to(q_pos), q_pos), dim=1)
        if self.kv_length > k_pos.shape[1]:  # static cache: free slots, all in the causal future
            extra = torch.arange(1, self.kv_length - k_pos.shape[1] + 1, device=k_pos.device)
            k_pos = torch.cat((k_pos, k_pos[:, -1:] + (extra if k_pos.dim() == 2 else extra[:, None])), dim=1)
        documents = None
        if self.dropped:  # the rows kept; their keys are the whole call's
            q_pos = q_pos[:, self.dropped :]
        elif c == 0 and self.kv_length == Lq and self.padding is None:
            # (multimodal positions repeat within an image: only the collator's cu_seq_lens count)
            restarts = q_pos if axes is None and not multimodal else None
            documents = _documents(restarts, batch, kwargs, Lq, q_pos.device)
        out = (q_pos, k_pos, documents)
        self._memo["positions"] = (key, out)
        return out

    def _unnumbered(self, position_ids: Tensor | None, length: int) -> bool:
        """Whether ``position_ids`` are what an HF model makes when it is given none: None (a layer
        not handed them), or ``arange(L) + cached`` as one row (Llama, GPT-2, Qwen, Gemma, ...).

        Those count the pads of a left-padded row as tokens, which moves its real tokens by the
        pads before them; :attr:`numbering` counts real tokens only, as ``generate`` does. Other
        position ids are the caller's and are kept.
        """
        if position_ids is None:
            return True
        if position_ids.dim() != 2 or position_ids.shape != (1, length) or position_ids.is_floating_point():
            return False
        start = self.q_offset - self.dropped
        return torch.equal(position_ids[0], torch.arange(start, start + length, device=position_ids.device))


def _documents(q_pos: Tensor | None, batch: int, kwargs: dict, length: int, device) -> Tensor | None:
    """Document index of every token ``(B, L)`` int64, or None for one document per row."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None and batch == 1:
        cu = torch.as_tensor(cu, device=device).long()
        if cu.numel() <= 2:
            return None
        # token t lies in document d when cu[d] <= t < cu[d + 1]
        return torch.bucketize(torch.arange(length, device=device), cu[1:-1], right=True)[None]
    if q_pos is None:
        return None
    return find_packed_sequence_indices(q_pos.expand(batch, -1))


def _mask_parts(fn, depth: int = 0) -> set[str]:
    """Qualified names of the functions HF composed into the mask function ``fn``
    (``and_masks``/``or_masks`` keep their parts in closure cells)."""
    out = {getattr(fn, "__qualname__", "")}
    if depth < 6:
        for cell in getattr(fn, "__closure__", None) or ():
            items = cell.cell_contents
            for item in items if isinstance(items, (tuple, list)) else (items,):
                if callable(item) and hasattr(item, "__qualname__"):
                    out |= _mask_parts(item, depth + 1)
    return out


def mask_interface(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: Tensor | None = None,
    local_size: int | None = None,
    **kwargs,
) -> PosencMask:
    """HF mask function for ``"posenc"``: a :class:`PosencMask` rather than a tensor.

    Takes HF's causal and bidirectional masks, with or without its sliding window
    (``create_sliding_window_causal_mask``: ``kv > q - W``, posenc's ``window=W``;
    ``create_bidirectional_sliding_window_mask``: ``|q - kv| <= W`` inclusive, posenc's
    ``window=W+1``, since posenc's bidirectional window is ``|i - j| < W``), padding, packed
    documents, and the key offset of HF's sliding-window caches.

    Raises:
        ValueError: another mask pattern (chunked attention, a model's own
            ``or_mask_function``/``and_mask_function``).
    """
    if isinstance(attention_mask, PosencMask):  # already prepared (generate with a static cache)
        return attention_mask
    parts = _mask_parts(mask_function)
    if mask_function is not causal_mask_function and kwargs.get("use_vmap"):
        # HF composes packed-document masks without vmap; a vmap'd mask means the model added
        # its own or/and mask function, which posenc cannot see into
        raise ValueError(
            "this model adds its own mask pattern (or_mask_function/and_mask_function), which posenc's HF adapter "
            "does not run; supported: causal and bidirectional masks, sliding windows, padding, packed documents"
        )
    if any(p.startswith("chunked_overlay") for p in parts):
        raise ValueError(
            f"posenc's HF adapter does not run HF's chunked masks (local_size={local_size}); give the layers "
            "posenc chunks instead (encoding='irope' or LayerSpec(chunk=...))"
        )
    causal = mask_function is not bidirectional_mask_function and not any(
        p.startswith(("bidirectional_mask_function", "sliding_window_bidirectional")) for p in parts
    )
    window = None
    if any(p.startswith("sliding_window_bidirectional_overlay") for p in parts):
        window = int(local_size) + 1  # |i - j| <= W in HF is |i - j| < W + 1 in posenc
    elif any(p.startswith("sliding_window_overlay") for p in parts):
        window = int(local_size)  # kv > q - W: the same W keys as posenc's window
    padding, numbering = prepare_padding_mask(attention_mask, kv_length, kv_offset), None
    if padding is not None:
        # HF's 2-D mask has a column per token from the first; key slot s holds token kv_offset + s
        # (a sliding-window cache dropped the first kv_offset)
        full = padding[:, : kv_offset + kv_length].bool()
        if bool(full.all()):
            padding = None
        else:
            padding = full[:, kv_offset:]
            numbering = (full.long().cumsum(-1) - 1).masked_fill(~full, 0)[:, kv_offset:]
            if bool(padding.all()):  # (the pads left the window; the numbering still counts from them)
                padding = None
    return PosencMask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=int(q_offset),
        padding=padding,
        causal=causal,
        kv_offset=int(kv_offset),
        window=window,
        numbering=numbering,
        device=kwargs.get("device"),
    )
