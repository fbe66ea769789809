"""Shared test helpers: one place for tolerances and small model settings."""

from __future__ import annotations

import pytest
import torch

import posenc

# small settings used across the suites
DIM, HEADS, HEAD_DIM, MAX_LEN = 16, 2, 8, 16


def tolerance(dtype: torch.dtype = torch.float32, *, n: int = 1, magnitude: float = 1.0) -> dict[str, float]:
    """``rtol``/``atol`` for comparing two computations of the same quantity (the rule of the suite).

    A result built from floating-point sums of ``n`` terms in all (the lengths of every
    reduction on its path added up: input projection ``D``, ``q·k`` over ``Dh``, softmax and
    ``attn @ v`` over ``Lk``, output projection ``H·Dh``, ...) carries a rounding error of
    at most ``γ_n = n·u/(1 - n·u) ≈ n·u`` relative to the *terms* (Higham, Accuracy and
    Stability of Numerical Algorithms, Thm 3.1), whatever the summation order, with
    ``u = eps/2``. Two implementations (scalar vs AVX2/AVX-512 kernels, another thread
    count, a reference library) sum in different orders, so they differ by at most twice
    that: ``2·n·u·|terms| = n·eps·magnitude``. ``magnitude`` is the size of the largest terms
    (not of the result, which cancellation can make small), so it goes into ``atol``;
    ``rtol`` gets the same relative bound. A comparison against float32 of a result
    computed in bfloat16/float16 passes that dtype: its ``eps`` dominates.

    This is a worst-case bound, so the suite cannot turn red on a CPU whose kernels
    vectorise differently (run it under ``ATEN_CPU_CAPABILITY=default`` too: CI does).
    """
    eps = torch.finfo(dtype).eps
    return {"rtol": n * eps, "atol": n * eps * magnitude}


def attention_tolerance(
    dtype: torch.dtype = torch.float32, *, dim: int, length: int, head_dim: int | None = None, magnitude: float = 1.0
) -> dict[str, float]:
    """:func:`tolerance` of one attention layer's output: ``D`` (projections) ``+ Dh + 2·Lk + D``."""
    head_dim = dim if head_dim is None else head_dim
    return tolerance(dtype, n=2 * dim + head_dim + 2 * length, magnitude=magnitude)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float = 1e-5, atol: float = 1e-6, msg=""):
    """Element-wise comparison with explicit tolerances (callers pass :func:`tolerance`'s)."""
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{msg}\n{m}" if msg else m)


def encoding_modes() -> list[tuple[str, bool]]:
    """(name, causal) for every registered encoding and every mode it supports."""
    out = []
    for name in posenc.available():
        out.append((name, True))
        if not posenc.get_class(name).causal_only:
            out.append((name, False))
    return out


def mode_id(p) -> str:
    name, causal = p
    return f"{name}-{'causal' if causal else 'bidir'}"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
