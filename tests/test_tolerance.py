"""The tolerance rule of ``tests/conftest.py``, checked against exact (float64) results.

Two float32 computations of one quantity (another CPU's kernels, another thread count, a
reference library) may each lie as far from the exact value as float32 rounding takes
them, in opposite directions. A rule that holds on every CPU must therefore leave every
float32 result within *half* its tolerance of the exact one. Issue 11: the ALiBi parity
test's fixed ``atol=1e-6, rtol=1e-5`` failed on an AVX-512 CPU (1 element off by
1.68e-6); below, this machine's float32 result alone is up to ~5x that allowance away
from the exact one, so no fixed constant of that size could hold on every CPU.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from tests.conftest import attention_n, encoding_modes, tolerance
from tests.test_contract import HEAD_DIM, HEADS, MAX_LEN, N_ATTN, L, _x, make_attn

import posenc

OLD = {"rtol": 1e-5, "atol": 1e-6}  # the constants the parity tests used before the rule


def _share(y: torch.Tensor, exact: torch.Tensor, tol: dict[str, float]) -> float:
    """Largest ``|y - exact| / (atol + rtol·|exact|)``: 1 is the edge of the tolerance."""
    return float(((y.double() - exact).abs() / (tol["atol"] + tol["rtol"] * exact.abs())).max())


@pytest.mark.parametrize("heads", [4, 6])
def test_alibi_parity_case_float32_error_is_within_half_the_rule(heads):
    """The issue's case (test_parity.py::test_alibi_attention_matches_bloom_bias), ten seeds."""
    B, Lq, Dh = 2, 12, 8
    n = attention_n(dim=heads * Dh, head_dim=Dh, length=Lq)
    worst_rule = worst_old = 0.0
    for seed in range(10):
        torch.manual_seed(seed)
        attn = posenc.Attention(heads * Dh, heads, "alibi", causal=True)
        with torch.no_grad():
            for p in attn.parameters():
                p.normal_(0, 0.3)
            x = torch.randn(B, Lq, heads * Dh)
            exact = copy.deepcopy(attn).double()(x.double(), backend="eager")
            rule = tolerance(n=n, magnitude=max(1.0, float(exact.abs().amax())))
            for backend in ("dense", "relative", "eager"):
                y = attn(x, backend=backend)
                worst_rule = max(worst_rule, _share(y, exact, rule))
                worst_old = max(worst_old, _share(y, exact, OLD))
    assert worst_rule <= 0.5, f"float32 error reaches {worst_rule:.3f} of the rule's tolerance"
    if heads == 6:  # the failure, reproduced on any CPU: float32 alone exceeds the old constants
        assert worst_old > 1.0, worst_old


CASES = [
    (n, c, b)
    for n, c in encoding_modes()
    for b in posenc.supported_backends(posenc.build(n, heads=HEADS, head_dim=HEAD_DIM, max_len=MAX_LEN, causal=c))
    if b != "flex"  # compiling FlexAttention per encoding costs ~50 s on CPU; test_contract compares it
]


def test_every_backend_float32_error_is_within_half_the_rule():
    """Every encoding, mode and backend of the contract suite (its N_ATTN rule). Tables an
    encoding keeps in float32 by design stay float32 in the float64 run, so this measures
    the reductions: what differs between vectorised and scalar kernels."""
    pos = torch.stack([torch.arange(L), torch.arange(L) + 3])
    shares = {}
    for name, causal, backend in CASES:
        attn = make_attn(name, causal, chunk_size=3)
        with torch.no_grad():
            exact = copy.deepcopy(attn).double()(_x().double(), pos=pos, backend="eager")
            y = attn(_x(), pos=pos, backend=backend)
        rule = tolerance(n=N_ATTN, magnitude=max(1.0, float(exact.abs().amax())))
        shares[f"{name}/{'causal' if causal else 'bidir'}/{backend}"] = _share(y, exact, rule)
    worst = max(shares, key=shares.get)
    assert shares[worst] <= 0.5, f"{worst}: float32 error reaches {shares[worst]:.3f} of the rule's tolerance"
    assert not any(math.isnan(v) for v in shares.values())
