"""The contract suite over grouped k/v: every registered encoding with ``kv_heads < heads``.

``kv_heads = H`` is the rest of the contract suite (tests/test_contract.py). Here, with
``H = 4`` and ``kv_heads`` in ``{2, 1}`` (grouped- and multi-query):

* a grouped layer equals the ``H``-head layer whose k/v projections repeat each group's
  rows (HF's ``repeat_kv``), so every encoding's key side (``read_input``, ``rotate``,
  ``rotate_value``) handles fewer key heads, or declares ``per_head_keys``;
* cached decoding (token by token and chunked prefill) equals the full forward, and the
  cache holds ``kv_heads`` keys (``H`` for an encoding with ``per_head_keys``);
* every backend the encoding supports equals eager (outputs and gradients), at ``H/2``
  (``flex``, seconds a case on CPU, in the slow suite).
"""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_close, attention_n, encoding_modes, lm_n, mode_id

import posenc

DIM, H, DH, MAX_LEN, L = 16, 4, 4, 16, 8
MODES = encoding_modes()
CAUSAL = [n for n, c in MODES if c]
N_ATTN = attention_n(dim=DIM, head_dim=DH, length=L)
N_GRAD = attention_n(dim=DIM, head_dim=DH, length=L, grad=True)
# Inkling's short convolutions hold per-head channels: the one per_head_keys encoding
EXTRA = {"inkling": {"sconv_kernel": 3}}


def _attn(name, causal, kv_heads, seed=0, **kw):
    torch.manual_seed(seed)
    opts = {**EXTRA.get(name, {}), **kw}
    attn = posenc.Attention(DIM, H, name, head_dim=DH, causal=causal, max_len=MAX_LEN, kv_heads=kv_heads, **opts)
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return attn


def _x(B=2, seed=1):
    return torch.randn(B, L, DIM, generator=torch.Generator().manual_seed(seed))


def _tied_full_heads(attn: posenc.Attention) -> posenc.Attention:
    """The ``H``-head layer that repeats each k/v group's projection rows (HF's repeat_kv)."""
    ref = _attn(attn.encoding.name, attn.causal, None, seed=1)
    g = H // attn.kv_heads
    with torch.no_grad():
        for name in ("q_proj", "o_proj"):
            getattr(ref, name).load_state_dict(getattr(attn, name).state_dict())
        for name in ("k_proj", "v_proj"):
            w = getattr(attn, name).weight.view(attn.kv_heads, DH, DIM)
            getattr(ref, name).weight.copy_(w.repeat_interleave(g, 0).reshape(H * DH, DIM))
        ref.encoding.load_state_dict(attn.encoding.state_dict())
    return ref


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv2", "kv1"])
@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_grouped_kv_equals_full_heads_with_repeated_kv_projections(mode, kv_heads):
    name, causal = mode
    attn = _attn(name, causal, kv_heads)
    assert attn.k_proj.weight.shape == (kv_heads * DH, DIM)
    ref = _tied_full_heads(attn)
    x, pos = _x(), torch.stack([torch.arange(L), torch.arange(L) + 3])
    with torch.no_grad():
        assert_close(attn(x, pos=pos), ref(x, pos=pos), n=N_ATTN, msg=f"{name} kv_heads={kv_heads}")


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv2", "kv1"])
@pytest.mark.parametrize("name", CAUSAL)
def test_grouped_kv_cache_decoding_equals_full_forward(name, kv_heads):
    torch.manual_seed(0)
    lm = posenc.TransformerLM(32, DIM, 1, H, name, MAX_LEN, kv_heads=kv_heads, **EXTRA.get(name, {}))
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(0.2 * torch.randn_like(p))
    lm.eval()
    attn = lm.blocks[0].attn
    t = torch.randint(0, 32, (2, 10))
    n = lm_n(dim=DIM, depth=1, length=10)
    with torch.no_grad():
        full = lm(t)
        cache = lm.init_cache(batch_size=2, max_len=12)
        # a prefill, a chunk, then token by token
        parts = [lm(t[:, :4], cache=cache), lm(t[:, 4:7], cache=cache)]
        parts += [lm(t[:, i : i + 1], cache=cache) for i in range(7, 10)]
        assert_close(torch.cat(parts, dim=1), full, n=n, msg=f"{name}: cached decoding")
    expected = H if attn.encoding.per_head_keys else kv_heads
    assert attn.key_heads == expected and cache.layers[0].k.shape[1] == expected


BACKEND_CASES = [
    pytest.param(n, c, b, marks=[pytest.mark.slow] if b == "flex" else [])  # (CPU FlexAttention: seconds each)
    for n, c in MODES
    for b in posenc.supported_backends(
        posenc.build(n, heads=H, head_dim=DH, max_len=MAX_LEN, causal=c, **EXTRA.get(n, {}))
    )
    if b != "eager"
]


@pytest.mark.parametrize("name,causal,backend", BACKEND_CASES, ids=lambda v: str(v))
def test_grouped_kv_backend_equals_eager(name, causal, backend):
    attn = _attn(name, causal, 2, chunk_size=3)
    pos = torch.stack([torch.arange(L), torch.arange(L) + 3])
    with_grad = backend != "flex"  # FlexAttention has no CPU backward
    outs, grads = {}, {}
    for b in ("eager", backend):
        attn.zero_grad()
        xi = _x().requires_grad_(with_grad)
        with torch.set_grad_enabled(with_grad):
            y = attn(xi, pos=pos, backend=b)
        outs[b] = y.detach()
        if with_grad:
            (y * torch.linspace(-1, 1, DIM)).sum().backward()
            grads[b] = [xi.grad] + [p.grad.clone() for p in attn.parameters()]
    assert_close(outs[backend], outs["eager"], n=N_ATTN, msg=f"{name}/{backend} output")
    for g, ge in zip(grads.get(backend, []), grads.get("eager", []), strict=True):
        assert_close(g, ge, n=N_GRAD, msg=f"{name}/{backend} gradient")


def test_per_head_keys_cache_holds_full_heads_and_plain_ones_kv_heads():
    conv = _attn("inkling", True, 1)
    plain = _attn("inkling", True, 1, sconv_kernel=0)
    assert conv.encoding.per_head_keys and not plain.encoding.per_head_keys
    assert conv.init_cache(1, 4).k.shape[1] == H and plain.init_cache(1, 4).k.shape[1] == 1
