"""Shared test helpers: one place for tolerances and small model settings."""

from __future__ import annotations

import pytest
import torch

import posenc

# small settings used across the suites
DIM, HEADS, HEAD_DIM, MAX_LEN = 16, 2, 8, 16


def tolerance(
    dtype: torch.dtype = torch.float32, *, n: int = 1, magnitude: float = 1.0, stored: int | None = None
) -> dict[str, float]:
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
    vectorise differently (run it under ``ATEN_CPU_CAPABILITY=default`` too: CI does; the
    values are lower case, ``default``/``avx2``/``avx512``: PyTorch ignores others with a
    warning). ``tests/test_tolerance.py`` checks that float32 results stay within half of
    this bound of float64 ones (measured: at most 0.05 of it).

    Half precision. Rounding every addition in ``dtype`` gives ``n·eps`` as above, which is
    vacuous once ``n`` nears ``1/eps`` (128 for bfloat16, 1024 for float16): a test under it
    could not fail. PyTorch's float16/bfloat16 kernels do not round every addition: matmul,
    bmm, softmax, SDPA and reductions accumulate in float32 (``at::opmath_type``) and round
    once, when they store their result. ``stored=k`` counts the values on the path stored in
    ``dtype`` (one attention layer: the input, ``W_qkv``, ``q/k/v``, rotated ``q/k``, scores,
    probabilities, ``attn @ v``, ``W_o``, the output: ``k = 10`` covers it); each is off by
    ``u = eps/2`` relative and moves the result by at most that times the magnitude, so a
    half-precision result and a float32 one differ by at most ``k·eps·magnitude`` plus the
    float32 accumulation ``n·eps_float32·magnitude``. (CUDA float16 GEMMs may reduce
    split-K partial sums in float16 unless ``allow_fp16_reduced_precision_reduction`` is
    off: leave ``stored`` out there.) Measured: xPos layers in float16/bfloat16 against
    float32 stay within ``0.55·eps·(magnitude + |value|)`` over 60 seeds and positions.
    """
    eps = torch.finfo(dtype).eps
    if stored is not None and dtype in (torch.float16, torch.bfloat16):
        rel = stored * eps + n * torch.finfo(torch.float32).eps
        return {"rtol": rel, "atol": rel * magnitude}
    return {"rtol": n * eps, "atol": n * eps * magnitude}


def attention_n(*, dim: int, length: int, head_dim: int | None = None, grad: bool = False, batch: int = 2) -> int:
    """Total reduction length of one attention layer's output: the q/k/v projections (``D``),
    ``q·k`` (``Dh``), softmax and ``attn @ v`` (``2·Lk``) and the output projection (``D``).
    Gradients run the chain back once more and sum weight gradients over ``B·L`` tokens."""
    n = 2 * dim + (dim if head_dim is None else head_dim) + 2 * length
    return 2 * n + batch * length if grad else n


def lm_n(*, dim: int, depth: int, length: int, mlp_ratio: float = 4.0, grad: bool = False, batch: int = 2) -> int:
    """Total reduction length of a :class:`posenc.TransformerLM`'s logits: per block one
    attention layer and an MLP (``D + mlp_ratio·D``), then the output head (``D``)."""
    block = attention_n(dim=dim, length=length) + dim + int(mlp_ratio * dim)
    n = depth * block + dim
    return 2 * n + batch * length if grad else n


def attention_tolerance(dtype: torch.dtype = torch.float32, *, dim: int, length: int, **kw) -> dict[str, float]:
    """:func:`tolerance` of one attention layer's output (see :func:`attention_n`)."""
    magnitude = kw.pop("magnitude", 1.0)
    return tolerance(dtype, n=attention_n(dim=dim, length=length, **kw), magnitude=magnitude)


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    n: int | None = None,
    magnitude: float | None = None,
    dtype: torch.dtype | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    msg="",
):
    """Element-wise comparison with the suite's rule (:func:`tolerance`).

    ``n``: the total reduction length behind the values (required unless ``rtol``/``atol``
    are given, for exact-by-construction comparisons); ``magnitude``: size of the summed
    terms, by default that of the result (at least 1); ``dtype``: the lowest precision on
    the path, by default ``expected``'s.
    """
    if rtol is None or atol is None:
        if n is None:
            raise TypeError("assert_close needs n= (the reduction length behind the values) or rtol= and atol=")
        if magnitude is None:
            magnitude = max(1.0, float(expected.detach().abs().amax())) if expected.numel() else 1.0
        tol = tolerance(dtype or expected.dtype, n=n, magnitude=magnitude)
        rtol = tol["rtol"] if rtol is None else rtol
        atol = tol["atol"] if atol is None else atol
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{msg}\n{m}" if msg else m)


def encoding_modes() -> list[tuple[str, bool]]:
    """(name, causal) for every registered encoding and every mode it supports."""
    out = []
    for name in posenc.available():
        out.append((name, True))
        if not posenc.get_class(name).causal_only:
            out.append((name, False))
    return out


def score_mod_modes() -> list[tuple[str, bool]]:
    """:func:`encoding_modes` of the encodings with an elementwise ``score_mod`` of their own
    (what FlexAttention compiles; the others run the dense fallback)."""
    return [(n, c) for n, c in encoding_modes() if posenc.get_class(n).defines("score_mod")]


def mode_id(p) -> str:
    name, causal = p
    return f"{name}-{'causal' if causal else 'bidir'}"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """One torch thread for the test (small tensors: one thread is faster, and two spinning
    threads crawl on a shared 2-core machine); the count is restored after it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
