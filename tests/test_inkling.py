"""Inkling (``posenc.encodings.inkling``) against HF ``InklingAttention`` and its formula.

HF parity (transformers ``models/inkling/modeling_inkling.py``): one global layer with the
log-scaled temperature (``rel_extent`` E) and one ``hybrid_sliding`` layer (window W, the
bias over ``W`` distances), from a tiny random ``InklingTextConfig``. Bypassed in HF's
module: ``q_norm``/``k_norm`` are replaced by the identity (posenc has no q/k norms yet,
issue #26) and k/v are not grouped (``num_key_value_heads == num_attention_heads``: posenc
has no grouped k/v); everything else runs as HF runs it: the eager attention function,
``r_proj`` and ``InklingRelativeLogits``, ``τ`` on q and the bias in float32, the short
convolutions (``InklingShortConvolution``) with their state in HF's ``DynamicCache``.
"""

from __future__ import annotations

import math

import pytest
import torch
from tests.conftest import assert_close, attention_n
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.models.inkling import modeling_inkling as hf_inkling
from transformers.models.inkling.configuration_inkling import InklingTextConfig

import posenc
from posenc import Context
from posenc.encodings.inkling import InklingTemperature

D, H, DH, W, E, K, D_REL, ALPHA, N_FLOOR, L = 16, 2, 8, 4, 6, 3, 3, 0.5, 2, 10
N = attention_n(dim=D, head_dim=DH, length=L) + 2 * K  # + the convolution taps on k and v


def hf_config(kernel: int) -> InklingTextConfig:
    cfg = InklingTextConfig(
        vocab_size=32, hidden_size=D, num_hidden_layers=2, num_attention_heads=H, num_key_value_heads=H,
        head_dim=DH, swa_num_attention_heads=H, swa_num_key_value_heads=H, swa_head_dim=DH,
        sliding_window_size=W, d_rel=D_REL, rel_extent=E, log_scaling_n_floor=N_FLOOR, log_scaling_alpha=ALPHA,
        layer_types=["hybrid", "hybrid_sliding"], conv_kernel_size=max(kernel, 1), intermediate_size=8,
        moe_intermediate_size=8, n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return cfg


def pair(layer: int, kernel: int):
    """HF's layer ``layer`` (0 global, 1 sliding) with random weights, q/k norms bypassed, and
    the posenc layer with the same weights. ``kernel`` 0: HF's convolutions are zeroed (the
    residual alone: the identity), posenc runs none."""
    cfg = hf_config(kernel)
    torch.manual_seed(layer)
    hf = hf_inkling.InklingAttention(cfg, layer)
    hf.q_norm, hf.k_norm = nn.Identity(), nn.Identity()
    sliding = layer == 1
    opts = {"d_rel": D_REL, "rel_extent": W if sliding else E, "sconv_kernel": kernel}
    if not sliding:  # a global layer: the temperature, a class of its own
        opts |= {"log_scaling_n_floor": N_FLOOR, "log_scaling_alpha": ALPHA}
    name = "inkling" if sliding else "inkling-temperature"
    ours = posenc.Attention(D, H, name, head_dim=DH, window=W if sliding else None, **opts)
    enc = ours.encoding
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
        for n in "qkvo":
            getattr(ours, f"{n}_proj").weight.copy_(getattr(hf, f"{n}_proj").weight)
        enc.r_proj.weight.copy_(hf.r_proj.weight)
        enc.rel_proj.copy_(hf.rel_logits_proj.proj)
        if kernel:
            enc.k_conv.copy_(hf.k_sconv.conv1d.weight.squeeze(1))
            enc.v_conv.copy_(hf.v_sconv.conv1d.weight.squeeze(1))
        else:
            hf.k_sconv.conv1d.weight.zero_()
            hf.v_sconv.conv1d.weight.zero_()
    return cfg, hf, ours


def hf_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding: bool) -> torch.Tensor:
    """HF's additive mask: causal, and ``j > i - W`` on the sliding layer."""
    i, j = q_pos[:, None], k_pos[None, :]
    ok = (j <= i) & ((j > i - W) if sliding else True)
    return torch.zeros(ok.shape).masked_fill(~ok, float("-inf"))[None, None]


def _x(B=2, length=L, seed=1):
    return torch.randn(B, length, D, generator=torch.Generator().manual_seed(seed))


CASES = [(layer, kernel) for layer in (0, 1) for kernel in (0, K)]
IDS = [f"{'global' if layer == 0 else 'sliding'}-sconv{kernel}" for layer, kernel in CASES]


@pytest.mark.parametrize("layer,kernel", CASES, ids=IDS)
def test_matches_hf_attention_and_its_bias(layer, kernel, monkeypatch):
    _, hf, ours = pair(layer, kernel)
    seen = {}
    eager = hf_inkling.eager_attention_forward

    def spy(*args, position_bias=None, **kw):
        seen["bias"] = position_bias
        return eager(*args, position_bias=position_bias, **kw)

    monkeypatch.setattr(hf_inkling, "eager_attention_forward", spy)
    x = _x()
    with torch.no_grad():
        ref, _ = hf(x, hf_mask(torch.arange(L), torch.arange(L), layer == 1))
        assert_close(ours(x, backend="eager"), ref, n=N)
        for backend in posenc.supported_backends(ours.encoding):
            assert_close(ours(x, backend=backend), ref, n=N, msg=backend)
        p = ours.project(x, ours.make_call(x, torch.arange(L)[None]))
        bias = ours.encoding.bias(p.q_pos, p.k_pos, ctx=p.ctx)
    assert_close(bias, seen["bias"].expand_as(bias), n=D + D_REL)


@pytest.mark.parametrize("layer,kernel", CASES, ids=IDS)
def test_cached_decoding_matches_hf_cache(layer, kernel):
    """HF's DynamicCache (conv state, sliding keys) against posenc's KV cache, in pieces of 4,
    1, 1, 3, 1 tokens: HF's multi-token and one-token conv paths both run."""
    cfg, hf, ours = pair(layer, kernel)
    x = _x()
    hf_cache, cache = DynamicCache(config=cfg), ours.init_cache(2, L)
    refs, outs, start = [], [], 0
    with torch.no_grad():
        for n in (4, 1, 1, 3, 1):
            kv_len, kv_off = hf_cache.get_mask_sizes(n, layer)
            mask = hf_mask(torch.arange(start, start + n), torch.arange(kv_len) + kv_off, layer == 1)
            refs.append(hf(x[:, start : start + n], mask, cache=hf_cache)[0])
            outs.append(ours(x[:, start : start + n], cache=cache))
            start += n
    assert_close(torch.cat(outs, 1), torch.cat(refs, 1), n=N)


def formula_bias(enc, x, q_pos, k_pos):
    """``b_h(i, j) = τ_i·(W_r x_i)_h·P[:, i - j]`` for ``0 <= i - j < E``, else 0, float64 loops."""
    r = (x.double() @ enc.r_proj.weight.double().T).view(*x.shape[:2], enc.heads, enc.d_rel)
    P = enc.rel_proj.double()
    out = torch.zeros(x.shape[0], enc.heads, len(q_pos), len(k_pos), dtype=torch.float64)
    for a, i in enumerate(q_pos.tolist()):
        tau = 1.0
        if isinstance(enc, InklingTemperature):
            tau = 1 + enc.log_scaling_alpha * math.log(max(1.0, (i + 1) / enc.log_scaling_n_floor))
        for c, j in enumerate(k_pos.tolist()):
            if 0 <= i - j < enc.rel_extent:
                out[:, :, a, c] = tau * (r[:, a] * P[:, i - j]).sum(-1)
    return out


@pytest.mark.parametrize("log_scaling", [False, True])
def test_bias_and_temperature_follow_the_formula(log_scaling):
    opts = {"log_scaling_n_floor": 3, "log_scaling_alpha": 0.25} if log_scaling else {}
    name = "inkling-temperature" if log_scaling else "inkling"
    enc = posenc.build(name, heads=H, head_dim=DH, d_rel=D_REL, rel_extent=5, **opts)
    q_pos, k_pos = torch.tensor([0, 2, 4, 7, 9, 30]), torch.tensor([0, 1, 3, 4, 5, 9, 12, 26, 30])
    x = _x(length=len(q_pos))
    ctx = Context(q_pos[None], k_pos[None], x=x)
    with torch.no_grad():
        bias = enc.bias(q_pos, k_pos, ctx=ctx)
        want = formula_bias(enc, x, q_pos, k_pos)
        assert_close(bias, want.float(), n=D + D_REL)
        d = q_pos[:, None] - k_pos[None, :]
        outside = (d < 0) | (d >= 5)
        assert torch.equal(bias[:, :, outside], torch.zeros_like(bias[:, :, outside]))  # exactly 0, not clipped
        assert (bias[:, :, d == 4].abs() > 0).all()  # the last distance inside still gets its bias
        # the FlexAttention closure gives the same values, without an L×L tensor
        mod = enc.score_mod(q_pos[None].expand(2, -1), k_pos[None].expand(2, -1), ctx=ctx)
        b, h, i, j = torch.meshgrid(*(torch.arange(n) for n in bias.shape), indexing="ij")
        assert_close(mod(torch.zeros(bias.shape), b, h, i, j), bias, n=1)
        # τ on the queries, in float32
        tau = torch.tensor([1 + 0.25 * math.log(max(1.0, (i + 1) / 3)) if log_scaling else 1.0 for i in q_pos.tolist()])
        q, k = torch.randn(2, H, len(q_pos), DH), torch.randn(2, H, len(k_pos), DH)
        q2, k2 = enc.rotate(q, k, q_pos, k_pos)
        assert_close(q2, q * tau[:, None], n=1)
        assert torch.equal(k2, k)
    assert enc.relative is not log_scaling and enc.scale == 1 / DH
    assert bool(enc.stages & posenc.Stage.QK) is log_scaling


def inkling_lm(window=None, name="inkling", **opts):
    torch.manual_seed(0)
    spec = posenc.LayerSpec(name, options={"rel_extent": 5, "sconv_kernel": K, **opts}, window=window)
    lm = posenc.TransformerLM(vocab_size=32, dim=D, depth=2, heads=H, layers=[spec, spec], max_len=16)
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return lm.eval()


@pytest.mark.parametrize("window", [None, 3], ids=["full", "window3"])
def test_cached_decoding_equals_full_pass_with_convolutions(window):
    lm = inkling_lm(window, "inkling-temperature", log_scaling_n_floor=2, log_scaling_alpha=0.3)
    t = torch.randint(0, 32, (2, 11))
    with torch.no_grad():
        full = lm(t)
        for cuts in ((1,) * 11, (5, 1, 2, 3)):
            cache, outs, i = lm.init_cache(batch_size=2, max_len=12), [], 0
            for c in cuts:
                outs.append(lm(t[:, i : i + c], cache=cache))
                i += c
            assert_close(torch.cat(outs, 1), full, n=4 * N, msg=f"steps {cuts}")


def test_backends_equal_eager_and_gradients_reach_the_convolutions():
    attn = posenc.Attention(
        D, H, "inkling-temperature", rel_extent=5, sconv_kernel=K, log_scaling_n_floor=2, chunk_size=3
    )
    x, pos = _x().requires_grad_(), torch.stack([torch.arange(L), torch.arange(L) + 3])
    ref = attn(x, pos=pos, backend="eager")
    ref.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in attn.named_parameters()}
    assert all(g.abs().sum() > 0 for g in grads.values()), [n for n, g in grads.items() if not g.abs().sum() > 0]
    for backend in ("flex", "dense", "chunked"):
        attn.zero_grad()
        with torch.set_grad_enabled(backend != "flex"):  # FlexAttention has no CPU backward
            out = attn(x, pos=pos, backend=backend)
        assert_close(out, ref, n=N, msg=backend)
        if backend != "flex":
            out.square().sum().backward()
            for n, p in attn.named_parameters():
                assert_close(p.grad, grads[n], n=2 * N + 2 * L, msg=f"{backend}/{n}")


def test_shift_invariance_follows_the_temperature():
    x = _x()
    cases = (("inkling", {"sconv_kernel": K}, True), ("inkling-temperature", {"log_scaling_n_floor": 2}, False))
    for name, opts, invariant in cases:
        attn = posenc.Attention(D, H, name, rel_extent=5, **opts)
        with torch.no_grad():
            base, shifted = attn(x, pos=torch.arange(L)), attn(x, pos=torch.arange(L) + 7)
        assert torch.allclose(base, shifted, atol=1e-5) is invariant and attn.encoding.relative is invariant


@pytest.mark.parametrize(
    "name,opts,match",
    [
        ("inkling", {"rel_extent": 0}, "rel_extent must be an int >= 1, got 0"),
        ("inkling", {"d_rel": -2}, "d_rel must be an int >= 1, got -2"),
        ("inkling", {"sconv_kernel": -1}, "sconv_kernel must be an int >= 0.*got -1"),
        ("inkling-temperature", {"log_scaling_n_floor": 0}, "log_scaling_n_floor must be an int >= 1, got 0"),
        ("inkling-temperature", {"log_scaling_alpha": -0.5}, "log_scaling_alpha must be a number > 0, got -0.5"),
        ("inkling-temperature", {"rel_extent": 0}, "rel_extent must be an int >= 1, got 0"),
        # the temperature is a class of its own: plain inkling takes none of its options, and says which does
        (
            "inkling",
            {"log_scaling_alpha": 0.2},
            r"unknown option\(s\) \['log_scaling_alpha'\] for encoding 'inkling';.*'inkling-temperature' takes them",
        ),
        ("inkling", {"log_scaling_n_floor": 2}, r"\['log_scaling_n_floor'\] .*; 'inkling-temperature' takes them"),
        ("inkling", {"hidden_size": 0}, "hidden_size must be an int >= 1 or None, got 0"),
        ("inkling", {"init_std": 0.0}, "init_std must be a number > 0, got 0.0"),
        ("inkling", {"causal": False}, "causal only"),
        ("inkling-temperature", {"causal": False}, "causal only"),
    ],
)
def test_bad_options_raise(name, opts, match):
    with pytest.raises(ValueError, match=match):
        posenc.build(name, heads=H, head_dim=DH, **opts)


def test_bias_without_the_layer_input_raises():
    enc = posenc.build("inkling-temperature", heads=H, head_dim=DH, log_scaling_n_floor=2)
    pos = torch.arange(4)
    for ctx in (None, Context(pos[None], pos[None])):
        with pytest.raises(ValueError, match=r"reads ctx\.x"):
            enc.bias(pos, pos, ctx=ctx)
        with pytest.raises(ValueError, match=r"reads ctx\.x"):
            enc.score_mod(pos[None], pos[None], ctx=ctx)
    with pytest.raises(ValueError, match="ctx.x has 5 rows for 4 query positions"):
        enc.bias(pos, pos, ctx=Context(pos[None], pos[None], x=torch.randn(1, 5, H * DH)))
    with pytest.raises(ValueError, match="q_pos holds 3 positions for 4 queries"):
        enc.rotate(torch.randn(1, H, 4, DH), torch.randn(1, H, 4, DH), pos[:3], pos)


def test_convolutions_stay_inside_documents_and_skip_padding():
    """With the short convolutions on, packed documents get the logits they get alone (the
    convolution restarts at each document, HF's seq_idx), and left padding enters the
    convolution as 0 (HF's conv_mask): the real tokens' logits equal the unpadded run's."""
    from tests.conftest import lm_n

    lm = inkling_lm()
    n = lm_n(dim=D, depth=2, length=12) + 4 * K
    a, b = torch.randint(0, 32, (1, 5)), torch.randint(0, 32, (1, 7))
    with torch.no_grad():
        packed = lm(torch.cat((a, b), 1), document_ids=torch.tensor([[0] * 5 + [1] * 7]))
        assert_close(packed[:, :5], lm(a), n=n)
        assert_close(packed[:, 5:], lm(b), n=n)
        pad = torch.randint(0, 32, (1, 3))  # garbage before the sequence
        kpm = torch.tensor([[False] * 3 + [True] * 7])
        pos = torch.tensor([[0, 0, 0, *range(7)]])
        padded = lm(torch.cat((pad, b), 1), pos=pos, key_padding_mask=kpm)
        assert_close(padded[:, 3:], lm(b), n=n)
