"""T5 relative buckets (``t5``): parity with HF ``T5Attention`` stacks, decoder buckets, score_mod."""

from __future__ import annotations

import warnings

import pytest
import torch
from tests.conftest import assert_close, attention_n
from transformers import T5Config
from transformers.models.t5.modeling_t5 import T5Attention

import posenc

H, DKV, DMODEL = 4, 8, 24


def _hf_layer(causal, has_bias, layer_idx, num_buckets=32, max_distance=128):
    cfg = T5Config(
        d_model=DMODEL,
        d_kv=DKV,
        num_heads=H,
        relative_attention_num_buckets=num_buckets,
        relative_attention_max_distance=max_distance,
        dropout_rate=0.0,
        is_decoder=causal,
    )
    cfg._attn_implementation = "eager"
    return T5Attention(cfg, has_relative_attention_bias=has_bias, layer_idx=layer_idx).eval()


def _copy(ours: posenc.Attention, hf: T5Attention) -> None:
    with torch.no_grad():
        for a, b in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("o_proj", "o")):
            getattr(ours, a).weight.copy_(getattr(hf, b).weight)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 12)])
def test_two_layer_stack_reuses_position_bias(causal, num_buckets, max_distance):
    """Layer 0 owns the table and returns ``position_bias``; layer 1 reuses it (HF T5Stack)."""
    torch.manual_seed(0)
    hf0 = _hf_layer(causal, True, 0, num_buckets, max_distance)
    hf1 = _hf_layer(causal, False, 1, num_buckets, max_distance)
    torch.nn.init.normal_(hf0.relative_attention_bias.weight)
    enc = posenc.build(
        "t5",
        heads=H,
        head_dim=DKV,
        causal=causal,
        num_buckets=num_buckets,
        max_distance=max_distance,
        scale_logits=False,
    )
    with torch.no_grad():
        enc.relative_attention_bias.weight.copy_(hf0.relative_attention_bias.weight)
    ours = [posenc.Attention(DMODEL, H, enc, head_dim=DKV, causal=causal) for _ in range(2)]
    _copy(ours[0], hf0)
    _copy(ours[1], hf1)
    B, L = 2, 40  # distances past max_distance=12 exercise the clamped log buckets
    x = torch.randn(B, L, DMODEL)
    mask = torch.triu(torch.full((L, L), torch.finfo(torch.float32).min), 1)[None, None] if causal else None
    with torch.no_grad():
        h0, position_bias, _ = hf0(x, mask=mask)
        x1 = x + h0
        h1, reused, _ = hf1(x1, mask=mask, position_bias=position_bias)
        assert reused is position_bias
        for backend in ("dense", "chunked", "eager"):
            n = attention_n(dim=DMODEL, head_dim=DKV, length=L)
            assert_close(ours[0](x, backend=backend), h0, n=n)
            assert_close(ours[1](x1, backend=backend), h1, n=2 * n)  # layer 1 reads layer 0's output
        assert torch.equal(enc.bias(torch.arange(L), torch.arange(L)), position_bias[0])  # the same table rows


def test_decoder_buckets_match_hf():
    rel = torch.arange(-300, 301)
    for nb, md in ((32, 128), (16, 40), (6, 9)):
        ref = T5Attention._relative_position_bucket(rel, bidirectional=False, num_buckets=nb, max_distance=md)
        enc = posenc.build("t5", heads=2, head_dim=4, causal=True, num_buckets=nb, max_distance=md)
        assert torch.equal(enc.buckets(rel), ref)
        assert int(enc.buckets(rel).max()) == nb - 1 and set(enc.buckets(rel[rel > 0]).tolist()) == {0}
        ref = T5Attention._relative_position_bucket(rel, bidirectional=True, num_buckets=nb, max_distance=md)
        enc = posenc.build("t5", heads=2, head_dim=4, causal=False, num_buckets=nb, max_distance=md)
        assert torch.equal(enc.buckets(rel), ref)


def test_decoder_with_kv_cache_matches_hf_compute_bias_offset():
    """Queries at cache_len + t: HF ``compute_bias(past_seen_tokens=...)`` gives the same rows."""
    torch.manual_seed(1)
    hf = _hf_layer(True, True, 0)
    enc = posenc.build("t5", heads=H, head_dim=DKV, causal=True, scale_logits=False)
    with torch.no_grad():
        enc.relative_attention_bias.weight.copy_(hf.relative_attention_bias.weight)
        ref = hf.compute_bias(3, 10, past_seen_tokens=7)[0]
        assert torch.equal(enc.bias(torch.arange(7, 10), torch.arange(10)), ref)


def test_shared_table_by_default_per_layer_option():
    lm = posenc.TransformerLM(32, 16, 3, 2, "t5")
    assert len(lm.encodings) == 1 and lm.blocks[2].attn.encoding is lm.blocks[0].attn.encoding
    lm = posenc.TransformerLM(32, 16, 3, 2, "t5", share_encoding=False)
    assert len(lm.encodings) == 3
    tables = [e.relative_attention_bias.weight for e in lm.encodings]
    assert not torch.equal(tables[0], tables[1])


def test_score_mod_path_equals_dense_with_arbitrary_positions():
    """FlexAttention's score_mod (no L×L tensor) equals the dense bias, including 2-D positions."""
    torch.manual_seed(2)
    for causal in (True, False):
        attn = posenc.Attention(DMODEL, H, "t5", head_dim=DKV, causal=causal, num_buckets=16, max_distance=20)
        torch.nn.init.normal_(attn.encoding.relative_attention_bias.weight)
        x = torch.randn(2, 24, DMODEL)
        pos = torch.stack([torch.arange(24) * 3, torch.arange(24) + 100])
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "flex_attention called without torch.compile"
            got = attn(x, pos=pos, backend="flex")
        ref = attn(x, pos=pos, backend="eager")
        assert_close(got, ref, n=attention_n(dim=DMODEL, head_dim=DKV, length=24))
        mod = attn.encoding.score_mod(pos, pos)
        b, h, i, j = torch.tensor(1), torch.tensor(3), torch.tensor(5), torch.tensor(20)
        dense = attn.encoding.bias(pos, pos)
        assert torch.equal(mod(torch.tensor(0.0), b, h, i, j), dense[1, 3, 5, 20])  # a table lookup plus 0


def test_scale_option_and_bad_options():
    assert posenc.build("t5", heads=2, head_dim=16).scale == pytest.approx(0.25)
    assert posenc.build("t5", heads=2, head_dim=16, scale_logits=False).scale == 1.0
    with pytest.raises(ValueError, match="num_buckets"):
        posenc.build("t5", heads=2, head_dim=4, causal=False, num_buckets=3)
    with pytest.raises(ValueError, match="max_distance"):
        posenc.build("t5", heads=2, head_dim=4, causal=False, num_buckets=32, max_distance=8)
