"""Rotary variants of HF transformers v5 (issue 26 item 2), element-wise against HF's own code.

* ``rope_type="proportional"`` (Gemma 4's global layers) vs ``_compute_proportional_rope_parameters``
  and ``Gemma4TextRotaryEmbedding`` + Gemma 4 ``apply_rotary_pos_emb``; and that it is *not*
  ``partial_rotary_factor``.
* Interleaved M-RoPE (``mrope_interleaved=True``) vs ``Qwen3VLTextRotaryEmbedding``
  (``recomposition_frequencies``, formerly ``apply_interleaved_mrope``).
* :func:`posenc.hf.rope_options`: HF v5 ``rope_parameters`` flat, per layer type and per label.

Bit-exact where HF runs the same float32 operations (``inv_freq``, cos/sin, the rotation).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import posenc

transformers = pytest.importorskip("transformers")
from transformers import Gemma4TextConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.gemma4.modeling_gemma4 import (  # noqa: E402
    Gemma4TextRotaryEmbedding,
    apply_rotary_pos_emb,
)

HEADS = 2


def _gemma4(head_dim: int, global_head_dim: int, full: dict) -> Gemma4TextConfig:
    """A tiny random Gemma 4 text config: sliding layers plain RoPE, full layers ``full``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Gemma4TextConfig(
            hidden_size=64,
            num_attention_heads=HEADS,
            num_key_value_heads=1,
            head_dim=head_dim,
            global_head_dim=global_head_dim,
            num_hidden_layers=2,
            intermediate_size=64,
            vocab_size=100,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": full,
            },
        )


PROPORTIONAL = [
    (64, {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}),
    (64, {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0, "factor": 8.0}),
    (32, {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 10_000.0}),
    (48, {"rope_type": "proportional", "partial_rotary_factor": 0.3, "rope_theta": 500_000.0}),  # int(p·Dh // 2) = 7
    (32, {"rope_type": "proportional", "rope_theta": 10_000.0}),  # p = 1: plain RoPE
]


@pytest.mark.parametrize("dh,params", PROPORTIONAL)
def test_proportional_inv_freq_equals_hf(dh, params):
    cfg = _gemma4(16, dh, params)
    ref, ref_factor = ROPE_INIT_FUNCTIONS["proportional"](cfg, "cpu", layer_type="full_attention")
    hf = Gemma4TextRotaryEmbedding(cfg).full_attention_inv_freq
    enc = posenc.build("rope", heads=HEADS, head_dim=dh, max_len=256, rope_scaling=params)
    assert enc.rotary_dim == dh and enc.inv_freq.shape == (dh // 2,)
    assert torch.equal(enc.inv_freq, ref) and torch.equal(enc.inv_freq, hf)
    assert enc.attention_factor == ref_factor == 1.0
    n = int(params.get("partial_rotary_factor", 1.0) * dh // 2)
    assert bool((enc.inv_freq[:n] > 0).all()) and bool((enc.inv_freq[n:] == 0).all())


@pytest.mark.parametrize("dh,params", PROPORTIONAL)
def test_proportional_rotation_equals_hf_gemma4(dh, params):
    torch.manual_seed(0)
    cfg = _gemma4(16, dh, params)
    rope = Gemma4TextRotaryEmbedding(cfg)
    q, k = torch.randn(2, HEADS, 24, dh), torch.randn(2, 1, 24, dh)
    pos = torch.stack((torch.arange(24), torch.arange(24) + 1000))  # (B, L): a decoding offset too
    cos, sin = rope(q, pos, "full_attention")
    ref_q, ref_k = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)
    enc = posenc.build("rope", heads=HEADS, head_dim=dh, max_len=2048, rope_scaling=params)
    got_q, got_k = enc.rotate(q, k.expand(-1, HEADS, -1, -1), pos, pos)
    assert torch.equal(got_q, ref_q)
    assert torch.equal(got_k, ref_k.expand(-1, HEADS, -1, -1))


def test_proportional_differs_from_partial_rotary_factor_past_position_0():
    torch.manual_seed(0)
    dh, p, theta = 64, 0.25, 10_000.0
    prop = posenc.build(
        "rope",
        heads=HEADS,
        head_dim=dh,
        rope_scaling={"rope_type": "proportional", "partial_rotary_factor": p, "rope_theta": theta},
    )
    part = posenc.build("rope", heads=HEADS, head_dim=dh, partial_rotary_factor=p, base=theta)
    # both rotate 8 pairs, but proportional's frequencies are base^(-2k/64), partial's base^(-2k/16)
    assert prop.rotary_dim == dh and part.rotary_dim == int(dh * p) == 16
    n = int(p * dh // 2)
    full_spectrum = posenc.build("rope", heads=HEADS, head_dim=dh, base=theta).inv_freq
    assert torch.equal(prop.inv_freq[:n], full_spectrum[:n])
    assert torch.equal(part.inv_freq, posenc.build("rope", heads=HEADS, head_dim=16, base=theta).inv_freq)
    assert not torch.allclose(prop.inv_freq[:n], part.inv_freq)
    q, k = torch.randn(1, HEADS, 16, dh), torch.randn(1, HEADS, 16, dh)
    pos = torch.arange(16)
    pq, pk = prop.rotate(q, k, pos, pos)
    rq, rk = part.rotate(q, k, pos, pos)
    # position 0: no rotation in either; after it the angles differ (and drift with distance)
    assert torch.equal(pq[..., 0, :], rq[..., 0, :]) and torch.equal(pq[..., 0, :], q[..., 0, :])
    diff = (pq - rq).abs().amax(dim=(0, 1, 3))  # (L,)
    assert bool((diff[1:] > 1e-3).all()), diff
    # the layouts of the rotated dims differ too: partial pairs (x_k, x_{k+8}), proportional (x_k, x_{k+32})
    assert torch.equal(pq[..., n : dh // 2], q[..., n : dh // 2])


# --------------------------------------------------------------------------- interleaved M-RoPE (Qwen3-VL)
def _qwen3vl_rotary(head_dim: int, params: dict):
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = Qwen3VLTextConfig(
            hidden_size=HEADS * head_dim,
            num_attention_heads=HEADS,
            num_key_value_heads=HEADS,
            head_dim=head_dim,
            intermediate_size=32,
            num_hidden_layers=1,
            vocab_size=64,
            rope_parameters=params,
        )
    return Qwen3VLTextRotaryEmbedding(cfg)


MROPE = [
    (
        128,
        {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20], "mrope_interleaved": True},
    ),
    (32, {"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [6, 5, 5], "mrope_interleaved": True}),
    (32, {"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [10, 3, 3], "mrope_interleaved": True}),
]


@pytest.mark.parametrize("dh,params", MROPE)
def test_interleaved_mrope_cos_sin_and_rotation_equal_hf_qwen3vl(dh, params):
    from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb as qwen3vl_apply

    from posenc.positions import mrope_positions

    torch.manual_seed(0)
    rotary = _qwen3vl_rotary(dh, params)
    pos = torch.stack((mrope_positions(3, (3, 4), 2, (2, 2, 3)), mrope_positions(5, (4, 2, 2), 3, (1, 5), start=40)))
    q, k = torch.randn(2, HEADS, pos.shape[1], dh), torch.randn(2, HEADS, pos.shape[1], dh)
    cos, sin = rotary(q, pos.permute(2, 0, 1))  # HF: position_ids (3, B, L)
    enc = posenc.build(
        "mrope",
        heads=HEADS,
        head_dim=dh,
        base=params["rope_theta"],
        mrope_section=params["mrope_section"],
        mrope_interleaved=True,
    )
    assert torch.equal(enc.inv_freq, rotary.inv_freq)
    ang = enc.angles(pos, enc.inv_freq)  # (B, 1, L, Dh/2)
    assert torch.equal(torch.cat((ang.cos(), ang.cos()), -1).squeeze(1), cos)
    assert torch.equal(torch.cat((ang.sin(), ang.sin()), -1).squeeze(1), sin)
    want = qwen3vl_apply(q, k, cos, sin)
    got = enc.rotate(q, k, pos, pos)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_interleaved_mrope_axes_and_contiguous_differ():
    enc = posenc.build("mrope", heads=HEADS, head_dim=32, mrope_section=[6, 5, 5], mrope_interleaved=True)
    assert enc.axis.tolist() == [0, 1, 2] * 5 + [0]  # T H W T H W … then T
    flat = posenc.build("mrope", heads=HEADS, head_dim=32, mrope_section=[6, 5, 5])
    assert flat.axis.tolist() == [0] * 6 + [1] * 5 + [2] * 5
    assert posenc.build("mrope", heads=HEADS, head_dim=128, mrope_interleaved=True).mrope_section == [24, 20, 20]
    # on text (t = h = w) both are 1-D RoPE
    q, k = torch.randn(1, HEADS, 9, 32), torch.randn(1, HEADS, 9, 32)
    pos = torch.arange(9)
    for a, b in zip(enc.rotate(q, k, pos, pos), flat.rotate(q, k, pos, pos)):
        assert torch.equal(a, b)
    grid = torch.tensor([[0, i // 3, i % 3] for i in range(9)])[None]  # a 3×3 image
    assert not torch.equal(enc.rotate(q, k, grid, grid)[0], flat.rotate(q, k, grid, grid)[0])


def test_interleaved_mrope_bad_options():
    with pytest.raises(TypeError, match="mrope_interleaved must be a bool"):
        posenc.build("mrope", heads=HEADS, head_dim=32, mrope_interleaved="yes")
    with pytest.raises(ValueError, match=r"one section per axis .* \[4, 4, 4, 4\]"):
        posenc.build("mrope", heads=HEADS, head_dim=32, mrope_section=[4, 4, 4, 4], mrope_interleaved=True)


# --------------------------------------------------------------------------- HF v5 rope_parameters
def _hf_configs():
    from transformers import Gemma3TextConfig, LlamaConfig, ModernBertConfig
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "llama": LlamaConfig(
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 500_000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                }
            ),
            "gemma3": Gemma3TextConfig(
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                }
            ),
            "modernbert": ModernBertConfig(),
            "deepseek_v4": DeepseekV4Config(
                num_hidden_layers=2,
                rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536},
            ),
        }


def test_rope_parameters_flat():
    from posenc.hf import rope_options, rope_options_for

    cfg = _hf_configs()["llama"]
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert rope_options(cfg) == {None: {"base": 500_000.0, "rope_scaling": scaling}}
    assert rope_options_for(cfg, "full_attention") == rope_options_for(cfg.rope_parameters)  # flat: every layer
    qwen3vl = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20], "mrope_interleaved": True}
    assert rope_options(qwen3vl) == {None: {"base": 5e6, "mrope_section": [24, 20, 20], "mrope_interleaved": True}}
    gemma4_global = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}
    opts = rope_options_for(gemma4_global)
    assert opts == {"base": 1e6, "partial_rotary_factor": 0.25, "rope_scaling": {"rope_type": "proportional"}}
    # the options build the same encoding HF runs
    enc = posenc.build("rope", heads=HEADS, head_dim=64, **opts)
    ref = posenc.build("rope", heads=HEADS, head_dim=64, rope_scaling=gemma4_global)
    assert torch.equal(enc.inv_freq, ref.inv_freq) and enc.rotary_dim == 64
    assert rope_options(None) == {} and rope_options({"rope_theta": 1e4}) == {None: {"base": 1e4}}


def test_rope_parameters_per_layer_type():
    from posenc.hf import rope_options, rope_options_for

    cfgs = _hf_configs()
    assert rope_options(cfgs["gemma3"]) == {
        "sliding_attention": {"base": 10_000.0},
        "full_attention": {"base": 1_000_000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    }
    assert rope_options_for(cfgs["modernbert"], "full_attention") == {"base": 160_000.0}
    assert rope_options_for(cfgs["modernbert"], "sliding_attention") == {"base": 10_000.0}
    with pytest.raises(ValueError, match=r"keyed by \['full_attention', 'sliding_attention'\]; got layer type None"):
        rope_options_for(cfgs["modernbert"])
    assert rope_options({"full_attention": {"rope_theta": 1e6}, "sliding_attention": None}) == {
        "full_attention": {"base": 1e6},
        "sliding_attention": None,
    }


def test_rope_parameters_per_label():
    from posenc.hf import rope_options

    opts = rope_options(_hf_configs()["deepseek_v4"])
    assert set(opts) == {"main", "compress"}
    assert opts["main"] == {"base": 10_000.0, "partial_rotary_factor": opts["main"]["partial_rotary_factor"]}
    comp = opts["compress"]
    assert comp["base"] == 160_000.0 and comp["rope_scaling"]["rope_type"] == "yarn"
    assert comp["rope_scaling"]["attention_factor"] == 1.0  # HF forces it for the compressed branches
    enc = posenc.build("rope", heads=HEADS, head_dim=64, max_len=65536 * 16, **comp)
    assert enc.attention_factor == 1.0


@pytest.mark.parametrize(
    "params,match",
    [
        ({"rope_type": "ntk-by-parts", "rope_theta": 1e4}, r"rope_type 'ntk-by-parts' is not one of \['default', "),
        ({"rope_type": "linear", "factor": 2.0}, r"rope_parameters has no 'rope_theta'"),
        ({}, r"rope_parameters has no 'rope_theta' \(rope_type 'default'\)"),
        ({"full_attention": {"rope_type": "default"}}, r"rope_parameters\['full_attention'\] has no 'rope_theta'"),
        ({"main": {"rope_type": "bogus", "rope_theta": 1e4}}, r"rope_parameters\['main'\]: rope_type 'bogus' is not"),
        ({"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "beta_fast": 4}, r"\['beta_fast'\] .* valid: "),
        ({"rope_type": "default", "rope_theta": 1.0}, r"rope_theta must be a number > 1, got 1.0"),
    ],
)
def test_rope_parameters_errors_name_the_key(params, match):
    from posenc.hf import rope_options

    with pytest.raises(ValueError, match=match):
        rope_options(params)


def test_convert_reads_rope_parameters_never_a_default_base():
    from types import SimpleNamespace

    from posenc.hf.convert import layer_specs
    from posenc.hf.models import LLAMA

    cfg = _hf_configs()["llama"]
    (spec,) = layer_specs("rope", {}, 1, cfg, LLAMA)
    assert spec["options"]["base"] == 500_000.0 and spec["options"]["rope_scaling"]["rope_type"] == "llama3"
    per_type = SimpleNamespace(
        rope_parameters={"sliding_attention": {"rope_theta": 1e4}, "full_attention": {"rope_theta": 1e6}},
        layer_types=["sliding_attention", "full_attention"],
    )
    specs = layer_specs("rope", {}, 2, per_type, LLAMA)
    assert [s["options"]["base"] for s in specs] == [1e4, 1e6]
    with pytest.raises(ValueError, match="has no 'rope_theta'"):
        layer_specs("rope", {}, 1, SimpleNamespace(rope_parameters={"rope_type": "default"}), LLAMA)


def test_rope_layout_reads_rope_parameters():
    from transformers import LlamaConfig

    from posenc.encodings.rotary import permute_for_layout
    from posenc.hf import rope_layout

    torch.manual_seed(0)
    w = torch.randn(HEADS * 16, 8)
    for params, rotary_dim in (
        ({"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}, 16),  # full width
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5, "rope_theta": 1e4}, 8),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = LlamaConfig(hidden_size=8, num_attention_heads=HEADS, head_dim=16, rope_parameters=params)
        got = rope_layout({"q_proj.weight": w}, cfg, to="interleaved")["q_proj.weight"]
        want = permute_for_layout(w, heads=HEADS, head_dim=16, to="interleaved", rotary_dim=rotary_dim)
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="has no 'rope_theta'"):
        bad = LlamaConfig(hidden_size=8, num_attention_heads=HEADS, head_dim=16)
        bad.rope_parameters = {"rope_type": "default"}
        rope_layout({"q_proj.weight": w}, bad, to="interleaved")


# ------------------------------------------------------------------ the contract, for the new variants
VARIANTS = {
    "proportional": ("rope", {"rope_scaling": {"rope_type": "proportional", "factor": 2.0},
                              "partial_rotary_factor": 0.5}),
    "interleaved-mrope": ("mrope", {"mrope_section": [2, 1, 1], "mrope_interleaved": True}),
}  # fmt: skip


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_keeps_the_contract(variant):
    """What the contract suite checks for every encoding's defaults, for these options too:
    cached decoding equals the full forward, every backend equals eager, scores unchanged when
    every position shifts (both variants are relative)."""
    from tests.conftest import assert_close, attention_n, lm_n

    from posenc.attend.backends import supported_backends

    torch.manual_seed(0)
    name, opts = VARIANTS[variant]
    L, dim = 8, 32  # 4 heads of 8
    lm = posenc.TransformerLM(32, dim, 2, 4, name, max_len=16, **opts).eval()
    t = torch.randint(0, 32, (2, L))
    with torch.no_grad():
        full = lm(t)
        cache = lm.init_cache(batch_size=2, max_len=L)
        steps = torch.cat([lm(t[:, i : i + 1], cache=cache) for i in range(L)], 1)
    assert_close(steps, full, n=lm_n(dim=dim, depth=2, length=L), msg=f"{variant}: token by token")
    x = torch.randn(2, L, dim)
    n = attention_n(dim=dim, head_dim=8, length=L)
    eager = posenc.Attention(dim, 4, name, causal=True, backend="eager", **opts)
    assert eager.encoding.relative
    with torch.no_grad():
        ref = eager(x)
        assert_close(eager(x, pos=torch.arange(L) + 5), ref, n=n + L + 5, msg=f"{variant}: shifted")
        for backend in supported_backends(eager.encoding):
            attn = posenc.Attention(dim, 4, name, causal=True, backend=backend, **opts)
            attn.load_state_dict(eager.state_dict())
            assert_close(attn(x), ref, n=n, msg=f"{variant}: {backend}")
