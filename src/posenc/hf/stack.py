"""The encodings of a converted Hugging Face model, and where they enter it.

A :class:`PosencStack` sits in the base model (``model.model.posenc`` for Llama,
``model.transformer.posenc`` for GPT-2) and owns one encoding per layer, or one shared by
the layers whose paper shares it (T5's bucket table). It wires them in without touching
anything global:

* each attention module gets a (non-module) reference to its layer's encoding, which
  :func:`posenc.hf.attention.attention_forward` runs;
* the model's own encoding is switched off (:mod:`posenc.hf.off`): Llama's rotary embedding
  returns the identity rotation (``cos = 1``, ``sin = 0``), GPT-2's ``wpe`` returns 0;
* an input stage (``learned``, ``sinusoidal``, ``conv``, ...) runs where the encoding
  declares it (``input_at``), as in :class:`posenc.TransformerLM`: ``n`` in a forward
  pre-hook of decoder layer ``n`` on the residual stream (0: the token embeddings), once
  per distinct instance; ``"layer"`` (FLOATER) in a pre-hook of every attention module
  using it, on that layer's attention input. The hooks read ``position_ids`` from the
  layer's keyword arguments, numbered from the padding mask where the model made them itself
  (:meth:`posenc.hf.masks.PosencMask.positions`: a left-padded row's first real token is at 0,
  so ``conv``'s zero padding, not the pads, lies before it); with a cache, an input stage that
  reads preceding inputs (``input_context``) keeps them in a :class:`posenc.layer.cache.InputHistory`
  per cache.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..base import PositionEncoding, Stage
from ..layer.cache import InputHistory, run_input_stage
from ..layer.setup import build_for_layer, layer_encodings
from .attention import RECORD, LayerRecord, swap_halves
from .hidden import HiddenReads, capture
from .history import PositionHistory
from .keys import capture_cache, keeps_rotated
from .masks import PosencMask
from .off import PartOff, PositionsOff, RotaryOff, norms_after, switch_off_parts

__all__ = ["PosencStack", "RotaryOff", "PositionsOff", "PartOff", "Dims", "switch_off_parts"]


@dataclass(frozen=True)
class Dims:
    """What the encodings need to know about the model.

    ``rotary_last``: the width of a rotary part that sits last in every q/k head (MLA's
    decoupled RoPE, :attr:`posenc.hf.families.Family.rotary_part`), 0 for none; the attention
    function moves it to the front of q and k before the encoding runs. ``value_dim``: the width
    of a value head where it is not ``head_dim`` (MLA's ``v_head_dim``), 0 for the same.
    ``mirrored``: the model's RoPE turns the other way (:attr:`posenc.hf.families.Family.mirrored`).
    """

    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    max_len: int | None
    rotary_last: int = 0
    value_dim: int = 0
    mirrored: bool = False


class _FusedSlice:
    """Columns ``[start, stop)`` of GPT-2's fused ``c_attn`` (a ``Conv1D``: ``x @ W + b``)."""

    def __init__(self, conv: nn.Module, start: int, stop: int) -> None:
        self.conv, self.start, self.stop = conv, start, stop
        self.in_features = conv.weight.shape[0]

    def __call__(self, x: Tensor) -> Tensor:
        w, b = self.conv.weight[:, self.start : self.stop], self.conv.bias[self.start : self.stop]
        return x @ w.to(x.dtype) + b.to(x.dtype)


class _RowSlice:
    """Rows ``[start, stop)`` of a fused ``Linear`` (Phi-3's ``qkv_proj``, ModernBERT's ``Wqkv``)."""

    def __init__(self, linear: nn.Linear, start: int, stop: int) -> None:
        self.linear, self.start, self.stop = linear, start, stop
        self.in_features = linear.weight.shape[1]

    def __call__(self, x: Tensor) -> Tensor:
        w, b = self.linear.weight[self.start : self.stop], self.linear.bias
        return nn.functional.linear(x, w.to(x.dtype), None if b is None else b[self.start : self.stop].to(x.dtype))


def qk_projections(attn: nn.Module, how: tuple[str, str], dims: Dims) -> tuple | None:
    """The layer's ``(W_Q, W_K)`` as callables, however the family stores them; None for a layer
    without its own (Gemma 4's key/value-sharing layers)."""
    kind, name = how
    if not hasattr(attn, name):
        return None
    q_width, k_width = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    if kind == "conv1d":
        return _FusedSlice(getattr(attn, name), 0, q_width), _FusedSlice(
            getattr(attn, name), q_width, q_width + k_width
        )
    if kind == "fused":
        fused = getattr(attn, name)
        return _RowSlice(fused, 0, q_width), _RowSlice(fused, q_width, q_width + k_width)
    return getattr(attn, kind), getattr(attn, name)


def _unhooked(norms: tuple | None, mirrored: bool = False) -> tuple | None:
    """The norms' ``forward`` (their call from the module is the identity: :mod:`posenc.hf.off`),
    after the halves of a ``mirrored`` layer's q/k are swapped back."""
    if norms is None:
        return None
    if mirrored:
        return tuple(functools.partial(_swapped_then, n.forward) for n in norms)
    return tuple(n.forward for n in norms)


def _swapped_then(norm, x: Tensor) -> Tensor:
    return norm(swap_halves(x))


def _find(kind, args: tuple, kwargs: dict):
    for a in (*args, *kwargs.values()):
        if isinstance(a, kind):
            return a
    return None


def build_encoding(spec: dict, dims: Dims, causal: bool = True) -> PositionEncoding:
    """One encoding for a layer spec ``{"encoding": name, "options": {...}}``.

    Built by :func:`posenc.layer.setup.build_for_layer`, the rule ``posenc.Attention`` uses:
    what acts on the hidden states gets their width ``hidden``.

    Raises:
        ValueError: an unknown name or option, or an encoding that builds the token
            embedding from ids (``input_at="tokens"``: ``complex-order`` with a
            ``vocab_size``; the embedding module sees no positions).
    """
    name, options = spec["encoding"], dict(spec.get("options") or {})
    size = {"heads": dims.heads, "head_dim": dims.head_dim, "dim": dims.hidden, "max_len": dims.max_len}
    enc = build_for_layer(name, options, causal=causal, **size)  # (the layer's widths: posenc.layer.setup)
    if enc.needs.input_at == "tokens":
        raise ValueError(
            f"encoding {name!r} with these options builds the token embedding from ids and positions together; "
            "a Hugging Face model's embedding sees no positions, so posenc.hf cannot run it"
        )
    return enc


class PosencStack(nn.Module):
    """The distinct encodings of a converted model and the layer -> encoding map.

    Args:
        layers: one spec ``{"encoding": name, "options": {...}}`` per decoder layer.
        dims: the model's sizes, or one :class:`Dims` per layer where head sizes differ
            between layers (Gemma 4's global layers); :attr:`dims` is then layer 0's.
        share: one instance for equal specs across layers; None follows each encoding
            (``share_across_layers``), as :class:`posenc.TransformerLM` does.
    """

    def __init__(self, layers: list[dict], dims: Dims, share: bool | None = None, causal: bool = True) -> None:
        super().__init__()
        per_layer = list(dims) if isinstance(dims, (list, tuple)) else [dims] * len(layers)
        self.dims, self.layer_dims, self.specs, self.causal = per_layer[0], per_layer, [dict(s) for s in layers], causal
        keys = [
            repr((spec["encoding"], sorted((spec.get("options") or {}).items()), per_layer[i]))
            for i, spec in enumerate(layers)
        ]
        encs = layer_encodings(
            keys, lambda i: build_encoding(layers[i], per_layer[i], causal), share
        )  # as TransformerLM
        self.encodings = nn.ModuleList(encs)
        # learned sink logits (gpt-oss) of the layers whose spec asks for them, zero-initialised as posenc.Attention's
        self.sinks = nn.ParameterDict(
            {
                str(i): nn.Parameter(torch.zeros(per_layer[i].heads))
                for i, spec in enumerate(layers)
                if spec.get("sinks")
            }
        )
        self.layer_index: list[int] = encs.index
        self._handles: list = []
        self.hidden = HiddenReads()  # read_input's keys and states per HF cache (FoX, Inkling)
        self._histories: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> {key: [history, seen]}

    def encoding(self, layer: int) -> PositionEncoding:
        return self.encodings[self.layer_index[layer]]

    # ------------------------------------------------------------------ wiring
    def unwire(self) -> None:
        """Remove this stack's input-stage hooks (before another stack replaces it)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def wire(
        self,
        layers: list[nn.Module],
        attentions: list[nn.Module],
        qk: tuple[str, str] = ("q_proj", "k_proj"),
        rotary: nn.Module | None = None,
        base: nn.Module | None = None,
        norms: tuple = (),
    ) -> None:
        """Attach each layer's encoding to its attention module and hook the input stages in.

        Each encoding takes the score scale and soft-cap of its attention module (``scaling``,
        ``attn_logit_softcapping``: Gemma's ``query_pre_attn_scalar``, Gemma 2's capping) through
        :meth:`posenc.PositionEncoding.set_scores`. ``qk``: how the family stores ``W_Q``/``W_K``
        (:func:`qk_projections`); ``rotary``: the model's rotary stand-in (multimodal positions);
        ``base``: the language model, hooked to keep the multimodal positions of cached tokens
        (:class:`posenc.hf.history.PositionHistory`; given for M-RoPE families only); ``norms``: the
        attributes of the q/k norms the model runs after its RoPE (``Family.norms_after``).

        Raises:
            ValueError: an ``input_at`` block index outside the model; layers sharing one
                encoding that HF scales differently; learned sinks on a layer that has HF's own.
        """
        self.unwire()
        before: dict[int, list[int]] = {}  # block -> indices of the encodings whose input stage runs there
        scores: dict[int, tuple] = {}  # encoding index -> (scale, softcap) given to it
        shares_keys = any(getattr(a, "is_kv_shared_layer", False) for a in attentions)
        for i, attn in enumerate(attentions):
            enc = self.encoding(i)
            spec = self.specs[i]
            if spec.get("sinks") and isinstance(getattr(attn, "sinks", None), nn.Parameter):
                raise ValueError(f"layer {i} has HF's own learned sinks; its posenc spec cannot add sinks=True")
            hidden = None
            if enc.defines("read_input"):  # the attention function needs the module's hidden states
                if getattr(attn, "is_kv_shared_layer", False):  # (Gemma 4: another layer's keys)
                    raise ValueError(
                        f"encoding {enc.name!r} reads the hidden state of the layer's own keys, and layer {i} "
                        "reuses another layer's keys and values (num_kv_shared_layers): give it an encoding "
                        "that reads no hidden state"
                    )
                hidden = self.hidden
                self._handles.append(attn.register_forward_pre_hook(capture, with_kwargs=True))
            dims = self.layer_dims[i]
            if dims.value_dim not in (0, dims.head_dim) and (enc.defines("rotate_value") or enc.defines("value_term")):
                raise ValueError(
                    f"encoding {enc.name!r} acts on the values, whose heads are {dims.value_dim} wide in layer {i}, "
                    f"and on q/k heads of {dims.head_dim}: posenc builds one head width per layer; "
                    "pick an encoding without a value stage"
                )
            hf_scores = self._set_scores(i, attn, enc, scores)
            rotated = keeps_rotated(enc, shares_keys)
            if rotated:  # the attention function writes rotated keys into HF's cache (posenc.hf.keys)
                self._handles.append(attn.register_forward_pre_hook(capture_cache, with_kwargs=True))
            if enc.stages & Stage.INPUT:
                if enc.needs.input_at == "layer":
                    hook = functools.partial(self._input_hook, [self.layer_index[i]], i)
                    self._handles.append(attn.register_forward_pre_hook(hook, with_kwargs=True))
                else:
                    at = enc.needs.input_at
                    if not isinstance(at, int) or not 0 <= at < len(layers):
                        raise ValueError(
                            f"encoding {enc.name!r}: input_at must be 'layer' or a block index in "
                            f"[0, {len(layers) - 1}], got {at!r}"
                        )
                    runs = before.setdefault(at, [])
                    if self.layer_index[i] not in runs:
                        runs.append(self.layer_index[i])
            # the layer's W_Q/W_K, read by an encoding that projects its own table with them
            # (DeBERTa's share_att_key, which refuses a W_K of grouped key heads)
            # one record per module (a reference to the encoding: the stack owns the module)
            attn.__dict__[RECORD] = LayerRecord(
                encoding=enc,
                window=spec.get("window"),
                chunk=spec.get("chunk"),
                sinks=self.sinks[str(i)] if str(i) in self.sinks else None,
                rotary=rotary,
                hidden=hidden,
                qk_proj=qk_projections(attn, qk, self.layer_dims[i]),
                scores=hf_scores,
                keeps_rotated=rotated,
                rotary_last=self.layer_dims[i].rotary_last,
                qk_norms=_unhooked(norms_after(attn, norms), self.layer_dims[i].mirrored),
                mirrored=self.layer_dims[i].mirrored,
            )
        for at, which in before.items():
            hook = functools.partial(self._input_hook, which, at)
            self._handles.append(layers[at].register_forward_pre_hook(hook, with_kwargs=True))
        if base is not None and rotary is not None:
            self._handles += PositionHistory(rotary).attach(base)

    def _set_scores(self, i: int, attn: nn.Module, enc: PositionEncoding, done: dict) -> tuple:
        """Give ``enc`` layer ``i``'s score scale and soft-cap (None where they are posenc's own);
        returns HF's ``(scaling, softcap)`` of the module, which its calls must keep."""
        hf_scale = getattr(attn, "scaling", None)
        scale = float(hf_scale) if hf_scale is not None else self.layer_dims[i].head_dim ** -0.5
        cap = getattr(attn, "attn_logit_softcapping", None)
        cap = float(cap) if cap else None
        own = enc.head_dim**-0.5  # (an input-stage encoding may be built one head wide)
        setting = (None if abs(scale - own) <= 1e-12 * own else scale, cap)
        index = self.layer_index[i]
        if index in done and done[index] != setting:
            raise ValueError(
                f"layer {i} shares its {enc.name!r} encoding with an earlier layer but HF gives it another "
                f"score scale / soft-cap {setting} (vs {done[index]}): convert with share=False"
            )
        done[index] = setting
        enc.set_scores(scale=setting[0], softcap=setting[1])
        return (None if hf_scale is None else float(hf_scale), cap)

    def _input_hook(self, which: list[int], layer: int, module: nn.Module, args: tuple, kwargs: dict):
        """Forward pre-hook of block (or attention module) ``layer``: run the input stages of
        encodings ``which`` on the hidden states it receives."""
        from transformers.cache_utils import Cache

        in_args = bool(args)
        y = args[0] if in_args else kwargs["hidden_states"]
        mask = _find(PosencMask, args, kwargs)
        B, L, _ = y.shape
        cached = 0
        cache = _find(Cache, args, kwargs)
        if cache is not None:
            cached = cache.get_seq_length(layer)
        if mask is None:
            mask = PosencMask(batch_size=B, q_length=L, kv_length=cached + L, q_offset=cached, padding=None)
        q_pos, _, documents = mask.positions(kwargs.get("position_ids"), B, kwargs)
        for index in which:
            enc = self.encodings[index]
            if documents is not None:  # packed (no cache): each document on its own
                y = run_input_stage(enc, y, q_pos, None, documents)
                continue
            history = self._history(enc, (index, layer), cache, cached, L) if cache is not None else None
            y = run_input_stage(enc, y, q_pos, history)
        if in_args:
            return (y, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": y}

    def _history(self, enc: PositionEncoding, key, cache, cached: int, new: int) -> InputHistory | None:
        """The input history of ``enc`` at hook ``key`` for this cache; None for a stage that reads no earlier inputs."""
        if enc.needs.input_context <= 0:
            return None
        per_cache = self._histories.setdefault(cache, {})
        entry = per_cache.get(key)
        if entry is None or cached == 0:
            if cached:
                raise ValueError(
                    f"encoding {enc.name!r} reads the last inputs of earlier calls; this cache already holds "
                    f"{cached} tokens it did not see (start decoding from an empty cache)"
                )
            entry = per_cache[key] = [InputHistory(enc.needs.input_context), 0]
        elif entry[1] != cached:
            raise ValueError(
                f"encoding {enc.name!r} saw {entry[1]} tokens but the cache holds {cached}: caches that are "
                "cropped or reordered (beam search, assisted decoding) are not supported with it"
            )
        entry[1] = cached + new
        return entry[0]
