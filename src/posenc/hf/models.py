"""Hugging Face model classes that run posenc encodings, registered with the ``Auto*`` classes.

* ``PosencLlamaConfig`` / ``PosencLlamaForCausalLM`` (``model_type="posenc_llama"``):
  Llama with one posenc encoding per layer.
* ``PosencGPT2Config`` / ``PosencGPT2LMHeadModel`` (``model_type="posenc_gpt2"``):
  GPT-2 with its learned ``wpe`` switched off and posenc encodings instead.

The encodings are recorded in ``config.json`` as ``posenc_layers``, one
``{"encoding": name, "options": {...}}`` per layer (``posenc_share``: share equal specs
across layers; None follows each encoding), so ``save_pretrained`` /
``AutoModelForCausalLM.from_pretrained`` round-trip. The models are the stock HF classes
plus a :class:`~posenc.hf.stack.PosencStack` at ``<base>.posenc``; their attention
implementation is ``"posenc"``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from ..base import PositionEncoding
from ..registry import get_class
from .attention import NAME
from .stack import Dims, PosencStack, PositionsOff, RotaryOff, build_encoding

__all__ = ["PosencLlamaConfig", "PosencLlamaForCausalLM", "PosencGPT2Config", "PosencGPT2LMHeadModel", "Family"]


def check_layers(layers, depth: int) -> list[dict]:
    """Validate ``posenc_layers``: ``depth`` specs ``{"encoding": registered name, "options": dict}``."""
    if not isinstance(layers, (list, tuple)) or len(layers) != depth:
        n = len(layers) if isinstance(layers, (list, tuple)) else type(layers).__name__
        raise ValueError(f"posenc_layers must list one spec per layer ({depth}), got {n}")
    out = []
    for i, spec in enumerate(layers):
        if not isinstance(spec, dict) or not isinstance(spec.get("encoding"), str):
            raise ValueError(f"posenc_layers[{i}] must be {{'encoding': name, 'options': {{...}}}}, got {spec!r}")
        get_class(spec["encoding"])  # ValueError naming the registered encodings
        options = spec.get("options") or {}
        if not isinstance(options, dict):
            raise ValueError(f"posenc_layers[{i}]['options'] must be a dict, got {options!r}")
        out.append({"encoding": spec["encoding"], "options": dict(options)})
    return out


@dataclass(frozen=True)
class Family:
    """Where a model family keeps what posenc replaces."""

    name: str
    base: str  # attribute of the LM holding the base model
    layers: str  # attribute of the base model: the decoder layers
    attention: str  # attribute of a layer: its attention module
    positions: str  # attribute of the base model: the model's own encoding, switched off
    dropout: str  # config field: attention-probability dropout

    def dims(self, config) -> Dims:
        if self.name == "gpt2":
            H = config.n_head
            return Dims(H, H, config.n_embd // H, config.n_embd, config.n_positions)
        H = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // H
        kv = config.num_key_value_heads or H
        return Dims(H, kv, head_dim, config.hidden_size, config.max_position_embeddings)


LLAMA = Family("llama", "model", "layers", "self_attn", "rotary_emb", "attention_dropout")
GPT2 = Family("gpt2", "transformer", "h", "attn", "wpe", "attn_pdrop")


class _PosencModel:
    """Mixin: build the :class:`PosencStack` after the HF model, and switch the model's own
    encoding off. Encodings init themselves; HF's initialiser only rebuilds their tables."""

    family: Family

    def _posenc_attach(self) -> None:
        config, fam = self.config, self.family
        dims = fam.dims(config)
        if getattr(config, fam.dropout, 0.0):
            raise ValueError(
                f"posenc backends have no attention dropout; set config.{fam.dropout}=0 "
                f"(got {getattr(config, fam.dropout)})"
            )
        layers = check_layers(config.posenc_layers, len(getattr(getattr(self, fam.base), fam.layers)))
        base = getattr(self, fam.base)
        blocks = list(getattr(base, fam.layers))
        attns = [getattr(b, fam.attention) for b in blocks]
        for a in attns:
            scaling = getattr(a, "scaling", dims.head_dim**-0.5)
            if abs(scaling - dims.head_dim**-0.5) > 1e-12 * scaling:
                raise ValueError(
                    f"layer {a.layer_idx} scales scores by {scaling}; posenc encodings set the score scale "
                    f"themselves (head_dim**-0.5 = {dims.head_dim**-0.5} unless the encoding says otherwise)"
                )
        setattr(base, fam.positions, RotaryOff(dims.head_dim) if fam.name == "llama" else PositionsOff())
        base.posenc = PosencStack(layers, dims, config.posenc_share)
        base.posenc.wire(blocks, attns, gpt2_fused=fam.name == "gpt2")
        self.set_attn_implementation(NAME)

    @property
    def posenc_stack(self) -> PosencStack:
        return getattr(self, self.family.base).posenc

    def _init_weights(self, module: nn.Module) -> None:
        stack = getattr(getattr(self, self.family.base, None), "posenc", None)
        if stack is not None and id(module) in {id(m) for e in stack.encodings for m in e.modules()}:
            return  # encodings initialise themselves (see _initialize_missing_keys)
        return super()._init_weights(module)

    def _initialize_missing_keys(self, *args, **kwargs) -> None:
        # from_pretrained: after HF initialised what the checkpoint lacked, give the encodings
        # posenc's own init for their missing parameters and rebuild their tables, which
        # loading leaves as uninitialised memory (non-persistent buffers)
        super()._initialize_missing_keys(*args, **kwargs)
        stack = self.posenc_stack
        for enc in stack.encodings:
            _restore(enc, stack)
            enc.init_buffers()


@torch.no_grad()
def _restore(enc: PositionEncoding, stack: PosencStack) -> None:
    """Give ``enc`` posenc's own initial values for the parameters HF did not load."""
    missing = {n for n, p in enc.named_parameters() if not getattr(p, "_is_hf_initialized", False)}
    if not missing:
        return
    index = next(i for i, e in enumerate(stack.encodings) if e is enc)
    fresh = build_encoding(stack.specs[stack.layer_index.index(index)], stack.dims).state_dict()
    for name, p in enc.named_parameters():
        if name in missing:
            p.copy_(fresh[name].to(p.dtype))


@strict
class PosencLlamaConfig(LlamaConfig):
    """:class:`transformers.LlamaConfig` plus ``posenc_layers`` and ``posenc_share``."""

    model_type = "posenc_llama"
    posenc_layers: list | None = None
    posenc_share: bool | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.posenc_layers is None:  # the model's own RoPE, run by posenc
            self.posenc_layers = [{"encoding": "rope", "options": {}}] * self.num_hidden_layers
        self.posenc_layers = check_layers(self.posenc_layers, self.num_hidden_layers)


class PosencLlamaForCausalLM(_PosencModel, LlamaForCausalLM):
    """``LlamaForCausalLM`` whose layers run the posenc encodings of ``config.posenc_layers``."""

    config_class = PosencLlamaConfig
    family = LLAMA

    def __init__(self, config: PosencLlamaConfig) -> None:
        super().__init__(config)
        self._posenc_attach()


@strict
class PosencGPT2Config(GPT2Config):
    """:class:`transformers.GPT2Config` plus ``posenc_layers`` and ``posenc_share``."""

    model_type = "posenc_gpt2"
    posenc_layers: list | None = None
    posenc_share: bool | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.posenc_layers is None:  # GPT-2's learned positions, run by posenc
            self.posenc_layers = [{"encoding": "learned", "options": {}}] + [{"encoding": "nope", "options": {}}] * (
                self.n_layer - 1
            )
        self.posenc_layers = check_layers(self.posenc_layers, self.n_layer)


class PosencGPT2LMHeadModel(_PosencModel, GPT2LMHeadModel):
    """``GPT2LMHeadModel`` with ``wpe`` off and the posenc encodings of ``config.posenc_layers``."""

    config_class = PosencGPT2Config
    family = GPT2

    def __init__(self, config: PosencGPT2Config) -> None:
        super().__init__(config)
        self._posenc_attach()


def register_auto() -> None:
    """Register both model types with ``AutoConfig`` / ``AutoModelForCausalLM`` (idempotent)."""
    for cfg, model in ((PosencLlamaConfig, PosencLlamaForCausalLM), (PosencGPT2Config, PosencGPT2LMHeadModel)):
        try:
            AutoConfig.register(cfg.model_type, cfg)
        except ValueError:  # already registered (a second import)
            pass
        try:
            AutoModelForCausalLM.register(cfg, model)
        except ValueError:
            pass
