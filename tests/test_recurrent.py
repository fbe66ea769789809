"""floater (neural ODE) and recurrent (GRU) positions, against their formulas written out."""

from __future__ import annotations

import math

import pytest
import torch
from tests.conftest import assert_close, lm_n

import posenc


def _vaswani(L: int, D: int) -> torch.Tensor:
    pe = torch.zeros(L, D, dtype=torch.float64)
    for p in range(L):
        for i in range(0, D, 2):
            pe[p, i] = math.sin(p / 10000 ** (i / D))
            pe[p, i + 1] = math.cos(p / 10000 ** (i / D))
    return pe.float()


def _linear_skew(enc):
    """Fix h to the linear skew-symmetric field Ω·p (g = 0) with the sinusoidal ω and p₀."""
    with torch.no_grad():
        enc.field.net[2].weight.zero_()
        enc.field.net[2].bias.zero_()
    return enc


@pytest.mark.parametrize(
    "opts",
    [
        dict(frame="fixed", method="dopri5", rtol=1e-6, atol=1e-8),  # integrates the rotation itself
        dict(frame="rotating"),  # default: rk4 in the rotating frame
    ],
    ids=["fixed-dopri5", "rotating-rk4"],
)
def test_floater_linear_skew_field_solves_to_sinusoidal(opts):
    enc = _linear_skew(posenc.build("floater", heads=2, head_dim=8, **opts))
    pos = torch.arange(16)
    with torch.no_grad():
        p = enc.positions(pos)
    # not rounding but the ODE solver's own error: dopri5 at rtol 1e-6/atol 1e-8 over 15 time units
    assert_close(p, _vaswani(16, 16), rtol=0, atol=2e-5)


def test_floater_fixed_and_rotating_frames_solve_the_same_ode():
    torch.manual_seed(0)
    fixed = posenc.build("floater", heads=1, head_dim=8, frame="fixed", method="dopri5", rtol=1e-8, atol=1e-10)
    rot = posenc.build("floater", heads=1, head_dim=8, frame="rotating", method="dopri5", rtol=1e-8, atol=1e-10)
    with torch.no_grad():
        for p in fixed.parameters():
            p.add_(0.1 * torch.randn_like(p))  # a non-trivial g
    rot.load_state_dict(fixed.state_dict())
    with torch.no_grad():
        pos = torch.arange(20)
        assert_close(rot.positions(pos), fixed.positions(pos), rtol=1e-5, atol=1e-5)  # two solves at 1e-8: solver error


def test_floater_keeps_the_norm_of_p0():
    torch.manual_seed(0)
    enc = posenc.build("floater", heads=2, head_dim=4, method="dopri5", rtol=1e-7, atol=1e-9)
    with torch.no_grad():
        enc.field.net[2].weight.normal_(std=0.3)  # a strong g
        norms = enc.positions(torch.arange(30)).norm(dim=-1)
    assert_close(norms, enc.p0.norm().expand(30), rtol=1e-5, atol=1e-5)  # the solver (rtol 1e-7) drifts the norm


def test_floater_adjoint_gradients_match_backprop():
    torch.manual_seed(0)
    direct = posenc.build("floater", heads=1, head_dim=8, method="dopri5", rtol=1e-7, atol=1e-9)
    adjoint = posenc.build("floater", heads=1, head_dim=8, method="dopri5", rtol=1e-7, atol=1e-9, adjoint=True)
    with torch.no_grad():
        for p in direct.parameters():
            p.add_(0.1 * torch.randn_like(p))
    adjoint.load_state_dict(direct.state_dict())
    pos, w = torch.arange(6), torch.randn(6, 8)
    for enc in (direct, adjoint):
        (enc.positions(pos) * w).sum().backward()
    for (name, a), b in zip(direct.named_parameters(), adjoint.parameters()):
        assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)  # adjoint = a second ODE solve (rtol 1e-7)


def test_floater_solves_once_per_forward_and_caches_at_inference():
    torch.manual_seed(0)
    lm = posenc.TransformerLM(32, 16, 3, 2, encoding="floater", max_len=8)
    enc = lm.blocks[0].attn.encoding
    assert all(b.attn.encoding is enc for b in lm.blocks)  # dynamics shared by every block
    calls = []
    solve = enc._solve
    enc._solve = lambda times: calls.append(len(times)) or solve(times)
    t = torch.randint(0, 32, (2, 8))
    pos = torch.arange(8)
    for _ in range(2):  # same pos tensor twice: the second forward must not reuse a freed graph
        lm(t, pos=pos).sum().backward()
    assert calls == [8, 8]  # one solve per forward, not one per layer
    calls.clear()
    with torch.no_grad():
        ref = lm(t)
        lm(t[:, :4])
    assert calls == [8]  # the inference table covers the shorter call
    with torch.no_grad():
        long = lm(torch.randint(0, 32, (1, 20)))  # extrapolates: integrates further
    assert calls == [8, 20] and torch.isfinite(long).all()
    assert_close(ref, lm(t, pos=pos).detach(), n=lm_n(dim=16, depth=3, length=8))  # cached table == solve with grad


@pytest.mark.parametrize("frame", ["rotating", "fixed"])
def test_floater_backward_keeps_one_copy_of_the_weights(frame):
    """Autograd keeps the float64 MLP weights once per solve, not once per function
    evaluation (4 per position with rk4): the copies cost ~1 MiB per position at D = 512 and
    made L = 16384 need ~23 GiB. The other saved tensors are state-sized (at most hidden x D),
    so the saved bytes grow by a bounded amount per position."""
    enc = posenc.build("floater", heads=2, head_dim=32, hidden=16, frame=frame)  # D = 64
    shapes = {tuple(enc.field.net[0].weight.shape), tuple(enc.field.net[2].weight.shape)}
    saved = {}
    for L in (16, 64):
        kept = {}  # distinct storages autograd keeps: data_ptr -> tensor

        def pack(t, kept=kept):
            kept[t.untyped_storage().data_ptr()] = t
            return t

        enc._memo.call = None
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = enc.positions(torch.arange(L))
        weights = sum(t.dtype == torch.float64 and tuple(t.shape) in shapes for t in kept.values())
        saved[L] = (weights, sum(t.untyped_storage().nbytes() for t in kept.values()))
        del out
    assert saved[16][0] == saved[64][0] <= 2, saved  # w1 and w2, once, whatever the length
    per_position = (saved[64][1] - saved[16][1]) / 48
    assert per_position < 4 * 64 * 8 * 40, saved  # 4 stages x ~40 state-sized float64 tensors


def test_floater_bad_options():
    with pytest.raises(ValueError, match="torchdiffeq solver.*'rk5'"):
        posenc.build("floater", heads=1, head_dim=4, method="rk5")
    with pytest.raises(ValueError, match="frame must be"):
        posenc.build("floater", heads=1, head_dim=4, frame="inertial")


def test_recurrent_matches_grucell_loop():
    torch.manual_seed(0)
    enc = posenc.build("recurrent", heads=2, head_dim=4)
    cell = torch.nn.GRUCell(1, 8)
    with torch.no_grad():
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            getattr(cell, name).copy_(getattr(enc.cell, f"{name}_l0"))
        h, rows = enc.p0.unsqueeze(0), [enc.p0]
        for _ in range(15):  # p_{k+1} = GRU(1, p_k)
            h = cell(torch.ones(1, 1), h)
            rows.append(h[0])
        expected = torch.stack(rows)
        n_gru = 16 * (3 * 8 + 8)  # 16 steps of a GRU cell: 3 gates over 8 hidden units (+ input)
        assert_close(enc.positions(torch.arange(16)), expected, n=n_gru)
    # with gradients, on a sparse set of positions: the same vectors
    assert_close(enc.positions(torch.tensor([[3, 9, 15]])).detach(), expected[[3, 9, 15]].unsqueeze(0), n=n_gru)
