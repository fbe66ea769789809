"""Window / chunk / sink-token masks (fields of ``posenc.AttentionMask``): the rule against
HF's mask functions, the key range the blocked backends keep, and every backend against eager."""

from __future__ import annotations

import itertools

import pytest
import torch
from tests.conftest import assert_close, attention_n

import posenc
from posenc import AttentionMask


def _grid(n: int, **kw) -> torch.Tensor:
    d = AttentionMask(**kw).dense(n, n)
    return torch.ones(n, n, dtype=torch.bool) if d is None else d[0, 0]


@pytest.mark.parametrize("W", [1, 3, 8])
def test_window_matches_hf_sliding_window(W):
    from transformers.masking_utils import sliding_window_causal_mask_function

    n = 12
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    ref = sliding_window_causal_mask_function(W)(0, 0, i, j)
    assert torch.equal(_grid(n, window=W), ref)
    assert int(_grid(n, window=W)[-1].sum()) == W  # W keys, the query included


@pytest.mark.parametrize("C", [1, 4, 5])
def test_chunk_matches_hf_chunked(C):
    from transformers.masking_utils import chunked_causal_mask_function

    n = 13
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    ref = chunked_causal_mask_function(C, torch.zeros(1, dtype=torch.long))(0, 0, i, j)
    assert torch.equal(_grid(n, chunk=C), ref)


def test_bidirectional_window_matches_gemma3_overlay():
    from transformers.models.gemma3.modeling_gemma3 import _bidirectional_window_overlay

    n, W = 12, 3
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    assert torch.equal(_grid(n, causal=False, window=W), _bidirectional_window_overlay(W)(0, 0, i, j))


def test_sink_tokens_stay_visible_but_not_ahead():
    g = _grid(10, window=3, sink_tokens=2)
    assert g[9].nonzero().flatten().tolist() == [0, 1, 7, 8, 9]
    assert g[0].nonzero().flatten().tolist() == [0]  # causality is never lifted
    assert torch.equal(_grid(10, sink_tokens=2), _grid(10))  # no window: no-op


def test_key_start_shifts_chunks_not_windows():
    """Keys from stream index 6 on (a rolling cache): windows are relative, chunks are not."""
    full_w, full_c = _grid(20, window=4), _grid(20, chunk=5)
    m = AttentionMask(offset=4, key_start=6)  # keys 6..19, queries 10..19
    assert torch.equal(AttentionMask(**{**vars(m), "window": 4}).dense(10, 14)[0, 0], full_w[10:, 6:])
    assert torch.equal(AttentionMask(**{**vars(m), "chunk": 5}).dense(10, 14)[0, 0], full_c[10:, 6:])


CASES = list(itertools.product([True, False], [None, 1, 3, 7], [None, 4], [0, 2], [0, 3]))


@pytest.mark.parametrize("causal,W,C,S,k0", CASES)
def test_key_range_and_narrow_agree_with_the_dense_mask(causal, W, C, S, k0):
    """Every visible key of a query block lies in key_range, and narrow() is that block of dense()."""
    Lk, Lq = 17, 11
    m = AttentionMask(causal=causal, offset=Lk - Lq, window=W, chunk=C, sink_tokens=S, key_start=k0)
    full = m.dense(Lq, Lk)
    full = torch.ones(Lq, Lk, dtype=torch.bool) if full is None else full[0, 0]
    for qs in range(Lq):
        for qe in range(qs + 1, Lq + 1):
            ks, ke = m.key_range(qs, qe, Lk)
            block = full[qs:qe]
            assert not block[:, :ks].any() and not block[:, ke:].any(), (qs, qe, ks, ke)
            sub = m.narrow(qs, ks, ke).dense(qe - qs, ke - ks)
            sub = torch.ones(qe - qs, ke - ks, dtype=torch.bool) if sub is None else sub[0, 0]
            assert torch.equal(sub, block[:, ks:ke])
            if W is not None and C is None and (S <= k0 or S == 0):
                assert ke - ks <= (qe - qs) + (W - 1) * (1 if causal else 2)  # tight: O(W) keys per block


def test_mask_validation():
    with pytest.raises(ValueError, match="window must be a positive int or None, got 0"):
        AttentionMask(window=0)
    with pytest.raises(ValueError, match="chunk must be a positive int or None, got 1.5"):
        AttentionMask(chunk=1.5)
    with pytest.raises(ValueError, match="sink_tokens must be an int >= 0, got -1"):
        AttentionMask(sink_tokens=-1)
    with pytest.raises(ValueError, match="key_start must be an int >= 0, got -2"):
        AttentionMask(key_start=-2)
    with pytest.raises(ValueError, match="window must be a positive int or None, got 0"):
        posenc.Attention(8, 2, "rope", window=0)


# ------------------------------------------------------------------ every backend equals eager
ENCODINGS = ["rope", "alibi", "t5", "shaw", "nope"]


@pytest.mark.parametrize("enc", ENCODINGS)
@pytest.mark.parametrize("kw", [{"window": 5}, {"chunk": 4}, {"window": 6, "chunk": 4}])
@pytest.mark.parametrize("causal", [True, False])
def test_every_backend_equals_eager_with_window_or_chunk(enc, kw, causal):
    torch.manual_seed(0)
    B, L, D, H = 2, 23, 16, 2
    attn = posenc.Attention(D, H, enc, causal=causal, max_len=64, chunk_size=4, **kw)
    attn.dense_chunk = 4  # several query blocks: block skipping is exercised
    x = torch.randn(B, L, D)
    kpm = torch.ones(B, L, dtype=torch.bool)
    kpm[1, :3] = False
    with torch.no_grad():
        for pad in (None, kpm):
            ref = attn(x, key_padding_mask=pad, backend="eager")
            for name in [*posenc.supported_backends(attn.encoding), "auto"]:
                if name == "flex" and pad is not None:
                    continue  # (FlexAttention's CPU reference needs no extra case here)
                out = attn(x, key_padding_mask=pad, backend=name)
                assert_close(out, ref, n=attention_n(dim=D, head_dim=D // H, length=L), msg=f"{enc} {name} {kw}")
    # the mask matters: without it the output differs
    plain = posenc.Attention(D, H, enc, causal=causal, max_len=64)
    plain.load_state_dict(attn.state_dict())
    with torch.no_grad():
        assert (plain(x) - attn(x)).abs().max() > 1e-4


@pytest.mark.parametrize("spec", ["rope(window=4)*2,nope", "alibi(chunk=5),t5(window=3)"])
def test_model_cached_decoding_equals_full_forward(spec):
    torch.manual_seed(0)
    lm = posenc.TransformerLM(50, 16, 3 if "nope" in spec else 2, 2, spec, max_len=64).eval()
    tokens = torch.randint(0, 50, (2, 19))
    with torch.no_grad():
        full = lm(tokens)
        cache = lm.init_cache(2, 19)
        steps = [lm(tokens[:, :7], cache=cache)] + [lm(tokens[:, t : t + 1], cache=cache) for t in range(7, 19)]
    assert_close(torch.cat(steps, 1), full, n=attention_n(dim=16, head_dim=8, length=19))
    assert [b.attn.window for b in lm.blocks] == [s.window for s in lm.config.layers]


# ------------------------------------------------------------------ learned sink logits (gpt-oss)
@pytest.mark.parametrize("enc", ["rope", "alibi", "t5", "shaw"])
@pytest.mark.parametrize("kw", [{}, {"window": 5}])
def test_sinks_on_every_backend_equal_the_formula(enc, kw):
    """Each backend against eager, and eager against a transcription of the formula
    (``softmax([s, sink_h])[:-1] @ v``; for encodings without a value stage)."""
    torch.manual_seed(0)
    B, L, D, H = 2, 19, 16, 2
    attn = posenc.Attention(D, H, enc, max_len=64, chunk_size=4, sinks=True, **kw)
    attn.dense_chunk = 4
    with torch.no_grad():
        attn.sinks.copy_(torch.tensor([1.5, -0.5]))
    x = torch.randn(B, L, D)
    kpm = torch.ones(B, L, dtype=torch.bool)
    kpm[1, :4] = False  # row 1's first queries see no key: output 0 (the sink takes it all)
    n = attention_n(dim=D, head_dim=D // H, length=L)
    with torch.no_grad():
        for pad in (None, kpm):
            ref = attn(x, key_padding_mask=pad, backend="eager")
            assert torch.isfinite(ref).all()
            for name in [*posenc.supported_backends(attn.encoding), "auto"]:
                assert_close(attn(x, key_padding_mask=pad, backend=name), ref, n=n, msg=f"{enc} {name}")
        if attn.encoding.stages & posenc.Stage.VALUE:
            return
        # eager against the formula, on the projected q, k, v
        pos = torch.arange(L)[None]
        call = attn.make_call(x, pos)
        p = attn.project(x, call)
        keep = call.mask(causal=attn.causal, window=attn.window, chunk=attn.chunk, k_len=L).dense(L, L)[0, 0]
        add = posenc.scores(attn.encoding, p.q, p.k, p.q_pos, p.k_pos, ctx=p.ctx).masked_fill(~keep, float("-inf"))
        o = torch.softmax(torch.cat((add, attn.sinks.view(1, H, 1, 1).expand(B, H, L, 1)), -1), -1)[..., :-1] @ p.v
        ref = attn.o_proj(o.transpose(1, 2).reshape(B, L, D))
        assert_close(attn(x, backend="eager"), ref, n=n)


def test_sinks_learn_and_are_validated():
    torch.manual_seed(0)
    attn = posenc.Attention(8, 2, "rope", sinks=True)
    assert attn.sinks.shape == (2,) and float(attn.sinks.detach().abs().sum()) == 0.0
    attn(torch.randn(1, 5, 8)).sum().backward()
    assert attn.sinks.grad is not None and attn.sinks.grad.abs().sum() > 0
    with pytest.raises(TypeError, match="sinks must be a bool, got 1"):
        posenc.Attention(8, 2, "rope", sinks=1)
    lm = posenc.TransformerLM(50, 16, 2, 2, "gpt-oss", max_len=32, window=4)
    assert [b.attn.sinks is not None for b in lm.blocks] == [True, True]


@pytest.mark.parametrize("enc", ["rope", "alibi", "t5"])
def test_window_and_sink_gradients_equal_eager(enc):
    torch.manual_seed(0)
    B, L, D, H = 2, 21, 16, 2
    attn = posenc.Attention(D, H, enc, max_len=64, chunk_size=4, sinks=True, window=5)
    attn.dense_chunk = 4
    with torch.no_grad():
        attn.sinks.copy_(torch.tensor([0.7, -0.3]))
    x = torch.randn(B, L, D)

    def grads(backend):
        attn.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        (attn(xi, backend=backend) * torch.linspace(-1, 1, D)).sum().backward()
        return [xi.grad] + [p.grad for p in attn.parameters()]

    ref = grads("eager")
    n = attention_n(dim=D, head_dim=D // H, length=L, grad=True)
    for name in posenc.supported_backends(attn.encoding):
        if name in ("eager", "flex"):  # (FlexAttention has no CPU backward)
            continue
        for g, r in zip(grads(name), ref, strict=True):
            assert_close(g, r, n=n, msg=f"{enc} {name}")
    assert attn.sinks.grad is not None


def test_query_block_follows_the_span():
    assert AttentionMask().query_block(1024) == 1024
    assert AttentionMask(window=128).query_block(1024) == 128
    assert AttentionMask(window=8).query_block(1024) == 64  # at least 64 rows per block
    assert AttentionMask(window=512, chunk=200).query_block(256) == 200
    assert AttentionMask(window=4).query_block(4) == 4
