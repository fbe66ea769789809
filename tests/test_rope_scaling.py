"""``rope_scaling``: inv_freq and attention factor equal HF's ``ROPE_INIT_FUNCTIONS`` bit for bit.

Also the applied rotation of every type against HF ``LlamaRotaryEmbedding`` +
``apply_rotary_pos_emb``, and the KV-cache contract of the length-dependent types.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from tests.conftest import assert_close, attention_n

import posenc
from posenc.encodings.rotary import ROPE_TYPES

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

HEADS = 4


def _hf_config(head_dim: int, max_pos: int, params: dict) -> LlamaConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LlamaConfig(
            hidden_size=HEADS * head_dim,
            num_attention_heads=HEADS,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rope_parameters=dict(params),
        )


def _grid(kind: str):
    """(head_dim, partial_rotary_factor, base, max_pos, rope_parameters) settings for one type."""
    for head_dim, prf, base, factor in itertools.product((32, 64, 128), (1.0, 0.5), (10000.0, 500000.0), (2.0, 8.0)):
        orig = 256
        p = {"rope_type": kind, "rope_theta": base, "partial_rotary_factor": prf}
        if kind == "linear":
            p |= {"factor": factor}
        elif kind == "dynamic":
            p |= {"factor": factor}
        elif kind == "yarn":
            p |= {"factor": factor, "original_max_position_embeddings": orig}
            for extra in ({}, {"beta_fast": 16, "beta_slow": 2}, {"mscale": 0.707, "mscale_all_dim": 1.0}):
                yield head_dim, prf, base, int(orig * factor), p | extra
            yield head_dim, prf, base, int(orig * factor), p | {"attention_factor": 1.3, "truncate": False}
            continue
        elif kind == "longrope":
            half = int(head_dim * prf) // 2
            p |= {
                "original_max_position_embeddings": orig,
                "long_factor": [1.0 + 0.37 * i for i in range(half)],
                "short_factor": [1.0 + 0.01 * i for i in range(half)],
            }
            yield head_dim, prf, base, int(orig * factor), p  # factor from max_len / original
            p = p | {"factor": factor}
        elif kind == "llama3":
            p |= {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
            p |= {"original_max_position_embeddings": orig}
        yield head_dim, prf, base, int(orig * factor), p


def _ours(head_dim, max_pos, p):
    return posenc.build("rope", heads=HEADS, head_dim=head_dim, max_len=max_pos, rope_scaling=p)


LLAMA_TYPES = [t for t in ROPE_TYPES if t != "ntk_alpha"]  # (ntk_alpha is HunYuan's own: test_ntk_alpha_equals_hunyuan)


@pytest.mark.parametrize("kind", [t for t in LLAMA_TYPES if t != "default"])
def test_inv_freq_and_attention_factor_equal_hf(kind):
    n = 0
    for head_dim, prf, base, max_pos, p in _grid(kind):
        cfg = _hf_config(head_dim, max_pos, p)
        enc = _ours(head_dim, max_pos, p)
        assert enc.rotary_dim == (head_dim if kind == "proportional" else int(head_dim * prf))  # Gemma 4: full width
        for seq_len in (None, max_pos // 4, max_pos, 3 * max_pos + 7):
            ref, ref_factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", seq_len=seq_len)
            got = enc.inv_freq if seq_len is None else enc.frequencies(seq_len)
            assert got.dtype == torch.float32
            assert torch.equal(got, ref), (kind, head_dim, prf, base, max_pos, p, seq_len)
            assert enc.attention_factor == ref_factor, (kind, p)
            n += 1
    assert n >= 48


@pytest.mark.parametrize("head_dim,base", [(32, 10000.0), (64, 10000), (128, 500000.0), (80, 1e6)])
def test_default_equals_llama_compute_default_rope_parameters(head_dim, base):
    cfg = _hf_config(head_dim, 2048, {"rope_type": "default", "rope_theta": base})
    ref, factor = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    for enc in (
        posenc.build("rope", heads=HEADS, head_dim=head_dim, base=base),
        posenc.build("rope", heads=HEADS, head_dim=head_dim, rope_scaling={"rope_type": "default", "rope_theta": base}),
    ):
        assert torch.equal(enc.inv_freq, ref)
        assert enc.attention_factor == factor == 1.0


def _hf_rotate(cfg, q, k, pos, rotary_dim):
    """HF Llama: cos/sin from LlamaRotaryEmbedding, rotate the first rotary_dim dims (NeoX-style partial)."""
    rope = LlamaRotaryEmbedding(cfg)
    cos, sin = rope(q, pos)
    r = rotary_dim
    qr, kr = apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin)
    return torch.cat((qr, q[..., r:]), -1), torch.cat((kr, k[..., r:]), -1)


@pytest.mark.parametrize("kind", LLAMA_TYPES)
def test_applied_rotation_equals_hf_llama(kind):
    torch.manual_seed(0)
    for head_dim, _prf, base, max_pos, p in itertools.islice(_grid(kind if kind != "default" else "linear"), 0, 24, 5):
        if kind == "default":
            p = {"rope_type": "default", "rope_theta": base}  # Llama's default ignores partial_rotary_factor
        cfg = _hf_config(head_dim, max_pos, p)
        enc = _ours(head_dim, max_pos, p)
        for longest in (max_pos // 2, 2 * max_pos):  # both sides of the length switch (dynamic, longrope)
            pos = torch.randint(0, longest, (1, 48)).sort(-1).values  # (1, L)
            pos[0, -1] = longest - 1
            q, k = torch.randn(2, 1, HEADS, pos.shape[-1], head_dim).unbind(0)
            ref_q, ref_k = _hf_rotate(cfg, q, k, pos, enc.rotary_dim)
            got_q, got_k = enc.rotate(q, k, pos, pos)
            # a rotation (2 terms) whose angles p·θ (p < 2·max_pos) each implementation rounds itself
            mag = float(ref_q.abs().amax()) * 2 * max_pos
            assert_close(got_q, ref_q, n=2, magnitude=mag)
            assert_close(got_k, ref_k, n=2, magnitude=float(ref_k.abs().amax()) * 2 * max_pos)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "dynamic", "factor": 4.0},
        {"rope_type": "longrope", "long_factor": [1.0 + i for i in range(4)], "short_factor": [1.0] * 4, "factor": 3.0},
    ],
    ids=["dynamic", "longrope"],
)
def test_length_dependent_cache_contract(scaling):
    """The cache holds raw keys: a cached step at length s equals a full forward over the first s tokens."""
    torch.manual_seed(0)
    orig, L = 6, 16
    attn = posenc.Attention(32, 4, "rope", causal=True, max_len=orig, rope_scaling=scaling)
    assert attn.encoding.cache_raw_keys and attn.encoding.needs.raw_keys
    x = torch.randn(2, L, 32)
    with torch.no_grad():
        full = attn(x)
        cache = attn.init_cache(2, L)
        steps = [attn(x[:, t : t + 1], cache=cache) for t in range(L)]
        for t in range(L):
            prefix = attn(x[:, : t + 1])
            assert_close(steps[t][:, 0], prefix[:, -1], n=attention_n(dim=32, head_dim=8, length=L))
        # inside the original length nothing depends on the length: decoding == one full forward
        assert_close(torch.cat(steps[:orig], 1), attn(x[:, :orig]), n=attention_n(dim=32, head_dim=8, length=L))
        # the contract matters: caching rotated keys (as HF does) mixes bases and differs. The
        # record is fixed at construction (assigning raises); the test swaps it behind its back
        with pytest.raises(AttributeError, match="fixed at construction"):
            attn.encoding.cache_raw_keys = False
        with pytest.raises(AttributeError, match="fixed at construction"):
            attn.encoding.needs = attn.encoding.needs.replace(raw_keys=False)
        attn.encoding.__dict__["needs"] = attn.encoding.needs.replace(raw_keys=False)
        assert not attn.encoding.cache_raw_keys
        cache = attn.init_cache(2, L)
        stale = [attn(x[:, t : t + 1], cache=cache) for t in range(L)]
        assert (stale[-1][:, 0] - full[:, -1]).abs().max() > 1e-4


def test_rope_scaling_validation():
    build = lambda **kw: posenc.build("rope", heads=2, head_dim=16, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="rope_type must be one of"):
        build(rope_scaling={"rope_type": "ntk-by-parts", "factor": 2.0})
    with pytest.raises(ValueError, match=r"needs \['factor'\]"):
        build(rope_scaling={"rope_type": "linear"})
    with pytest.raises(ValueError, match="unknown rope_scaling key"):
        build(rope_scaling={"rope_type": "linear", "factor": 2.0, "beta_fast": 3})
    with pytest.raises(ValueError, match="factor must be a positive number"):
        build(rope_scaling={"rope_type": "linear", "factor": -1.0})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        build(rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="must have rotary_dim/2 = 8 entries"):
        build(max_len=64, rope_scaling={"rope_type": "longrope", "long_factor": [1.0], "short_factor": [1.0]})
    with pytest.raises(ValueError, match="high_freq_factor > low_freq_factor"):
        build(
            max_len=64,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
        )
    with pytest.raises(TypeError, match="must be a dict"):
        build(rope_scaling="linear")
    # HF's legacy key "type" is accepted
    assert build(rope_scaling={"type": "linear", "factor": 2.0}).rope_type == "linear"


@pytest.mark.parametrize("head_dim,base,alpha", [(16, 10000.0, 1000.0), (128, 10000.0, 1000.0), (64, 5e5, 2.0)])
def test_ntk_alpha_equals_hunyuan(head_dim, base, alpha):
    """HunYuan's fixed-alpha NTK (HF labels it "dynamic" with an ``alpha``), against its rotary module's
    own ``compute_ntk_alpha_rope_parameters``; through HF's rope_parameters as posenc.hf reads them too."""
    from transformers import HunYuanDenseV1Config
    from transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense import HunYuanDenseV1RotaryEmbedding

    from posenc.hf.rope_config import rope_options

    params = {"rope_type": "dynamic", "rope_theta": base, "alpha": alpha, "factor": 1.0}
    cfg = HunYuanDenseV1Config(
        hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, rope_parameters=params
    )
    ref, factor = HunYuanDenseV1RotaryEmbedding.compute_ntk_alpha_rope_parameters(cfg)
    options = rope_options(cfg)[None]
    assert options["rope_scaling"] == {"rope_type": "ntk_alpha", "alpha": alpha, "factor": 1.0}
    enc = posenc.build("rope", heads=4, head_dim=head_dim, base=options["base"], rope_scaling=options["rope_scaling"])
    assert torch.equal(enc.inv_freq, ref) and enc.attention_factor == factor
    assert torch.equal(enc.frequencies(10 * head_dim), ref)  # fixed: not length dependent
    with pytest.raises(ValueError, match="alpha"):
        posenc.build("rope", heads=4, head_dim=head_dim, rope_scaling={"rope_type": "ntk_alpha"})
