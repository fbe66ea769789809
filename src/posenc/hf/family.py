"""What a row of :data:`posenc.hf.families.FAMILIES` says: :class:`Family`, one HF model family,
and :data:`ROPE_LAYERS`, the rules by which a family's modeling file decides which layers rotate."""

from __future__ import annotations

import math
from dataclasses import dataclass

import transformers

from .rope_config import rope_options_for
from .stack import Dims

__all__ = ["Family", "ROPE_LAYERS"]


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
            (gpt-oss: 0.5, one entry per rotated pair); None: the config's ``partial_rotary_factor``
            (Phi, StableLM: ``cos``/``sin`` only as wide as the rotated part).
        sub: the sub-config of the language model in a composite config (``"text_config"``:
            Qwen2-VL, Qwen3-VL; the vision tower keeps its own attention), or None.
        default: the encoding that reproduces the stock model (``posenc_layers`` when a
            config names none): ``"rope"``, ``"lerope"`` (Mistral Large 4's learned frequencies),
            ``"mrope"``, ``"inkling"``, or ``"gpt2"`` (learned on layer 0, then nope).
        layout: how the model pairs the rotated dimensions: ``"half"`` (``rotate_half``, Llama) or
            ``"interleaved"`` (``rotate_every_two``: Cohere, GLM; DeepSeek-V2's complex pairs
            ``(x_2k, x_2k+1)``), posenc ``rope``'s ``layout``: the pairs as the attention function
            receives them (DeepSeek-V3's interleave de-interleaves before it rotates: ``"half"``).
        rope_layers: which layers rotate, by a rule of :data:`ROPE_LAYERS` (None: every layer);
            the others run ``nope`` in the stock scheme (SmolLM3, Cohere 2, EXAONE 4).
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
            that parameter with that shape (the default scheme), as GPT-2's ``wpe`` does ``learned``;
            a path starting ``"base:"`` lies under the language model instead (Mistral Large 4's
            LeRoPE ``"base:rotary_emb.alpha"`` -> ``lerope``'s ``alpha``).
        own_rotation: attributes of an attention module holding sub-modules that read the model's
            own rotation for something other than the layer's q/k: the model's rotary module stays
            (with its parameters), the layers get the identity rotation from it and these
            sub-modules its stock ``cos``/``sin`` (:class:`posenc.hf.off.RotaryTap`; the DSA
            ``indexer``, which selects each query's keys with its own RoPE).
        norms_after: ``(q norm, k norm)``: attributes of an attention module holding the q/k norms
            the model applies *after* its RoPE (HunYuan's ``query_layernorm``/``key_layernorm``);
            the module's own call of them becomes the identity and
            the attention function runs them after posenc's rotation (empty: the norms, if any, run
            where the module has them, before the rotation).
        mirrored: the model's RoPE turns each pair the other way (nanochat's ``rotate_half`` is
            ``cat(x2, -x1)``: the angle ``-iθ`` over the whole head); the attention function swaps
            the halves of q and k before posenc's rotation (the usual rotation of ``[x2 | x1]`` is
            the mirrored one of ``[x1 | x2]``; a common permutation of q and k leaves every q·k as
            it was) and back before the ``norms_after``.
        plain: class names of other modules that call HF's attention interface and carry no
            position (Inkling-2's attention residuals over layers): they keep HF's SDPA.
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
    rotary_width: float | None = 1.0
    sub: str | None = None
    default: str = "rope"
    layout: str = "half"
    rope_layers: str | None = None

    def rotates(self, config, depth: int) -> list[bool]:
        """Whether each layer applies the model's RoPE (its NoPE layers: False)."""
        if self.rope_layers is None:
            return [True] * depth
        config = self.text_config(config)
        return [bool(ROPE_LAYERS[self.rope_layers](config, i)) for i in range(depth)]

    head_dim: str | None = None
    kv_heads: str | None = None
    rotary_part: str | None = None
    value_dim: str | None = None
    off_parts: tuple = ()
    takes: tuple = ()
    plain: tuple = ()
    rope_elsewhere: tuple = ()
    own_rotation: tuple = ()
    norms_after: tuple = ()
    mirrored: bool = False

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
        if self.rotary_width is None:
            fraction = rope_options_for(self.text_config(config)).get("partial_rotary_factor", 1.0)
            return int(dims.head_dim * fraction)
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
        return Dims(
            H, kv, head_dim, config.hidden_size, max_len, rotary_last=last, value_dim=value, mirrored=self.mirrored
        )

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


def _sliding(config, i: int) -> bool:
    return config.layer_types[i] == "sliding_attention"


# which layers apply RoPE, as each modeling file decides it (a rule per model, not per checkpoint)
ROPE_LAYERS = {
    # SmolLM3 (modeling_smollm3.py: use_rope = config.no_rope_layers[layer_idx]), 1 = rotates
    "no_rope_layers": lambda config, i: config.no_rope_layers[i],
    # Cohere 2 (modeling_cohere2.py: rotates where the layer's sliding_window is set)
    "sliding": _sliding,
    # Cohere 2 MoE (modeling_cohere2_moe.py: sliding, or a dense layer under prefix_dense_sliding_window_pattern 1)
    "sliding_or_dense_prefix": lambda config, i: (
        _sliding(config, i)
        or (config.mlp_layer_types[i] == "dense" and config.prefix_dense_sliding_window_pattern == 1)
    ),
    # EXAONE 4, EXAONE MoE, Kolibri 1 (modeling_exaone4.py: sliding_window None or is_sliding)
    "sliding_or_all": lambda config, i: config.sliding_window is None or _sliding(config, i),
}
