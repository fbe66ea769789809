"""The Hugging Face model families ``posenc.hf`` converts, as data.

What the families share is one code path (:mod:`posenc.hf.models`, :mod:`posenc.hf.convert`);
what differs between them is a row of :data:`FAMILIES`: where the base model, its layers, their
attention modules and the model's own position encoding live, how ``W_Q``/``W_K`` are stored
(separate, fused ``Linear``, GPT-2's fused ``Conv1D``), whether the model is causal and whether HF's
default RoPE honours ``partial_rotary_factor``. (Attention dropout needs no row: HF's modules
pass their own to the attention function in training.) A new family with HF's usual attention interface is one row.
"""

from __future__ import annotations

from .family import ROPE_LAYERS, Family

__all__ = ["Family", "FAMILIES", "ROPE_LAYERS", "family_of", "family_by_type"]


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
        # ---- rows measured by scripts/hf_coverage.py (docs/hf.md, "Every model type"): Llama's layout
        *(
            Family(t, lm)
            for t, lm in (
                ("apertus", "ApertusForCausalLM"),
                ("apertus1p5_text", "Apertus1p5TextForCausalLM"),
                ("arcee", "ArceeForCausalLM"),
                ("aria_text", "AriaTextForCausalLM"),
                ("bitnet", "BitNetForCausalLM"),
                ("cwm", "CwmForCausalLM"),
                ("diffllama", "DiffLlamaForCausalLM"),
                ("dots1", "Dots1ForCausalLM"),
                ("flex_olmo", "FlexOlmoForCausalLM"),
                ("gemma", "GemmaForCausalLM"),
                ("granite", "GraniteForCausalLM"),
                ("granitemoe", "GraniteMoeForCausalLM"),
                ("granitemoeshared", "GraniteMoeSharedForCausalLM"),
                ("hy_v3", "HYV3ForCausalLM"),
                ("hyperclovax", "HyperCLOVAXForCausalLM"),
                ("jais2", "Jais2ForCausalLM"),
                ("lfm2", "Lfm2ForCausalLM"),
                ("mellum", "MellumForCausalLM"),
                ("minimax_m2", "MiniMaxM2ForCausalLM"),
                ("minimax_m3_vl_text", "MiniMaxM3VLForCausalLM"),
                ("ministral", "MinistralForCausalLM"),
                ("mixtral", "MixtralForCausalLM"),
                ("olmo", "OlmoForCausalLM"),
                ("olmo2", "Olmo2ForCausalLM"),  # q/k norm over the whole projection: inside HF's module
                ("olmo3", "Olmo3ForCausalLM"),
                ("olmoe", "OlmoeForCausalLM"),
                ("phimoe", "PhimoeForCausalLM"),
                ("qwen2_moe", "Qwen2MoeForCausalLM"),
                ("qwen3_moe", "Qwen3MoeForCausalLM"),
                ("seed_oss", "SeedOssForCausalLM"),
                ("solar_open", "SolarOpenForCausalLM"),
                ("starcoder2", "Starcoder2ForCausalLM"),
                ("vaultgemma", "VaultGemmaForCausalLM"),
            )
        ),
        Family("gemma4_unified_text", "Gemma4UnifiedForCausalLM"),
        Family("falcon_h1", "FalconH1ForCausalLM"),  # (its attention layers; Mamba mixers beside them keep HF's)
        # q/k norms after RoPE (modeling_hunyuan_v1_dense.py: rotate, then query_layernorm/key_layernorm)
        Family("hunyuan_v1_dense", "HunYuanDenseV1ForCausalLM", norms_after=("query_layernorm", "key_layernorm")),
        Family("hunyuan_v1_moe", "HunYuanMoEV1ForCausalLM", norms_after=("query_layernorm", "key_layernorm")),
        # nanochat: the same order, and a rotate_half of cat(x2, -x1) (modeling_nanochat.py)
        Family("nanochat", "NanoChatForCausalLM", norms_after=("q_norm", "k_norm"), mirrored=True),
        Family("smollm3", "SmolLM3ForCausalLM", rope_layers="no_rope_layers"),
        Family("exaone4", "Exaone4ForCausalLM", rope_layers="sliding_or_all"),
        Family("exaone_moe", "ExaoneMoeForCausalLM", rope_layers="sliding_or_all"),
        Family("kolibri1", "Kolibri1ForCausalLM", rope_layers="sliding_or_all"),
        Family("afmoe", "AfmoeForCausalLM", rope_layers="sliding"),  # (modeling_afmoe.py: is_local_attention)
        Family("flint", "FlintForCausalLM", rope_layers="sliding"),  # (modeling_flint.py: only sliding layers rotate)
        # interleaved pairs (rotate_every_two / repeat_interleave)
        Family("cohere", "CohereForCausalLM", layout="interleaved"),
        Family("cohere2", "Cohere2ForCausalLM", layout="interleaved", rope_layers="sliding"),
        Family("cohere2_moe", "Cohere2MoeForCausalLM", layout="interleaved", rope_layers="sliding_or_dense_prefix"),
        Family("ernie4_5", "Ernie4_5ForCausalLM", layout="interleaved"),
        Family("ernie4_5_moe", "Ernie4_5_MoeForCausalLM", layout="interleaved"),
        Family("helium", "HeliumForCausalLM", layout="interleaved"),
        # partial rotary (the first partial_rotary_factor of each head)
        Family("glm", "GlmForCausalLM", layout="interleaved", partial_rotary=True),
        Family("glm4", "Glm4ForCausalLM", layout="interleaved", partial_rotary=True),
        Family("glm4_moe", "Glm4MoeForCausalLM", partial_rotary=True),
        Family("laguna", "LagunaForCausalLM", partial_rotary=True),
        Family("nemotron", "NemotronForCausalLM", partial_rotary=True),
        Family("phi", "PhiForCausalLM", partial_rotary=True, rotary_width=None),
        Family("stablelm", "StableLmForCausalLM", partial_rotary=True, rotary_width=None),
        # encoders
        Family("eurobert", "EuroBertForMaskedLM", auto="masked", causal=False),
        Family("ultrabert", "UltrabertForMaskedLM", auto="masked", causal=False),
        # MLA (DeepSeek-V2 paper, 2024): q and one shared rotary key part per token from latents;
        # RoPE on the last qk_rope_head_dim channels only (HF's interleaved layout, with the
        # identity cos/sin, hands them over de-interleaved: posenc's "half" layout)
        Family("deepseek_v3", "DeepseekV3ForCausalLM", **_MLA),
        Family("deepseek_v2", "DeepseekV2ForCausalLM", off="complex", layout="interleaved", **_MLA),
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
        # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): MLA whose indexer (its own RoPE, half layout,
        # from the model's cos/sin) selects each query's top-k keys (posenc.AttentionMask.selected)
        Family("deepseek_v32", "DeepseekV32ForCausalLM", own_rotation=("indexer",), **_MLA),
        Family("glm_moe_dsa", "GlmMoeDsaForCausalLM", own_rotation=("indexer",), **_MLA),
        Family(  # Mistral Large 4 (models/mistral_large4): MLA, LeRoPE under YaRN, NoPE every 4th layer,
            # DeepSeek Sparse Attention (the indexer keeps the model's RoPE; its top-k reaches the attention
            # function as `indices`: posenc.AttentionMask.selected), key/value sharing between layers
            "mistral_large4",
            "MistralLarge4ForConditionalGeneration",
            base="model.language_model",
            sub="text_config",
            default="lerope",
            rope_layers="no_rope_layers",
            takes=(("base:rotary_emb.alpha", "alpha"),),
            own_rotation=("indexer",),
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
