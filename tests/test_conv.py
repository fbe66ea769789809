"""conv: depthwise convolution positions, against the convolution sum written out."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_close, attention_n, lm_n

import posenc


def _direct(x, w, b, *, left: int, right: int, padding: str):
    """out[t, c] = x[t, c] + b[c] + Σ_m w[c, m]·x[t − left + m, c], padding as named."""
    B, L, D = x.shape
    k = w.shape[-1]
    out = x.clone()
    for t in range(L):
        window = range(t - left, t + right + 1)
        if padding == "none" and (t - left < 0 or t + right >= L):
            continue  # the window leaves the sequence: no conv term
        acc = b.clone().expand(B, D).clone()
        for m, s in enumerate(window):
            if padding == "circular":
                s = s % L
            elif not 0 <= s < L:
                continue  # zero padding
            acc += w[:, m] * x[:, s]
        assert m == k - 1
        out[:, t] += acc
    return out


@pytest.mark.parametrize(
    "causal,padding,k",
    [(True, "zeros", 3), (True, "none", 4), (False, "zeros", 5), (False, "circular", 3), (False, "none", 3)],
)
def test_conv_matches_direct_sum(causal, padding, k):
    torch.manual_seed(0)
    enc = posenc.build("conv", heads=2, head_dim=3, causal=causal, kernel_size=k, padding=padding)
    x = torch.randn(2, 7, 6)
    w, b = enc.conv.weight[:, 0].detach(), enc.conv.bias.detach()  # (D, k), (D,)
    left, right = (k - 1, 0) if causal else ((k - 1) // 2, (k - 1) // 2)
    expected = _direct(x, w, b, left=left, right=right, padding=padding)
    assert_close(enc.embed(x, torch.arange(7)), expected, n=k + 2)  # a k-tap depthwise sum, bias, residual


def _periodic_tokens(period: int, repeats: int) -> torch.Tensor:
    return torch.randint(0, 32, (1, period)).repeat(1, repeats)  # (1, period·repeats)


def test_circular_padding_makes_the_model_shift_equivariant():
    torch.manual_seed(0)
    lm = posenc.TransformerLM(32, 16, 2, 2, encoding="conv", causal=False, padding="circular", kernel_size=5).eval()
    t = _periodic_tokens(6, 4)
    with torch.no_grad():
        y = lm(t)
        for s in (1, 3, 7):
            # shifting a periodic input = rolling it; a relative-only model must roll its output alike
            assert_close(lm(t.roll(s, 1)), y.roll(s, 1), n=lm_n(dim=16, depth=2, length=24) + 5)


def test_zero_padding_leaks_absolute_position():
    torch.manual_seed(0)
    lm = posenc.TransformerLM(32, 16, 2, 2, encoding="conv", causal=False, padding="zeros", kernel_size=5).eval()
    t = _periodic_tokens(6, 4)
    with torch.no_grad():
        diff = (lm(t.roll(3, 1)) - lm(t).roll(3, 1)).abs().amax(dim=(0, 2))  # per position
    assert diff[:2].min() > 1e-3 and diff[-2:].min() > 1e-3  # tokens at the boundaries see the padding


@pytest.mark.parametrize("padding", ["zeros", "none"])
def test_attention_level_decoding_carries_the_conv_window(padding):
    torch.manual_seed(0)
    attn = posenc.Attention(16, 2, "conv", padding=padding, kernel_size=4)
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        full = attn(x)
        cache = attn.init_cache(2, 9)
        steps = torch.cat([attn(x[:, :2], cache=cache)] + [attn(x[:, i : i + 1], cache=cache) for i in range(2, 9)], 1)
        cache.reset()
        again = torch.cat([attn(x[:, :5], cache=cache), attn(x[:, 5:], cache=cache)], 1)
    n = attention_n(dim=16, head_dim=8, length=9) + 4 + 2
    assert_close(steps, full, n=n)
    assert_close(again, full, n=n)  # reset empties the window too


def test_conv_bad_options():
    with pytest.raises(ValueError, match="circular.*causal=False"):
        posenc.build("conv", heads=1, head_dim=4, causal=True, padding="circular")
    with pytest.raises(ValueError, match="odd kernel_size.*4"):
        posenc.build("conv", heads=1, head_dim=4, causal=False, kernel_size=4)
    with pytest.raises(ValueError, match="padding must be"):
        posenc.build("conv", heads=1, head_dim=4, padding="reflect")
    attn = posenc.Attention(4, 1, "conv", causal=True)
    cache = attn.init_cache(2, 4)
    attn(torch.randn(2, 1, 4), cache=cache)
    with pytest.raises(ValueError, match="batch size 2, got 3"):
        attn(torch.randn(3, 1, 4), cache=cache)
