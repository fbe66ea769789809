"""FlexAttention kernels that do not fit the GPU's shared memory (``posenc.attend.flex``).

On an H200 (torch 2.11), Inkling's ``score_mod`` at 16 heads of 64 channels in bfloat16 failed
to compile with inductor's defaults ("out of resource: triton_tem_fused_flex_attention_0
Required: 249856 Hardware limit:232448"); ``kernel_options={"num_stages": 2}`` and ``1``
compiled, forward and backward (benchmarks/flex_options_probe.py). The backend then runs again
with smaller options. Here the compiled call is replaced by one that refuses as inductor did
unless ``num_stages`` is small enough, and otherwise runs FlexAttention's reference.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

import posenc
import posenc.attend.flex as flex_mod

REFUSAL = (
    "No valid triton configs. OutOfMemoryError: out of resource: triton_tem_fused_flex_attention_0 "
    "Required: 249856 Hardware limit:232448 Reducing block sizes or `num_stages` may help."
)


def kernel(fits, calls: list):
    """A compiled call that refuses the options ``fits`` rejects, else runs the reference."""

    def run(q, k, v, kernel_options=None, **kwargs):
        calls.append(kernel_options)
        if not fits(kernel_options):
            raise RuntimeError(REFUSAL)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return flex_attention(q, k, v, **kwargs)

    return run


def attend(name="inkling"):
    torch.manual_seed(0)
    attn = posenc.Attention(32, 2, name, head_dim=16, max_len=64).eval()
    x = torch.randn(1, 24, 32)
    with torch.no_grad():
        return attn, x, attn(x, backend="dense")


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(flex_mod, "_fitted", {})


def test_a_kernel_out_of_shared_memory_runs_with_fewer_stages_and_says_so(fresh, monkeypatch):
    calls = []
    fits = lambda o: o is not None and o.get("num_stages", 3) <= 1  # noqa: E731 (2 refused too)
    monkeypatch.setattr(flex_mod, "_flex_attention", lambda device_type: kernel(fits, calls))
    attn, x, want = attend()
    with pytest.warns(UserWarning, match=r"Inkling .*did not fit.*kernel_options=\{'num_stages': 1\}"):
        with torch.no_grad():
            got = attn(x, backend="flex")
    torch.testing.assert_close(got, want)
    assert calls == [None, {"num_stages": 2}, {"num_stages": 1}]
    calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # remembered: no second warning, no refused compile
        with torch.no_grad():
            torch.testing.assert_close(attn(x, backend="flex"), want)
    assert calls == [{"num_stages": 1}]


def test_a_kernel_that_fits_runs_with_inductors_defaults(fresh, monkeypatch):
    calls = []
    monkeypatch.setattr(flex_mod, "_flex_attention", lambda device_type: kernel(lambda o: True, calls))
    attn, x, want = attend("alibi")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            torch.testing.assert_close(attn(x, backend="flex"), want)
    assert calls == [None]


def test_other_errors_and_a_kernel_that_never_fits_are_raised(fresh, monkeypatch):
    calls = []
    monkeypatch.setattr(flex_mod, "_flex_attention", lambda device_type: kernel(lambda o: False, calls))
    attn, x, _ = attend()
    with pytest.raises(RuntimeError, match="out of resource"), torch.no_grad():
        attn(x, backend="flex")
    assert calls == [None, {"num_stages": 2}, {"num_stages": 1}] and not flex_mod._fitted

    def broken(q, k, v, kernel_options=None, **kwargs):
        calls.append(kernel_options)
        raise RuntimeError("LoweringException: something else")

    calls.clear()
    monkeypatch.setattr(flex_mod, "_flex_attention", lambda device_type: broken)
    with pytest.raises(RuntimeError, match="something else"), torch.no_grad():
        attn(x, backend="flex")
    assert calls == [None]
