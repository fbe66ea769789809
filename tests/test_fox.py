"""FoX (Forgetting Transformer, Lin et al., ICLR 2025): the paper's formula in float64,
x-transformers' ``DataDependentAlibi`` element-wise, cached decoding (plain, rolling window,
sink window, Transformer-XL memory) against the full pass, and the errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.conftest import DIM, HEAD_DIM, HEADS, assert_close, attention_n, lm_n

import posenc
from posenc.encodings.forget import FoX

xt = pytest.importorskip("x_transformers.x_transformers")

L = 10
N_GATE = DIM + L  # the gate logits (D) and their cumulative sum (L)


def _layer(causal=True, seed=0, **kw) -> posenc.Attention:
    torch.manual_seed(seed)
    attn = posenc.Attention(DIM, HEADS, "fox", head_dim=HEAD_DIM, causal=causal, **kw)
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.2 * torch.randn_like(p))
        attn.encoding.gate.bias.uniform_(-1.0, 3.0)  # gates from 0.27 to 0.95: real forgetting
    return attn.eval()


def _x(B=2, n=L, seed=1):
    return torch.randn(B, n, DIM, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _reference(attn: posenc.Attention, x: torch.Tensor, visible: torch.Tensor):
    """The paper's formula, written out in float64: ``s_ij = q_i·k_j/√Dh + Σ_{s=j+1..i} ln f_s``
    with ``f_s = σ(w_h·x_s + b_h)`` (bidirectional, keys after the query: ``Σ_{s=i+1..j} ln f'_s``
    with the second ``H`` gates), softmax over ``visible`` keys ``(L, L)``, values, output.
    Returns the output ``(B, L, D)`` and the scores (for the size of their terms)."""
    enc, d = attn.encoding, torch.float64
    B, n, _ = x.shape
    H, Dh = attn.heads, attn.head_dim
    xd = x.to(d)

    def heads(lin):
        return (xd @ lin.weight.to(d).T).view(B, n, H, Dh).transpose(1, 2)

    q, k, v = heads(attn.q_proj), heads(attn.k_proj), heads(attn.v_proj)
    log_f = F.logsigmoid(xd @ enc.gate.weight.to(d).T + enc.gate.bias.to(d))  # (B, L, G·H)
    decay = torch.zeros(B, H, n, n, dtype=d)
    for i in range(n):
        for j in range(n):
            if j <= i:
                decay[:, :, i, j] = log_f[:, j + 1 : i + 1, :H].sum(1)
            elif not attn.causal:
                decay[:, :, i, j] = log_f[:, i + 1 : j + 1, H:].sum(1)
    s = q @ k.transpose(-1, -2) * Dh**-0.5 + decay
    o = torch.softmax(s.masked_fill(~visible, float("-inf")), -1) @ v
    return o.transpose(1, 2).reshape(B, n, H * Dh) @ attn.o_proj.weight.to(d).T, s


def _visible(n, causal=True, window=None, sinks=0):
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    vis = j <= i if causal else torch.ones(n, n, dtype=torch.bool)
    if window is not None:
        vis = vis & ((i - j < window) | (j < sinks))
    return vis


def _check(got, ref, scores, extra=0, msg=""):
    # the scores' terms reach |s|, and the output moves by their rounding times |v| ~ 1
    n = attention_n(dim=DIM, head_dim=HEAD_DIM, length=L) + N_GATE + extra
    magnitude = max(1.0, float(scores.abs().amax()), float(ref.detach().abs().amax()))
    assert_close(got, ref.float(), n=n, magnitude=magnitude, msg=msg)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_every_backend_matches_the_paper_formula(causal):
    attn = _layer(causal, chunk_size=3)  # chunk_size 3: the blocked backends cut the states
    x = _x()
    ref, s = _reference(attn, x, _visible(L, causal))
    assert set(posenc.supported_backends(attn.encoding)) == {"flex", "dense", "chunked", "eager"}
    with torch.no_grad():
        for backend in posenc.supported_backends(attn.encoding):
            _check(attn(x, backend=backend), ref, s, msg=backend)
            # positions play no part: shifted, or different per row, the output is the same
            pos = torch.stack([torch.arange(L) + 7, torch.arange(L) * 3])
            _check(attn(x, pos=pos, backend=backend), ref, s, msg=f"{backend}, other positions")


def test_bias_matches_x_transformers_data_dependent_alibi():
    """The bias tensor itself, element-wise, causal and bidirectional, weights copied over."""
    x = _x()
    for causal in (True, False):
        torch.manual_seed(0)
        ref = xt.DataDependentAlibi(DIM, HEADS, causal=causal)
        enc = FoX(heads=HEADS, head_dim=HEAD_DIM, causal=causal)
        assert enc.gate.bias.eq(5.0).all() and ref.to_forget_gates[0].bias.eq(5.0).all()  # same init
        with torch.no_grad():
            ref.to_forget_gates[0].bias.uniform_(-1.0, 3.0)
            enc.gate.load_state_dict(ref.to_forget_gates[0].state_dict())
        read = enc.read_input(x, None, None)
        pos = torch.arange(L)
        ctx = posenc.Context(pos, pos, x=x, q_state=read.state, k_state=read.state)
        expected = ref(x)
        assert_close(enc.bias(pos, pos, ctx=ctx), expected, n=N_GATE, msg=f"causal={causal}")
        mod = enc.score_mod(pos[None], pos[None], ctx=ctx)
        b, h, i, j = torch.meshgrid(*(torch.arange(s) for s in expected.shape), indexing="ij")
        assert_close(mod(torch.zeros(()), b, h, i, j), expected, n=N_GATE, msg=f"score_mod causal={causal}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_attention_layer_matches_x_transformers(causal):
    """A whole layer against x-transformers' Attention(data_dependent_alibi=True): outputs,
    gradients of the input and of the gate's weight and bias."""
    torch.manual_seed(0)
    ref = xt.Attention(DIM, dim_head=HEAD_DIM, heads=HEADS, causal=causal, data_dependent_alibi=True)
    attn = _layer(causal)
    with torch.no_grad():
        ref.data_dependent_alibi.to_forget_gates[0].load_state_dict(attn.encoding.gate.state_dict())
        for ours, theirs in (("q_proj", "to_q"), ("k_proj", "to_k"), ("v_proj", "to_v"), ("o_proj", "to_out")):
            getattr(ref, theirs).weight.copy_(getattr(attn, ours).weight)
    x = _x()
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, got = ref(x_ref), attn(x_ours, backend="eager")
    _, s = _reference(attn, x, _visible(L, causal))
    _check(got, expected.detach(), s)
    w = torch.linspace(-1, 1, DIM)
    (expected * w).sum().backward()
    (got * w).sum().backward()
    n_grad = 2 * (attention_n(dim=DIM, head_dim=HEAD_DIM, length=L) + N_GATE) + 2 * L
    mag = max(1.0, float(s.abs().amax()))
    assert_close(x_ours.grad, x_ref.grad, n=n_grad, magnitude=mag * max(1.0, float(x_ref.grad.abs().amax())))
    theirs = ref.data_dependent_alibi.to_forget_gates[0]
    for p, q in ((attn.encoding.gate.weight, theirs.weight), (attn.encoding.gate.bias, theirs.bias)):
        assert_close(p.grad, q.grad, n=n_grad, magnitude=mag * max(1.0, float(q.grad.abs().amax())))


@pytest.mark.parametrize("window", [None, 3], ids=["plain", "window3"])
def test_cached_decoding_equals_the_full_pass(window):
    """Token by token and in uneven pieces through the layer's KV cache (a rolling
    WindowKVCache with ``window``): the carry continues the cumulative gates."""
    attn = _layer(window=window)
    x = _x()
    ref, s = _reference(attn, x, _visible(L, window=window))
    with torch.no_grad():
        full = attn(x)
        _check(full, ref, s, msg="full pass")
        for cuts in ((1,) * L, (4, 1, 3, 2)):
            cache, outs, i = attn.init_cache(2, L), [], 0
            for c in cuts:
                outs.append(attn(x[:, i : i + c], cache=cache))
                i += c
            assert_close(torch.cat(outs, 1), full, n=attention_n(dim=DIM, head_dim=HEAD_DIM, length=L) + N_GATE)
            if window is not None:
                assert cache.k.shape[2] == window - 1 and cache.state["c"].shape[2] == window - 1


def test_sink_window_decoding_equals_the_formula():
    """StreamingLLM's SinkWindow cache: each query sees the 2 sinks and its last 4 tokens; the
    decay to a sink counts every token in between, evicted ones included (the stored ``c``)."""
    attn = _layer()
    x = _x(n=14)
    ref, s = _reference(attn, x, _visible(14, window=4, sinks=2))
    policy = posenc.SinkWindow(sinks=2, window=4)
    with torch.no_grad():
        cache = attn.init_cache(2, 14, policy=policy)
        steps = torch.cat([attn(x[:, i : i + 1], cache=cache) for i in range(14)], 1)
        cache = attn.init_cache(2, 14, policy=policy)
        pieces = torch.cat([attn(x[:, :6], cache=cache), attn(x[:, 6:], cache=cache)], 1)
    _check(steps, ref, s, extra=4)
    _check(pieces, ref, s, extra=4)
    lm = posenc.TransformerLM(32, DIM, 2, HEADS, "fox", max_len=64).eval()
    t = torch.randint(0, 32, (1, 15))
    with torch.no_grad():
        cache = lm.init_cache(1, 15, policy=policy)
        one = torch.cat([lm(t[:, i : i + 1], cache=cache) for i in range(15)], 1)
        assert all(c.k.shape[2] == 2 + 3 for c in cache.layers)
        cache = lm.init_cache(1, 15, policy=policy)
        several = torch.cat([lm(t[:, :5], cache=cache), lm(t[:, 5:], cache=cache)], 1)
    assert_close(several, one, n=lm_n(dim=DIM, depth=2, length=6) + N_GATE)


def test_memory_keys_equal_the_full_pass():
    """Transformer-XL memory: keys from cat(memory, x), the gates summed over both."""
    attn = _layer()
    x = _x()
    with torch.no_grad():
        full = attn(x)
        got = attn(x[:, 4:], memory=x[:, :4])
    assert_close(got, full[:, 4:], n=attention_n(dim=DIM, head_dim=HEAD_DIM, length=L) + N_GATE)


def test_errors():
    enc = FoX(heads=HEADS, head_dim=HEAD_DIM)
    pos = torch.arange(4)
    for call in (enc.bias, enc.score_mod):
        with pytest.raises(ValueError, match="'fox' reads its forget gates from the layer input.*posenc.Attention"):
            call(pos, pos)
        with pytest.raises(ValueError, match="'fox' reads its forget gates"):
            call(pos, pos, ctx=posenc.Context(pos, pos))
    read = enc.read_input(torch.randn(1, 4, DIM), None, None)
    with pytest.raises(ValueError, match="states of 4 queries and 4 keys, positions of 3 and 4"):
        enc.bias(pos[:3], pos, ctx=posenc.Context(pos, pos, q_state=read.state, k_state=read.state))
    # a layer wider than heads*head_dim builds it for its own width (attention_setup.build_for_layer);
    # the bare encoding, built for 16, refuses a 24-wide input in one line
    attn = posenc.Attention(24, HEADS, "fox", head_dim=HEAD_DIM)
    assert attn.encoding.hidden_size == 24 and attn(torch.randn(1, 4, 24)).shape[-1] == 24
    with pytest.raises(ValueError, match=r"hidden_size=16\), got \(1, 4, 24\); build it with hidden_size="):
        enc.read_input(torch.randn(1, 4, 24), None, None)
    with pytest.raises(ValueError, match="hidden_size must be a positive int or None, got 0"):
        FoX(heads=HEADS, head_dim=HEAD_DIM, hidden_size=0)
    with pytest.raises(ValueError, match="bias_init"):
        FoX(heads=HEADS, head_dim=HEAD_DIM, bias_init=float("nan"))
    with pytest.raises(ValueError, match="hidden_size must be a positive int or None, got 16.0"):
        FoX(heads=HEADS, head_dim=HEAD_DIM, hidden_size=16.0)
