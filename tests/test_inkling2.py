"""Inkling-2's relative bias (``inkling`` / ``inkling-temperature`` with ``rel_clip``) against HF
``Inkling2RelativePositionBias`` (transformers ``models/inkling2/modeling_inkling2.py``): the
relative states scaled per head and channel by a learned vector and L2-clipped (no RMSNorm), the
bank ``P`` gathered at ``i - j`` and 0 outside ``[0, E)``, on sliding layers (``E`` = the window,
no temperature) and full layers (``τ_i`` on the clipped states). Oracle: HF's module with the same
weights, on full tensors; and the formula written out for the clip.
"""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_close

transformers = pytest.importorskip("transformers")
from transformers.models.inkling2 import modeling_inkling2 as hf  # noqa: E402
from transformers.models.inkling2.configuration_inkling2 import Inkling2TextConfig  # noqa: E402

import posenc  # noqa: E402
import posenc.hf as ph  # noqa: E402
from posenc.context import Context  # noqa: E402

D, H, D_REL = 24, 3, 4


def config(**kw) -> Inkling2TextConfig:
    base = dict(
        vocab_size=32,
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=H,
        num_key_value_heads=1,
        head_dim=8,
        swa_num_attention_heads=H,
        swa_num_key_value_heads=1,
        swa_head_dim=8,
        sliding_window_size=5,
        d_rel=D_REL,
        rel_extent=9,
        log_scaling_n_floor=3,
        log_scaling_alpha=0.4,
        rel_l2_clip_threshold=0.7,  # below most states' norms: the clip acts on most rows
        n_routed_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=8,
        eos_token_id=None,
    )
    return Inkling2TextConfig(**base | kw)


def pair(full: bool):
    """HF's bias module of a full (``full``) or sliding layer and the posenc encoding with its weights."""
    cfg = config()
    extent = cfg.rel_extent if full else cfg.sliding_window_size
    module = hf.Inkling2RelativePositionBias(cfg, H, extent, log_scaling=full)
    with torch.no_grad():
        module.proj.normal_()
        module.norm.scale.copy_(1 + 0.5 * torch.randn(H, D_REL))
    name = "inkling-temperature" if full else "inkling"
    opts = dict(d_rel=D_REL, rel_extent=extent, hidden_size=D, rel_clip=cfg.rel_l2_clip_threshold, sqrt_scale=True)
    if full:
        opts |= dict(log_scaling_n_floor=cfg.log_scaling_n_floor, log_scaling_alpha=cfg.log_scaling_alpha)
    enc = posenc.build(name, heads=H, head_dim=8, **opts)
    with torch.no_grad():
        enc.r_proj.weight.copy_(module.linear.weight)
        enc.rel_proj.copy_(module.proj)
        enc.rel_scale.copy_(module.norm.scale)
    return module, enc


@pytest.mark.parametrize("full", [False, True], ids=["sliding", "full"])
@pytest.mark.parametrize("cached", [0, 7], ids=["prefill", "after-7-cached"])
def test_bias_equals_hf_inkling2(full, cached):
    """Every entry of HF's ``(B, H, Lq, Lk)`` bias, with and without cached keys before the queries."""
    module, enc = pair(full)
    Lq = 12 - cached
    x = 2.0 * torch.randn(2, Lq, D)
    q_pos = torch.arange(cached, 12).expand(2, Lq)
    k_pos = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        want = module(x, q_pos[0][:, None] - k_pos[0][None, :], q_pos)
        got = enc.bias(q_pos, k_pos, ctx=Context(q_pos, k_pos, x=x))
    n = D + D_REL + 2  # the projection, the clip's norm and P's sum, the temperature
    assert_close(got, want, n=n)
    d = q_pos[0][:, None] - k_pos[0][None, :]
    outside = (d < 0) | (d >= enc.rel_extent)
    assert outside.any() and got[:, :, outside].eq(0).all() and got[:, :, ~outside].ne(0).all()


def test_clip_follows_the_formula():
    """``r·s`` whose norm exceeds ``c`` comes out at norm ``c`` (to 1e-6 relative), shorter ones as they are."""
    _, enc = pair(False)
    x = torch.randn(1, 6, D)
    with torch.no_grad():
        enc.rel_scale.fill_(1.0)
        r = enc.r_proj(x).view(1, 6, H, D_REL)
        table = enc._rows_table(torch.arange(6), Context(torch.arange(6), torch.arange(6), x=x), span=D_REL)
        P = enc.rel_proj[:, :D_REL]
    norms = r.norm(dim=-1, keepdim=True)
    clipped = torch.where(norms > enc.rel_clip, r * enc.rel_clip / (norms + 1e-6), r)
    assert (norms > enc.rel_clip).any() and (norms < enc.rel_clip).any()
    assert_close(table, (clipped @ P).transpose(1, 2), n=2 * D_REL)


def test_sqrt_scale_and_bad_options():
    """Inkling-2's ``Dh^-1/2`` (Inkling's own is ``1/Dh``); a bad clip or flag raises naming it."""
    assert posenc.build("inkling", heads=H, head_dim=16, sqrt_scale=True).scale == pytest.approx(0.25)
    assert posenc.build("inkling", heads=H, head_dim=16).scale == pytest.approx(1 / 16)
    with pytest.raises(ValueError, match="rel_clip must be a number > 0 or None.*got -1"):
        posenc.build("inkling", heads=H, head_dim=8, rel_clip=-1)
    with pytest.raises(ValueError, match="sqrt_scale must be True or False, got 'yes'"):
        posenc.build("inkling", heads=H, head_dim=8, sqrt_scale="yes")


# ---------------------------------------------------------------------------- the Inkling-2 family
V = 32


def stock() -> torch.nn.Module:
    """A tiny Inkling-2 (one sliding layer of window 5, one full layer; attention residuals every
    layer), its small parameters moved off their init so a dropped one shows."""
    torch.manual_seed(3)
    cfg = config(
        unpadded_vocab_size=V,
        layer_types=["hybrid_sliding", "hybrid"],
        n_layers_per_attn_res_block=1,
        initializer_range=0.3,
        pad_token_id=None,
    )
    model = transformers.Inkling2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() < 100:
                p.add_(0.3 * torch.randn_like(p))
    return model


def inkling2_n(cfg, length: int) -> int:
    """Reduction length behind the logits: per layer the attention, the relative states and bank,
    the residual attention over layers, the experts and convolutions; then the head."""
    Dh = cfg.head_dim
    layer = 2 * D + Dh + 2 * length + D_REL + cfg.rel_extent + 4 * D + 2 * cfg.moe_intermediate_size + 8
    return cfg.num_hidden_layers * layer + 3 * D


def logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


def greedy(model, ids, new, **kw):
    out = model.generate(
        ids, max_new_tokens=new, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kw
    )
    return out.sequences, torch.stack(out.logits, 1)


def test_inkling2_converts_to_its_own_scheme_with_stock_logits():
    """Default conversion: ``inkling`` (sliding, E = window) and ``inkling-temperature`` (full)
    with HF's bias weights taken over, HF's bias and query temperature switched off (stand-ins),
    HF's per-query sinks and attention residuals kept: stock logits."""
    model = stock()
    ours = ph.convert(model).eval()
    assert [s["encoding"] for s in ours.config.posenc_layers] == ["inkling", "inkling-temperature"]
    assert type(ours.model.layers[0].self_attn.relative_position_bias).__name__ == "PartOff"
    assert type(ours.model.layers[1].self_attn.q_proj.norm.log_scale).__name__ == "PartOff"
    ids = torch.randint(1, V, (2, 12))
    want = logits(model, ids)
    assert_close(logits(ours, ids), want, n=inkling2_n(model.config, 12))
    assert (logits(ph.convert(model, encoding="nope"), ids) - want).abs().max() > 1e-2  # the bias matters


@pytest.mark.parametrize("encoding", [None, "alibi"])
def test_inkling2_cached_generation_equals_uncached(encoding):
    """Past the sliding window (5): cached = uncached greedy decoding; the own scheme gives the
    stock model's tokens."""
    model = stock()
    ours = ph.convert(model, encoding=encoding).eval()
    prompt = torch.randint(1, V, (2, 5))
    cached, cached_logits = greedy(ours, prompt, 8, cache=transformers.DynamicCache(config=ours.config))
    uncached, uncached_logits = greedy(ours, prompt, 8, use_cache=False)
    assert torch.equal(cached, uncached)
    assert_close(cached_logits, uncached_logits, n=inkling2_n(model.config, 13))
    if encoding is None:
        want, want_logits = greedy(model, prompt, 8)
        assert torch.equal(cached, want)
        assert_close(cached_logits, want_logits, n=inkling2_n(model.config, 13))


def test_inkling2_round_trip_and_alibi_step(tmp_path):
    """``save_pretrained`` -> ``AutoModelForCausalLM``: every tensor bit for bit (the taken-over bias
    weights live in the encodings), the logits within the rounding rule (the loaded tensors are read
    in place from the file, at addresses whose alignment picks the CPU kernels' summation order: one
    ulp apart); an ALiBi swap trains one step with finite weights."""
    model = ph.convert(stock()).eval()
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    ids = torch.randint(1, V, (2, 9))
    assert_close(logits(loaded, ids), logits(model, ids), n=inkling2_n(model.config, 9))
    swapped = ph.convert(stock(), encoding="alibi").train()
    out = swapped(ids, labels=ids)
    out.loss.backward()
    grads = [p.grad for p in swapped.model.posenc.parameters()]
    assert torch.isfinite(out.loss) and all(g is None or torch.isfinite(g).all() for g in grads)


def test_a_restored_position_bias_is_refused():
    """Putting HF's own bias module back on a converted layer would add the bias twice: the
    attention function refuses the call, naming the layer."""
    model = stock()
    ours = ph.convert(model).eval()
    ours.model.layers[0].self_attn.relative_position_bias = model.model.layers[0].self_attn.relative_position_bias
    with pytest.raises(ValueError, match="layer 0 still computes the model's own position_bias"):
        logits(ours, torch.randint(1, V, (1, 6)))
