"""Hugging Face model classes that run posenc encodings, made from the stock classes, one per family.

For each family of :data:`posenc.hf.families.FAMILIES`, :func:`posenc_classes` makes

* ``Posenc<StockConfig>`` (``model_type = "posenc_" + stock model_type``): the stock config
  plus ``posenc_layers`` (one ``{"encoding", "options"[, "window", "chunk", "sinks"]}`` per
  layer) and ``posenc_share`` (share equal specs across layers; None follows each encoding);
* ``Posenc<StockModel>``: the stock model class with the model's own encoding switched off and a
  :class:`~posenc.hf.stack.PosencStack` at ``<base>.posenc``, attention implementation
  ``"posenc"``;

and registers them with ``AutoConfig`` and ``AutoModelForCausalLM`` (``AutoModelForMaskedLM``
for encoders), so ``save_pretrained`` / ``from_pretrained`` round-trip. The older names
(``PosencLlamaConfig``, ``PosencLlamaForCausalLM``, ``PosencGPT2Config``,
``PosencGPT2LMHeadModel``) are the llama and gpt2 classes made here.
"""

from __future__ import annotations

import json
import os
import pathlib

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

from ..base import PositionEncoding
from .attention import NAME, PLAIN, RECORD
from .families import FAMILIES, Family, family_by_type
from .off import switch_off
from .remote import HASH_FIELD, check_remote_code, remote_source, save_remote_code
from .specs import check_layers, check_share, default_specs
from .stack import PosencStack, build_encoding

__all__ = [
    "PosencLlamaConfig",
    "PosencLlamaForCausalLM",
    "PosencGPT2Config",
    "PosencGPT2LMHeadModel",
    "Family",
    "check_saved",
    "posenc_classes",
    "register_auto",
]


def _path(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


class _PosencModel:
    """Mixin: build the :class:`PosencStack` after the HF model, and switch the model's own
    encoding off. Encodings init themselves; HF's initialiser only rebuilds their tables."""

    family: Family

    def _posenc_attach(self) -> None:
        config, fam = self.config, self.family
        base = _path(self, fam.base)
        blocks = list(getattr(base, fam.layers))
        layers = check_layers(config.posenc_layers, len(blocks))
        attns = [getattr(b, fam.attention) for b in blocks]
        width = fam.rotary_widths(config, len(blocks)) if fam.rotary_off else None
        rotary = switch_off(base, attns, fam, width)
        for module in base.modules():  # (attention over other axes than the sequence: HF's own)
            if type(module).__name__ in fam.plain:
                module.__dict__[RECORD] = PLAIN
        dims = fam.layer_dims(config, len(blocks))
        base.posenc = PosencStack(layers, dims, config.posenc_share, causal=fam.causal)
        base.posenc.wire(blocks, attns, fam.qk, rotary, base if fam.default == "mrope" else None, fam.norms_after)
        self.set_attn_implementation({fam.sub: NAME} if fam.sub else NAME)  # (a vision tower keeps its own)
        base.register_forward_pre_hook(_check_implementation)

    @classmethod
    def is_custom_code(cls) -> bool:
        """False: HF's loader then initialises every module it did not fully load through the stock
        class's ``_init_weights`` (transformers' own, flag-aware code), as for the stock model. As
        custom code, modules with no parameters of their own count as loaded, and a buffer only the
        stock ``_init_weights`` computes stays uninitialised memory (Falcon-H1's ``mup_vector``: NaN
        logits after ``from_pretrained``). posenc's stack initialises itself (:meth:`_init_weights`)."""
        return False

    @property
    def posenc_stack(self) -> PosencStack:
        return _path(self, self.family.base).posenc

    def _init_weights(self, module: nn.Module) -> None:
        stack = getattr(_path(self, self.family.base), "posenc", None)
        if stack is not None and id(module) in {id(m) for m in stack.modules()}:
            return  # encodings (and sink logits) initialise themselves (see _initialize_missing_keys)
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

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """HF's ``from_pretrained``, after checking that a local folder's remote code is the module
        posenc writes (:func:`posenc.hf.remote.check_remote_code`): a ``ValueError`` if not."""
        path = pretrained_model_name_or_path
        if isinstance(path, (str, os.PathLike)) and os.path.isdir(path):
            check_saved(path)
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """HF's ``save_pretrained``, plus what a client needs without importing posenc: an
        ``auto_map`` in ``config.json``, the module it names and its sha256 (:mod:`posenc.hf.remote`)."""
        auto_map, sha = save_remote_code(save_directory, self.family, type(self.config), type(self))
        self.config.auto_map = auto_map
        setattr(self.config, HASH_FIELD, sha)
        # a class HF loaded with trust_remote_code got an _auto_class, which would make HF copy
        # posenc's own source next to the weights (and name it in auto_map) instead
        classes = (type(self), type(self.config))
        before = [c.__dict__.get("_auto_class") for c in classes]
        for c in classes:
            c._auto_class = None
        try:
            return super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            for c, b in zip(classes, before):
                if b is None:
                    del c._auto_class
                else:
                    c._auto_class = b


def _check_implementation(base: nn.Module, args) -> None:
    """Forward pre-hook of a converted base model: its attention implementation is still posenc's.

    The model's own encoding is switched off (:class:`~posenc.hf.off.RotaryOff`,
    :class:`~posenc.hf.off.PositionsOff`), so a tool that sets ``_attn_implementation`` to
    ``"sdpa"`` (or anything else) after conversion would run the layers with no position
    encoding at all, without a word.

    Raises:
        ValueError: naming the implementation found.
    """
    found = base.config._attn_implementation
    if found != NAME:
        raise ValueError(
            f"this converted model's attn_implementation is {found!r}, set after posenc.hf.convert; its own position "
            f"encoding is switched off, so {found!r} would run it with none: call "
            f"model.set_attn_implementation({NAME!r}) (or leave attn_implementation unset in the tool that changed it)"
        )


@torch.no_grad()
def _restore(enc: PositionEncoding, stack: PosencStack) -> None:
    """Give ``enc`` posenc's own initial values for the parameters HF did not load."""
    missing = {n for n, p in enc.named_parameters() if not getattr(p, "_is_hf_initialized", False)}
    if not missing:
        return
    index = next(i for i, e in enumerate(stack.encodings) if e is enc)
    spec = stack.specs[stack.layer_index.index(index)]
    fresh = build_encoding(spec, stack.layer_dims[stack.layer_index.index(index)], stack.causal).state_dict()
    for name, p in enc.named_parameters():
        if name in missing:
            p.copy_(fresh[name].to(p.dtype))


def check_saved(folder, config: dict | None = None) -> None:
    """Refuse a saved posenc model folder whose ``posenc_remote.py`` (or its recorded sha256, or
    ``auto_map``) is not what posenc writes for its model type (:func:`posenc.hf.remote.check_remote_code`).
    ``config``: the folder's ``config.json`` as read (default: read here).

    Raises:
        ValueError: the remote code differs, or the model type is not a posenc one.
    """
    if config is None:
        try:
            config = json.loads((pathlib.Path(os.fspath(folder)) / "config.json").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            return  # no readable config: transformers reports it
    if not isinstance(config, dict):
        return

    def source():
        kind = config.get("model_type")
        stock = kind.removeprefix("posenc_") if isinstance(kind, str) and kind.startswith("posenc_") else None
        fam = next((f for f in FAMILIES.values() if f.model_type == stock), None)
        if fam is None:
            raise ValueError(f"model_type {kind!r} is not a posenc model type, yet the folder has posenc's remote code")
        return remote_source(*posenc_classes(fam), fam)

    check_remote_code(folder, config, source)


_CLASSES: dict[str, tuple[type, type]] = {}


def posenc_classes(family: Family | str) -> tuple[type, type]:
    """``(config class, model class)`` of a family (a :class:`Family` or a stock ``model_type``),
    made once from the stock HF classes."""
    fam = family if isinstance(family, Family) else family_by_type(family)
    if fam.model_type in _CLASSES:
        return _CLASSES[fam.model_type]
    stock = fam.stock_class()
    stock_config = stock.config_class
    posenc_type = "posenc_" + fam.model_type

    @strict
    class Config(stock_config):
        model_type = posenc_type
        posenc_layers: list | None = None
        posenc_share: bool | None = None
        posenc_remote_sha256: str | None = None

        def __post_init__(self, **kwargs):
            super().__post_init__(**kwargs)
            check_share(self.posenc_share)
            depth = fam.text_config(self).num_hidden_layers
            if self.posenc_layers is None:  # the model's own encoding, run by posenc
                self.posenc_layers = default_specs(self, fam, depth)
            self.posenc_layers = check_layers(self.posenc_layers, depth)

    Config.__name__ = Config.__qualname__ = "Posenc" + stock_config.__name__.replace("TextConfig", "Config")
    Config.__doc__ = f":class:`transformers.{stock_config.__name__}` plus ``posenc_layers`` and ``posenc_share``."
    Config.__module__ = __name__

    def __init__(self, config) -> None:
        stock.__init__(self, config)
        self._posenc_attach()

    model = type(
        "Posenc" + stock.__name__,
        (_PosencModel, stock),
        {
            "config_class": Config,
            "family": fam,
            "__init__": __init__,
            "__module__": __name__,
            "__doc__": f"``{stock.__name__}`` whose layers run the posenc encodings of ``config.posenc_layers``.",
        },
    )
    _CLASSES[fam.model_type] = (Config, model)
    return Config, model


def register_auto() -> None:
    """Register every family's classes with ``AutoConfig`` and ``AutoModelForCausalLM`` /
    ``AutoModelForMaskedLM`` (idempotent)."""
    for fam in FAMILIES.values():
        cfg, model = posenc_classes(fam)
        auto = AutoModelForMaskedLM if fam.auto == "masked" else AutoModelForCausalLM
        try:
            AutoConfig.register(cfg.model_type, cfg)
        except ValueError:  # already registered (a second import)
            pass
        try:
            auto.register(cfg, model)
        except ValueError:
            pass


LLAMA, GPT2 = FAMILIES["llama"], FAMILIES["gpt2"]  # (the older module-level names of two rows)
PosencLlamaConfig, PosencLlamaForCausalLM = posenc_classes("llama")
PosencGPT2Config, PosencGPT2LMHeadModel = posenc_classes("gpt2")
