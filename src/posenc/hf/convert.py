"""``posenc.hf.convert``: a Hugging Face model with its position handling replaced by posenc.

::

    model = posenc.hf.convert(LlamaForCausalLM(cfg), encoding="alibi")
    model = posenc.hf.convert(model, encoding=["rope", "rope", "rope", "nope"])   # per layer
    model = posenc.hf.convert(model, encoding=[("rope", {"base": 5e5}), "alibi"])
    model = posenc.hf.convert(model, encoding="rope*3,nope")                      # a posenc.layers pattern

The result is a :class:`~posenc.hf.PosencLlamaForCausalLM` (or
:class:`~posenc.hf.PosencGPT2LMHeadModel`) that shares every weight with ``model`` and adds
the encodings' own parameters; ``model`` itself is left as it was (its config included).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import GPT2LMHeadModel, LlamaForCausalLM

from ..layer_spec import LayerSpec
from ..patterns import is_pattern, layers
from ..registry import get_class, options_of
from .models import GPT2, LLAMA, PosencGPT2Config, PosencGPT2LMHeadModel, PosencLlamaConfig, PosencLlamaForCausalLM
from .rope_config import rope_options_for
from .stack import PosencStack

__all__ = ["convert", "layer_specs", "SUPPORTED"]

# model class -> (family, posenc config class, posenc model class)
SUPPORTED = {
    LlamaForCausalLM: (LLAMA, PosencLlamaConfig, PosencLlamaForCausalLM),
    GPT2LMHeadModel: (GPT2, PosencGPT2Config, PosencGPT2LMHeadModel),
}
_DROP = ("model_type", "architectures", "transformers_version", "posenc_layers", "posenc_share")


def _family(model: nn.Module):
    for cls, entry in SUPPORTED.items():
        if isinstance(model, cls):
            return entry
    names = ", ".join(c.__name__ for c in SUPPORTED)
    raise TypeError(f"posenc.hf.convert supports {names} (and their subclasses); got {type(model).__name__}")


def _defaults(name: str, config, family, layer_type: str | None = None) -> dict:
    """Options the model's own config implies: RoPE's base, partial rotary and scaling, read from
    HF's ``rope_parameters`` (flat, per layer type or per label) by :func:`rope_options_for`,
    which raises rather than fall back to a default base."""
    if family is not LLAMA or name not in ("rope", "xpos"):
        return {}
    out = dict(rope_options_for(config, layer_type))
    if "rope_scaling" not in out:  # HF Llama's default RoPE turns the whole head whatever partial_rotary_factor says
        out.pop("partial_rotary_factor", None)
    return {"base": out["base"]} if name == "xpos" and "base" in out else out


def layer_specs(encoding, options: dict, depth: int, config, family) -> list[dict]:
    """One ``{"encoding": name, "options": {...}}`` per layer.

    ``encoding``: a name for every layer, a :func:`posenc.layers` pattern or preset
    (``"rope*3,nope"``, repeated to ``depth``), or a list of ``depth`` entries, each a name,
    a ``(name, options)`` pair, a spec dict or a :class:`posenc.LayerSpec`. ``options`` apply to every layer, then the
    per-layer options; options the model's config implies (RoPE base and scaling) come
    first, so explicit ones win.

    Raises:
        ValueError: a list of the wrong length, ``options`` some layer's encoding does
            not take, or a layer with a window, chunks or sinks (the adapter runs causal
            attention over every earlier token).
        TypeError: an entry of another type.
    """
    if isinstance(encoding, str) and is_pattern(encoding):
        entries = layers(encoding, depth)
    elif isinstance(encoding, str):
        entries = [encoding] * depth
    elif isinstance(encoding, (list, tuple)):
        if len(encoding) != depth:
            raise ValueError(f"encoding lists {len(encoding)} layers, the model has {depth}")
        entries = list(encoding)
    else:
        raise TypeError(f"encoding must be a name or a list of one per layer, got {type(encoding).__name__}")
    specs = []
    for i, e in enumerate(entries):
        if isinstance(e, str):
            name, own = e, {}
        elif isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], dict):
            name, own = e
        elif isinstance(e, dict) and isinstance(e.get("encoding"), str):
            name, own = e["encoding"], dict(e.get("options") or {})
        elif isinstance(e, LayerSpec):
            if e.window is not None or e.chunk is not None or e.sinks:
                raise ValueError(
                    f"layer {i} ({e}) has a window, chunks or sinks; posenc.hf runs full causal attention "
                    "(only the encoding and its options of a LayerSpec carry over)"
                )
            name, own = e.encoding, dict(e.options)
        else:
            raise TypeError(f"encoding[{i}] must be a name, (name, options), a spec dict or a LayerSpec, got {e!r}")
        valid = options_of(get_class(name))
        bad = sorted(set(options) - set(valid))
        if bad:
            raise ValueError(f"option(s) {bad} do not apply to layer {i}'s encoding {name!r}; valid: {valid}")
        layer_type = (getattr(config, "layer_types", None) or [None] * depth)[i]
        defaults = {k: v for k, v in _defaults(name, config, family, layer_type).items() if k in valid}
        specs.append({"encoding": name, "options": {**defaults, **options, **own}})
    return specs


def convert(model: nn.Module, encoding="rope", *, share: bool | None = None, **options) -> nn.Module:
    """``model`` with its attention and position handling replaced by posenc encodings.

    Args:
        model: a ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` (or a subclass, e.g. an
            already converted model).
        encoding: a registered name for every layer, a posenc.layers pattern or preset, or one entry per layer (see
            :func:`layer_specs`).
        share: one encoding instance for layers with equal specs; None follows each
            encoding (T5 shares its table, as in the paper).
        **options: encoding options for every layer (``num_buckets``, ``base``, ...). For
            ``rope``/``xpos`` on Llama the config's ``rope_theta`` and ``rope_parameters``
            are the defaults, so ``encoding="rope"`` reproduces the model as it was.

    Returns:
        A ``PosencLlamaForCausalLM`` / ``PosencGPT2LMHeadModel`` sharing ``model``'s weights
        (its rotary embedding or ``wpe`` switched off), in the same train/eval mode. GPT-2's
        ``wpe`` initialises a ``learned`` encoding of layer 0 when the shapes match, so
        ``encoding="learned"`` reproduces GPT-2.

    Raises:
        TypeError: an unsupported model class.
        ValueError: an unknown encoding or option, attention dropout in the config, an
            encoding posenc.hf cannot run (``complex-order``).
    """
    family, config_cls, model_cls = _family(model)
    base = getattr(model, family.base)
    depth = len(getattr(base, family.layers))
    specs = layer_specs(encoding, options, depth, model.config, family)
    fields = {k: v for k, v in model.config.to_dict().items() if k not in _DROP}
    config = config_cls(**fields, posenc_layers=specs, posenc_share=share)
    params = list(model.parameters())
    device, dtype = params[0].device, params[0].dtype
    with torch.device("meta"):  # the HF weights are taken over below, not allocated twice
        new = model_cls(config)
    state = {k: v for k, v in model.state_dict(keep_vars=True).items() if ".posenc." not in k}
    missing, unexpected = new.load_state_dict(state, strict=False, assign=True)
    stray = [k for k in missing if ".posenc." not in k] + [k for k in unexpected if not k.endswith("wpe.weight")]
    if stray:
        raise ValueError(f"weights that do not carry over to the posenc model: {stray}")
    new_base = getattr(new, family.base)
    new_base.posenc.unwire()
    with torch.device(device):  # the encodings, built for real (posenc initialises them)
        new_base.posenc = PosencStack(specs, family.dims(config), share)
    if dtype.is_floating_point and dtype != torch.float32:
        new_base.posenc.to(dtype)
    blocks = list(getattr(new_base, family.layers))
    new_base.posenc.wire(blocks, [getattr(b, family.attention) for b in blocks], gpt2_fused=family is GPT2)
    _carry_buffers(model, new, device)
    if family is GPT2 and specs[0]["encoding"] == "learned":
        table, wpe = new_base.posenc.encoding(0).table.weight, getattr(base, "wpe", None)
        if isinstance(wpe, nn.Embedding) and wpe.weight.shape == table.shape:
            with torch.no_grad():
                table.copy_(wpe.weight)
    new.generation_config = copy.deepcopy(model.generation_config)
    return new.train(model.training)


def _carry_buffers(old: nn.Module, new: nn.Module, device) -> None:
    """Non-persistent buffers of the HF modules (not in the state dict) from ``old``; the
    posenc switches' own buffers built on ``device``."""
    old_buffers = dict(old.named_buffers())
    for name, buf in list(new.named_buffers()):
        if not buf.is_meta:
            continue
        owner_name, _, attr = name.rpartition(".")
        owner = new.get_submodule(owner_name)
        if name in old_buffers and old_buffers[name].shape == buf.shape:
            owner._buffers[attr] = old_buffers[name]
        else:
            owner._buffers[attr] = torch.zeros(buf.shape, dtype=buf.dtype, device=device)
