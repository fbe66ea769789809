"""Shared test helpers: one place for tolerances and small model settings."""

from __future__ import annotations

import pytest
import torch

import posenc

# small settings used across the suites
DIM, HEADS, HEAD_DIM, MAX_LEN = 16, 2, 8, 16


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float = 1e-5, atol: float = 1e-6, msg=""):
    """Element-wise comparison with explicit tolerances (float32 defaults)."""
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
