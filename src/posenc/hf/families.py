"""The Hugging Face model families ``posenc.hf`` converts, as data.

What the families share is one code path (:mod:`posenc.hf.models`, :mod:`posenc.hf.convert`);
what differs between them is a row of :data:`FAMILIES`: where the base model, its layers, their
attention modules and the model's own position encoding live, how ``W_Q``/``W_K`` are stored
(separate, fused ``Linear``, GPT-2's fused ``Conv1D``), whether the model is causal and whether HF's
default RoPE honours ``partial_rotary_factor``. (Attention dropout needs no row: HF's modules
pass their own to the attention function in training.) A new family with HF's usual attention interface is one row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import transformers

from .stack import Dims

__all__ = ["Family", "FAMILIES", "family_of", "family_by_type"]


@dataclass(frozen=True)
class Family:
    """Where one HF model family keeps what posenc replaces.

    Attributes:
        model_type: the stock config's ``model_type`` (``"qwen2"``); the converted one is
            ``"posenc_" + model_type``.
        lm: the stock model class name in ``transformers`` (``"Qwen2ForCausalLM"``).
        auto: ``"causal"`` (``AutoModelForCausalLM``) or ``"masked"`` (``AutoModelForMaskedLM``).
        base: attribute of the LM holding the base model.
        layers: attribute of the base model: the decoder (encoder) layers.
        attention: attribute of a layer: its attention module.
        positions: attribute of the base model: the model's own encoding, switched off.
        off: ``"rotary"`` (identity rotation ``cos = 1, sin = 0``), ``"complex"`` (identity
            ``freqs_cis = 1 + 0i``: DeepSeek-V2), ``"zero"`` (an absolute table adding 0) or
            ``"none"`` (no position module on the base: see ``off_parts``).
        qk: how the attention module stores ``W_Q``/``W_K``: ``("q_proj", "k_proj")``,
            ``("fused", name)`` (one ``Linear``: q rows, then k rows, then v rows) or
            ``("conv1d", name)`` (GPT-2's ``Conv1D``, columns q, k, v).
        causal: a decoder (True) or a bidirectional encoder (False).
        partial_rotary: HF's default RoPE rotates only ``partial_rotary_factor`` of each head
            (Phi-3); False: the whole head whatever the factor says (Llama).
        rotary_width: the width of the model's ``cos``/``sin`` as a fraction of the head
            (gpt-oss: 0.5, one entry per rotated pair).
        sub: the sub-config of the language model in a composite config (``"text_config"``:
            Qwen2-VL, Qwen3-VL; the vision tower keeps its own attention), or None.
        default: the encoding that reproduces the stock model (``posenc_layers`` when a
            config names none): ``"rope"``, or ``"gpt2"`` (learned on layer 0, then nope).
        head_dim: the config attribute holding the width of a q/k head where ``head_dim`` is not
            it (MLA: ``"qk_head_dim"``, ``qk_nope_head_dim + qk_rope_head_dim``; DeepSeek's
            ``head_dim`` is the rotary part's width), or None.
        kv_heads: the config attribute holding the number of key heads the attention function
            receives where ``num_key_value_heads`` is not it (MLA expands its latent into one key
            per query head: ``"num_attention_heads"``), or None.
        rotary_part: the config attribute holding the width of a rotary part that sits *last* in
            every q/k head (MLA's decoupled RoPE: ``"qk_rope_head_dim"``; the content part
            ``q/k_nope`` comes first), or None. The adapter moves that part to the front of q and
            k, where posenc's ``partial_rotary_factor`` turns it (a common permutation of q's and
            k's channels leaves every score as it was), and the model's ``cos``/``sin`` are that wide.
        value_dim: the config attribute holding the width of a value head where it differs from
            the q/k head (MLA: ``"v_head_dim"``), or None.
        off_parts: parts of each attention module that are the model's own position handling,
            as ``(path under the module, what its stand-in returns: "none" or "input")``; a path a
            module lacks is skipped (Inkling-2: ``relative_position_bias`` -> None, the full
            layers' ``q_proj.norm.log_scale`` -> its input). ``off="none"``: the base has none.
        takes: ``(parameter path under an attention module, parameter of the layer's encoding)``:
            the weights of an ``off_part`` that initialise the layer's posenc encoding when it has
            that parameter with that shape (the default scheme), as GPT-2's ``wpe`` does ``learned``.
        plain: class names of other modules that call HF's attention interface and carry no
            position (Inkling-2's attention residuals over layers): they keep HF's SDPA.
        rotary_layout: the layout of the rotated pairs as the attention function receives them
            under the identity stand-in: ``"half"`` (HF's ``rotate_half``, and DeepSeek-V3's
            interleave, which de-interleaves first) or ``"interleaved"`` (DeepSeek-V2's complex
            pairs ``(x_2k, x_2k+1)``, left in place); the default ``rope`` takes it as ``layout``.
        rope_elsewhere: keys of ``rope_parameters`` that the model reads for something other than
            its rotation (Mistral 4's ``llama_4_scaling_beta``, a query temperature its attention
            module applies itself), left out of the RoPE options instead of refused.
    """

    model_type: str
    lm: str
    auto: str = "causal"
    base: str = "model"
    layers: str = "layers"
    attention: str = "self_attn"
    positions: str = "rotary_emb"
    off: str = "rotary"
    qk: tuple[str, str] = ("q_proj", "k_proj")
    causal: bool = True
    partial_rotary: bool = False
    rotary_width: float = 1.0
    sub: str | None = None
    default: str = "rope"
    head_dim: str | None = None
    kv_heads: str | None = None
    rotary_part: str | None = None
    value_dim: str | None = None
    off_parts: tuple = ()
    takes: tuple = ()
    plain: tuple = ()
    rotary_layout: str = "half"
    rope_elsewhere: tuple = ()

    @property
    def rotary_off(self) -> bool:
        """The model's own encoding is a rotary module, stood in for by the identity rotation."""
        return self.off in ("rotary", "complex")

    @property
    def name(self) -> str:  # the older spelling (posenc 0.x: Family.name)
        return self.model_type

    def stock_class(self) -> type:
        return getattr(transformers, self.lm)

    def text_config(self, config):
        """The config of the language model (``config`` itself unless the family has a ``sub``)."""
        return getattr(config, self.sub) if self.sub else config

    def layer_dims(self, config, depth: int) -> Dims | list[Dims]:
        """One :class:`Dims` for every layer, or one per layer where the config gives layers their
        own head size or key heads (Gemma 4's ``per_layer_config``)."""
        if not getattr(self.text_config(config), "per_layer_config", None):
            return self.dims(config)
        dims = [self.dims(config, i) for i in range(depth)]
        return dims[0] if len(set(dims)) == 1 else dims

    def rotary_widths(self, config, depth: int) -> int | dict:
        """The width of the model's ``cos``/``sin``: one, or one per layer type (Gemma 4)."""
        if self.rotary_part:  # (MLA: the decoupled rotary part's width, one for every layer)
            return int(getattr(self.text_config(config), self.rotary_part))
        dims = self.layer_dims(config, depth)
        if isinstance(dims, Dims):
            return int(dims.head_dim * self.rotary_width)
        types = getattr(self.text_config(config), "layer_types", None) or [None] * depth
        return {t: int(d.head_dim * self.rotary_width) for t, d in zip(types, dims)}

    def dims(self, config, layer: int = 0) -> Dims:
        """The sizes of layer ``layer`` (every layer's, unless the config has ``per_layer_config``)."""
        config = self.text_config(config)
        if self.model_type == "gpt2":
            H = config.n_head
            return Dims(H, H, config.n_embd // H, config.n_embd, config.n_positions)
        per = getattr(config, "per_layer_config", None)
        own = per[layer] if per else config  # (a heterogeneous config refuses global reads of per-layer sizes)
        H = own.num_attention_heads
        head_dim = getattr(own, self.head_dim or "head_dim", None) or own.hidden_size // H
        kv = getattr(own, self.kv_heads or "num_key_value_heads", None) or H
        max_len = getattr(config, "max_position_embeddings", None)
        last = int(getattr(config, self.rotary_part)) if self.rotary_part else 0
        value = int(getattr(config, self.value_dim)) if self.value_dim else 0
        return Dims(H, kv, head_dim, config.hidden_size, max_len, rotary_last=last, value_dim=value)

    def rotary_factor(self, config) -> float | None:
        """``partial_rotary_factor`` that makes posenc's RoPE turn exactly the ``rotary_part``
        (``int(Dh·p) == width``: the plain quotient can fall one short, ``int(44·(30/44)) = 29``),
        or None for a family without one. ``config``: the model's or its language model's."""
        if not self.rotary_part:
            return None
        if self.sub and hasattr(config, self.sub):
            config = self.text_config(config)
        width = int(getattr(config, self.rotary_part))
        head_dim = int(getattr(config, self.head_dim or "head_dim"))
        p = width / head_dim
        while int(head_dim * p) < width:
            p = math.nextafter(p, 1.0)
        return p


# Multi-head latent attention: q/k heads of qk_head_dim, one key per query head, a decoupled rotary part last
_MLA = dict(
    head_dim="qk_head_dim", kv_heads="num_attention_heads", rotary_part="qk_rope_head_dim", value_dim="v_head_dim"
)

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "LlamaForCausalLM"),
        Family(
            "gpt2",
            "GPT2LMHeadModel",
            base="transformer",
            layers="h",
            attention="attn",
            positions="wpe",
            off="zero",
            qk=("conv1d", "c_attn"),
            default="gpt2",
        ),
        Family("qwen2", "Qwen2ForCausalLM"),
        Family("qwen3", "Qwen3ForCausalLM"),
        Family("mistral", "MistralForCausalLM"),
        Family("phi3", "Phi3ForCausalLM", qk=("fused", "qkv_proj"), partial_rotary=True),
        Family("gemma2", "Gemma2ForCausalLM"),
        Family("gemma3_text", "Gemma3ForCausalLM"),
        Family("gemma4_text", "Gemma4ForCausalLM"),
        Family("gpt_oss", "GptOssForCausalLM", rotary_width=0.5),
        Family(
            "qwen2_vl",
            "Qwen2VLForConditionalGeneration",
            base="model.language_model",
            sub="text_config",
            default="mrope",
        ),
        Family(
            "qwen3_vl",
            "Qwen3VLForConditionalGeneration",
            base="model.language_model",
            sub="text_config",
            default="mrope",
        ),
        Family(
            "modernbert",
            "ModernBertForMaskedLM",
            auto="masked",
            qk=("fused", "Wqkv"),
            attention="attn",
            causal=False,
            partial_rotary=True,
        ),
        # MLA (DeepSeek-V2 paper, 2024): q and one shared rotary key part per token from latents;
        # RoPE on the last qk_rope_head_dim channels only (HF's interleaved layout, with the
        # identity cos/sin, hands them over de-interleaved: posenc's "half" layout)
        Family("deepseek_v3", "DeepseekV3ForCausalLM", **_MLA),
        Family("deepseek_v2", "DeepseekV2ForCausalLM", off="complex", rotary_layout="interleaved", **_MLA),
        Family("glm4_moe_lite", "Glm4MoeLiteForCausalLM", **_MLA),
        Family(  # (its llama_4_scaling_beta query temperature stays in HF's module)
            "mistral4",
            "Mistral4ForCausalLM",
            rope_elsewhere=("llama_4_scaling_beta", "max_position_embeddings"),
            **_MLA,
        ),
        Family("youtu", "YoutuForCausalLM", **_MLA),
        Family("minicpm3", "MiniCPM3ForCausalLM", **_MLA),  # (halves layout, no interleave)
        # Inkling-2 (HF models/inkling2): the hidden-state relative bias on sliding and full layers,
        # relative states L2-clipped after a learned per-head scale, τ on full layers: posenc's
        # inkling / inkling-temperature (specs.default_specs reads the options off the config)
        Family(
            "inkling2_text",
            "Inkling2ForCausalLM",
            off="none",
            default="inkling",
            off_parts=(("relative_position_bias", "none"), ("q_proj.norm.log_scale", "input")),
            takes=(
                ("relative_position_bias.linear.weight", "r_proj.weight"),
                ("relative_position_bias.proj", "rel_proj"),
                ("relative_position_bias.norm.scale", "rel_scale"),
            ),
            plain=("Inkling2BlockAttentionResidual",),
        ),
        Family(  # Kimi K2.5: a DeepSeek-V3 language model behind a vision tower
            "kimi_k25",
            "Kimi_K25ForConditionalGeneration",
            base="model.language_model",
            sub="text_config",
            **_MLA,
        ),
    )
}


def family_by_type(model_type: str) -> Family:
    """The family of a stock ``model_type``.

    Raises:
        ValueError: a model type no family row covers, naming those covered.
    """
    fam = FAMILIES.get(model_type)
    if fam is None:
        raise ValueError(f"posenc.hf has no family for model_type {model_type!r}; covered: {sorted(FAMILIES)}")
    return fam


def family_of(model) -> Family:
    """The family of a stock or converted HF model (matched by class, subclasses included).

    Raises:
        TypeError: a model of no covered family, naming the covered classes.
    """
    for fam in FAMILIES.values():
        if isinstance(model, fam.stock_class()):
            return fam
    names = ", ".join(f.lm for f in FAMILIES.values())
    raise TypeError(f"posenc.hf.convert supports {names} (and their subclasses); got {type(model).__name__}")
