"""pytest-benchmark timings of one attention layer per encoding (not part of the test run).

Run:  PYTHONPATH=src python -m pytest benchmarks/bench_attention.py -o python_files='bench_*.py' \
          --benchmark-columns=median,iqr,rounds --benchmark-sort=name

Each benchmark is forward+backward of ``posenc.Attention`` (B = 1, H = 8, Dh = 64, causal)
on the backend ``auto`` picks, at ``L`` = 1024; ``nope`` on ``sdpa`` is the baseline.
``posenc bench`` is the full tool (ratios, references, memory, plots); this file is for
tracking regressions with pytest-benchmark's own compare/history features.
"""

from __future__ import annotations

import pytest
import torch

import posenc

L = 1024
NAMES = posenc.available()


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, L, 512, generator=g)
    grad = torch.randn(1, L, 512, generator=g)
    return x, grad


def _layer(name: str):
    causal = True
    return posenc.Attention(512, 8, name, causal=causal, max_len=L)


@pytest.mark.parametrize("name", NAMES)
def test_fwd_bwd(benchmark, inputs, name):
    x, grad = inputs
    attn = _layer(name)

    def step():
        attn.zero_grad(set_to_none=True)
        attn(x).backward(grad)

    benchmark.pedantic(step, warmup_rounds=1, rounds=5, iterations=1)


@pytest.mark.parametrize("name", NAMES)
def test_fwd(benchmark, inputs, name):
    x, _ = inputs
    attn = _layer(name)

    def step():
        with torch.no_grad():
            attn(x)

    benchmark.pedantic(step, warmup_rounds=1, rounds=5, iterations=1)
