"""LeRoPE (``lerope``) against HF ``MistralLarge4TextRotaryEmbedding`` (transformers
``models/mistral_large4``): Mistral Large 4's YaRN (factor 2048 over a 512-token window,
``attention_factor`` 1) with a learned ``α`` per frequency, ``inv_freq·exp(α)``. Oracle: HF's
module with the same ``α``, its cos/sin applied with HF's ``rotate_half`` formula, on full tensors.
"""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_close

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import rotate_half  # noqa: E402
from transformers.models.mistral_large4 import modeling_mistral_large4 as hf  # noqa: E402

import posenc  # noqa: E402
from posenc.hf import rope_options_for  # noqa: E402

ROPE = 16  # qk_rope_head_dim: HF's rotary width (config.head_dim points at it)


def hf_rotary() -> tuple[torch.nn.Module, dict]:
    cfg = transformers.MistralLarge4TextConfig(
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        qk_rope_head_dim=ROPE,
        qk_nope_head_dim=8,
        v_head_dim=8,
        kv_lora_rank=8,
        vocab_size=32,
        n_routed_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=8,
        intermediate_size=16,
        index_n_heads=2,
        index_head_dim=ROPE,
        index_topk=4,
    )
    module = hf.MistralLarge4TextRotaryEmbedding(cfg)
    with torch.no_grad():
        module.alpha.copy_(0.3 * torch.randn_like(module.alpha))
    return module, cfg


def lerope_of(cfg, module) -> posenc.PositionEncoding:
    """posenc's encoding with the config's RoPE options (as ``posenc.hf`` reads them) and HF's ``α``."""
    opts = rope_options_for(cfg)
    enc = posenc.build("lerope", heads=2, head_dim=ROPE, max_len=cfg.max_position_embeddings, **opts)
    with torch.no_grad():
        enc.alpha.copy_(module.alpha)
    return enc


def test_config_is_mistral_large4s_yarn_and_nope_pattern():
    """What the lines cited above set: YaRN 2048 over 512 with attention factor 1, NoPE every 4th layer."""
    module, cfg = hf_rotary()
    p = cfg.rope_parameters
    assert (p["rope_type"], p["factor"], p["original_max_position_embeddings"], p["attention_factor"]) == (
        "yarn",
        2048.0,
        512,
        1.0,
    )
    assert cfg.no_rope_layers == [1, 1, 1, 0] and module.alpha.shape == (ROPE // 2,)


def test_rotation_equals_hf_with_learned_alpha():
    """Queries and keys turned by HF's cos/sin (``inv_freq·exp(α)``, ``rotate_half``) and by
    ``lerope`` with the same ``α``, at positions inside and past the 512-token window."""
    module, cfg = hf_rotary()
    enc = lerope_of(cfg, module)
    pos = torch.tensor([[0, 1, 7, 300, 511, 512, 900, 5000]])
    q, k = torch.randn(1, 2, 8, ROPE), torch.randn(1, 2, 8, ROPE)
    with torch.no_grad():
        cos, sin = module(q, pos)
        cos, sin = cos[:, None], sin[:, None]
        want_q = q * cos + rotate_half(q) * sin
        want_k = k * cos + rotate_half(k) * sin
        got_q, got_k = enc.rotate(q, k, pos, pos)
    # angles up to 5000·θ: float32 rounding of HF's product, relative 2^-24 of the angle
    assert_close(got_q, want_q, rtol=1e-5, atol=5000 * 2**-23 * 4)
    assert_close(got_k, want_k, rtol=1e-5, atol=5000 * 2**-23 * 4)
    plain = posenc.build("rope", heads=2, head_dim=ROPE, max_len=cfg.max_position_embeddings, **rope_options_for(cfg))
    assert (plain.rotate(q, k, pos, pos)[0] - got_q).abs().max() > 1e-2  # α moved the frequencies


def test_alpha_is_learned_and_starts_as_rope():
    """``α = 0`` is the configured RoPE exactly; a loss on the rotated queries reaches ``α``."""
    enc = posenc.build("lerope", heads=2, head_dim=8, max_len=64)
    rope = posenc.build("rope", heads=2, head_dim=8, max_len=64)
    q, k, pos = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.arange(5)
    assert torch.equal(enc.rotate(q, k, pos, pos)[0], rope.rotate(q, k, pos, pos)[0])
    enc.rotate(q, k, pos, pos)[0].square().sum().backward()
    assert enc.alpha.grad is not None and enc.alpha.grad.abs().sum() > 0


def test_axes_are_not_an_option():
    with pytest.raises(ValueError, match="unknown option.*'axes'.*for encoding 'lerope'"):
        posenc.build("lerope", heads=2, head_dim=8, axes=2)
