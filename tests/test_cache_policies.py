"""Rolling KV caches of windowed / chunked layers and StreamingLLM's SinkWindow policy."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_close, attention_n

import posenc
from posenc.layer.cache import WindowKVCache


def _decode(lm, tokens, prefill, cache, step=1):
    with torch.no_grad():
        outs = [lm(tokens[:, :prefill], cache=cache)]
        for t in range(prefill, tokens.shape[1], step):
            outs.append(lm(tokens[:, t : t + step], cache=cache))
    return torch.cat(outs, 1)


@pytest.mark.parametrize(
    "spec", ["rope(window=4)*2,nope", "alibi(chunk=5),t5(window=3)", "rope(window=3,chunk=4),shaw(window=6)"]
)
@pytest.mark.parametrize("step", [1, 3])
def test_rolling_cache_equals_full_forward_with_o_w_memory(spec, step):
    torch.manual_seed(0)
    depth = len(posenc.layers(spec))
    lm = posenc.TransformerLM(50, 16, depth, 2, spec, max_len=64).eval()
    tokens = torch.randint(0, 50, (2, 29))
    with torch.no_grad():
        full = lm(tokens)
    cache = lm.init_cache(2, 29)
    out = _decode(lm, tokens, 5, cache, step)
    assert_close(out, full, n=attention_n(dim=16, head_dim=8, length=29))
    for block, c in zip(lm.blocks, cache.layers, strict=True):
        a = block.attn
        span = [n for n in (a.window, a.chunk) if n is not None]
        if span:
            assert isinstance(c, WindowKVCache) and c.k.shape[2] == min(span) - 1  # O(W), not O(L)
        else:
            assert c.k.shape[2] == 29
    assert cache.length == 29


def test_rolling_cache_with_left_padding_equals_full_forward():
    torch.manual_seed(0)
    lm = posenc.TransformerLM(50, 16, 2, 2, "rope(window=4),alibi(chunk=3)", max_len=64).eval()
    tokens = torch.randint(0, 50, (2, 14))
    kpm = torch.ones(2, 14, dtype=torch.bool)
    kpm[1, :3] = False
    with torch.no_grad():
        full = lm(tokens, key_padding_mask=kpm)
        cache = lm.init_cache(2, 14)
        outs = [lm(tokens[:, :6], cache=cache, key_padding_mask=kpm[:, :6])]
        for t in range(6, 14):
            outs.append(lm(tokens[:, t : t + 1], cache=cache, key_padding_mask=kpm[:, : t + 1]))
    out = torch.cat(outs, 1)
    assert_close(out[kpm], full[kpm], n=attention_n(dim=16, head_dim=8, length=14))


def _streaming_reference(lm, tokens, sinks, window):
    """StreamingLLM by its definition, one token at a time: the cache holds the first
    ``sinks`` tokens and the last ``window - 1`` before the query; each step recomputes
    every layer's raw keys/values from the stored layer inputs, rotates them at positions
    ``0 .. n-1`` and the query at ``n`` (``pos_shift``)."""
    L = tokens.shape[1]
    outs = []
    with torch.no_grad():
        hist = [[] for _ in lm.blocks]  # per layer: the attention input (LN'd) of each token
        for t in range(L):
            keep = list(range(min(sinks, t))) + list(range(max(min(sinks, t), t - (window - 1)), t))
            x = lm.embed(tokens[:, t : t + 1], lm.make_call(tokens[:, t : t + 1], torch.tensor([[t]])))
            for li, b in enumerate(lm.blocks):
                a = b.attn
                h = b.ln1(x)
                hist[li].append(h)
                ctx = torch.cat([hist[li][j] for j in keep] + [h], 1)  # (B, n + 1, D)
                n1 = ctx.shape[1]
                B = ctx.shape[0]
                q = a.q_proj(h).view(B, 1, a.heads, a.head_dim).transpose(1, 2)
                k = a.k_proj(ctx).view(B, n1, a.heads, a.head_dim).transpose(1, 2)
                v = a.v_proj(ctx).view(B, n1, a.heads, a.head_dim).transpose(1, 2)
                kp = torch.arange(n1)[None]
                qp = kp[:, -1:]
                q, k = a.encoding.rotate(q, k, qp, kp)
                s = posenc.scores(a.encoding, q, k, qp, kp)
                o = torch.softmax(s, -1) @ v
                x = x + a.o_proj(o.transpose(1, 2).reshape(B, 1, -1))
                x = x + b.mlp(b.ln2(x))
            outs.append(lm.head(lm.ln_f(x)))
    return torch.cat(outs, 1)


@pytest.mark.parametrize("enc", ["rope", "alibi", "nope"])
def test_sink_window_equals_streaming_llm_definition(enc):
    torch.manual_seed(0)
    lm = posenc.TransformerLM(50, 16, 2, 2, enc, max_len=64).eval()
    tokens = torch.randint(0, 50, (1, 23))
    policy = posenc.SinkWindow(sinks=2, window=5)
    cache = lm.init_cache(1, 23, policy=policy)
    out = _decode(lm, tokens, 1, cache)
    ref = _streaming_reference(lm, tokens, 2, 5)
    assert_close(out, ref, n=attention_n(dim=16, head_dim=8, length=8))
    assert all(c.k.shape[2] == 2 + 4 for c in cache.layers)  # sinks + window - 1, not 23
    assert cache.length == 23
    if enc == "rope":  # the positions are re-assigned: differs from the full forward with that mask
        with torch.no_grad():
            assert (out - lm(tokens)).abs().max() > 1e-3


def test_sink_window_prefill_uses_the_sink_window_mask():
    """A multi-token call through a SinkWindow cache: each query sees the sinks and its
    window (by cache slot), as decoding token by token would for a non-rotary encoding."""
    torch.manual_seed(0)
    lm = posenc.TransformerLM(50, 16, 2, 2, "nope", max_len=64).eval()
    tokens = torch.randint(0, 50, (1, 17))
    policy = posenc.SinkWindow(sinks=2, window=4)
    a = _decode(lm, tokens, 17, lm.init_cache(1, 17, policy=policy))
    b = _decode(lm, tokens, 1, lm.init_cache(1, 17, policy=policy))
    assert_close(a, b, n=attention_n(dim=16, head_dim=8, length=6))


def test_cache_policy_errors():
    with pytest.raises(ValueError, match="SinkWindow.sinks must be an int >= 0, got -1"):
        posenc.SinkWindow(sinks=-1)
    with pytest.raises(ValueError, match="SinkWindow.window must be an int >= 1, got 0"):
        posenc.SinkWindow(window=0)
    lm = posenc.TransformerLM(50, 16, 2, 2, "sinusoidal", max_len=64)
    with pytest.raises(ValueError, match="cannot have its positions re-assigned"):
        lm.init_cache(1, 8, policy=posenc.SinkWindow(2, 4))
    lm = posenc.TransformerLM(50, 16, 2, 2, "rope(window=4)*2", max_len=64)
    with pytest.raises(ValueError, match="without their own window"):
        lm.init_cache(1, 8, policy=posenc.SinkWindow(2, 4))
    with pytest.raises(TypeError, match="policy must be a posenc.SinkWindow"):
        lm.init_cache(1, 8, policy="sinks")
    cache = lm.init_cache(1, 8)
    with pytest.raises(ValueError, match="cache was made for batch size 1, got 2"):
        lm(torch.zeros(2, 3, dtype=torch.long), cache=cache)
