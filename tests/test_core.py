"""Registry, dispatch and attention-layer behaviour beyond the contract suite."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_close, attention_n

import posenc
from posenc.attend.flex import check_flex_heads
from posenc.base import PositionEncoding, Stage


def test_build_unknown_name_lists_available():
    with pytest.raises(ValueError, match="unknown encoding 'nope2'.*alibi.*rope"):
        posenc.build("nope2", heads=2, head_dim=8)


def test_register_rejects_duplicates_and_non_encodings():
    with pytest.raises(TypeError, match="PositionEncoding subclass"):
        posenc.register(int)

    class Clash(PositionEncoding):
        name = "rope"

    with pytest.raises(ValueError, match="already registered"):
        posenc.register(Clash)


@pytest.mark.parametrize("bad", [0, -1, 2.5, None])
def test_bad_sizes(bad):
    with pytest.raises(ValueError, match="heads"):
        posenc.build("nope", heads=bad, head_dim=8)


def test_rotary_odd_head_dim_raises():
    with pytest.raises(ValueError, match=r"rotary dim .*7.* must be even"):
        posenc.build("rope", heads=2, head_dim=7)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        posenc.build("rope", heads=2, head_dim=8, partial_rotary_factor=1.5)


def test_learned_needs_max_len():
    with pytest.raises(ValueError, match="max_len"):
        posenc.build("learned", heads=2, head_dim=8)


@pytest.mark.parametrize(
    "name,cpu,cuda",
    [
        ("nope", "sdpa", "sdpa"),
        ("rope", "sdpa", "sdpa"),
        ("sinusoidal", "sdpa", "sdpa"),
        ("alibi", "blockwise", "flex"),
        ("t5", "blockwise", "flex"),
        ("shaw", "blockwise", "chunked"),
        ("fire", "dense", "flex"),
        ("cope", "chunked", "chunked"),
    ],
)
def test_backend_dispatch(name, cpu, cuda):
    enc = posenc.build(name, heads=2, head_dim=16, max_len=16)
    assert posenc.select_backend(enc, "cpu") == cpu
    assert posenc.select_backend(enc, "cuda") == cuda


@pytest.mark.parametrize("name", ["alibi", "t5", "fire", "kerple"])
def test_auto_leaves_flex_out_on_cuda_for_heads_under_16(name):
    """FlexAttention's compiled CUDA kernel refuses heads under 16 channels ("NYI: embedding
    dimension ... must be at least 16", seen on an H100): auto picks the next backend there, and
    an explicit flex says why instead of failing inside inductor."""
    wide, narrow = (posenc.build(name, heads=2, head_dim=d, max_len=16) for d in (16, 8))
    assert posenc.attend.backends.FLEX_MIN_HEAD_DIM == 16
    assert posenc.select_backend(wide, "cuda") == "flex"
    assert posenc.select_backend(narrow, "cuda") == "dense"
    assert posenc.select_backend(narrow, "cpu") == posenc.select_backend(wide, "cpu")
    assert "flex" in posenc.supported_backends(narrow)  # runs on the CPU (the unfused reference)
    with pytest.raises(
        ValueError, match=r"backend 'flex' on CUDA needs heads of at least 16 channels .* got head_dim=8"
    ):
        check_flex_heads("cuda", 8, 8)
    with pytest.raises(ValueError, match=r"got head_dim=16 \(values 8\)"):
        check_flex_heads("cuda", 16, 8)
    check_flex_heads("cuda", 16, 16)
    check_flex_heads("cpu", 8, 8)  # the unfused reference runs any width


@pytest.mark.parametrize("name", ["alibi", "t5", "fire"])
def test_auto_leaves_flex_out_on_cuda_for_decoding_shapes(name):
    """posenc compiles FlexAttention for static shapes: a call with fewer queries than one block
    (the KV cache's decoding steps, whose key count grows every step) runs dense on CUDA."""
    enc = posenc.build(name, heads=2, head_dim=16, max_len=16)
    least = posenc.attend.backends.FLEX_MIN_QUERIES
    assert least == 128
    assert posenc.select_backend(enc, "cuda", least, least) == "flex"
    assert posenc.select_backend(enc, "cuda", least, 4 * least) == "flex"
    assert posenc.select_backend(enc, "cuda") == "flex"  # lengths unknown: the long-sequence choice
    for q_len, k_len in [(1, 1), (1, 4096), (least - 1, least - 1), (8, 8192)]:
        assert posenc.select_backend(enc, "cuda", q_len, k_len) == "dense", (q_len, k_len)
    attn = posenc.Attention(32, 2, name, head_dim=16, max_len=64)
    assert attn.resolve_backend("auto", "cuda", 1, 40) == "dense"
    assert attn.resolve_backend("flex", "cuda", 1, 40) == "flex"  # asked for: runs


def test_compiled_flex_raises_dynamos_recompile_limit(monkeypatch):
    """FlexAttention is one compiled function for every score_mod, mask and shape: past dynamo's
    8 entries it ran uncompiled (the unfused L x L path). posenc's compiled call (CUDA) raises
    the limit for its own calls only. Run here with dynamo's eager backend on the CPU: the
    limit is dynamo's, whatever compiles the graph."""
    import posenc.attend.flex as flex_mod

    real_compile = torch.compile
    monkeypatch.setattr(flex_mod, "_compiled_flex", None)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, **{**kw, "backend": "eager"}))
    run = flex_mod._flex_attention("cuda")  # the wrapper CUDA calls, compiled for the CPU here
    monkeypatch.setattr(torch, "compile", real_compile)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    before = torch._dynamo.config.recompile_limit
    assert flex_mod.FLEX_RECOMPILE_LIMIT >= 64 > before

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx)

    try:
        with torch.no_grad():
            for n in range(1, 13):  # 12 shapes: 12 entries of one function
                q = torch.randn(1, 2, 16 * n, 16)
                out = run(q, q, q, score_mod=score_mod)
                assert out.shape == q.shape
        frames = dict(torch._dynamo.utils.counters["frames"])
    finally:
        torch._dynamo.reset()
    assert frames.get("ok") == frames.get("total") == 12, frames  # each compiled; none left eager at 8
    assert torch._dynamo.config.recompile_limit == before  # the user's setting is back


def test_forced_backend_must_support_encoding():
    with pytest.raises(ValueError, match="backend 'sdpa' cannot run encoding 'shaw'"):
        posenc.Attention(16, 2, "shaw", backend="sdpa")
    with pytest.raises(ValueError, match="backend must be one of"):
        posenc.Attention(16, 2, "rope", backend="fast")


def test_stage_flags_and_bias_shapes():
    t5 = posenc.build("t5", heads=3, head_dim=8, causal=False)
    assert t5.stages == Stage.BIAS and t5.share_across_layers
    assert t5.bias(torch.arange(5), torch.arange(7)).shape == (3, 5, 7)
    assert t5.bias(torch.arange(5).expand(2, 5), torch.arange(7).expand(2, 7)).shape == (2, 3, 5, 7)


def test_t5_table_shared_across_layers_by_default():
    lm = posenc.TransformerLM(32, 16, 3, 2, "t5")
    assert len(lm.encodings) == 1
    lm = posenc.TransformerLM(32, 16, 3, 2, "t5", share_encoding=False)
    assert len(lm.encodings) == 3
    lm = posenc.TransformerLM(32, 16, 3, 2, "shaw")
    assert len(lm.encodings) == 3


def test_left_padding_is_positions_plus_mask():
    """A left-padded row with positions starting at 0 on its first real token equals the unpadded row."""
    torch.manual_seed(0)
    attn = posenc.Attention(16, 2, "rope")
    x = torch.randn(1, 6, 16)
    ref = attn(x)
    padded = torch.cat([torch.randn(1, 2, 16), x], dim=1)
    pos = torch.tensor([0, 0, 0, 1, 2, 3, 4, 5])
    keep = torch.tensor([[False, False, True, True, True, True, True, True]])
    for backend in ("sdpa", "eager"):
        out = attn(padded, pos=pos, key_padding_mask=keep, backend=backend)
        assert_close(out[:, 2:], ref, n=attention_n(dim=16, head_dim=8, length=8), msg=backend)


def test_kv_cache_overflow_and_batch_mismatch():
    attn = posenc.Attention(16, 2, "rope")
    cache = attn.init_cache(batch_size=1, max_len=4)
    attn(torch.randn(1, 3, 16), cache=cache)
    with pytest.raises(ValueError, match="overflow"):
        attn(torch.randn(1, 2, 16), cache=cache)
    with pytest.raises(ValueError, match="batch size 1"):
        attn(torch.randn(2, 1, 16), cache=attn.init_cache(batch_size=1, max_len=4))


def test_bfloat16_model_keeps_float32_tables():
    lm = posenc.TransformerLM(32, 16, 2, 2, "rope").to(torch.bfloat16)
    assert lm.blocks[0].attn.encoding.inv_freq.dtype == torch.float32
    alibi = posenc.Attention(16, 2, "alibi").to(torch.bfloat16)
    assert alibi.encoding.slopes.dtype == torch.float32


def test_checkpoint_round_trip(tmp_path):
    lm = posenc.TransformerLM(32, 16, 2, 2, "t5", max_len=16, num_buckets=8, max_distance=12)
    posenc.save_checkpoint(tmp_path / "m.pt", lm, step=7)
    lm2, extra = posenc.load_checkpoint(tmp_path / "m.pt")
    t = torch.randint(0, 32, (2, 9))
    assert extra == {"step": 7}
    assert torch.equal(lm2(t), lm(t))  # the same weights, the same computation
    torch.save({"x": 1}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="not a posenc checkpoint"):
        posenc.load_checkpoint(tmp_path / "bad.pt")
