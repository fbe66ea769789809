"""``cope``: the contextual-position term against the formula written out, and the
paper's ``CoPE``/``SelfAttn`` listing, through the attention layer."""

from __future__ import annotations

import math

import pytest
import torch
from tests.conftest import assert_close, attention_n

import posenc


def _formula(q, k, E, scale, npos_max):
    """e_ij for one head, loops over i and j exactly as the paper's equations read."""
    n = q.shape[0]
    out = torch.zeros(n, n, dtype=torch.float64)
    q, k, E = q.double(), k.double(), E.double()
    for i in range(n):
        for j in range(i + 1):
            p = sum(torch.sigmoid(scale * q[i] @ k[t]) for t in range(j, i + 1))
            p = min(float(p), npos_max - 1)
            lo, hi = math.floor(p), math.ceil(p)
            w = p - lo
            out[i, j] = (1 - w) * (q[i] @ E[:, lo]) + w * (q[i] @ E[:, hi])
    return out


def test_cope_term_equals_formula():
    torch.manual_seed(0)
    H, Dh, n = 2, 8, 9
    enc = posenc.build("cope", heads=H, head_dim=Dh, npos_max=4)  # small npos_max: the clip is exercised
    with torch.no_grad():
        enc.pos_emb.normal_()
    q, k = 2 * torch.randn(1, H, n, Dh), 2 * torch.randn(1, H, n, Dh)
    pos = torch.arange(n)
    got = enc.score_terms(q, k, pos, pos) * enc.scale  # the layer multiplies the terms by scale
    assert float(enc.positions(q, k, pos, pos).max()) == 3.0
    lower = torch.ones(n, n, dtype=torch.bool).tril()
    for h in range(H):
        ref = _formula(q[0, h], k[0, h], enc.pos_emb.detach(), enc.scale, 4)
        assert_close(got[0, h][lower].double(), ref[lower], n=2 * Dh + n + 2, dtype=torch.float32)


class _PaperCoPE(torch.nn.Module):
    """Golovneva et al. 2024, the listing in the paper (batch x seq_len x head_dim)."""

    def __init__(self, npos_max, head_dim):
        super().__init__()
        self.npos_max = npos_max
        self.pos_emb = torch.nn.Parameter(torch.zeros(1, head_dim, npos_max))

    def forward(self, query, attn_logits):
        gates = torch.sigmoid(attn_logits)
        pos = gates.flip(-1).cumsum(dim=-1).flip(-1)
        pos = pos.clamp(max=self.npos_max - 1)
        pos_ceil = pos.ceil().long()
        pos_floor = pos.floor().long()
        logits_int = torch.matmul(query, self.pos_emb)
        logits_ceil = logits_int.gather(-1, pos_ceil)
        logits_floor = logits_int.gather(-1, pos_floor)
        w = pos - pos_floor
        return logits_ceil * w + logits_floor * (1 - w)


def _paper_self_attn(cpe, query, key, val, mask):
    attn_logits = torch.bmm(query, key.transpose(-1, -2))
    attn_logits = attn_logits / math.sqrt(key.size(-1))
    attn_logits += mask.log()
    attn_logits += cpe(query, attn_logits)
    attn = torch.softmax(attn_logits, dim=-1)
    return torch.bmm(attn, val)


@pytest.mark.parametrize("backend", ["eager", "chunked"])
def test_cope_attention_equals_paper_listing(backend):
    torch.manual_seed(0)
    H, Dh, n, dim = 2, 8, 11, 16
    attn = posenc.Attention(dim, H, "cope", npos_max=6, chunk_size=4)
    with torch.no_grad():
        attn.encoding.pos_emb.normal_()
    paper = _PaperCoPE(6, Dh)
    with torch.no_grad():
        paper.pos_emb.copy_(attn.encoding.pos_emb[None])
    x = torch.randn(1, n, dim)
    q = attn.q_proj(x).view(1, n, H, Dh).transpose(1, 2)[0]  # (H, L, Dh): heads as the paper's batch
    k = attn.k_proj(x).view(1, n, H, Dh).transpose(1, 2)[0]
    v = attn.v_proj(x).view(1, n, H, Dh).transpose(1, 2)[0]
    mask = torch.ones(n, n).tril().expand(H, n, n)
    ref = _paper_self_attn(paper, q, k, v, mask)  # (H, L, Dh)
    ref = attn.o_proj(ref.transpose(0, 1).reshape(1, n, dim))
    assert_close(attn(x, backend=backend), ref, n=attention_n(dim=dim, head_dim=Dh, length=n) + 2 * Dh + n + 2)


@pytest.mark.parametrize("backend", ["eager", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cope_gradients_equal_paper_listing(backend, dtype):
    """Gradients of every parameter (q/k/v/o projections and E) and of the input against the
    listing run in float64: posenc.scores hands CoPE the score's own q·kᵀ (terms_read_qk),
    so the gates and the score share one product and one backward through it."""
    torch.manual_seed(0)
    H, Dh, n, dim = 2, 8, 23, 16
    attn = posenc.Attention(dim, H, "cope", npos_max=6, chunk_size=4)
    with torch.no_grad():
        attn.encoding.pos_emb.normal_()
    ref_attn = posenc.Attention(dim, H, "cope", npos_max=6).double()
    ref_attn.load_state_dict(attn.state_dict())
    paper = _PaperCoPE(6, Dh).double()
    with torch.no_grad():
        paper.pos_emb.copy_(ref_attn.encoding.pos_emb[None])
    x = torch.randn(1, n, dim, dtype=torch.float64)
    g = torch.randn(1, n, dim, dtype=torch.float64)

    xr = x.clone().requires_grad_()
    q, k, v = (p(xr).view(1, n, H, Dh).transpose(1, 2)[0] for p in (ref_attn.q_proj, ref_attn.k_proj, ref_attn.v_proj))
    mask = torch.ones(n, n, dtype=torch.float64).tril().expand(H, n, n)
    ref = ref_attn.o_proj(_paper_self_attn(paper, q, k, v, mask).transpose(0, 1).reshape(1, n, dim))
    ref.backward(g)
    ref_grads = {name: p.grad for name, p in ref_attn.named_parameters() if name != "encoding.pos_emb"}
    ref_grads["encoding.pos_emb"] = paper.pos_emb.grad[0]

    attn = attn.to(dtype)
    xa = x.to(dtype).requires_grad_()
    out = attn(xa, backend=backend)
    out.backward(g.to(dtype))
    N = attention_n(dim=dim, head_dim=Dh, length=n, grad=True, batch=1) + 2 * Dh + n + 2
    assert_close(out.double(), ref, n=N, dtype=dtype)
    assert_close(xa.grad.double(), xr.grad, n=N, dtype=dtype, msg="input")
    for name, p in attn.named_parameters():
        assert_close(p.grad.double(), ref_grads[name], n=N * n, dtype=dtype, msg=name)


def test_cope_score_terms_use_the_product_given():
    """score_terms(qk=...) reads the product it is given (the gates change with it) and
    checks its shape; without it, the terms compute their own (the same values)."""
    torch.manual_seed(0)
    enc = posenc.build("cope", heads=2, head_dim=8, npos_max=8)
    with torch.no_grad():
        enc.pos_emb.normal_()
    q, k = torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    pos = torch.arange(7)
    own = enc.score_terms(q, k, pos, pos)
    assert torch.equal(enc.score_terms(q, k, pos, pos, qk=q @ k.transpose(-1, -2)), own)
    other = enc.score_terms(q, k, pos, pos, qk=torch.zeros(1, 2, 7, 7))  # every gate 1/2
    assert not torch.allclose(other, own)
    assert torch.equal(enc.positions(q, k, pos, pos, qk=torch.zeros(1, 2, 7, 7))[0, 0, 6], torch.arange(7, 0, -1) / 2)
    with pytest.raises(ValueError, match="qk must be q @ k"):
        enc.score_terms(q, k, pos, pos, qk=torch.zeros(1, 2, 7, 6))


def test_cope_cache_decoding_and_errors():
    torch.manual_seed(0)
    attn = posenc.Attention(16, 2, "cope")
    with torch.no_grad():
        attn.encoding.pos_emb.normal_()
        x = torch.randn(2, 10, 16)
        full = attn(x)
        cache = attn.init_cache(2, 10)
        steps = torch.cat([attn(x[:, t : t + 1], cache=cache) for t in range(10)], 1)
    assert_close(steps, full, n=attention_n(dim=16, head_dim=8, length=10) + 2 * 8 + 10 + 2)
    with pytest.raises(ValueError, match="causal only"):
        posenc.build("cope", heads=2, head_dim=8, causal=False)
    with pytest.raises(ValueError, match="npos_max"):
        posenc.build("cope", heads=2, head_dim=8, npos_max=1)
