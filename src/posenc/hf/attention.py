"""posenc as a Hugging Face attention implementation: ``attn_implementation="posenc"``.

Two functions are registered under the name ``"posenc"``:

* :func:`mask_interface` with ``AttentionMaskInterface``. Without a mask function for
  its name, HF's ``create_causal_mask`` returns ``None`` for an unknown implementation
  and the causal mask is silently dropped. This one returns a :class:`PosencMask`
  instead of a tensor: what HF knows about the call (query offset into the cache, key
  length, the 2-D padding mask), which every layer receives unchanged.
* :func:`attention_forward` with ``AttentionInterface``. Each layer calls it with
  ``q, k, v`` projected (and, in a converted model, not rotated: the model's own rotary
  embedding is switched to the identity), the :class:`PosencMask`, and ``position_ids``.
  It runs the layer's posenc encoding: ``rotate`` on queries and keys, then a posenc
  backend for the score and value stages.

What the attention interface does not carry, and how it is rebuilt here:

* **Key positions.** HF passes the positions of the new tokens only. Keys in the cache
  are taken to run contiguously up to the first new token, ``k_pos = q_pos[0] - c + j``
  for cached key ``j`` of ``c`` (clamped at 0 for left padding, which is masked). This is
  how HF's ``generate`` numbers tokens, with or without left padding.
* **Packed documents.** HF's mask function arrives as an opaque closure. Documents are
  found the way HF finds them: from ``cu_seq_lens_q`` when the collator returns
  flash-attention kwargs, else where ``position_ids`` restart
  (``masking_utils.find_packed_sequence_indices``), whenever no token is cached and
  nothing is padded. Each document then attends only within itself (posenc's
  ``AttentionMask.documents``, honoured by every backend).
* **Rotated keys in the cache.** The model's cache stores keys before posenc's rotation,
  so each decoding step rotates all cached keys at their positions again (as posenc's own
  ``cache_raw_keys`` encodings do): ``O(L·Dh)`` more per layer and step, exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import (
    AttentionMaskInterface,
    bidirectional_mask_function,
    causal_mask_function,
    find_packed_sequence_indices,
    prepare_padding_mask,
)

from .. import functional as PF
from ..backends import attend
from ..base import PositionEncoding, Stage
from ..context import Context
from ..mask import AttentionMask

__all__ = ["NAME", "PosencMask", "attention_forward", "mask_interface", "register", "layer_encoding"]

NAME = "posenc"


@dataclass(eq=False)
class PosencMask:
    """The mask of one forward call (of one layer type), as HF's mask machinery describes it.

    Shapes: ``padding`` ``(B, Lk)`` bool, True = a real token, or None when nothing is
    padded. ``q_offset`` tokens came before the ``q_length`` new ones; the layer's cache
    holds ``kv_length`` key slots, slot ``s`` holding token ``kv_offset + s`` (a sliding-window
    cache drops the first ``kv_offset`` tokens; a static cache holds more slots than tokens:
    the unused ones lie in the causal future and are never seen). ``window``: HF's sliding
    window in posenc's terms (:class:`posenc.AttentionMask`: ``W`` keys up to the query
    included, causal; ``|i - j| < W`` bidirectional); None: none.
    """

    batch_size: int
    q_length: int
    kv_length: int
    q_offset: int
    padding: Tensor | None
    causal: bool = True
    kv_offset: int = 0
    window: int | None = None
    _memo: dict = field(default_factory=dict, repr=False)

    # HF's generate and create_causal_mask treat a prepared mask like a 4-D tensor
    ndim = 4

    def contiguous(self) -> PosencMask:
        return self

    @property
    def cached(self) -> int:
        """Key slots before the first query (cached keys this layer still holds)."""
        return self.q_offset - self.kv_offset

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
        Lq, c = self.q_length, self.cached
        if axes is not None:
            q_pos = PF.check_positions(axes.permute(1, 2, 0), Lq, name="position_ids", batch=batch, axes=axes.shape[0])
        elif position_ids is None:
            q_pos = PF.default_positions(Lq, offset=self.q_offset).unsqueeze(0)
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
        if c == 0 and self.kv_length == Lq and self.padding is None:
            # (multimodal positions repeat within an image: only the collator's cu_seq_lens count)
            restarts = q_pos if axes is None and not multimodal else None
            documents = _documents(restarts, batch, kwargs, Lq, q_pos.device)
        out = (q_pos, k_pos, documents)
        self._memo["positions"] = (key, out)
        return out


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
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is not None:
        padding = padding[:, :kv_length].bool()
        if bool(padding.all()):
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
    )


def layer_encoding(module: nn.Module) -> PositionEncoding:
    """The posenc encoding a converted model attached to the attention ``module``."""
    enc = module.__dict__.get("posenc_encoding")
    if enc is None:
        raise ValueError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) has no posenc encoding: "
            "attn_implementation='posenc' needs a model made by posenc.hf.convert or a Posenc* model class"
        )
    return enc


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: PosencMask | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """HF attention function for ``"posenc"``.

    Shapes: ``query`` ``(B, H, Lq, Dh)``; ``key``, ``value`` ``(B, Hkv, Lk, Dh)`` (grouped
    query attention repeats them to ``H``); returns ``((B, Lq, H, Dh), None)`` (no weights).

    The layer's own window/chunk/sinks (``config.posenc_layers``) join HF's mask: the
    narrower of the two windows; HF's learned sinks (gpt-oss's ``s_aux``) or the layer's.

    Raises:
        ValueError: no posenc encoding on ``module``, attention dropout, a prepared 4-D
            tensor mask (posenc builds its masks from positions and padding), or a score
            scale / soft-cap other than the one the encoding was set up with.
    """
    enc = layer_encoding(module)
    if dropout:
        raise ValueError(
            f"posenc backends have no attention dropout; got dropout={dropout} (set it to 0 in the config)"
        )
    own = module.__dict__.get("posenc_layer", {})
    _check_scores(module, own, scaling, kwargs.get("softcap"))
    B, H, Lq, _ = query.shape
    Lk = key.shape[2]
    if attention_mask is None:  # no mask function ran: plain causal over the keys given
        causal = getattr(module, "is_causal", True)
        attention_mask = PosencMask(B, Lq, Lk, q_offset=Lk - Lq if causal else 0, padding=None, causal=causal)
    elif not isinstance(attention_mask, PosencMask):
        raise ValueError(
            f"attn_implementation='posenc' builds its own masks; got a prepared {type(attention_mask).__name__} "
            "(pass a 2-D attention_mask of 1 = token, 0 = padding instead)"
        )
    mask = attention_mask
    # multimodal positions (A, B, Lq), as the model handed them to its rotary embedding (Qwen2-VL)
    # and those of the cached tokens (posenc.hf.history), which need not run contiguously
    axes, past, position_ids, multimodal = None, None, kwargs.get("position_ids"), False
    rotary = module.__dict__.get("posenc_rotary")
    got, held = getattr(rotary, "positions", None), getattr(rotary, "past", None)
    if got is not None and got.shape[-1] == Lq:
        c = mask.cached
        if held is not None and c and held.shape[-1] >= c:
            held = held[..., held.shape[-1] - c :]
        else:
            held = None
        if enc.axes > 1 and got.shape[0] == enc.axes:
            axes, past = got, None if held is None else held.permute(1, 2, 0)
        elif position_ids is None:  # a 1-D encoding in a multimodal model: the temporal row (text: t = h = w)
            position_ids, past, multimodal = got[0], None if held is None else held[0], True
    q_pos, k_pos, documents = mask.positions(position_ids, B, kwargs, axes, past, multimodal)
    ctx = Context(q_pos, k_pos, qk_proj=module.__dict__.get("posenc_qk_proj"))
    if enc.stages & Stage.QK:  # before grouped heads are repeated: one rotation per key head
        query, key = enc.rotate(query, key, q_pos, k_pos, ctx=ctx)
    if enc.rotates_value:
        value = enc.rotate_value(value, k_pos, ctx=ctx)
    if key.shape[1] != H:  # grouped-query attention: kv head g serves query heads g·r .. g·r + r - 1
        key = key.repeat_interleave(H // key.shape[1], dim=1)
        value = value.repeat_interleave(H // value.shape[1], dim=1)
    key, value = key.to(query.dtype), value.to(query.dtype)
    windows = [w for w in (mask.window, own.get("window")) if w is not None]
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = module.__dict__.get("posenc_sinks")
    # packed rows (documents, no cache): each run of equal ids attends only within itself
    amask = AttentionMask(
        causal=mask.causal,
        offset=mask.cached,
        key_padding=mask.padding,
        documents=documents,
        window=min(windows) if windows else None,
        chunk=own.get("chunk"),
        key_start=mask.kv_offset,
    )
    out = attend(enc, query, key, value, q_pos, k_pos, amask, ctx=ctx, sinks=sinks)  # the layer's own attend step
    return out.transpose(1, 2).contiguous(), None


def _check_scores(module: nn.Module, own: dict, scaling, softcap) -> None:
    """The score scale and soft-cap HF passes must be those the encoding was set up with
    (:meth:`posenc.hf.stack.PosencStack.wire` reads them off the module when it converts)."""
    want_scale, want_cap = module.__dict__.get("posenc_scores", (None, None))
    if scaling is not None and want_scale is not None and abs(scaling - want_scale) > 1e-12 * abs(want_scale):
        raise ValueError(
            f"layer {getattr(module, 'layer_idx', '?')} scales scores by {scaling}, but its posenc encoding was "
            f"set up with {want_scale} (the module's scaling changed after conversion: convert again)"
        )
    if (softcap or None) != (want_cap or None):
        raise ValueError(
            f"layer {getattr(module, 'layer_idx', '?')} soft-caps scores at {softcap}, but its posenc encoding was "
            f"set up with {want_cap} (convert again)"
        )


def register() -> None:
    """Register ``"posenc"`` with HF's ``AttentionInterface`` and ``AttentionMaskInterface``.

    Idempotent; :mod:`posenc.hf` calls it on import.
    """
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask_interface)
