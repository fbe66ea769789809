"""Stick-breaking attention (Tan et al. 2024): the paper's weights written out in float64 with
explicit products, every backend, the KV cache (plain and rolling), left padding, packed
documents, and flash-linear-attention's naive reference where fla imports."""

from __future__ import annotations

import importlib

import pytest
import torch
from tests.conftest import DIM, HEAD_DIM, HEADS, assert_close, attention_n

import posenc
from posenc.encodings.stickbreaking import StickBreaking

L = 10
N = attention_n(dim=DIM, head_dim=HEAD_DIM, length=L) + L  # + the log-space sum over the keys


def _layer(seed=0, **kw) -> posenc.Attention:
    torch.manual_seed(seed)
    attn = posenc.Attention(DIM, HEADS, "stick-breaking", head_dim=HEAD_DIM, **kw)
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.3 * torch.randn_like(p))  # scores of a few units: β spread over (0, 1)
    return attn.eval()


def _x(B=2, n=L, seed=1):
    return torch.randn(B, n, DIM, generator=torch.Generator().manual_seed(seed))


def _visible(n, window=None):
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    vis = j <= i
    return vis if window is None else vis & (i - j < window)


@torch.no_grad()
def _reference(attn: posenc.Attention, x: torch.Tensor, visible: torch.Tensor, attend_current=False):
    """The paper's formula in float64, a product per weight: ``β_ij = σ(q_i·k_j/√Dh)``,
    ``A_ij = β_ij ∏_{l} (1 − β_il)`` over the visible ``l`` with ``j < l < i`` (``j < l ≤ i``
    with ``attend_current``), ``o_i = Σ_j A_ij v_j`` over the visible ``j < i`` (``j ≤ i``)."""
    d = torch.float64
    B, n, _ = x.shape
    H, Dh = attn.heads, attn.head_dim
    kv = attn.kv_heads

    def heads(lin, h):
        out = (x.to(d) @ lin.weight.to(d).T).view(B, n, h, Dh).transpose(1, 2)
        return out.repeat_interleave(H // h, dim=1)  # grouped k/v: query head h reads h // (H/kv)

    q, k, v = heads(attn.q_proj, H), heads(attn.k_proj, kv), heads(attn.v_proj, kv)
    beta = torch.sigmoid(q @ k.transpose(-1, -2) / Dh**0.5)  # (B, H, n, n)
    A = torch.zeros(B, H, n, n, dtype=d)
    for i in range(n):
        last = i if attend_current else i - 1
        for j in range(last + 1):
            if not visible[i, j]:
                continue
            a = beta[:, :, i, j].clone()
            for m in range(j + 1, last + 1):
                if visible[i, m]:
                    a = a * (1 - beta[:, :, i, m])
            A[:, :, i, j] = a
    o = A @ v
    return o.transpose(1, 2).reshape(B, n, H * Dh) @ attn.o_proj.weight.to(d).T, A


@pytest.mark.parametrize("attend_current", [False, True], ids=["before", "current"])
def test_every_backend_matches_the_paper_formula(attend_current):
    attn = _layer(chunk_size=3, attend_current=attend_current)  # chunk_size 3: several query blocks
    x = _x()
    ref, A = _reference(attn, x, _visible(L), attend_current)
    assert posenc.supported_backends(attn.encoding) == ["chunked", "eager"]
    with torch.no_grad():
        for backend in ("chunked", "eager"):
            got = attn(x, backend=backend)
            assert_close(got, ref.float(), n=N, msg=backend)
            # positions play no part: shifted, or different per row, the output is the same
            pos = torch.stack([torch.arange(L) + 7, torch.arange(L) * 3])
            assert_close(attn(x, pos=pos, backend=backend), ref.float(), n=N, msg=f"{backend}, other positions")
    if not attend_current:  # the first token sees no key before it: output 0, and A's rows sum to < 1
        assert torch.equal(got[:, 0], torch.zeros(2, DIM))
    assert (A.sum(-1) <= 1 + 1e-12).all() and (A.sum(-1)[:, :, 1:] > 0).all()


def test_weights_stage_alone():
    """``weights`` on hand-made masked scores: hidden keys get exactly 0 and break nothing, a
    row that sees nothing gives zeros (no NaN), gradients stay finite."""
    enc = StickBreaking(heads=1, head_dim=4)
    s = torch.tensor([[[[0.5, -1.0, 2.0, 0.3], [1.0, float("-inf"), -0.5, 0.0], [float("-inf")] * 4]]])
    s.requires_grad_()
    w = enc.weights(s)
    b = torch.sigmoid(s.detach())
    # row 0: every key visible, the last (the query's own) excluded
    want0 = [b[0, 0, 0, 0] * (1 - b[0, 0, 0, 1]) * (1 - b[0, 0, 0, 2]), b[0, 0, 0, 1] * (1 - b[0, 0, 0, 2])]
    want0 = torch.stack([*want0, b[0, 0, 0, 2], torch.tensor(0.0)])
    # row 1: key 1 hidden: weight 0, and it does not break the stick of key 0
    want1 = torch.stack([b[0, 0, 1, 0] * (1 - b[0, 0, 1, 2]), torch.tensor(0.0), b[0, 0, 1, 2], torch.tensor(0.0)])
    assert_close(w[0, 0, 0], want0, rtol=1e-6, atol=1e-7)
    assert_close(w[0, 0, 1], want1, rtol=1e-6, atol=1e-7)
    assert torch.equal(w[0, 0, 2], torch.zeros(4)) and w[0, 0, 1, 1] == 0
    w.sum().backward()
    assert torch.isfinite(s.grad).all()
    cur = StickBreaking(heads=1, head_dim=4, attend_current=True).weights(s.detach())
    assert_close(cur[0, 0, 0, 3], b[0, 0, 0, 3], rtol=1e-6, atol=1e-7)  # the nearest key breaks first


@pytest.mark.parametrize("window", [None, 3], ids=["plain", "window3"])
def test_cached_decoding_equals_the_full_pass(window):
    """Token by token and in uneven pieces through the KV cache (a rolling WindowKVCache with ``window``)."""
    attn = _layer(window=window)
    x = _x()
    ref, _ = _reference(attn, x, _visible(L, window))
    with torch.no_grad():
        full = attn(x)
        assert_close(full, ref.float(), n=N, msg="full pass")
        for cuts in ((1,) * L, (4, 1, 3, 2)):
            cache, outs, i = attn.init_cache(2, L), [], 0
            for c in cuts:
                outs.append(attn(x[:, i : i + c], cache=cache))
                i += c
            assert_close(torch.cat(outs, 1), ref.float(), n=N, msg=f"cuts {cuts}")


def test_grouped_kv_matches_the_formula():
    torch.manual_seed(0)
    attn = posenc.Attention(DIM, 4, "stick-breaking", head_dim=4, kv_heads=2, chunk_size=3).eval()
    x = _x()
    ref, _ = _reference(attn, x, _visible(L))
    with torch.no_grad():
        for backend in ("chunked", "eager"):
            assert_close(attn(x, backend=backend), ref.float(), n=N, msg=backend)


def test_left_padding_and_packed_documents_equal_each_sequence_alone():
    attn = _layer(chunk_size=3)
    x = _x(B=1)
    ref, _ = _reference(attn, x, _visible(L))
    pad = 3
    padded = torch.cat([torch.randn(1, pad, DIM), x], 1)
    kpm = torch.cat([torch.zeros(1, pad, dtype=torch.bool), torch.ones(1, L, dtype=torch.bool)], 1)
    with torch.no_grad():
        for backend in ("chunked", "eager"):
            got = attn(padded, key_padding_mask=kpm, backend=backend)
            assert_close(got[:, pad:], ref.float(), n=N, msg=f"left padding, {backend}")
        # two documents packed in one row: each equals itself alone
        y = _x(B=1, n=6, seed=2)
        ref_y, _ = _reference(attn, y, _visible(6))
        docs = torch.tensor([[0] * L + [1] * 6])
        for backend in ("chunked", "eager"):
            got = attn(torch.cat([x, y], 1), document_ids=docs, backend=backend)
            assert_close(got[:, :L], ref.float(), n=N, msg=f"document 0, {backend}")
            assert_close(got[:, L:], ref_y.float(), n=N, msg=f"document 1, {backend}")


def test_gradients_equal_between_backends_and_reach_q_and_k():
    attn = _layer(chunk_size=3)
    grads = {}
    for backend in ("chunked", "eager"):
        attn.zero_grad()
        x = _x().requires_grad_()
        (attn(x, backend=backend) * torch.linspace(-1, 1, DIM)).sum().backward()
        grads[backend] = [x.grad] + [p.grad.clone() for p in attn.parameters()]
    for g, ge in zip(grads["chunked"], grads["eager"], strict=True):
        assert_close(g, ge, n=2 * N + 2 * L)
    assert attn.q_proj.weight.grad.abs().sum() > 0 and attn.k_proj.weight.grad.abs().sum() > 0


def test_learned_sinks_and_bidirectional_are_refused():
    with pytest.raises(ValueError, match="'stick-breaking' has its own normaliser; learned sinks"):
        posenc.Attention(DIM, HEADS, "stick-breaking", sinks=True)(_x())
    with pytest.raises(ValueError, match="causal only"):
        posenc.Attention(DIM, HEADS, "stick-breaking", causal=False)
    with pytest.raises(TypeError, match="attend_current"):
        StickBreaking(heads=1, head_dim=4, attend_current="no")


def _fla(module: str):
    """An fla module, or a skip: fla imports only beside triton, which posenc does not depend on."""
    try:
        return importlib.import_module(module)
    except Exception as e:  # ImportError, or fla's own device checks
        pytest.skip(
            f"flash-linear-attention does not import here ({type(e).__name__}: {e}); it needs fla-core and "
            "triton, which import on a CPU too but are no dependency of posenc"
        )


@pytest.mark.parametrize("attend_current", [False, True], ids=["before", "current"])
@pytest.mark.parametrize("kv_heads", [None, 1], ids=["mha", "mqa"])
def test_layer_matches_fla_naive_reference(attend_current, kv_heads):
    """fla 0.6 ``naive_stickbreaking_attn`` on this layer's projections, element-wise, and its
    remainder ``rem = 1 − Σ_j A_ij`` against the weights posenc computes."""
    naive = _fla("fla.ops.stickbreaking_attn").naive_stickbreaking_attn
    torch.manual_seed(0)
    attn = posenc.Attention(DIM, 4, "stick-breaking", head_dim=4, kv_heads=kv_heads, attend_current=attend_current)
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = _x()
    B, Hk = x.shape[0], attn.kv_heads
    with torch.no_grad():
        q = attn.q_proj(x).view(B, L, 4, 4)  # fla's layout: (B, T, H, D)
        k, v = attn.k_proj(x).view(B, L, Hk, 4), attn.v_proj(x).view(B, L, Hk, 4)
        o, rem = naive(q, k, v, scale=4**-0.5, attend_current=attend_current)
        expected = attn.o_proj(o.reshape(B, L, 16))
        for backend in ("chunked", "eager"):
            assert_close(attn(x, backend=backend), expected, n=N, msg=backend)
        call = attn.make_call(x, torch.arange(L)[None])
        p = attn.project(x, call)
        mask = call.mask(causal=True, window=None, chunk=None, k_len=L).dense(L, L)
        s = posenc.scores(attn.encoding, p.q, p.k, p.q_pos, p.k_pos).masked_fill(~mask, float("-inf"))
        total = attn.encoding.weights(s).sum(-1)  # (B, H, L)
        assert_close(total, 1 - rem.permute(0, 2, 1), n=N)
