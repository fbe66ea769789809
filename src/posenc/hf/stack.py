"""The encodings of a converted Hugging Face model, and where they enter it.

A :class:`PosencStack` sits in the base model (``model.model.posenc`` for Llama,
``model.transformer.posenc`` for GPT-2) and owns one encoding per layer, or one shared by
the layers whose paper shares it (T5's bucket table). It wires them in without touching
anything global:

* each attention module gets a (non-module) reference to its layer's encoding, which
  :func:`posenc.hf.attention.attention_forward` runs;
* the model's own encoding is switched off: Llama's rotary embedding returns the identity
  rotation (``cos = 1``, ``sin = 0``), GPT-2's ``wpe`` returns 0;
* an input-stage encoding of layer ``i`` (``learned``, ``sinusoidal``, ``conv``, ...) runs
  in a forward pre-hook of decoder layer ``i`` on the residual stream (layer 0: the token
  embeddings), one that the paper applies in every layer (FLOATER) on that layer's
  attention input. The hooks read ``position_ids`` from the layer's keyword arguments.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..base import PositionEncoding, Stage, build, get_class
from .attention import PosencMask

__all__ = ["PosencStack", "RotaryOff", "PositionsOff", "Dims"]


@dataclass(frozen=True)
class Dims:
    """What the encodings need to know about the model."""

    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    max_len: int | None


class RotaryOff(nn.Module):
    """Stands in for a Llama rotary embedding: the identity rotation, ``cos = 1``, ``sin = 0``.

    ``q·1 + rotate_half(q)·0`` is ``q`` exactly, so posenc rotates (or not) in the attention
    function instead.
    """

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim

    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        shape = (*position_ids.shape, self.head_dim)  # (B|1, L, Dh)
        return x.new_ones(shape), x.new_zeros(shape)


class PositionsOff(nn.Module):
    """Stands in for GPT-2's ``wpe``: adds nothing.

    Returns a 0-d float32 zero, which adds to embeddings of any float dtype without
    promoting them (and, holding no buffer, needs no initialisation when loaded).
    """

    def forward(self, position_ids: Tensor) -> Tensor:
        return torch.zeros((), device=position_ids.device)


class _ProjectionView:
    """The ``dim``/``q_proj``/``k_proj`` of an HF attention module, for DeBERTa's ``share_att_key``."""

    def __init__(self, dim: int, q_proj, k_proj) -> None:
        self.dim, self.q_proj, self.k_proj = dim, q_proj, k_proj


class _FusedSlice:
    """Columns ``[start, stop)`` of GPT-2's fused ``c_attn`` (a ``Conv1D``: ``x @ W + b``)."""

    def __init__(self, conv: nn.Module, start: int, stop: int) -> None:
        self.conv, self.start, self.stop = conv, start, stop

    def __call__(self, x: Tensor) -> Tensor:
        w, b = self.conv.weight[:, self.start : self.stop], self.conv.bias[self.start : self.stop]
        return x @ w.to(x.dtype) + b.to(x.dtype)


def _find(kind, args: tuple, kwargs: dict):
    for a in (*args, *kwargs.values()):
        if isinstance(a, kind):
            return a
    return None


def build_encoding(spec: dict, dims: Dims) -> PositionEncoding:
    """One encoding for a layer spec ``{"encoding": name, "options": {...}}``.

    Input-stage encodings act on the hidden states: they are built for width ``hidden``.

    Raises:
        ValueError: an unknown name or option, or an encoding that builds the token
            embedding from ids (``complex-order``: the embedding module sees no positions).
    """
    name, options = spec["encoding"], dict(spec.get("options") or {})
    cls = get_class(name)
    if cls.builds_embedding:
        raise ValueError(
            f"encoding {name!r} builds the token embedding from ids and positions together; a Hugging Face "
            "model's embedding sees no positions, so posenc.hf cannot run it"
        )
    heads, head_dim = dims.heads, dims.head_dim
    if cls.stages & Stage.INPUT and heads * head_dim != dims.hidden:
        heads, head_dim = 1, dims.hidden
    return build(name, heads=heads, head_dim=head_dim, max_len=dims.max_len, causal=True, **options)


class PosencStack(nn.Module):
    """The distinct encodings of a converted model and the layer -> encoding map.

    Args:
        layers: one spec ``{"encoding": name, "options": {...}}`` per decoder layer.
        dims: the model's sizes.
        share: one instance for equal specs across layers; None follows each encoding
            (``share_across_layers``), as :class:`posenc.TransformerLM` does.
    """

    def __init__(self, layers: list[dict], dims: Dims, share: bool | None = None) -> None:
        super().__init__()
        self.dims, self.specs = dims, [dict(s) for s in layers]
        self.encodings = nn.ModuleList()
        self.layer_index: list[int] = []
        shared: dict[str, int] = {}
        for spec in layers:
            key = repr((spec["encoding"], sorted((spec.get("options") or {}).items())))
            cls = get_class(spec["encoding"])
            if (cls.share_across_layers if share is None else share) and key in shared:
                self.layer_index.append(shared[key])
                continue
            shared[key] = len(self.encodings)
            self.layer_index.append(len(self.encodings))
            self.encodings.append(build_encoding(spec, dims))
        self._handles: list = []
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> input-stage state

    def encoding(self, layer: int) -> PositionEncoding:
        return self.encodings[self.layer_index[layer]]

    # ------------------------------------------------------------------ wiring
    def unwire(self) -> None:
        """Remove this stack's input-stage hooks (before another stack replaces it)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def wire(self, layers: list[nn.Module], attentions: list[nn.Module], gpt2_fused: bool = False) -> None:
        """Attach each layer's encoding to its attention module and hook the input stages in."""
        self.unwire()
        d = self.dims
        for i, (layer, attn) in enumerate(zip(layers, attentions)):
            enc = self.encoding(i)
            attn.__dict__["posenc_encoding"] = enc  # a reference: the stack owns the module
            if enc.stages & Stage.INPUT:
                target = attn if enc.input_every_layer else layer
                hook = functools.partial(self._input_hook, i)
                self._handles.append(target.register_forward_pre_hook(hook, with_kwargs=True))
            if getattr(enc, "share_att_key", False):
                if d.kv_heads != d.heads:
                    raise ValueError("deberta with share_att_key=True needs as many key heads as query heads")
                if gpt2_fused:
                    D = d.hidden
                    view = _ProjectionView(D, _FusedSlice(attn.c_attn, 0, D), _FusedSlice(attn.c_attn, D, 2 * D))
                else:
                    view = _ProjectionView(d.hidden, attn.q_proj, attn.k_proj)
                enc.__dict__["_layer"] = None
                enc.attach(view)

    def _input_hook(self, layer: int, module: nn.Module, args: tuple, kwargs: dict):
        """Forward pre-hook: run layer ``layer``'s input stage on the hidden states it receives."""
        from transformers.cache_utils import Cache

        enc = self.encoding(layer)
        in_args = bool(args)
        x = args[0] if in_args else kwargs["hidden_states"]
        mask = _find(PosencMask, args, kwargs)
        B, L, _ = x.shape
        cached = 0
        cache = _find(Cache, args, kwargs)
        if cache is not None:
            cached = cache.get_seq_length(layer)
        if mask is None:
            mask = PosencMask(batch_size=B, q_length=L, kv_length=cached + L, q_offset=cached, padding=None)
        q_pos, _, documents = mask.positions(kwargs.get("position_ids"), B, kwargs)
        state = self._state(enc, cache, cached, B, x) if cache is not None else None
        if documents is not None:  # packed: an input stage that reads neighbours must not cross documents
            rows = []
            for b in range(B):
                starts = torch.nonzero(torch.diff(documents[b], prepend=documents[b, :1] - 1)).flatten().tolist()
                pb = min(b, q_pos.shape[0] - 1)
                parts = [
                    enc.embed(x[b : b + 1, s:e], q_pos[pb : pb + 1, s:e]) for s, e in zip(starts, [*starts[1:], L])
                ]
                rows.append(torch.cat(parts, dim=1))
            y = torch.cat(rows, dim=0)
        else:
            y = enc.embed(x, q_pos) if state is None else enc.embed(x, q_pos, state=state)
        if in_args:
            return (y, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": y}

    def _state(self, enc: PositionEncoding, cache, cached: int, batch: int, x: Tensor):
        """The input stage's decoding state for this cache (conv's last inputs), or None."""
        if type(enc).init_state is PositionEncoding.init_state:
            return None  # a stateless input stage
        per_cache = self._states.setdefault(cache, {})
        state = per_cache.get(id(enc))
        if state is None or cached == 0:
            if cached:
                raise ValueError(
                    f"encoding {enc.name!r} keeps the last inputs of earlier calls; this cache already holds "
                    f"{cached} tokens it did not see (start decoding from an empty cache)"
                )
            state = enc.init_state(batch, dtype=x.dtype, device=x.device)
            if state is None:
                return None
            per_cache[id(enc)] = state
        elif state.length != cached:
            raise ValueError(
                f"encoding {enc.name!r} saw {state.length} tokens but the cache holds {cached}: caches that are "
                "cropped or reordered (beam search, assisted decoding) are not supported with it"
            )
        return state
