"""complex-order and the complex-valued model, against the paper's formulas written out."""

from __future__ import annotations

import cmath
import math

import pytest
import torch
from tests.conftest import assert_close, attention_n, lm_n

import posenc
from posenc.complex_model import ComplexAttention, ComplexLinear, ComplexTransformerLM


def _enc(**kw):
    torch.manual_seed(0)
    enc = posenc.build("complex-order", heads=2, head_dim=4, vocab_size=11, **kw)
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.3 * torch.randn_like(p))  # per-word ω and θ that differ
    return enc


def test_embedding_matches_paper_formula():
    enc = _enc()
    tokens, pos = torch.tensor([[3, 7, 3, 0, 10]]), torch.tensor([0, 1, 2, 9, 40])
    r, w, th = enc.amplitude.weight.detach(), enc.frequency.detach(), enc.phase.detach()
    expected = torch.zeros(1, 5, 4, dtype=torch.complex64)
    for n, (j, k) in enumerate(zip(tokens[0].tolist(), pos.tolist())):
        for d in range(4):  # f(j, k) = r_j · exp(i(ω_j·k + θ_j))
            expected[0, n, d] = float(r[j, d]) * cmath.exp(1j * (float(w[j, d]) * k + float(th[j, d])))
    z = enc.complex_embedding(tokens, pos)
    # r·exp(i(ω·k + θ)): angles up to |ω|·40 + |θ| rounded in float32 here, float64 there
    ang = float(w.abs().amax() * 40 + th.abs().amax())
    assert_close(z, expected, n=3, magnitude=ang * float(r.abs().amax()), dtype=torch.float32)
    want = torch.cat((expected.real, expected.imag), -1)
    assert_close(enc.embed(tokens, pos), want, n=3, magnitude=ang * float(r.abs().amax()))


@pytest.mark.parametrize("share", [dict(), dict(share_frequency=True, share_phase=True)], ids=["per-word", "shared"])
def test_shift_multiplies_by_word_phase(share):
    enc = _enc(**share)
    tokens = torch.randint(0, 11, (2, 6))
    pos, s = torch.arange(6), 13
    w = enc.frequency[0].expand(2, 6, -1) if enc.share_frequency else enc.frequency[tokens]
    rotated = enc.complex_embedding(tokens, pos) * torch.polar(torch.ones_like(w), w * s)  # · exp(i·ω_j·s)
    ang = float(w.detach().abs().amax()) * (6 + s) + 1.0
    assert_close(
        enc.complex_embedding(tokens, pos + s).detach(), rotated.detach(), n=4, magnitude=ang * 4, dtype=torch.float32
    )


def test_zero_frequency_is_a_phase_shifted_word_embedding():
    enc = _enc()
    with torch.no_grad():
        enc.frequency.zero_()
    tokens = torch.tensor([[4, 4, 2]])
    z = enc.complex_embedding(tokens, torch.tensor([0, 17, 300]))
    r, th = enc.amplitude(tokens), enc.phase[tokens]
    ang = float(enc.frequency.abs().amax()) * 300 + math.pi + float(th.abs().amax())
    assert_close(
        z,
        torch.polar(r.abs(), th + math.pi * (r < 0)).detach(),
        n=3,
        magnitude=ang * float(r.abs().amax()),
        dtype=torch.float32,
    )
    assert torch.equal(z[0, 0], z[0, 1])  # the same word at any position: the same vector


def test_without_vocabulary_it_rotates_given_vectors():
    enc = posenc.build("complex-order", heads=2, head_dim=4)
    assert enc.input_at == 0 and [n for n, _ in enc.named_parameters()] == ["frequency"]
    x, pos = torch.randn(1, 3, 8), torch.tensor([0, 5, 9])
    z = torch.complex(x[..., :4], x[..., 4:]) * torch.polar(torch.ones(3, 4), pos[:, None] * enc.frequency[0])
    assert_close(
        enc.embed(x, pos), torch.cat((z.real, z.imag), -1).detach(), n=4, magnitude=9.0 * float(x.abs().amax())
    )
    with pytest.raises(ValueError, match="without vocab_size"):
        enc.complex_embedding(torch.zeros(1, 3, dtype=torch.long), pos)
    with pytest.raises(ValueError, match=r"shape \(B, L, 8\)"):
        enc.embed(torch.zeros(1, 3, dtype=torch.long), pos)


def test_model_passes_its_vocabulary_and_checks_ids():
    lm = posenc.TransformerLM(40, 16, 1, 2, encoding="complex-order")
    enc = lm.input_encoding
    assert (
        enc.input_at == "tokens" and lm.tok_emb is None and enc.vocab_size == 40 and enc.amplitude.num_embeddings == 40
    )
    with pytest.raises(ValueError, match=r"\[0, 39\].*40"):
        lm(torch.tensor([[1, 40]]))


def test_complex_linear_is_complex_matmul():
    torch.manual_seed(0)
    lin = ComplexLinear(3, 2, bias=True)
    z = torch.randn(4, 3, dtype=torch.complex64)
    W = torch.complex(lin.real.weight, lin.imag.weight)
    b = torch.complex(lin.real.bias, lin.imag.bias)
    assert_close(lin(z), z @ W.T + b, n=2 * 3 + 2, magnitude=4.0, dtype=torch.float32)  # 4 real products of length 3


@pytest.mark.parametrize("conjugate", [False, True])
def test_complex_attention_matches_loops(conjugate):
    torch.manual_seed(0)
    attn = ComplexAttention(4, 2, causal=True, conjugate=conjugate)
    z = torch.randn(1, 5, 4, dtype=torch.complex64)
    out = attn(z)
    with torch.no_grad():
        q, k, v = attn.q_proj(z)[0], attn.k_proj(z)[0], attn.v_proj(z)[0]  # (L, D)
        o = torch.zeros(5, 4, dtype=torch.complex64)
        for h in range(2):
            sl = slice(2 * h, 2 * h + 2)
            for i in range(5):
                s = []
                for j in range(i + 1):  # causal: keys 0..i
                    kj = k[j, sl].conj() if conjugate else k[j, sl]
                    s.append(abs(complex((q[i, sl] * kj).sum())) / math.sqrt(2))  # |Σ_d q_id k_jd| / √Dh
                a = torch.softmax(torch.tensor(s), 0)
                o[i, sl] = sum(a[j] * v[j, sl] for j in range(i + 1))
        expected = attn.o_proj(o.unsqueeze(0))
    assert_close(
        out.detach(), expected, n=2 * attention_n(dim=4, head_dim=2, length=5), dtype=torch.float32
    )  # real and imaginary parts


def test_complex_lm_is_causal_and_trainable():
    torch.manual_seed(0)
    lm = ComplexTransformerLM(30, 8, 2, 2)
    t = torch.randint(0, 30, (2, 10))
    logits = lm(t)
    assert logits.shape == (2, 10, 30) and logits.dtype == torch.float32
    t2 = torch.cat([t[:, :6], torch.randint(0, 30, (2, 4))], 1)
    assert_close(lm(t2)[:, :6], logits[:, :6], n=2 * lm_n(dim=8, depth=2, length=10))  # the future does not leak
    logits.square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lm.parameters())
    with pytest.raises(ValueError, match="complex of shape"):
        lm.blocks[0].attn(torch.randn(1, 3, 8))


def test_complex_lm_kv_cache_equals_full_forward():
    torch.manual_seed(0)
    lm = ComplexTransformerLM(30, 8, 2, 2).eval()
    t = torch.randint(0, 30, (2, 9))
    with torch.no_grad():
        full = lm(t)
        cache = lm.init_cache(2, 9)
        steps = torch.cat([lm(t[:, :4], cache=cache)] + [lm(t[:, i : i + 1], cache=cache) for i in range(4, 9)], 1)
    assert cache.length == 9
    # per block: complex projections (4 real products of length D), |q·k| over Dh, softmax and values over L
    assert_close(steps, full, n=2 * (4 * 8 + 4 + 2 * 9 + 4 * 8 + 2 * 4 * 8 * 4) + 2 * 8)
    with pytest.raises(ValueError, match="overflow"):
        lm(t[:, :1], cache=cache)
