"""The CUDA paths (marked ``cuda``; skipped without a GPU). ``scripts/gpu_check.sh`` runs them.

* FlexAttention (compiled on CUDA) equals the eager oracle in outputs and gradients for
  every scalar bias with a ``score_mod``, causal and bidirectional, float32 and bfloat16;
* every backend an encoding supports equals eager on CUDA (``blockwise`` runs its general
  backend there), outputs and gradients;
* decoding with the KV cache on CUDA equals the full forward, for every causal encoding;
* ``backend="auto"`` picks FlexAttention for the scalar biases on CUDA;
* windows, chunks and learned sinks on every backend equal eager (outputs and gradients).
"""

from __future__ import annotations

import pytest
import torch
from tests.conftest import HEADS, attention_n, encoding_modes, mode_id, score_mod_modes, tolerance

import posenc

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

L = 48  # past FlexAttention's 16-row minimum block and every small table's far field
HEAD_DIM = 16  # FlexAttention's compiled kernel refuses narrower heads (posenc.attend.backends.FLEX_MIN_HEAD_DIM)
DIM = HEADS * HEAD_DIM
MAX_LEN = 64
CUDA = torch.device("cuda")
SCALAR = score_mod_modes()


def make_attn(name: str, causal: bool, dtype=torch.float32, head_dim: int = HEAD_DIM) -> posenc.Attention:
    torch.manual_seed(0)
    attn = posenc.Attention(HEADS * head_dim, HEADS, name, head_dim=head_dim, causal=causal, max_len=MAX_LEN)
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return attn.to(device=CUDA, dtype=dtype)


def outputs_and_grads(attn, x, backend, **kw):
    attn.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    y = attn(xi, backend=backend, **kw)
    (y.float() * torch.linspace(-1, 1, x.shape[-1], device=x.device)).sum().backward()
    grads = [xi.grad] + [p.grad for p in attn.parameters() if p.grad is not None]
    return y.detach().float(), [g.float() for g in grads]


def assert_same(a, b, *, dtype, msg):
    n = attention_n(dim=DIM, head_dim=HEAD_DIM, length=L)
    ya, ga = a
    yb, gb = b
    mag = max(1.0, float(yb.abs().amax()))
    torch.testing.assert_close(ya, yb, **tolerance(dtype, n=n, magnitude=mag, stored=10), msg=f"{msg} output")
    assert len(ga) == len(gb), msg
    for g, h in zip(ga, gb):
        mag = max(1.0, float(h.abs().amax()))
        torch.testing.assert_close(g, h, **tolerance(dtype, n=2 * n + 2 * L, magnitude=mag, stored=10), msg=msg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", SCALAR, ids=mode_id)
def test_flex_equals_eager_on_cuda(mode, dtype):
    name, causal = mode
    attn = make_attn(name, causal, dtype)
    assert attn.resolve_backend("auto", "cuda") == "flex"
    x = torch.randn(2, L, DIM, device=CUDA, dtype=dtype)
    assert_same(outputs_and_grads(attn, x, "flex"), outputs_and_grads(attn, x, "eager"), dtype=dtype, msg=name)


@pytest.mark.parametrize("name", ["alibi", "t5", "fire"])
def test_heads_under_16_run_without_flex_on_cuda(name):
    """Inductor refuses FlexAttention for heads under 16 channels: auto runs another backend
    (equal to eager), and an explicit flex says so in one line."""
    attn = make_attn(name, True, head_dim=8)
    assert attn.resolve_backend("auto", "cuda") == "dense"
    x = torch.randn(2, L, HEADS * 8, device=CUDA)
    assert_same(outputs_and_grads(attn, x, "auto"), outputs_and_grads(attn, x, "eager"), dtype=torch.float32, msg=name)
    with pytest.raises(ValueError, match="backend 'flex' on CUDA needs heads of at least 16 channels"):
        attn(x, backend="flex")


@pytest.mark.parametrize("mode", encoding_modes(), ids=mode_id)
def test_every_backend_equals_eager_on_cuda(mode):
    name, causal = mode
    attn = make_attn(name, causal)
    x = torch.randn(2, L, DIM, device=CUDA)
    ref = outputs_and_grads(attn, x, "eager")
    for b in posenc.supported_backends(attn.encoding):
        if b != "eager":
            assert_same(outputs_and_grads(attn, x, b), ref, dtype=torch.float32, msg=f"{name}/{b}")


@pytest.mark.parametrize("name", [n for n, c in encoding_modes() if c])
def test_kv_cache_on_cuda_equals_full_forward(name):
    torch.manual_seed(0)
    lm = posenc.TransformerLM(32, DIM, 2, HEADS, encoding=name, max_len=MAX_LEN).to(CUDA).eval()
    toks = torch.randint(0, 32, (2, 20), device=CUDA)
    with torch.no_grad():
        full = lm(toks)
        cache = lm.init_cache(2, 20)
        steps = [lm(toks[:, :8], cache=cache)] + [lm(toks[:, t : t + 1], cache=cache) for t in range(8, 20)]
    n = 2 * (attention_n(dim=DIM, head_dim=HEAD_DIM, length=20) + 5 * DIM) + DIM
    torch.testing.assert_close(
        torch.cat(steps, 1), full, **tolerance(torch.float32, n=n, magnitude=max(1.0, float(full.abs().amax())))
    )


@pytest.mark.parametrize("kw", [{"window": 7}, {"chunk": 16}, {"window": 7, "sinks": True}, {"sinks": True}])
@pytest.mark.parametrize("name", ["alibi", "t5", "rope"])
def test_windows_chunks_sinks_on_every_backend_on_cuda(name, kw):
    """Window / chunk masks (FlexAttention block sparsity) and learned sinks, outputs and gradients."""
    torch.manual_seed(0)
    attn = posenc.Attention(DIM, HEADS, name, head_dim=HEAD_DIM, max_len=MAX_LEN, **kw)
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.2 * torch.randn_like(p))
    attn = attn.to(CUDA)
    x = torch.randn(2, L, DIM, device=CUDA)
    ref = outputs_and_grads(attn, x, "eager")
    for b in [*posenc.supported_backends(attn.encoding), "auto"]:
        if b != "eager":
            assert_same(outputs_and_grads(attn, x, b), ref, dtype=torch.float32, msg=f"{name}/{b}/{kw}")
