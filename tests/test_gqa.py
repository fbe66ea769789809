"""Core attention as HF's models have it, against HF's own layers (tiny random configs, eager).

One posenc :class:`~posenc.Attention` with the HF layer's weights copied in, against the HF
attention module of the family: Llama (grouped k/v, multi-query), Qwen3 (grouped k/v, q/k
RMSNorm before RoPE), Gemma 2 (``query_pre_attn_scalar`` and logit soft-capping), Gemma 3
(Gemma's ``(1 + w)`` q/k norm, ``query_pre_attn_scalar``); and the three norms against the
HF modules themselves.
"""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_close, attention_n
from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, Qwen3Config
from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention, Gemma2RotaryEmbedding
from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention, Gemma3RMSNorm, Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
from transformers.models.llama4.modeling_llama4 import Llama4TextL2Norm
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RMSNorm, Qwen3RotaryEmbedding

import posenc
from posenc.layer.qk_norm import QKNorm

D, H, DH, L, B = 32, 4, 8, 10, 2
N = attention_n(dim=D, head_dim=DH, length=L)
COMMON = dict(
    hidden_size=D, num_attention_heads=H, head_dim=DH, intermediate_size=16, num_hidden_layers=1, vocab_size=32,
    max_position_embeddings=64, rms_norm_eps=1e-6, attention_bias=False,
)  # fmt: skip


def _hf(attn_cls, rope_cls, cfg, **forward_kw):
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = attn_cls(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))  # norm weights off their init too
    rope = rope_cls(cfg)
    return layer, rope


def _run_hf(layer, rope, x, causal_mask, rope_kw=None):
    pos = torch.arange(L).expand(B, L)
    cos, sin = rope(x, pos, **(rope_kw or {}))
    with torch.no_grad():
        return layer(x, (cos, sin), causal_mask)[0]


def _posenc_from(layer, **kw) -> posenc.Attention:
    attn = posenc.Attention(D, H, "rope", head_dim=DH, max_len=64, **kw).eval()
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(attn, name).weight.copy_(getattr(layer, name).weight)
        if attn.q_norm is not None:
            attn.q_norm.weight.copy_(layer.q_norm.weight)
            attn.k_norm.weight.copy_(layer.k_norm.weight)
    return attn


def _mask():
    return torch.zeros(1, 1, L, L).masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))


def _x():
    return torch.randn(B, L, D, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa", "mqa"])
def test_grouped_kv_equals_hf_llama_attention(kv_heads):
    """HF's repeat_kv + eager attention: posenc's grouped k/v on every backend rope runs."""
    layer, rope = _hf(LlamaAttention, LlamaRotaryEmbedding, LlamaConfig(**COMMON, num_key_value_heads=kv_heads))
    x = _x()
    ref = _run_hf(layer, rope, x, _mask())
    attn = _posenc_from(layer, kv_heads=kv_heads)
    assert attn.k_proj.weight.shape == (kv_heads * DH, D)
    for backend in posenc.supported_backends(attn.encoding):
        with torch.no_grad():
            assert_close(attn(x, backend=backend), ref, n=N, msg=backend)
    cache = attn.init_cache(B, L)
    with torch.no_grad():
        steps = torch.cat([attn(x[:, :4], cache=cache), *(attn(x[:, i : i + 1], cache=cache) for i in range(4, L))], 1)
    assert cache.k.shape == (B, kv_heads, L, DH)  # the cache holds kv_heads, not H
    assert_close(steps, ref, n=N)


def test_qwen3_qk_norm_before_rope_equals_hf():
    cfg = Qwen3Config(**COMMON, num_key_value_heads=2)
    layer, rope = _hf(Qwen3Attention, Qwen3RotaryEmbedding, cfg)
    x = _x()
    attn = _posenc_from(layer, kv_heads=2, qk_norm="rms", qk_norm_eps=1e-6)
    with torch.no_grad():
        out = attn(x)
    assert_close(out, _run_hf(layer, rope, x, _mask()), n=N)
    # the norm's place matters: after the rotation it is another layer
    after = _posenc_from(layer, kv_heads=2, qk_norm="rms", qk_norm_position="after")
    with torch.no_grad():
        assert (after(x) - out).abs().max() > 1e-3


def test_gemma2_softcap_and_query_pre_attn_scalar_equal_hf():
    cfg = Gemma2Config(
        **COMMON, num_key_value_heads=2, query_pre_attn_scalar=24, attn_logit_softcapping=0.5,
        layer_types=["full_attention"], sliding_window=None,
    )  # fmt: skip
    layer, rope = _hf(Gemma2Attention, Gemma2RotaryEmbedding, cfg)
    x = 4 * _x()  # large scores: the cap of 0.5 bites
    ref = _run_hf(layer, rope, x, _mask())
    attn = _posenc_from(layer, kv_heads=2, score_scale=24**-0.5, softcap=0.5)
    assert posenc.supported_backends(attn.encoding) == ["flex", "chunked", "eager"]
    for backend in ("chunked", "eager"):  # (flex with a cap against eager: tests/test_softcap.py)
        with torch.no_grad():
            assert_close(attn(x, backend=backend), ref, n=N, msg=backend)
    plain = _posenc_from(layer, kv_heads=2, score_scale=24**-0.5)
    with torch.no_grad():
        assert (plain(x) - ref).abs().max() > 1e-3  # without the cap: another result


def test_gemma3_qk_norm_and_scale_equal_hf():
    cfg = Gemma3TextConfig(
        **COMMON, num_key_value_heads=1, query_pre_attn_scalar=32, layer_types=["full_attention"], sliding_window=None,
    )  # fmt: skip
    layer, rope = _hf(Gemma3Attention, Gemma3RotaryEmbedding, cfg)
    x = _x()
    ref = _run_hf(layer, rope, x, _mask(), {"layer_type": "full_attention"})
    attn = _posenc_from(layer, kv_heads=1, qk_norm="gemma-rms", score_scale=32**-0.5)
    base = cfg.rope_parameters["full_attention"]["rope_theta"]
    attn.encoding = posenc.build("rope", heads=H, head_dim=DH, max_len=64, base=base).set_scores(scale=32**-0.5)
    with torch.no_grad():
        assert_close(attn(x), ref, n=N)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("kind", "hf"),
    [("rms", lambda: Qwen3RMSNorm(DH, eps=1e-5)), ("gemma-rms", lambda: Gemma3RMSNorm(DH, eps=1e-5)),
     ("l2", lambda: Llama4TextL2Norm(eps=1e-5))],
)  # fmt: skip
def test_qk_norm_modules_equal_hf_bit_for_bit(kind, hf, dtype):
    ref = hf()
    ours = QKNorm(kind, DH, eps=1e-5)
    if kind != "l2":
        with torch.no_grad():
            ref.weight.copy_(torch.randn(DH))
            ours.weight.copy_(ref.weight)
    ref, ours = ref.to(dtype), ours.to(dtype)
    x = (3 * torch.randn(B, H, L, DH)).to(dtype)
    assert torch.equal(ours(x), ref(x))
    assert ours(x).dtype == ref(x).dtype


def test_qk_norm_init_follows_hf():
    assert torch.equal(QKNorm("rms", DH).weight, Qwen3RMSNorm(DH).weight)
    assert torch.equal(QKNorm("gemma-rms", DH).weight, Gemma3RMSNorm(DH).weight)
    assert QKNorm("l2", DH).weight is None


def test_bad_attention_settings_raise():
    with pytest.raises(ValueError, match=r"kv_heads must be a positive int dividing heads=4.*got 3"):
        posenc.Attention(D, H, "rope", kv_heads=3)
    with pytest.raises(ValueError, match=r"kv_heads must be a positive int dividing heads=4.*got 0"):
        posenc.Attention(D, H, "rope", kv_heads=0)
    with pytest.raises(ValueError, match=r"qk_norm must be one of \('rms', 'gemma-rms', 'l2'\) or None, got 'layer'"):
        posenc.Attention(D, H, "rope", qk_norm="layer")
    with pytest.raises(ValueError, match=r"qk_norm_position must be one of \('before', 'after'\), got 'middle'"):
        posenc.Attention(D, H, "rope", qk_norm="rms", qk_norm_position="middle")
    with pytest.raises(ValueError, match=r"qk_norm_eps must be a finite number >= 0, got -1"):
        posenc.Attention(D, H, "rope", qk_norm="rms", qk_norm_eps=-1)
    with pytest.raises(ValueError, match=r"softcap must be a positive finite number or None, got -2"):
        posenc.Attention(D, H, "rope", softcap=-2)
    with pytest.raises(ValueError, match=r"kv_heads must be a positive int dividing heads=4.*got 3"):
        posenc.ModelConfig(32, D, 2, H, kv_heads=3)
    with pytest.raises(ValueError, match=r"kv_heads must be a positive int dividing heads=4.*got 3"):
        posenc.ModelConfig(32, D, 2, H, layers=[posenc.LayerSpec("rope"), posenc.LayerSpec("rope", kv_heads=3)])


def test_built_encoding_keeps_its_score_settings():
    enc = posenc.build("alibi", heads=H, head_dim=DH).set_scores(softcap=30.0)
    attn = posenc.Attention(D, H, enc, head_dim=DH)  # None: the encoding's
    assert attn.encoding.softcap == 30.0
    posenc.Attention(D, H, enc, head_dim=DH, softcap=30)  # equal: fine
    with pytest.raises(ValueError, match=r"softcap=20.0 given with an encoding built with softcap=30.0"):
        posenc.Attention(D, H, enc, head_dim=DH, softcap=20)
    with pytest.raises(ValueError, match=r"score_scale=0.5 given with an encoding built with score_scale=None"):
        posenc.Attention(D, H, enc, head_dim=DH, score_scale=0.5)


def test_model_layers_share_encodings_only_with_equal_score_settings():
    """T5 shares one bucket table across layers; a layer with its own cap gets its own instance."""
    specs = [posenc.LayerSpec("t5"), posenc.LayerSpec("t5"), posenc.LayerSpec("t5", softcap=5.0)]
    lm = posenc.TransformerLM(32, D, 3, H, layers=specs, softcap=50.0, kv_heads=2)
    encs = [b.attn.encoding for b in lm.blocks]
    assert encs[0] is encs[1] and encs[2] is not encs[0]
    assert (encs[0].softcap, encs[2].softcap) == (50.0, 5.0)
    assert all(b.attn.kv_heads == 2 for b in lm.blocks)


def test_config_round_trips_and_old_configs_load():
    cfg = posenc.ModelConfig(
        32, D, 2, H, encoding="rope(kv_heads=1,softcap=20),rope", kv_heads=2, qk_norm="gemma-rms",
        qk_norm_position="after", score_scale=0.25,
    )  # fmt: skip
    assert [s.kv_heads for s in cfg.layers] == [1, None] and cfg.layers[0].softcap == 20.0
    assert cfg.layers[0].describe() == "rope(kv_heads=1,softcap=20.0)"
    back = posenc.ModelConfig.from_dict(cfg.to_dict())
    assert back == cfg
    lm = posenc.TransformerLM(config=back)
    assert [b.attn.kv_heads for b in lm.blocks] == [1, 2]
    assert lm.blocks[1].attn.qk_norm_position == "after" and lm.blocks[1].attn.encoding.score_scale == 0.25
    old = {k: v for k, v in posenc.ModelConfig(32, D, 2, H).to_dict().items() if k not in _NEW}
    assert posenc.ModelConfig.from_dict(old).kv_heads is None


_NEW = ("kv_heads", "qk_norm", "qk_norm_position", "qk_norm_eps", "score_scale", "softcap")


@pytest.mark.parametrize("name", ["rope", "alibi"])
def test_grouped_kv_with_window_and_sinks_every_backend_and_rolling_cache(name):
    """Grouped k/v through the query-blocked SDPA path (a window), learned sinks and the
    rolling window cache, which stores kv_heads keys."""
    torch.manual_seed(0)
    attn = posenc.Attention(D, H, name, head_dim=DH, window=3, sinks=True, kv_heads=2).eval()
    with torch.no_grad():
        attn.sinks.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    x = _x()
    with torch.no_grad():
        ref = attn(x, backend="eager")
        for backend in posenc.supported_backends(attn.encoding):
            assert_close(attn(x, backend=backend), ref, n=N, msg=backend)
        cache = attn.init_cache(B, L)
        steps = torch.cat([attn(x[:, i : i + 1], cache=cache) for i in range(L)], 1)
    assert cache.k.shape[1] == 2 and cache.k.shape[2] <= 2  # W - 1 keys of 2 heads
    assert_close(steps, ref, n=N)
