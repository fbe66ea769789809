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

* **Positions of a padded call.** Called without ``position_ids`` (as HF models are, outside
  ``generate``), a model numbers the tokens ``0 .. L-1``, pads included, so a left-padded row's
  real tokens sit as many positions on as there are pads before them. Whenever the 2-D mask
  pads something and the positions are those a model makes by itself, the tokens are numbered
  from the mask instead, as ``generate`` numbers them: the real tokens before each, pads at 0
  (:meth:`PosencMask.positions`), cached keys included. Attention and input stages get the same
  positions, so a left-padded row gives its real tokens what the row gives alone (an absolute
  table, a convolution whose zero padding marks where the sequence starts).
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
* **Rotated keys in the cache.** HF's cache update runs before the attention function, on
  keys the model did not rotate. An encoding whose key rotation depends on the key's position
  only rotates the new keys and writes them into the cache's own tensor
  (:mod:`posenc.hf.keys`), so the cache holds rotated keys as a stock model's does and a
  decoding step costs what a stock one does. Other encodings and caches keep raw keys, which
  each call rotates again at their positions (as posenc's own ``needs.raw_keys`` encodings do):
  ``O(L·Dh)`` more per layer and step, exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from ..attend.backends import attend
from ..attend.scores import expand_kv
from ..base import PositionEncoding
from ..context import Context
from ..layer.attention import encode
from ..mask import AttentionMask
from .keys import rotated_rows
from .masks import PosencMask, mask_interface

__all__ = [
    "NAME",
    "LayerRecord",
    "PosencMask",
    "attention_forward",
    "mask_interface",
    "register",
    "layer_encoding",
    "swap_halves",
]

NAME = "posenc"
RECORD = "posenc"  # the attribute of a converted attention module that holds its LayerRecord
PLAIN = "plain"  # ... or this, on a module that attends over no sequence positions (Family.plain)


@dataclass(frozen=True, eq=False)
class LayerRecord:
    """What a converted model keeps on one HF attention module (:meth:`posenc.hf.stack.PosencStack.wire`).

    ``encoding``: the layer's posenc encoding; ``window``/``chunk``: the layer's own mask fields
    (joined with HF's); ``sinks``: posenc's learned sink logits ``(H,)`` (None: HF's own or none);
    ``rotary``: the model's rotary stand-in (multimodal positions); ``hidden``: where the
    encodings that read the hidden state keep their per-cache state; ``qk_proj``: the layer's
    ``(W_Q, W_K)``; ``scores``: HF's ``(scaling, softcap)`` at conversion, which calls must keep;
    ``keeps_rotated``: HF's dynamic caches hold this layer's keys rotated (:mod:`posenc.hf.keys`);
    ``rotary_last``: the width of the rotary part HF puts last in each q/k head (MLA), moved to
    the front before the encoding runs (0: none); ``qk_norms``: the module's q/k norms that run after
    the rotation (HunYuan: ``Family.norms_after``), or None; ``mirrored``: the model's RoPE turns the
    other way (``Family.mirrored``): q's and k's halves are swapped before the encoding runs.
    """

    encoding: PositionEncoding
    window: int | None = None
    chunk: int | None = None
    sinks: Tensor | None = None
    rotary: nn.Module | None = None
    hidden: object = None
    qk_proj: tuple | None = None
    scores: tuple = (None, None)
    keeps_rotated: bool = False
    rotary_last: int = 0
    qk_norms: tuple | None = None
    mirrored: bool = False


def layer_record(module: nn.Module) -> LayerRecord:
    """The :class:`LayerRecord` a converted model attached to the attention ``module``."""
    rec = module.__dict__.get(RECORD)
    if not isinstance(rec, LayerRecord):
        raise ValueError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) has no posenc encoding: "
            "attn_implementation='posenc' needs a model made by posenc.hf.convert or a Posenc* model class"
        )
    return rec


def layer_encoding(module: nn.Module) -> PositionEncoding:
    """The posenc encoding a converted model attached to the attention ``module``."""
    return layer_record(module).encoding


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
        ValueError: no posenc encoding on ``module``, a prepared 4-D tensor mask (posenc builds its masks from positions and padding), or a score
            scale / soft-cap other than the one the encoding was set up with, or a ``position_bias``
            (the model's own relative bias, which a converted model switches off).

    Modules a family marks ``plain`` (attention over layers, not positions) run HF's SDPA.
    """
    if module.__dict__.get(RECORD) == PLAIN:  # (Inkling-2's attention residuals over layers)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout)
    rec = layer_record(module)
    enc = rec.encoding
    _check_scores(module, rec.scores, scaling, kwargs.get("softcap"))
    if kwargs.get("position_bias") is not None:
        raise ValueError(
            f"layer {getattr(module, 'layer_idx', '?')} still computes the model's own position_bias; "
            "a converted model switches it off (Family.off_parts): convert the model again"
        )
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
    rotary = rec.rotary
    got, held = getattr(rotary, "positions", None), getattr(rotary, "past", None)
    if got is not None and got.shape[-1] == Lq + mask.dropped:
        c = mask.cached - mask.dropped
        if held is not None and c and held.shape[-1] >= c:
            held = held[..., held.shape[-1] - c :]
        else:
            held = None
        if enc.needs.axes > 1 and got.shape[0] == enc.needs.axes:
            axes, past = got, None if held is None else held.permute(1, 2, 0)
        elif position_ids is None:  # a 1-D encoding in a multimodal model: the temporal row (text: t = h = w)
            position_ids, past, multimodal = got[0], None if held is None else held[0], True
    q_pos, k_pos, documents = mask.positions(position_ids, B, kwargs, axes, past, multimodal)
    if rec.rotary_last:  # MLA: [nope | rope] -> [rope | nope] in q and k alike (every q·k unchanged)
        query, key = _rotary_first(query, rec.rotary_last), _rotary_first(key, rec.rotary_last)
    if rec.mirrored:  # nanochat: [x1 | x2] -> [x2 | x1] in q and k alike (the cache keeps raw keys: a new tensor)
        query, key = swap_halves(query), swap_halves(key)
    qk_proj = rec.qk_proj
    # the q/k side, written once for posenc's layer and this one; grouped heads stay grouped:
    # attend expands them. HF's cache holds rotated keys (rows: only the new ones are rotated,
    # into the cache's tensor; they sit at the queries' positions) or raw ones (every key is rotated here)
    rows = rotated_rows(module, enc, key, value, k_pos, mask) if rec.keeps_rotated else None
    if enc.defines("read_input"):  # FoX, Inkling: read_input on the module's hidden states (posenc.hf.hidden)
        key, value, q_state, k_state, x = rec.hidden.read(module, enc, key, value, mask, documents)
        ctx = Context(q_pos, k_pos, x=x, q_state=q_state, k_state=k_state, qk_proj=qk_proj, tables=mask.tables)
    else:
        ctx = Context(q_pos, k_pos if rows is None else q_pos, qk_proj=qk_proj, tables=mask.tables)
    if enc.needs.per_head_keys:  # key-side stages with per-head parameters see every query head's keys
        key, value = expand_kv(key, value, H)
    if rows is not None:
        c = rows.cached
        new = (key[:, :, c:], value[:, :, c:])
        query, key, value, q_pos, k_pos, ctx = encode(enc, query, *new, ctx, cache=rows, norms=rec.qk_norms)
        rows.check(query)  # (the rows written and the queries, in one host read on CPU)
    else:
        query, key, value, q_pos, k_pos, ctx = encode(enc, query, key, value, ctx, norms=rec.qk_norms)
    windows = [w for w in (mask.window, rec.window) if w is not None]
    sinks, backend = kwargs.get("s_aux"), "auto"
    per_query = kwargs.get("sinks")  # Inkling-2: one sink logit per query row, (B, H, Lq, 1)
    if sinks is None and isinstance(per_query, Tensor) and per_query.dim() == 4:
        sinks, backend = per_query.squeeze(-1), "eager"  # (the materialising backend takes them)
    if sinks is None:
        sinks = rec.sinks
    # packed rows (documents, no cache): each run of equal ids attends only within itself
    amask = AttentionMask(
        causal=mask.causal,
        offset=mask.cached,
        key_padding=mask.padding,
        documents=documents,
        window=min(windows) if windows else None,
        chunk=rec.chunk,
        key_start=mask.kv_offset,
        checked_keys=0 if rows is None else rows.checked_keys,  # (their check is on the cache)
        checked_queries=rows is not None and rows.checked_queries,
        selected=_selected(kwargs.get("indices"), B, Lq, Lk),
    )
    # the layer's own attend step; HF passes the attention dropout in training and 0 otherwise
    out = attend(enc, query, key, value, q_pos, k_pos, amask, ctx=ctx, sinks=sinks, dropout=dropout, backend=backend)
    if rows is not None:  # NaN in the heads whose cached rows held a NaN or an inf
        out = rows.mark_nonfinite(out)
    return out.transpose(1, 2).contiguous(), None


def _selected(indices, batch: int, q_len: int, k_len: int) -> Tensor | None:
    """DeepSeek Sparse Attention's top-k key slots per query ``(B, Lq, k)`` (HF hands them to any
    attention function but eager and SDPA as ``indices``, flash-MLA's input) as the
    :class:`posenc.AttentionMask` ``selected`` field ``(B, Lq, Lk)`` bool; None without them.

    Raises:
        ValueError: indices of another shape, or a slot outside the ``Lk`` keys.
    """
    if indices is None:
        return None
    if not isinstance(indices, Tensor) or indices.dim() != 3 or indices.shape[:2] not in ((batch, q_len), (1, q_len)):
        raise ValueError(
            f"indices (the keys a sparse-attention indexer selected) must be (B, Lq, k) = ({batch}, {q_len}, k), got "
            f"{getattr(indices, 'dtype', type(indices).__name__)} {tuple(getattr(indices, 'shape', ()))}"
        )
    idx = indices.long()
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= k_len):
        raise ValueError(f"indices select key slots in [{int(idx.min())}, {int(idx.max())}], outside [0, {k_len - 1}]")
    out = torch.zeros(indices.shape[0], q_len, k_len, dtype=torch.bool, device=indices.device)
    return out.scatter_(-1, idx, True)


def swap_halves(x: Tensor) -> Tensor:
    """``x`` ``(..., Dh)`` with its two halves swapped, ``[x1 | x2] -> [x2 | x1]`` (its own inverse)."""
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


def _rotary_first(x: Tensor, width: int) -> Tensor:
    """``x`` ``(B, H, L, Dh)`` with its last ``width`` channels moved to the front."""
    return torch.cat((x[..., -width:], x[..., :-width]), dim=-1)


def _check_scores(module: nn.Module, want: tuple, scaling, softcap) -> None:
    """The score scale and soft-cap HF passes must be those the encoding was set up with
    (:meth:`posenc.hf.stack.PosencStack.wire` reads them off the module when it converts)."""
    want_scale, want_cap = want
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
