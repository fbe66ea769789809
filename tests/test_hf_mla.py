"""``posenc.hf.convert`` on Multi-head Latent Attention (MLA, DeepSeek-V2/V3): RoPE on a decoupled
rotary part that HF puts last in each q/k head (``qk_rope_head_dim``, one key part shared by every
head), content in ``q/k_nope``, values narrower than q/k heads, HF's cache holding the latent.

Oracles: the stock HF model with the same weights (tiny random configs, no download): its logits,
its greedy tokens; for cached decoding, the uncached forward over every token.
"""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_close, attention_n

transformers = pytest.importorskip("transformers")
from tests.test_hf import greedy  # noqa: E402
from tests.test_hf_families import assert_parity_padded_and_rotation_matters, logits, trainer_step  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402

import posenc.hf as ph  # noqa: E402
from posenc.hf.families import FAMILIES  # noqa: E402

V = 96
YARN = {  # DeepSeek-V3's own form: mscale pair, scores scaled by mscale(factor, mscale_all_dim)^2
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
}
VARIANTS = {
    "interleaved": {},
    "halves": {"rope_interleave": False},
    "yarn": {"rope_parameters": YARN},
    "no_q_lora": {"q_lora_rank": None},
}


def deepseek_config(**kw):
    base = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        initializer_range=0.3,  # sharp attention: logits that depend on every position term
    )
    return transformers.DeepseekV3Config(**base | kw)


def stock(variant: str = "interleaved") -> torch.nn.Module:
    torch.manual_seed(7)
    model = transformers.DeepseekV3ForCausalLM(deepseek_config(**VARIANTS[variant])).eval()
    with torch.no_grad():  # norms off their ones init, so a dropped one shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model


def mla_n(cfg, length: int) -> int:
    """Reduction length behind the logits (tests/conftest.py): per layer the q and kv latents
    (D), their norms and up-projections (ranks), q·k over the q/k head, the MoE/MLP (D, then its
    widest hidden size, twice for shared + routed experts), four norms; then the final norm and
    the head."""
    D, Dh = cfg.hidden_size, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    ranks = 2 * ((cfg.q_lora_rank or 0) + cfg.kv_lora_rank)
    layer = attention_n(dim=D, length=length, head_dim=Dh) + ranks + 2 * (D + cfg.intermediate_size) + 4 * D
    return cfg.num_hidden_layers * layer + 3 * D


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rope_on_the_decoupled_part_reproduces_stock_logits(variant):
    """The default conversion rotates exactly the last ``qk_rope_head_dim`` channels (moved to
    the front) with the config's base and scaling: stock logits, left padding included."""
    model = stock(variant)
    ours = ph.convert(model).eval()
    spec = ours.config.posenc_layers[0]
    assert spec["encoding"] == "rope" and ours.model.posenc.encoding(0).rotary_dim == 8
    ids = torch.randint(1, V, (2, 20))  # past original_max_position_embeddings (16) of the YaRN variant
    n = mla_n(model.config, 20)
    assert_parity_padded_and_rotation_matters(model, ours, ids, n)


def test_yarn_scores_keep_deepseeks_mscale_squared():
    """DeepSeek's YaRN scales scores by ``mscale(factor, mscale_all_dim)^2 / sqrt(Dh)`` and cos/sin
    by ``mscale / mscale_all_dim``: the encoding carries both (the attention factor differs from 1)."""
    model = stock("yarn")
    enc = ph.convert(model).model.posenc.encoding(0)
    want_scale = model.model.layers[0].self_attn.scaling
    assert enc.score_scale == pytest.approx(want_scale, rel=1e-12) and want_scale != pytest.approx(24**-0.5)
    assert enc.attention_factor == pytest.approx(model.model.rotary_emb.attention_scaling, rel=1e-12)
    assert enc.attention_factor != pytest.approx(1.0)


@pytest.mark.parametrize("encoding", [None, "alibi"])
def test_cached_generation_equals_uncached(encoding):
    """HF's cache holds the latent and the (here unrotated) shared rotary key part; posenc rotates
    every cached key part at its position on each step: cached = uncached greedy decoding, and
    with the model's own scheme the stock model's tokens."""
    model = stock()
    ours = ph.convert(model, encoding=encoding).eval()
    ids = torch.randint(1, V, (2, 5))
    cache = DynamicCache(config=ours.config)
    cached, cached_logits = greedy(ours, ids, 14, cache=cache)
    uncached, uncached_logits = greedy(ours, ids, 14, use_cache=False)
    assert torch.equal(cached, uncached)
    assert_close(cached_logits, uncached_logits, n=mla_n(model.config, 19))
    assert cache.layers[0].keys.shape[-1] == model.config.kv_lora_rank  # the latent, as stock HF caches it
    if encoding is None:
        want, want_logits = greedy(model, ids, 14, cache=DynamicCache(config=model.config))
        assert torch.equal(cached, want)
        assert_close(cached_logits, want_logits, n=mla_n(model.config, 19))


def test_save_pretrained_round_trips_bit_for_bit(tmp_path):
    model = ph.convert(stock(), encoding=["alibi", "rope"]).eval()
    with torch.no_grad():
        for p in model.posenc_stack.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded).__name__ == "PosencDeepseekV3ForCausalLM"
    assert loaded.config.posenc_layers == model.config.posenc_layers
    ids = torch.randint(1, V, (2, 11))
    assert torch.equal(logits(loaded, ids), logits(model, ids))


def test_rotary_part_under_yarn_equals_a_stock_yarn_model():
    """A swap of the rotary part to YaRN (options at conversion) is the stock model whose config
    names that YaRN, with the same weights."""
    plain = stock()
    scaling = {k: v for k, v in YARN.items() if k not in ("rope_type", "rope_theta")}
    ours = ph.convert(plain, encoding="rope", rope_scaling={"rope_type": "yarn", **scaling}).eval()
    yarn = transformers.DeepseekV3ForCausalLM(deepseek_config(rope_parameters=YARN)).eval()
    yarn.load_state_dict(plain.state_dict())
    ids = torch.randint(1, V, (2, 20))
    # (HF scales yarn's scores by mscale^2; the swapped model keeps the plain model's 1/sqrt(Dh),
    # so compare with that scale put back)
    for layer in yarn.model.layers:
        layer.self_attn.scaling = plain.model.layers[0].self_attn.scaling
    assert_close(logits(ours, ids), logits(yarn, ids), n=mla_n(plain.config, 20))


@pytest.mark.parametrize("encoding", ["alibi", "rope"])
def test_swap_trains_one_trainer_step(encoding, tmp_path):
    kw = {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}} if encoding == "rope" else {}
    model = ph.convert(stock(), encoding=encoding, **kw)
    loss, change = trainer_step(model, tmp_path)
    assert 0 < loss < 50 and change > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_value_stage_encodings_are_refused_at_conversion():
    """MLA's values are narrower than its q/k heads: an encoding with a value stage is refused in
    one line when converted, not at the first forward."""
    with pytest.raises(ValueError, match="'rope-value' acts on the values, whose heads are 12 wide"):
        ph.convert(stock(), encoding="rope-value")


@pytest.mark.parametrize("rope, nope", [(8, 16), (30, 14), (26, 19), (64, 128)])
def test_rotary_factor_turns_exactly_the_rotary_part(rope, nope):
    """``int(Dh·p)`` of the factor is the rotary width, also where ``rope / Dh`` falls short
    (``int(44·(30/44)) = 29``)."""
    cfg = deepseek_config(qk_rope_head_dim=rope, qk_nope_head_dim=nope)
    p = FAMILIES["deepseek_v3"].rotary_factor(cfg)
    assert int((rope + nope) * p) == rope


def _kimi(**kw):
    vision = dict(
        patch_size=2,
        pos_emb_height=4,
        pos_emb_width=4,
        pos_emb_time=1,
        num_attention_heads=2,
        num_hidden_layers=1,
        hidden_size=16,
        intermediate_size=32,
    )
    tokens = dict(image_token_id=V - 1, video_token_id=V - 2, vision_start_token_id=V - 3, vision_end_token_id=V - 4)
    return transformers.Kimi_K25Config(
        text_config=deepseek_config(**kw).to_dict(), vision_config=vision, projection_hidden_size=16, **tokens
    )


# the other MLA families of transformers 5.24 that are one row each: (LM class, config)
SHARED = {
    "deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV2Config"),
    "glm4_moe_lite": ("Glm4MoeLiteForCausalLM", "Glm4MoeLiteConfig"),
    "youtu": ("YoutuForCausalLM", "YoutuConfig"),
    "minicpm3": ("MiniCPM3ForCausalLM", "MiniCPM3Config"),
    "kimi_k25": ("Kimi_K25ForConditionalGeneration", None),
}


def shared_config(family: str):
    """The tiny config of an MLA family of :data:`SHARED` (also scripts/hf_coverage.py's)."""
    config = SHARED[family][1]
    if config is None:
        return _kimi()
    fields = {k: v for k, v in deepseek_config().to_dict().items() if k in getattr(transformers, config)().to_dict()}
    return getattr(transformers, config)(**fields | dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}))


def mistral4_config():
    """Mistral 4's tiny config (its own head_dim: the whole q/k head), temperature from the fifth token."""
    skip = ("rope_parameters", "head_dim")
    fields = {k: v for k, v in deepseek_config().to_dict().items() if k in transformers.Mistral4Config().to_dict()}
    cfg = transformers.Mistral4Config(**{k: v for k, v in fields.items() if k not in skip})
    cfg.rope_parameters["original_max_position_embeddings"] = 4
    return cfg


def shared_stock(family: str) -> torch.nn.Module:
    torch.manual_seed(11)
    model = getattr(transformers, SHARED[family][0])(shared_config(family)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.slow
@pytest.mark.parametrize("family", list(SHARED))
def test_other_mla_families_reproduce_stock_and_decode_cached(family):
    """DeepSeek-V2 (complex pairs), GLM-4 MoE Lite (glm4_moe_lite), Youtu, MiniCPM3 (halves layout)
    and Kimi K2.5 (a DeepSeek-V3 behind a vision tower) share DeepSeek-V3's attention: rows of data, stock logits, cached = uncached
    greedy decoding equal to the stock model's tokens."""
    model = shared_stock(family)
    ours = ph.convert(model).eval()
    assert type(ours).__name__ == "Posenc" + type(model).__name__
    cfg = model.config.get_text_config()
    ids = torch.randint(1, V - 4, (2, 20))
    assert_close(logits(ours, ids), logits(model, ids), n=mla_n(cfg, 20))
    prompt = ids[:, :5]
    cached, cached_logits = greedy(ours, prompt, 8, cache=DynamicCache(config=cfg))
    uncached, _ = greedy(ours, prompt, 8, use_cache=False)
    want, _ = greedy(model, prompt, 8)
    assert torch.equal(cached, uncached) and torch.equal(cached, want)


def test_deepseek_v2_complex_pairs_stay_interleaved():
    """DeepSeek-V2 turns its rotary part as complex numbers (``freqs_cis``), pairs ``(x_2k, x_2k+1)``
    left in place: the stand-in hands it ``1 + 0i`` and the default ``rope`` turns the part in the
    ``interleaved`` layout; stock logits (the ``half`` layout would not give them)."""
    model = shared_stock("deepseek_v2")
    ours = ph.convert(model).eval()
    assert ours.config.posenc_layers[0]["options"]["layout"] == "interleaved"
    ids = torch.randint(1, V, (2, 20))
    want = logits(model, ids)
    assert_close(logits(ours, ids), want, n=mla_n(model.config, 20))
    halves = ph.convert(model, encoding="rope", layout="half").eval()
    assert (logits(halves, ids) - want).abs().max() > 1e-2


def test_mistral4_keeps_its_query_temperature_and_converts():
    """Mistral 4 (MLA, YaRN with DeepSeek's mscale pair) scales queries by Llama 4's
    ``1 + β·ln(1 + ⌊pos/orig⌋)`` inside its attention module, from a key of ``rope_parameters``
    (``llama_4_scaling_beta``) that is no RoPE option: its row leaves that key to the module
    (``rope_elsewhere``). With ``orig = 4`` the temperature acts from the fifth token: stock logits,
    and cached = uncached greedy decoding with the stock model's tokens."""
    cfg = mistral4_config()
    torch.manual_seed(5)
    model = transformers.Mistral4ForCausalLM(cfg).eval()
    ours = ph.convert(model).eval()
    assert "llama_4_scaling_beta" not in ours.config.posenc_layers[0]["options"]["rope_scaling"]
    ids = torch.randint(1, V, (2, 20))
    assert_close(logits(ours, ids), logits(model, ids), n=mla_n(cfg, 20))
    prompt = ids[:, :5]
    cached, cached_logits = greedy(ours, prompt, 8, cache=DynamicCache(config=cfg))
    uncached, uncached_logits = greedy(ours, prompt, 8, use_cache=False)
    want, _ = greedy(model, prompt, 8)
    assert torch.equal(cached, uncached) and torch.equal(cached, want)
    assert_close(cached_logits, uncached_logits, n=mla_n(cfg, 13))
