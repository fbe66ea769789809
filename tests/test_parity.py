"""Element-wise parity of the core encodings with their original implementations.

Oracles (test extras): HF ``transformers`` (DistilBERT sinusoids, Llama and RoFormer
rotary, Bloom ALiBi, T5 attention), ``positional-encodings``, and a direct
transcription of tensor2tensor's ``dot_product_attention_relative`` for Shaw.
All built with random weights on the CPU, compared on small full tensors.
"""

from __future__ import annotations

import math

import pytest
import torch
from tests.conftest import assert_close, attention_n

import posenc
from posenc import functional as PF


def _heads(x: torch.Tensor, H: int) -> torch.Tensor:
    B, L, _ = x.shape
    return x.view(B, L, H, -1).transpose(1, 2)  # (B, H, L, Dh)


def _qkv(attn: posenc.Attention, x: torch.Tensor):
    H = attn.heads
    return _heads(attn.q_proj(x), H), _heads(attn.k_proj(x), H), _heads(attn.v_proj(x), H)


def _out(attn: posenc.Attention, o: torch.Tensor) -> torch.Tensor:
    B, H, L, Dh = o.shape
    return attn.o_proj(o.transpose(1, 2).reshape(B, L, H * Dh))


def _randomize(m: torch.nn.Module):
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)


# ------------------------------------------------------------------------------ sinusoidal
@pytest.mark.parametrize("dim", [8, 16, 64, 130])
def test_sinusoidal_matches_positional_encodings(dim):
    from positional_encodings.torch_encodings import PositionalEncoding1D

    L = 50
    ref = PositionalEncoding1D(dim)(torch.zeros(2, L, dim))
    enc = posenc.build("sinusoidal", heads=1, head_dim=dim)
    ours = enc.embed(torch.zeros(2, L, dim), torch.arange(L).unsqueeze(0))
    # the reference rounds ω = 1/10000^(2k/D) and then p·ω to float32 (two roundings of at
    # most u = eps/2 each, relative): its angle is off by up to eps·p·ω <= eps·(L - 1); sin
    # and cos are 1-Lipschitz, and each result is rounded once more (eps/2 on values <= 1)
    eps = torch.finfo(torch.float32).eps
    atol = eps * (L - 1) + eps
    assert_close(ours, ref, atol=atol, rtol=0.0)


@pytest.mark.parametrize("dim", [8, 32, 64])
def test_sinusoidal_matches_distilbert(dim):
    from transformers.models.distilbert.modeling_distilbert import create_sinusoidal_embeddings

    n = 300
    ref = create_sinusoidal_embeddings(n, dim, torch.empty(n, dim))
    ours = PF.sinusoidal_table(torch.arange(n), dim)
    # DistilBERT builds its angles in float64 (numpy) and rounds once to float32, as we do
    assert_close(ours, ref, n=1)
    enc = posenc.build("sinusoidal", heads=2, head_dim=dim // 2)
    assert_close(enc.embed(torch.zeros(1, n, dim), torch.arange(n)), ref.unsqueeze(0), n=1)


# ------------------------------------------------------------------------------ rotary
@pytest.mark.parametrize("base", [10000.0, 500000.0])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rope_half_matches_hf_llama(base, partial):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    B, H, L, Dh = 2, 3, 12, 16
    cfg = LlamaConfig(
        hidden_size=H * Dh,
        num_attention_heads=H,
        head_dim=Dh,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": base},
    )
    rot = int(Dh * partial)
    pos = torch.stack([torch.arange(L), torch.randint(0, 3000, (L,)).sort().values])  # (B, L)
    q, k = torch.randn(B, H, L, Dh), torch.randn(B, H, L, Dh)
    emb = LlamaRotaryEmbedding(cfg)
    if partial < 1:  # HF rotates the first `rot` dims with a table built for them
        emb.inv_freq = PF.sinusoidal_inv_freq(rot, base)
    cos, sin = emb(q, pos)
    rq, rk = apply_rotary_pos_emb(q[..., :rot], k[..., :rot], cos, sin)
    enc = posenc.build("rope", heads=H, head_dim=Dh, base=base, partial_rotary_factor=partial)
    oq, ok = enc.rotate(q, k, pos, pos)
    # x·cos + rotate_half(x)·sin: 2 terms; angles p·θ rounded once in float32 (p < 3000)
    assert_close(oq[..., :rot], rq, n=2)
    assert_close(ok[..., :rot], rk, n=2)
    assert torch.equal(oq[..., rot:], q[..., rot:])


def test_rope_interleaved_matches_hf_roformer_with_value():
    from transformers.models.roformer.modeling_roformer import (
        RoFormerSelfAttention,
        RoFormerSinusoidalPositionalEmbedding,
    )

    B, H, L, Dh = 2, 4, 20, 16
    table = RoFormerSinusoidalPositionalEmbedding(64, Dh)
    table.weight.data.copy_(table.create_weight())  # random until filled, as in HF's _init_weights
    sinusoidal_pos = table((B, L))[None, None]  # (1, 1, L, Dh) as [sin | cos]
    q, k, v = (torch.randn(B, H, L, Dh) for _ in range(3))
    rq, rk, rv = RoFormerSelfAttention.apply_rotary_position_embeddings(sinusoidal_pos, q, k, v)
    enc = posenc.build("rope-value", heads=H, head_dim=Dh, layout="interleaved")
    pos = torch.arange(L)
    oq, ok = enc.rotate(q, k, pos, pos)
    assert_close(oq, rq, n=2)
    assert_close(ok, rk, n=2)
    assert_close(enc.rotate_value(v, pos), rv, n=2)


def test_rope_layout_permutation():
    Dh = 16
    perm = PF.interleaved_to_half_perm(Dh)
    x = torch.randn(3, 2, 10, Dh)
    pos = torch.arange(10)
    half = posenc.build("rope", heads=2, head_dim=Dh, layout="half")
    inter = posenc.build("rope", heads=2, head_dim=Dh, layout="interleaved")
    assert_close(inter.rotate(x, x, pos, pos)[0][..., perm], half.rotate(x[..., perm], x[..., perm], pos, pos)[0], n=2)


# ------------------------------------------------------------------------------ ALiBi
def test_alibi_slopes_match_bloom_for_1_to_64_heads():
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    for h in range(1, 65):
        assert_close(PF.alibi_slopes(h), _get_alibi_slopes(h, torch.device("cpu")), n=2, msg=f"heads={h}")


@pytest.mark.parametrize("heads", [4, 6])
def test_alibi_attention_matches_bloom_bias(heads):
    """Bloom adds +m·j (key position only): a per-row constant away from -m(i - j)."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    B, L, Dh = 2, 12, 8
    attn = posenc.Attention(heads * Dh, heads, "alibi", causal=True)
    _randomize(attn)
    x = torch.randn(B, L, heads * Dh)
    q, k, v = _qkv(attn, x)
    alibi = build_alibi_tensor(torch.ones(B, L), heads, torch.float32).view(B, heads, 1, L)
    s = q @ k.transpose(-1, -2) / math.sqrt(Dh) + alibi
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    ref = _out(attn, torch.softmax(s, -1) @ v)
    n = attention_n(dim=heads * Dh, head_dim=Dh, length=L)
    for backend in ("dense", "chunked", "eager"):
        assert_close(attn(x, backend=backend), ref, n=n, msg=backend)
    with torch.no_grad():
        assert_close(attn(x, backend="flex"), ref.detach(), n=n, msg="flex")


# ------------------------------------------------------------------------------ T5
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (16, 64), (64, 256), (8, 20), (33, 100)])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_buckets_match_hf(num_buckets, max_distance, bidirectional):
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = torch.arange(-300, 301)
    ref = T5Attention._relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    ours = PF.t5_relative_position_bucket(
        rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    assert torch.equal(ours, ref)


def test_t5_bucket_values_from_references():
    rel = torch.tensor([0, -1, -8, -9, -64, -127, -500, 1, 8, 64, 127, 500])
    expect = torch.tensor([0, 1, 8, 8, 14, 15, 15, 17, 24, 30, 31, 31])
    assert torch.equal(PF.t5_relative_position_bucket(rel), expect)


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_t5_attention_matches_hf(causal):
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    B, L, D, H, Dkv = 2, 40, 32, 4, 8
    cfg = T5Config(
        d_model=D,
        d_kv=Dkv,
        num_heads=H,
        relative_attention_num_buckets=16,
        relative_attention_max_distance=32,
        dropout_rate=0.0,
        is_decoder=causal,
    )
    cfg._attn_implementation = "eager"
    ref_attn = T5Attention(cfg, has_relative_attention_bias=True, layer_idx=0).eval()
    _randomize(ref_attn)
    ours = posenc.Attention(
        D, H, "t5", head_dim=Dkv, causal=causal, num_buckets=16, max_distance=32, scale_logits=False
    )
    with torch.no_grad():
        for a, b in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
            getattr(ours, b).weight.copy_(getattr(ref_attn, a).weight)
        ours.encoding.relative_attention_bias.weight.copy_(ref_attn.relative_attention_bias.weight)
    x = torch.randn(B, L, D)
    mask = None
    if causal:
        mask = torch.zeros(1, 1, L, L).masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    ref = ref_attn(x, mask=mask)[0]
    n = attention_n(dim=D, head_dim=Dkv, length=L)
    for backend in ("dense", "chunked", "eager"):
        assert_close(ours(x, backend=backend), ref, n=n, msg=backend)
    with torch.no_grad():
        assert_close(ours(x, backend="flex"), ref.detach(), n=n, msg="flex")


# ------------------------------------------------------------------------------ Shaw
def t2t_dot_product_attention_relative(q, k, v, rel_k, rel_v, max_relative_position, causal):
    """tensor2tensor ``dot_product_attention_relative``, transcribed (materialises (L, L, Dh)).

    ``_generate_relative_positions_matrix``: distance ``j - i`` clipped to [-k, k], + k;
    ``_relative_attention_inner``: ``x·yᵀ + x·zᵀ`` per (i, j); q pre-scaled by Dh^-0.5.
    """
    L, Dh = q.shape[2], q.shape[3]
    rng = torch.arange(L)
    distance = rng[None, :] - rng[:, None]
    index = distance.clamp(-max_relative_position, max_relative_position) + max_relative_position
    a_k, a_v = rel_k[index], rel_v[index]  # (L, L, Dh)
    q = q * Dh**-0.5
    logits = q @ k.transpose(-1, -2) + torch.einsum("bhid,ijd->bhij", q, a_k)
    if causal:  # t2t adds a large negative bias ("attention_bias_lower_triangle")
        logits = logits + torch.ones(L, L).triu(1) * -1e9
    w = torch.softmax(logits, dim=-1)
    return w @ v + torch.einsum("bhij,ijd->bhid", w, a_v)


@pytest.mark.parametrize("causal", [True, False], ids=["masked", "unmasked"])
@pytest.mark.parametrize("k", [1, 3, 30])
def test_shaw_matches_tensor2tensor(causal, k):
    B, L, H, Dh = 2, 14, 3, 8
    attn = posenc.Attention(H * Dh, H, "shaw", causal=causal, max_relative_position=k, chunk_size=5)
    _randomize(attn)
    x = torch.randn(B, L, H * Dh)
    q, kk, v = _qkv(attn, x)
    enc = attn.encoding
    ref = _out(attn, t2t_dot_product_attention_relative(q, kk, v, enc.rel_k, enc.rel_v, k, causal))
    # + the relative terms: one more Dh-long dot product per score, one more Lk-long sum per output
    n = attention_n(dim=H * Dh, head_dim=Dh, length=L) + Dh + L
    for backend in ("chunked", "eager"):
        assert_close(attn(x, backend=backend), ref, n=n, msg=backend)
