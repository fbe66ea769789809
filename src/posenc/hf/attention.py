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
    """The mask of one forward call, as HF's mask machinery describes it.

    Shapes: ``padding`` ``(B, Lk)`` bool, True = a real token, or None when nothing is
    padded. ``q_offset`` tokens are cached before the ``q_length`` new ones; the cache
    holds ``kv_length`` key slots (a static cache holds more slots than tokens: the
    unused ones lie in the causal future and are never seen).
    """

    batch_size: int
    q_length: int
    kv_length: int
    q_offset: int
    padding: Tensor | None
    causal: bool = True
    _memo: dict = field(default_factory=dict, repr=False)

    # HF's generate and create_causal_mask treat a prepared mask like a 4-D tensor
    ndim = 4

    def contiguous(self) -> PosencMask:
        return self

    def positions(self, position_ids: Tensor | None, batch: int, kwargs: dict) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(q_pos (B|1, Lq), k_pos (B|1, Lk), documents (B, L) or None)``, computed once per call.

        Every layer gets the same ``position_ids`` tensor, so the result is memoised on it.
        """
        memo = self._memo.get("positions")
        if memo is not None and memo[0] is position_ids:
            return memo[1]
        Lq, c = self.q_length, self.q_offset
        if position_ids is None:
            q_pos = PF.default_positions(Lq, offset=c).unsqueeze(0)
        else:
            q_pos = PF.check_positions(position_ids, Lq, name="position_ids", batch=batch)
        q_pos = q_pos.to(self.padding.device if self.padding is not None else q_pos.device)
        k_pos = q_pos
        if c:  # cached keys run contiguously up to the first new token
            past = (q_pos[:, :1] - c + torch.arange(c, device=q_pos.device)).clamp(min=0)
            k_pos = torch.cat((past, q_pos), dim=1)
        if self.kv_length > k_pos.shape[1]:  # static cache: free slots, all in the causal future
            extra = self.kv_length - k_pos.shape[1]
            k_pos = torch.cat((k_pos, k_pos[:, -1:] + torch.arange(1, extra + 1, device=k_pos.device)), dim=1)
        documents = None
        if c == 0 and self.kv_length == Lq and self.padding is None:
            documents = _documents(q_pos, batch, kwargs)
        out = (q_pos, k_pos, documents)
        self._memo["positions"] = (position_ids, out)
        return out


def _documents(q_pos: Tensor, batch: int, kwargs: dict) -> Tensor | None:
    """Document index of every token ``(B, L)`` int64, or None for one document per row."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None and batch == 1:
        cu = torch.as_tensor(cu, device=q_pos.device).long()
        if cu.numel() <= 2:
            return None
        # token t lies in document d when cu[d] <= t < cu[d + 1]
        return torch.bucketize(torch.arange(q_pos.shape[-1], device=q_pos.device), cu[1:-1], right=True)[None]
    return find_packed_sequence_indices(q_pos.expand(batch, -1))


def mask_interface(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: Tensor | None = None,
    **kwargs,
) -> PosencMask:
    """HF mask function for ``"posenc"``: a :class:`PosencMask` rather than a tensor.

    Raises:
        ValueError: a mask pattern other than causal (with padding or packed documents),
            e.g. a sliding window or a model's extra ``or_mask_function``.
    """
    if isinstance(attention_mask, PosencMask):  # already prepared (generate with a static cache)
        return attention_mask
    if mask_function is bidirectional_mask_function:
        raise ValueError("posenc's HF adapter runs causal language models; got a bidirectional mask")
    if mask_function is not causal_mask_function and kwargs.get("use_vmap"):
        # HF composes packed-document masks without vmap; a vmap'd mask means the model added
        # its own or/and mask function, which posenc cannot see into
        raise ValueError(
            "this model adds its own mask pattern (or_mask_function/and_mask_function), which posenc's HF adapter "
            "does not run; supported: causal masks with padding and packed documents"
        )
    if kwargs.get("local_size") is not None:
        raise ValueError(
            f"posenc's HF adapter does not run sliding-window or chunked masks (local_size={kwargs['local_size']})"
        )
    if kv_offset:
        raise ValueError(f"posenc's HF adapter needs kv_offset=0 (no sliding-window caches), got {kv_offset}")
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is not None:
        padding = padding[:, :kv_length].bool()
        if bool(padding.all()):
            padding = None
    return PosencMask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=int(q_offset), padding=padding
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

    Raises:
        ValueError: no posenc encoding on ``module``, attention dropout, or a prepared 4-D
            tensor mask (posenc builds its masks from positions and padding).
    """
    enc = layer_encoding(module)
    if dropout:
        raise ValueError(
            f"posenc backends have no attention dropout; got dropout={dropout} (set it to 0 in the config)"
        )
    B, H, Lq, _ = query.shape
    Lk = key.shape[2]
    if attention_mask is None:  # no mask function ran: plain causal over the keys given
        attention_mask = PosencMask(batch_size=B, q_length=Lq, kv_length=Lk, q_offset=Lk - Lq, padding=None)
    elif not isinstance(attention_mask, PosencMask):
        raise ValueError(
            f"attn_implementation='posenc' builds its own masks; got a prepared {type(attention_mask).__name__} "
            "(pass a 2-D attention_mask of 1 = token, 0 = padding instead)"
        )
    mask = attention_mask
    q_pos, k_pos, documents = mask.positions(kwargs.get("position_ids"), B, kwargs)
    ctx = Context(q_pos, k_pos, qk_proj=module.__dict__.get("posenc_qk_proj"))
    if enc.stages & Stage.QK:  # before grouped heads are repeated: one rotation per key head
        query, key = enc.rotate(query, key, q_pos, k_pos, ctx=ctx)
    if enc.rotates_value:
        value = enc.rotate_value(value, k_pos, ctx=ctx)
    if key.shape[1] != H:  # grouped-query attention: kv head g serves query heads g·r .. g·r + r - 1
        key = key.repeat_interleave(H // key.shape[1], dim=1)
        value = value.repeat_interleave(H // value.shape[1], dim=1)
    key, value = key.to(query.dtype), value.to(query.dtype)
    # packed rows (documents, no cache): each run of equal ids attends only within itself
    amask = AttentionMask(causal=mask.causal, offset=mask.q_offset, key_padding=mask.padding, documents=documents)
    out = attend(enc, query, key, value, q_pos, k_pos, amask, ctx=ctx)  # the layer's own attend step
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"posenc"`` with HF's ``AttentionInterface`` and ``AttentionMaskInterface``.

    Idempotent; :mod:`posenc.hf` calls it on import.
    """
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask_interface)
