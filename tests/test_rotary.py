"""``rope`` and ``xpos``: applied rotation against HF Llama / RoFormer, torchtune and
rotary-embedding-torch; layouts and their conversion; float32 tables under bf16.

torchtune 0.6.1 is installed with ``--no-deps``; its two position-embedding modules are
loaded by file path (importing the package pulls torchao and heavy extras).
"""

from __future__ import annotations

import copy
import importlib.util
import math
from pathlib import Path

import pytest
import torch
from tests.conftest import assert_close, attention_n, tolerance

import posenc
from posenc.encodings.rotary import permute_for_layout

H, DH = 4, 32


def _qk(L, dh=DH, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, H, L, dh, generator=g), torch.randn(b, H, L, dh, generator=g)


def _close(a, b, *, angle: float = 0.0, n: int = 2):
    """A rotation ``x·cos φ + swap(x)·sin φ`` (2 terms) computed two ways. Implementations
    round the angle ``p·θ`` differently (directly, through a table, in float64): up to
    ``eps·|φ|`` apart, so the size of the terms is ``|x|·(1 + max|φ|)``; ``angle`` is that
    bound (the largest position, as θ <= 1)."""
    assert_close(a, b, n=n, magnitude=max(1.0, float(b.abs().amax())) * (1.0 + angle))


# --------------------------------------------------------------------------- HF Llama / RoFormer
def test_half_layout_equals_hf_llama_with_offsets_and_batch_positions():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    enc = posenc.build("rope", heads=H, head_dim=DH, base=500000.0)
    q, k = _qk(24)
    pos = torch.stack((torch.arange(24), torch.arange(100, 124)))  # (B, L): per-sequence offsets
    ang = pos[..., None].float() * enc.inv_freq  # HF LlamaRotaryEmbedding.forward
    emb = torch.cat((ang, ang), -1)
    ref = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin())
    got = enc.rotate(q, k, pos, pos)
    _close(got[0], ref[0], angle=124)
    _close(got[1], ref[1], angle=124)


@pytest.mark.parametrize("rotary_value", [False, True])
def test_interleaved_equals_hf_roformer(rotary_value):
    from transformers.models.roformer.modeling_roformer import (
        RoFormerSelfAttention,
        RoFormerSinusoidalPositionalEmbedding,
    )

    L = 40
    table = RoFormerSinusoidalPositionalEmbedding(64, DH)
    with torch.no_grad():
        table.weight.copy_(table.create_weight())
    sinusoidal_pos = table((1, L))[None, None]  # (1, 1, L, Dh): [sin | cos]
    q, k = _qk(L)
    v = torch.randn_like(q)
    ref = RoFormerSelfAttention.apply_rotary_position_embeddings(sinusoidal_pos, q, k, v if rotary_value else None)
    # RoFormer's rotated values are a class of their own (rope-value: it defines rotate_value)
    enc = posenc.build("rope-value" if rotary_value else "rope", heads=H, head_dim=DH, layout="interleaved")
    pos = torch.arange(L)
    got_q, got_k = enc.rotate(q, k, pos, pos)
    _close(got_q, ref[0], angle=L)
    _close(got_k, ref[1], angle=L)
    assert enc.defines("rotate_value") is rotary_value and enc.stages == posenc.Stage.QK
    if rotary_value:
        _close(enc.rotate_value(v, pos), ref[2], angle=L)
        # and the attention layer uses it: equals eager on every backend it allows
        attn = posenc.Attention(64, H, "rope-value", head_dim=DH, layout="interleaved")
        assert "sdpa" not in posenc.supported_backends(attn.encoding)
        x = torch.randn(2, 10, 64)
        _close(attn(x, backend="chunked"), attn(x, backend="eager"), n=attention_n(dim=64, head_dim=DH, length=10))


# --------------------------------------------------------------------------- torchtune
_TORCHTUNE_FILES = {
    "rope": "torchtune/modules/position_embeddings.py",
    "llama3": "torchtune/models/llama3_1/_position_embeddings.py",
}


def _load_torchtune(key: str):
    spec = importlib.util.find_spec("torchtune")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torchtune not installed (pip install torchtune==0.6.1 --no-deps)")
    path = Path(list(spec.submodule_search_locations)[0]).parent / _TORCHTUNE_FILES[key]
    mod_spec = importlib.util.spec_from_file_location(f"_torchtune_{key}", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def test_interleaved_equals_torchtune_rotary_positional_embeddings():
    tt = _load_torchtune("rope").RotaryPositionalEmbeddings(dim=DH, max_seq_len=512, base=10000)
    enc = posenc.build("rope", heads=H, head_dim=DH, layout="interleaved")
    q, _ = _qk(30)
    pos = torch.stack((torch.arange(30), torch.arange(300, 330)))
    ref = tt(q.transpose(1, 2), input_pos=pos).transpose(1, 2)  # torchtune is (B, L, H, Dh)
    got, _ = enc.rotate(q, q, pos, pos)
    _close(got, ref, angle=330)


def test_llama3_scaling_equals_torchtune_llama3_scaled_rope():
    tt = _load_torchtune("llama3").Llama3ScaledRoPE(
        dim=DH, max_seq_len=4096, base=500000, scale_factor=8, low_freq_factor=1, high_freq_factor=4, old_context_len=64
    )
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    enc = posenc.build("rope", heads=H, head_dim=DH, layout="interleaved", base=500000.0, rope_scaling=scaling)
    _close(enc.inv_freq, tt.theta, n=4)  # base^(-2k/D), then the llama3 smoothing: a few roundings
    q, _ = _qk(32)
    pos = torch.arange(3000, 3032).unsqueeze(0)
    ref = tt(q.transpose(1, 2), input_pos=pos).transpose(1, 2)
    got, _ = enc.rotate(q, q, pos, pos)
    _close(got, ref, angle=3032)


# --------------------------------------------------------------------------- rotary-embedding-torch
def test_interleaved_equals_rotary_embedding_torch_with_offset():
    from rotary_embedding_torch import RotaryEmbedding

    ref_mod = RotaryEmbedding(dim=DH)
    enc = posenc.build("rope", heads=H, head_dim=DH, layout="interleaved")
    q, _ = _qk(20)
    ref = ref_mod.rotate_queries_or_keys(q, offset=7)  # its positions: arange(L) + offset
    got, _ = enc.rotate(q, q, torch.arange(7, 27), torch.arange(7, 27))
    _close(got, ref, angle=27)


def test_partial_rotary_equals_rotary_embedding_torch():
    from rotary_embedding_torch import RotaryEmbedding

    ref_mod = RotaryEmbedding(dim=DH // 2)  # rotates the first 16 of 32 dims, passes the rest through
    enc = posenc.build("rope", heads=H, head_dim=DH, layout="interleaved", partial_rotary_factor=0.5)
    q, _ = _qk(12)
    got, _ = enc.rotate(q, q, torch.arange(12), torch.arange(12))
    _close(got, ref_mod.rotate_queries_or_keys(q), angle=12)
    assert torch.equal(got[..., DH // 2 :], q[..., DH // 2 :])


# --------------------------------------------------------------------------- layouts
def test_layout_conversion_of_checkpoint_weights():
    """W_Q/W_K of an interleaved model, permuted, give the same attention with layout='half'."""
    torch.manual_seed(0)
    dim = H * DH
    for rotary in (1.0, 0.5):
        inter = posenc.Attention(dim, H, "rope", layout="interleaved", partial_rotary_factor=rotary, qkv_bias=True)
        half = posenc.Attention(dim, H, "rope", layout="half", partial_rotary_factor=rotary, qkv_bias=True)
        sd = {k: v.clone() for k, v in inter.state_dict().items()}
        r = inter.encoding.rotary_dim
        for name in ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias"):
            sd[name] = permute_for_layout(sd[name], heads=H, head_dim=DH, to="half", rotary_dim=r)
        half.load_state_dict(sd)
        x = torch.randn(2, 16, dim)
        _close(half(x), inter(x), n=attention_n(dim=dim, head_dim=DH, length=16))
        back = permute_for_layout(sd["q_proj.weight"], heads=H, head_dim=DH, to="interleaved", rotary_dim=r)
        assert torch.equal(back, inter.q_proj.weight)


def test_layout_permutation_is_hf_llama_conversion_permute():
    """HF's convert_llama_weights_to_hf ``permute`` (Meta interleaved -> HF halves)."""
    w = torch.randn(H * DH, 24)

    def hf_permute(w, n_heads, dim1, dim2):
        return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)

    assert torch.equal(permute_for_layout(w, heads=H, head_dim=DH, to="half"), hf_permute(w, H, H * DH, 24))


def test_layout_and_option_errors():
    with pytest.raises(ValueError, match="layout must be"):
        posenc.build("rope", heads=2, head_dim=8, layout="pairs")
    with pytest.raises(ValueError, match="must be even"):
        posenc.build("rope", heads=2, head_dim=9)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        posenc.build("rope", heads=2, head_dim=8, partial_rotary_factor=1.5)
    with pytest.raises(ValueError, match="base must be"):
        posenc.build("rope", heads=2, head_dim=8, base=1.0)
    with pytest.raises(ValueError, match="rows, expected heads"):
        permute_for_layout(torch.zeros(10, 3), heads=2, head_dim=8, to="half")
    with pytest.raises(ValueError, match="to must be"):
        permute_for_layout(torch.zeros(16, 3), heads=2, head_dim=8, to="neox")
    enc = posenc.build("rope", heads=2, head_dim=8)
    with pytest.raises(ValueError, match="positions of length"):
        enc.rotate(torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8), torch.arange(4), torch.arange(5))
    with pytest.raises(ValueError, match=r"\(B, H, L, Dh\)"):
        enc.rotate(torch.zeros(2, 5, 8), torch.zeros(2, 5, 8), torch.arange(5), torch.arange(5))


# --------------------------------------------------------------------------- precision
def test_bf16_rotation_at_large_positions_matches_float32():
    """bf16 q/k rotated at positions >= 32768 equal the float32 result cast to bf16."""
    enc = posenc.build("rope", heads=H, head_dim=64)
    q, k = (t.to(torch.bfloat16) for t in _qk(64, dh=64))
    for start in (32768, 100_000, 1_000_000):
        pos = torch.arange(start, start + 64)
        got_q, got_k = enc.rotate(q, k, pos, pos)
        ref_q, ref_k = enc.rotate(q.float(), k.float(), pos, pos)
        assert got_q.dtype == torch.bfloat16
        assert torch.equal(got_q, ref_q.to(torch.bfloat16))
        assert torch.equal(got_k, ref_k.to(torch.bfloat16))
        # what the test guards against: angles formed in bf16 are wrong by whole radians here
        naive = pos.to(torch.bfloat16)[:, None] * enc.inv_freq.to(torch.bfloat16)
        exact = pos.double()[:, None] * enc.inv_freq.double()
        assert (naive.double() - exact).abs().max() > 1.0


def test_tables_stay_float32_under_model_to_bf16():
    lm = posenc.TransformerLM(vocab_size=32, dim=32, depth=1, heads=2, encoding="rope", max_len=64)
    enc = lm.encodings[0]
    ref = enc.inv_freq.clone()
    lm.to(torch.bfloat16)
    assert enc.inv_freq.dtype == torch.float32 and torch.equal(enc.inv_freq, ref)
    assert lm(torch.randint(0, 32, (1, 8))).dtype == torch.bfloat16
    xp = posenc.build("xpos", heads=2, head_dim=8).to(torch.bfloat16)
    assert xp.zeta.dtype == torch.float32 and xp.inv_freq.dtype == torch.float32


def test_meta_construction_then_init_buffers():
    with torch.device("meta"):
        enc = posenc.build("rope", heads=2, head_dim=16, max_len=32, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    enc = enc.to_empty(device="cpu")
    enc.init_buffers()
    ref = posenc.build("rope", heads=2, head_dim=16, max_len=32, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    assert torch.equal(enc.inv_freq, ref.inv_freq)


# --------------------------------------------------------------------------- xpos
def test_xpos_equals_rotary_embedding_torch_use_xpos():
    """rotary-embedding-torch centres the decay on ``len//2``, as posenc's per-call reference
    (the middle of the query positions) does for a full sequence: q̃, k̃ equal element-wise."""
    from rotary_embedding_torch import RotaryEmbedding

    for L in (64, 65):
        ref_mod = RotaryEmbedding(dim=DH, use_xpos=True, xpos_scale_base=512)
        q, k = _qk(L)
        ref_q, ref_k = ref_mod.rotate_queries_and_keys(q, k)
        enc = posenc.build("xpos", heads=H, head_dim=DH)
        pos = torch.arange(L)
        got_q, got_k = enc.rotate(q, k, pos, pos)
        _close(got_q, ref_q, angle=L, n=3)  # and the decay factor: one more product
        _close(got_k, ref_k, angle=L, n=3)


def test_xpos_formula_decays_with_distance():
    """q̃_i·k̃_j = Σ_k ζ_k^((i-j)/512)·(rotation of pair k by (i-j)θ_k), written out per pair."""
    enc = posenc.build("xpos", heads=1, head_dim=8)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    i, j = 900, 100
    got_q, got_k = enc.rotate(q, k, torch.tensor([i]), torch.tensor([j]))  # one call: one reference
    score = float((got_q * got_k).sum())
    ref = 0.0
    for p in range(4):
        zeta = (2 * p / 8 + 0.4) / 1.4
        theta = 10000 ** (-2 * p / 8)
        a, b = q[0, 0, 0, 2 * p : 2 * p + 2].double(), k[0, 0, 0, 2 * p : 2 * p + 2].double()
        ang = (i - j) * theta
        rot = (a[0] * b[0] + a[1] * b[1]) * math.cos(ang) + (a[0] * b[1] - a[1] * b[0]) * math.sin(ang)
        ref += zeta ** ((i - j) / 512) * float(rot)
    # 8 products and a 2-term rotation; the float32 angles p·θ (p up to 900) are rounded
    magnitude = float((q.abs() * k.abs()).sum()) * (1 + i)
    assert_close(torch.tensor(score), torch.tensor(ref, dtype=torch.float32), n=8 + 2, magnitude=magnitude)


def test_xpos_is_causal_only_and_checks_its_range():
    with pytest.raises(ValueError, match="causal only"):
        posenc.build("xpos", heads=2, head_dim=8, causal=False)
    enc = posenc.build("xpos", heads=2, head_dim=8)
    x = torch.zeros(1, 2, 1, 8)
    enc.rotate(x, x, torch.tensor([10**6]), torch.tensor([10**6]))  # absolute position alone is fine
    long = torch.zeros(1, 2, 12000, 8)
    with pytest.raises(ValueError, match=r"overflow torch.float16.*at most \d+ fit"):
        enc.rotate(long.half(), long.half(), torch.arange(12000), torch.arange(12000))
    enc.rotate(long, long, torch.arange(12000), torch.arange(12000))  # float32: far below its limit
    with pytest.raises(ValueError, match="overflow torch.float32"):
        enc.rotate(x, x, torch.tensor([0]), torch.tensor([70000]))  # a key far past the query
    with pytest.raises(ValueError, match="scale_base"):
        posenc.build("xpos", heads=2, head_dim=8, scale_base=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("start", [0, 4_000, 6_000, 32_768, 100_000])
def test_xpos_half_precision_matches_float32_far_out(dtype, start):
    """Scores depend on i - j only: a half-precision layer at position 10^5 is as exact as at 0.

    Before the per-call reference, float16 keys overflowed past ~4 500 and a layer at
    6000-6003 returned zeros. Compared with the float32 layer at the same positions,
    within the half-precision rule: 10 values stored in ``dtype`` on the path, float32
    accumulation over the reductions (D = 32 inputs, L keys).
    """
    torch.manual_seed(0)
    attn = posenc.Attention(32, 4, "xpos")
    x = torch.randn(2, 16, 32)
    pos = torch.arange(start, start + 16)
    with torch.no_grad():
        ref = attn(x, pos=pos)
        low = copy.deepcopy(attn).to(dtype)(x.to(dtype), pos=pos)
        assert torch.isfinite(low).all()
        assert float(low.float().abs().amax()) > 0.1 * float(ref.abs().amax())
        tol = tolerance(dtype, n=32 + 8 + 16 + 16 + 32, stored=10, magnitude=max(1.0, float(ref.abs().amax())))
        assert_close(low.float(), ref, **tol)


def test_xpos_half_precision_cached_decoding_far_out():
    torch.manual_seed(0)
    attn = posenc.Attention(32, 4, "xpos").half()
    x = torch.randn(1, 8, 32).half()
    pos = torch.arange(50_000, 50_008)
    with torch.no_grad():
        full = attn(x, pos=pos)
        cache = attn.init_cache(1, 8)
        steps = torch.cat([attn(x[:, t : t + 1], pos=pos[t : t + 1], cache=cache) for t in range(8)], 1)
    assert torch.isfinite(full).all()
    tol = tolerance(torch.float16, n=32 + 8 + 8 + 8 + 32, stored=10, magnitude=max(1.0, float(full.abs().amax())))
    assert_close(steps.float(), full.float(), **tol)


def test_xpos_cache_decoding_equals_full_forward():
    torch.manual_seed(0)
    attn = posenc.Attention(32, 4, "xpos")
    x = torch.randn(2, 12, 32)
    with torch.no_grad():
        full = attn(x)
        cache = attn.init_cache(2, 12)
        steps = torch.cat([attn(x[:, t : t + 1], cache=cache) for t in range(12)], 1)
    _close(steps, full, n=attention_n(dim=32, head_dim=8, length=12))


def test_xpos_float16_prefill_past_its_span_limit_in_chunks():
    """The error's advice works: a float16 prompt too long for one call (here scale_base=32:
    ~283 query positions per call) raises, and the same prompt fed in chunks through the KV
    cache equals the float32 layer run in one call (half-precision rule)."""
    torch.manual_seed(0)
    attn = posenc.Attention(32, 4, "xpos", scale_base=32.0)
    x = torch.randn(1, 600, 32)
    pos = torch.arange(10_000, 10_600)
    low = copy.deepcopy(attn).half()
    with torch.no_grad():
        ref = attn(x, pos=pos)
        with pytest.raises(ValueError, match=r"overflow torch.float16.*about 28\d query positions per call"):
            low(x.half(), pos=pos)
        cache = low.init_cache(1, 600)
        got = torch.cat([low(x[:, s : s + 200].half(), pos=pos[s : s + 200], cache=cache) for s in (0, 200, 400)], 1)
    assert torch.isfinite(got).all()
    tol = tolerance(torch.float16, n=32 + 8 + 600 + 600 + 32, stored=10, magnitude=max(1.0, float(ref.abs().amax())))
    assert_close(got.float(), ref, **tol)
