"""PoPE (``pope``): parity with x-transformers, the paper's formula, options and errors.

The contract suite (tests/test_contract.py) covers what every encoding must do (cached
decoding equals the full forward, every backend equals eager, gradients, shift invariance).
"""

from __future__ import annotations

import math

import pytest
import torch
from tests.conftest import assert_close

import posenc
from posenc.encodings.polar import PoPE

xt = pytest.importorskip("x_transformers.x_transformers")

B, H, DH, D = 2, 2, 8, 16


def _pope(**kw) -> PoPE:
    return posenc.build("pope", heads=H, head_dim=DH, max_len=64, **kw)


def _random_phase(g: torch.Generator) -> torch.Tensor:
    """``(H, Dh)`` phases, a few outside ``[-2π, 0]`` so that the clamp is exercised."""
    phase = torch.empty(H, DH).uniform_(-2 * math.pi, 0.0, generator=g)
    phase[0, :2] = torch.tensor([0.7, -7.5])  # clamped to 0 and -2π by both
    return phase


def _angle_rounding(max_pos: int) -> int:
    """The roundings of the angles, in units of ``eps`` times the terms ``μq·μk``.

    x-transformers adds the phase to the keys' angles, ``fl(fl(jθ) + δ)``, posenc subtracts
    it from the queries', ``fl(fl(iθ) - δ)`` (``fl(pos·θ)`` bit-identical in both): each
    sum rounds once, by at most ``u·(P + 2π)`` at positions below ``P`` (``u = eps/2``), so
    the two ``cos((j - i)θ + δ)`` differ by at most ``eps·(P + 2π)``."""
    return max_pos + 7


def test_scores_match_x_transformers():
    """The pre-softmax scores ``scale·q̃·k̃`` of x-transformers' PolarEmbedding and
    apply_polar_pos_emb (phase copied over), queries the last 5 of 12 keys at positions
    30..41 (a cached step, as x-transformers slices ``freqs[:, -Lq:]``)."""
    g = torch.Generator().manual_seed(0)
    ref = xt.PolarEmbedding(DH, H)
    enc = _pope()
    with torch.no_grad():
        ref.learned_bias.copy_(_random_phase(g).unsqueeze(1))  # (H, 1, Dh)
        enc.phase.copy_(ref.learned_bias.squeeze(1))
    assert torch.equal(enc.inv_freq, ref.inv_freq)  # the same float32 frequencies
    k_pos = torch.arange(30, 42)
    q_pos = k_pos[-5:]
    q = 2 * torch.randn(B, H, 5, DH, generator=g)
    k = 2 * torch.randn(B, H, 12, DH, generator=g)
    freqs, bias = ref(k_pos)
    expected = xt.apply_polar_pos_emb(q, freqs) @ xt.apply_polar_pos_emb(k, freqs + bias).transpose(-1, -2)
    expected = expected * DH**-0.5  # x-transformers' Attend: scale = dim_head ** -0.5
    qr, kr = enc.rotate(q, k, q_pos[None], k_pos[None])
    assert qr.shape == (B, H, 5, 2 * DH) and kr.shape == (B, H, 12, 2 * DH)
    assert enc.scale == DH**-0.5
    got = posenc.scores(enc, qr, kr, q_pos[None], k_pos[None])
    terms = (torch.nn.functional.softplus(q) @ torch.nn.functional.softplus(k).transpose(-1, -2)) * DH**-0.5
    n = 2 * DH + _angle_rounding(41)
    assert_close(got, expected, n=n, magnitude=float(terms.amax()))


def test_attention_layer_matches_x_transformers():
    """A whole causal attention layer (projections, PoPE, softmax, values, output) against
    x-transformers' Attention with ``polar_pos_emb``, weights and phase copied over;
    gradients of the input and of the phase too."""
    torch.manual_seed(0)
    ref = xt.Attention(D, dim_head=DH, heads=H, causal=True)
    pe = xt.PolarEmbedding(DH, H)
    attn = posenc.Attention(D, H, "pope", head_dim=DH, causal=True, max_len=64, backend="eager")
    with torch.no_grad():
        pe.learned_bias.uniform_(-2 * math.pi, 0.0)
        attn.encoding.phase.copy_(pe.learned_bias.squeeze(1))
        for ours, theirs in (("q_proj", "to_q"), ("k_proj", "to_k"), ("v_proj", "to_v"), ("o_proj", "to_out")):
            getattr(attn, ours).weight.copy_(getattr(ref, theirs).weight)
    L = 10
    x = torch.randn(B, L, D)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = ref(x_ref, polar_pos_emb=pe(torch.arange(L)))
    got = attn(x_ours)
    # projections (D), q̃·k̃ (2·Dh), softmax and attn @ v (2·L), output (D), the angles
    n = 2 * D + 2 * DH + 2 * L + _angle_rounding(L)
    assert_close(got, expected, n=n)
    w = torch.linspace(-1, 1, D)
    (expected * w).sum().backward()
    (got * w).sum().backward()
    n_grad = 2 * n + B * L
    assert_close(x_ours.grad, x_ref.grad, n=n_grad)
    assert_close(attn.encoding.phase.grad, pe.learned_bias.grad.squeeze(1), n=n_grad)


def test_scores_match_the_paper_formula():
    """s_ij = scale·Re[Σ_c conj(q̃_ic)·k̃_jc], q̃_ic = μq_ic·e^{i·i·θ_c}, k̃_jc = μk_jc·e^{i(j·θ_c + δ_c)},
    μ = softplus, θ_c = base^(-(c-1)/d) for c = 1..d (arXiv 2509.10534, Sec. 3), in float64
    complex arithmetic; positions up to 1 010, a base other than the default."""
    g = torch.Generator().manual_seed(1)
    base = 500.0
    enc = _pope(base=base)
    delta = torch.empty(H, DH, dtype=torch.float64).uniform_(-2 * math.pi, 0.0, generator=g)
    with torch.no_grad():
        enc.phase.copy_(delta)
    q = torch.randn(B, H, 6, DH, generator=g)
    k = torch.randn(B, H, 9, DH, generator=g)
    q_pos = torch.tensor([[3, 1000, 4, 1001, 5, 1002], [0, 1, 2, 3, 4, 5]])
    k_pos = torch.tensor([[1010, 0, 999, 2, 7, 1005, 1003, 1, 6], [0, 1, 2, 3, 4, 5, 6, 7, 8]])

    c = torch.arange(1, DH + 1, dtype=torch.float64)
    theta = base ** (-(c - 1) / DH)  # (Dh,)
    mu_q = torch.log1p(torch.exp(q.double()))  # softplus, (B, H, Lq, Dh)
    mu_k = torch.log1p(torch.exp(k.double()))
    delta = enc.phase.detach().double()[None, :, None, :]  # (1, H, 1, Dh)
    phase_q = q_pos.double()[:, None, :, None] * theta  # (B, 1, Lq, Dh)
    phase_k = k_pos.double()[:, None, :, None] * theta + delta  # (B, H, Lk, Dh)
    q_c = torch.polar(mu_q, phase_q)
    k_c = torch.polar(mu_k, phase_k)
    expected = torch.einsum("bhic,bhjc->bhij", q_c.conj(), k_c).real * DH**-0.5

    got = posenc.scores(enc, *enc.rotate(q, k, q_pos, k_pos), q_pos, k_pos)
    terms = (mu_q @ mu_k.transpose(-1, -2)) * DH**-0.5
    # float32 against float64: the angles' roundings (fl(iθ), fl(·-δ): _angle_rounding) and
    # float32 θ_c = 1/base^(c/Dh) a few ulp off the exact one (pow, divide, reciprocal: at
    # most 2·eps relative, moving i·θ by 2·eps·P), then the 2·Dh-term sum
    n = 2 * DH + 3 * _angle_rounding(1010)
    assert_close(got.double(), expected, n=n, magnitude=float(terms.amax()), dtype=torch.float32)


def test_scores_depend_on_the_distance_only():
    """relative=True: the same distances at positions 0.. and 5 000.. give the same scores,
    and a learned phase does not break it."""
    enc = _pope(bias_uniform_init=True)
    assert enc.relative and enc.extrapolates and enc.position_limit is None
    q, k = torch.randn(1, H, 8, DH), torch.randn(1, H, 8, DH)
    pos = torch.arange(8)[None]
    near = posenc.scores(enc, *enc.rotate(q, k, pos, pos), pos, pos)
    far = posenc.scores(enc, *enc.rotate(q, k, pos + 5000, pos + 5000), pos + 5000, pos + 5000)
    terms = (torch.nn.functional.softplus(q) @ torch.nn.functional.softplus(k).transpose(-1, -2)) * DH**-0.5
    # fl(iθ), fl(jθ) and fl(· - δ) at |angle| <= 5 008 + 2π: three roundings of u·(P + 2π) each
    assert_close(far, near, n=2 * DH + 2 * _angle_rounding(5008), magnitude=float(terms.amax()))


def test_grouped_keys_equal_repeated_keys():
    """Keys with fewer heads (the HF adapter's grouped-query attention) give the scores of
    the same keys repeated per query head: the phase sits on the queries."""
    enc = _pope(bias_uniform_init=True)
    q, k = torch.randn(B, H, 5, DH), torch.randn(B, 1, 5, DH)
    pos = torch.arange(5)[None]
    qg, kg = enc.rotate(q, k, pos, pos)
    assert kg.shape == (B, 1, 5, 2 * DH)
    grouped = qg @ kg.transpose(-1, -2)  # (B, H, 5, 5): the one key head broadcast
    repeated = posenc.scores(enc, *enc.rotate(q, k.expand(B, H, 5, DH).contiguous(), pos, pos), pos, pos)
    assert_close(grouped * enc.scale, repeated, n=2 * DH)


def test_phase_init_and_dtypes():
    """Zeros by default (x-transformers), U(-2π, 0) with bias_uniform_init; the tables stay
    float32 and the rotated q/k keep the activation dtype at twice the head dim."""
    assert torch.equal(_pope().phase, torch.zeros(H, DH))
    phase = _pope(bias_uniform_init=True).phase
    assert phase.shape == (H, DH) and phase.requires_grad
    assert bool((phase >= -2 * math.pi).all() and (phase <= 0).all()) and phase.std() > 0.5
    enc = _pope().to(torch.bfloat16)
    assert enc.inv_freq.dtype == torch.float32 and enc.phase.dtype == torch.bfloat16
    q = torch.randn(1, H, 4, DH, dtype=torch.bfloat16)
    qr, kr = enc.rotate(q, q, torch.arange(4), torch.arange(4))
    assert qr.dtype == kr.dtype == torch.bfloat16 and qr.shape == (1, H, 4, 2 * DH)
    assert "phase" in _pope().state_dict() and "inv_freq" not in _pope().state_dict()
    assert PoPE.cache_raw_keys  # the cache cannot hold 2·Dh-wide keys


@pytest.mark.parametrize("base", [1, 1.0, 0.5, -3.0])
def test_bad_base_raises(base):
    with pytest.raises(ValueError, match=rf"base must be a number > 1, got {base!r}"):
        _pope(base=base)


def test_bad_option_types_raise():
    with pytest.raises(TypeError, match="base must be a number > 1, got '10000' \\(str\\)"):
        _pope(base="10000")
    with pytest.raises(TypeError, match="base must be a number > 1, got True"):
        _pope(base=True)
    with pytest.raises(TypeError, match="bias_uniform_init"):
        _pope(bias_uniform_init=1)
    with pytest.raises(ValueError, match="base.*nan"):
        _pope(base=float("nan"))


def test_bad_shapes_raise():
    enc = _pope()
    pos = torch.arange(4)
    q = torch.randn(1, H, 4, DH)
    with pytest.raises(ValueError, match=rf"query of shape \(B, H, L, {DH}\) with H = {H}, got \(1, {H}, 4, 6\)"):
        enc.rotate(torch.randn(1, H, 4, 6), q, pos, pos)
    with pytest.raises(ValueError, match=rf"H = a divisor of {H}, got \(1, 3, 4, {DH}\)"):
        enc.rotate(q, torch.randn(1, 3, 4, DH), pos, pos)
    with pytest.raises(ValueError, match="positions of length 3 for a key of length 4"):
        enc.rotate(q, q, pos, torch.arange(3))
