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

from .families import FAMILIES, family_of
from .models import _path, posenc_classes
from .off import rotary_stand_in
from .specs import check_share, default_specs, layer_specs
from .stack import PosencStack

__all__ = ["convert", "layer_specs", "SUPPORTED"]


# stock model class -> (family, posenc config class, posenc model class)
SUPPORTED = {fam.stock_class(): (fam, *posenc_classes(fam)) for fam in FAMILIES.values()}
_DROP = (
    "model_type",
    "architectures",
    "transformers_version",
    "posenc_layers",
    "posenc_share",
    "auto_map",
    "posenc_remote_sha256",
)


def convert(model: nn.Module, encoding=None, *, share: bool | None = None, **options) -> nn.Module:
    """``model`` with its attention and position handling replaced by posenc encodings.

    Args:
        model: a model of a family in :data:`posenc.hf.families.FAMILIES` (Llama, GPT-2, Qwen2/3,
            Mistral, Phi-3, Gemma 2-4, gpt-oss, ModernBERT, OLMo, SmolLM3, Cohere 2, GLM 4, ...: the
            model types docs/hf.md measures; a subclass too, e.g. an already converted model).
        encoding: a registered name for every layer, a posenc.layers pattern or preset, or one entry per layer (see
            :func:`layer_specs`). None: the model's own scheme (``rope``; ``mrope`` for Qwen2-VL/Qwen3-VL;
            GPT-2's ``learned`` on layer 0 then ``nope``), which reproduces the stock model.
        share: one encoding instance for layers with equal specs; None follows each
            encoding (T5 shares its table, as in the paper).
        **options: encoding options for every layer (``num_buckets``, ``base``, ...). For
            ``rope``/``xpos`` on Llama the config's ``rope_theta`` and ``rope_parameters``
            are the defaults, so ``encoding="rope"`` reproduces the model as it was.

    Returns:
        A ``Posenc<Stock>`` model (``PosencLlamaForCausalLM``, ``PosencQwen2ForCausalLM``, ...) sharing ``model``'s weights
        (its rotary embedding or ``wpe`` switched off), in the same train/eval mode. GPT-2's
        ``wpe`` initialises a ``learned`` encoding of layer 0 when the shapes match, so
        ``encoding="learned"`` reproduces GPT-2.

    Raises:
        TypeError: an unsupported model class.
        ValueError: an unknown encoding or option, an encoding posenc.hf cannot run
            (``complex-order``).
    """
    check_share(share)
    family = family_of(model)
    config_cls, model_cls = posenc_classes(family)
    base = _path(model, family.base)
    depth = len(getattr(base, family.layers))
    if encoding is None:
        specs = layer_specs(default_specs(model.config, family, depth), options, depth, model.config, family)
    else:
        specs = layer_specs(encoding, options, depth, model.config, family)
    fields = {k: v for k, v in model.config.to_dict().items() if k not in _DROP}
    if _from_gguf(fields.get("quantization_config")):
        del fields["quantization_config"]  # the weights taken over are plain tensors: no GGUF file stands behind them
    config = config_cls(**fields, posenc_layers=specs, posenc_share=share)
    params = list(model.parameters())
    device, dtype = params[0].device, params[0].dtype
    with torch.device("meta"):  # the HF weights are taken over below, not allocated twice
        new = model_cls(config)
    switched = _switched_off(family)  # (weights of the parts the stand-ins replace: the encodings take them)
    state = {k: v for k, v in model.state_dict(keep_vars=True).items() if ".posenc." not in k and not switched(k)}
    missing, unexpected = new.load_state_dict(state, strict=False, assign=True)
    stray = [k for k in missing if ".posenc." not in k] + [k for k in unexpected if not k.endswith("wpe.weight")]
    if stray:
        raise ValueError(f"weights that do not carry over to the posenc model: {stray}")
    new_base = _path(new, family.base)
    new_base.posenc.unwire()
    with torch.device(device):  # the encodings, built for real (posenc initialises them)
        new_base.posenc = PosencStack(specs, family.layer_dims(config, depth), share, causal=family.causal)
    if dtype.is_floating_point and dtype != torch.float32:
        new_base.posenc.to(dtype)
    blocks = list(getattr(new_base, family.layers))
    attns = [getattr(b, family.attention) for b in blocks]
    rotary = rotary_stand_in(new_base, family)
    mrope = new_base if family.default == "mrope" else None
    new_base.posenc.wire(blocks, attns, family.qk, rotary, mrope, family.norms_after)
    _carry_buffers(model, new, device)
    _take_over(family, base, [getattr(b, family.attention) for b in getattr(base, family.layers)], new_base.posenc)
    if family.default == "gpt2" and specs[0]["encoding"] == "learned":
        table, wpe = new_base.posenc.encoding(0).table.weight, getattr(base, "wpe", None)
        if isinstance(wpe, nn.Embedding) and wpe.weight.shape == table.shape:
            with torch.no_grad():
                table.copy_(wpe.weight)
    if getattr(model, "generation_config", None) is not None:  # (encoders have none)
        new.generation_config = copy.deepcopy(model.generation_config)
    return new.train(model.training)


def _switched_off(family):
    """A test for the state-dict keys under an attention module's ``off_parts``."""
    parts = tuple(path for path, _ in family.off_parts)
    if not parts:
        return lambda key: False
    head = f"{family.base}.{family.layers}."

    def switched(key: str) -> bool:
        if not key.startswith(head):
            return False
        rest = key[len(head) :].partition(".")[2]  # (after the layer index)
        if not rest.startswith(family.attention + "."):
            return False
        sub = rest[len(family.attention) + 1 :]
        return any(sub.startswith(p + ".") for p in parts)

    return switched


@torch.no_grad()
def _take_over(family, base: nn.Module, attentions: list[nn.Module], stack: PosencStack) -> None:
    """Each layer's encoding starts from the weights of its module's switched-off parts
    (``family.takes``; ``"base:"`` paths under the language model ``base``) where it has the
    parameter with that shape (the model's own scheme)."""
    for i, attn in enumerate(attentions):
        enc = stack.encoding(i)
        for src, dst in family.takes:
            owner, src = (base, src[5:]) if src.startswith("base:") else (attn, src)
            try:
                old, new = owner.get_parameter(src), enc.get_parameter(dst)
            except AttributeError:
                continue
            if old.shape == new.shape:
                new.copy_(old.to(new.dtype))


def _from_gguf(quantization) -> bool:
    """``quantization_config`` is the one transformers' GGUF loader sets (``from_pretrained(...,
    gguf_file=...)``: ``quant_method`` ``"gguf"``), which a converted model must not keep: saved,
    it would name a GGUF file the safetensors do not come from."""
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    return str(getattr(method, "value", method)) == "gguf"


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
