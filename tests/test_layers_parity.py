"""Parity of the per-layer presets with the HF attention layers they reproduce.

Each test builds one layer of a tiny random HF config (``tests/hf_layer_oracles.py``),
builds the posenc layer from the matching preset's spec for the same layer index, copies
the projections, and compares outputs element-wise.
"""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_close, attention_n
from tests.hf_layer_oracles import copy_projections, gemma3_layer, gpt_oss_layer, llama4_layer, sink_softmax_attention

import posenc
from posenc.patterns import LayerSpec, layers

DIM, HEADS, HEAD_DIM, L = 32, 4, 8, 13


def _attention(spec: LayerSpec, **kw) -> posenc.Attention:
    return posenc.Attention(
        DIM,
        HEADS,
        spec.encoding,
        head_dim=HEAD_DIM,
        causal=True,
        window=spec.window,
        chunk=spec.chunk,
        sinks=spec.sinks,
        **spec.options,
        **kw,
    )


def _check_every_backend(attn: posenc.Attention, ref: torch.Tensor, x: torch.Tensor) -> None:
    attn.chunk_size = attn.dense_chunk = 4  # several query blocks: key ranges are exercised
    with torch.no_grad():
        for backend in [*posenc.supported_backends(attn.encoding), "auto"]:
            assert_close(attn(x, backend=backend), ref, n=_n(), msg=backend)


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, L, DIM, generator=torch.Generator().manual_seed(seed))


def _n() -> int:
    return attention_n(dim=DIM, head_dim=HEAD_DIM, length=L)


# ------------------------------------------------------------------ Llama 4 (iRoPE)
def test_irope_nope_layer_matches_hf_llama4():
    """Layer 3 of 4: no RoPE, full causal attention, query temperature (floor_scale=4, so
    the temperature steps at positions 3, 7, 11 within L=13)."""
    torch.manual_seed(0)
    hf = llama4_layer(3, chunk=5, floor_scale=4, attn_scale=0.1)
    assert not hf.uses_rope and hf.layer_type == "full_attention"
    spec = layers("irope", chunk=5, floor_scale=4)[3]
    assert spec.encoding == "nope-temperature" and spec.chunk is None and spec.window is None
    attn = _attention(spec)
    copy_projections(hf.module, attn)
    x = _x()
    with torch.no_grad():
        ref = hf.run(x)
        for backend in posenc.supported_backends(attn.encoding):
            assert_close(attn(x, backend=backend), ref, n=_n(), msg=backend)


def test_irope_temperature_matters():
    """Without the temperature the same weights give another output (the check can fail)."""
    torch.manual_seed(0)
    hf = llama4_layer(3, chunk=5, floor_scale=4, attn_scale=0.1)
    plain = _attention(LayerSpec("nope"))
    copy_projections(hf.module, plain)
    with torch.no_grad():
        assert (plain(_x()) - hf.run(_x())).abs().max() > 1e-3


def test_irope_chunked_rope_layer_matches_hf_llama4():
    """Layer 0 of 4: interleaved RoPE inside aligned chunks of 5 (L = 13: three chunks)."""
    torch.manual_seed(0)
    hf = llama4_layer(0, chunk=5, floor_scale=4, attn_scale=0.1, theta=500000.0)
    assert hf.uses_rope and hf.layer_type == "chunked_attention"
    spec = layers("irope", chunk=5, floor_scale=4)[0]
    assert spec.chunk == 5 and spec.options["layout"] == "interleaved"
    attn = _attention(spec)
    copy_projections(hf.module, attn)
    x = _x()
    with torch.no_grad():
        ref = hf.run(x)
    _check_every_backend(attn, ref, x)
    attn.chunk = None  # the chunks matter
    with torch.no_grad():
        assert (attn(x) - ref).abs().max() > 1e-3


# ------------------------------------------------------------------ Gemma 3
def test_gemma3_local_layer_matches_hf():
    """Layer 0 of 6: sliding window of 4 keys, θ = 1e4."""
    torch.manual_seed(0)
    hf = gemma3_layer(0, window=4)
    assert hf.layer_type == "sliding_attention"
    spec = layers("gemma3", window=4)[0]
    assert spec.window == 4 and spec.options["base"] == 10000
    attn = _attention(spec)
    copy_projections(hf.module, attn)
    x = _x()
    with torch.no_grad():
        ref = hf.run(x)
    _check_every_backend(attn, ref, x)
    attn.window = None  # the window matters
    with torch.no_grad():
        assert (attn(x) - ref).abs().max() > 1e-3


def test_gemma3_global_layer_matches_hf():
    """Layer 5 of 6: global attention with θ = 1e6."""
    torch.manual_seed(0)
    hf = gemma3_layer(5, window=4)
    assert hf.layer_type == "full_attention"
    spec = layers("gemma3", window=4)[5]
    assert spec.window is None and spec.options["base"] == 1000000
    attn = _attention(spec)
    copy_projections(hf.module, attn)
    x = _x()
    with torch.no_grad():
        assert_close(attn(x), hf.run(x), n=_n())


# ------------------------------------------------------------------ gpt-oss
YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 16,
}


@pytest.mark.parametrize("layer_idx,kind", [(0, "sliding_attention"), (1, "full_attention")])
def test_gpt_oss_layers_with_sinks_match_hf(layer_idx, kind):
    """Even layers: window 4 (L = 13) + sinks; odd layers: full + sinks. YaRN RoPE, biases."""
    torch.manual_seed(0)
    hf = gpt_oss_layer(layer_idx, window=4, rope_parameters={**YARN, "rope_theta": 150000.0})
    assert hf.layer_type == kind
    spec = layers("gpt-oss", window=4, rope_scaling=YARN)[layer_idx]
    assert spec.sinks and spec.window == (4 if layer_idx == 0 else None)
    attn = _attention(spec, qkv_bias=True)
    copy_projections(hf.module, attn)
    with torch.no_grad():
        attn.sinks.copy_(hf.module.sinks)
    x = _x()
    with torch.no_grad():
        ref = hf.run(x)
    _check_every_backend(attn, ref, x)
    with torch.no_grad():  # the sinks matter
        attn.sinks.zero_()
        assert (attn(x) - ref).abs().max() > 1e-3


# ------------------------------------------------------------------ gpt-oss sinks (the formula)
def test_sink_transcription_matches_hf_gpt_oss_eager():
    """The test-side transcription of gpt-oss's sink softmax equals HF's eager function."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    B, H, Lq, Dh = 2, 3, 6, 8
    q, k, v = (torch.randn(B, H, Lq, Dh) for _ in range(3))
    sinks = torch.randn(H)
    mask = torch.zeros(Lq, Lq).masked_fill(torch.ones(Lq, Lq, dtype=torch.bool).triu(1), float("-inf"))
    module = SimpleNamespace(num_key_value_groups=1, sinks=sinks, training=False)
    ref, _ = eager_attention_forward(module, q, k, v, mask[None, None], scaling=Dh**-0.5)
    ours = sink_softmax_attention(q, k, v, sinks, mask, Dh**-0.5).transpose(1, 2)
    assert_close(ours, ref, n=Dh + 2 * Lq)


@pytest.mark.parametrize(
    "bad,match",
    [
        ("nope-temperature(attn_scale=-1)", "attn_scale must be a number >= 0, got -1"),
        ("nope-temperature(floor_scale=0)", "floor_scale must be a number > 0, got 0"),
        # plain nope takes neither: the temperature is a class of its own, which the message names
        (
            "nope(attn_scale=0.1)",
            r"unknown option\(s\) \['attn_scale'\] for encoding 'nope' in a layer pattern.*'nope-temperature' takes them",
        ),
    ],
)
def test_temperature_options_are_validated(bad, match):
    with pytest.raises(ValueError, match=match):
        spec = layers(bad)[0]
        posenc.build(spec.encoding, heads=2, head_dim=4, **spec.options)
