"""Score-scale override and tanh logit soft-capping (``PositionEncoding.set_scores``).

Parity: posenc's attend against HF Gemma 2's own ``eager_attention_forward`` (the code that
defines the cap), every backend that can run a capped encoding against the eager oracle,
and the scale override against the formula each encoding documents.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from tests.conftest import assert_close
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager

import posenc
from posenc import AttentionMask
from posenc.attend.backends import attend

B, H, L, DH = 2, 4, 8, 8
N = DH + 2 * L  # q·k over Dh, softmax and attn @ v over Lk


def _qkv(seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return tuple(scale * torch.randn(B, H, L, DH, generator=g) for _ in range(3))


def _enc(name, causal=True, **scores):
    enc = posenc.build(name, heads=H, head_dim=DH, max_len=16, causal=causal)
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return enc.set_scores(**scores)


def _pos():
    return torch.arange(L).view(1, L), torch.arange(L).view(1, L)


@pytest.mark.parametrize(
    ("backend", "causal"),
    [("eager", True), ("eager", False), ("chunked", True), ("chunked", False), ("flex", True)],
    ids=["eager-causal", "eager-bidir", "chunked-causal", "chunked-bidir", "flex-causal"],
)  # (FlexAttention off CUDA traces its score_mod at every call: seconds each, so one flex case)
def test_softcap_equals_gemma2_eager_attention(backend, causal):
    """NoPE (no position term): posenc's capped attention is Gemma 2's eager attention."""
    q, k, v = _qkv()
    enc = _enc("nope", causal=causal, scale=0.25, softcap=5.0)
    qp, kp = _pos()
    out = attend(enc, q, k, v, qp, kp, AttentionMask(causal=causal), backend=backend)
    module = types.SimpleNamespace(head_dim=DH, num_key_value_groups=1, training=False)
    add = torch.zeros(L, L)
    if causal:
        add = add.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    ref, _ = gemma2_eager(module, q, k, v, add.view(1, 1, L, L), scaling=0.25, softcap=5.0)
    assert_close(out, ref.transpose(1, 2), n=N)
    # the cap changes the result here: large scores (|q|, |k| ~ 3) are squashed
    uncapped, _ = gemma2_eager(module, q, k, v, add.view(1, 1, L, L), scaling=0.25, softcap=None)
    assert (uncapped - ref).abs().max() > 1e-2


@pytest.mark.parametrize("backend", ["eager", "chunked"])
def test_softcap_gradients_equal_gemma2_eager_attention(backend):
    """Backward through the cap (Gemma 2 trains with it): q, k, v gradients equal HF's."""
    q, k, v = (t.requires_grad_() for t in _qkv(seed=1))
    enc = _enc("nope", scale=0.25, softcap=5.0)
    qp, kp = _pos()
    out = attend(enc, q, k, v, qp, kp, AttentionMask(causal=True), backend=backend)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    module = types.SimpleNamespace(head_dim=DH, num_key_value_groups=1, training=False)
    add = torch.zeros(L, L).masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    ref, _ = gemma2_eager(module, q2, k2, v2, add.view(1, 1, L, L), scaling=0.25, softcap=5.0)
    ref_grads = torch.autograd.grad(ref.transpose(1, 2).square().sum(), (q2, k2, v2))
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, n=2 * N)


@pytest.mark.parametrize("name", ["rope", "alibi", "t5", "nope", "cope", "shaw", "fire"])
@torch.no_grad()  # FlexAttention off CUDA: forward only
def test_softcap_every_supporting_backend_equals_eager(name):
    enc = _enc(name, softcap=2.0)
    q, k, v = _qkv(1)
    qp, kp = _pos()
    mask = AttentionMask(causal=True)
    q, k = enc.rotate(q, k, qp, kp)
    ref = attend(enc, q, k, v, qp, kp, mask, backend="eager")
    backends = posenc.supported_backends(enc)
    assert not {"sdpa", "dense", "blockwise"} & set(backends)
    for b in backends:
        if b == "flex" and name not in ("rope", "alibi"):  # (one pure rotary, one bias: flex is slow off CUDA)
            continue
        assert_close(attend(enc, q, k, v, qp, kp, mask, backend=b), ref, n=N, msg=b)
    # the scores are the transcription c·tanh(s/c) of the uncapped sum
    s = posenc.scores(enc, q, k, qp, kp)
    raw = posenc.scores(_copy_uncapped(enc), q, k, qp, kp)
    assert_close(s, 2.0 * torch.tanh(raw / 2.0), n=N)
    assert float(s.abs().max()) <= 2.0
    parts = posenc.scores(enc, q, k, qp, kp, parts=True)
    assert "softcap" in parts
    assert_close(sum(parts.values()), s, n=N)


def _copy_uncapped(enc):
    import copy

    out = copy.deepcopy(enc)
    return out.set_scores(scale=enc.score_scale, softcap=None)


def test_softcap_with_sinks_caps_scores_not_sink_logits():
    enc = _enc("alibi", softcap=1.5)
    q, k, v = _qkv(2)
    qp, kp = _pos()
    sinks = torch.tensor([4.0, -1.0, 0.5, 3.0])
    mask = AttentionMask(causal=True)
    ref = attend(enc, q, k, v, qp, kp, mask, backend="eager", sinks=sinks)
    for b in ("flex", "chunked"):
        assert_close(attend(enc, q, k, v, qp, kp, mask, backend=b, sinks=sinks), ref, n=N, msg=b)
    # a sink logit of 4 above a cap of 1.5 keeps most of the mass on the sink for head 0
    s = posenc.scores(enc, q, k, qp, kp)
    p = torch.softmax(torch.cat((s, sinks.view(1, H, 1, 1).expand(B, H, L, 1)), -1), -1)
    assert float(p[:, 0, :, -1].min()) > 0.5


def test_softcap_drops_backends_that_cannot_express_it():
    rope = _enc("rope")
    assert "sdpa" in posenc.supported_backends(rope)
    rope.set_scores(softcap=30.0)
    assert posenc.supported_backends(rope) == ["flex", "chunked", "eager"]
    assert posenc.select_backend(rope, "cpu") == "chunked"
    assert posenc.select_backend(rope, "cuda") == ("flex" if rope.head_dim >= 16 else "chunked")
    wide = posenc.build("rope", heads=2, head_dim=16)
    wide.set_scores(softcap=30.0)
    assert posenc.select_backend(wide, "cuda") == "flex"  # FlexAttention's kernel: heads of 16+ channels
    assert posenc.supported_backends(_enc("cope", softcap=3.0)) == ["chunked", "eager"]
    q, k, v = _qkv()
    qp, kp = _pos()
    with pytest.raises(ValueError, match="backend 'sdpa' cannot run encoding 'rope'"):
        attend(rope, q, k, v, qp, kp, AttentionMask(), backend="sdpa")
    rope.set_scores()  # both off again
    assert "sdpa" in posenc.supported_backends(rope) and rope.softcap is None and rope.score_scale is None


@pytest.mark.parametrize(
    ("name", "factor"),
    [("rope", 1.0), ("deberta", 3**-0.5), ("tupe", 2**-0.5), ("t5", 1.0), ("inkling", DH**-0.5)],
)
def test_score_scale_replaces_the_dh_factor(name, factor):
    """Each encoding's documented scale with ``Dh^-1/2`` replaced by the override."""
    enc = _enc(name)
    default = enc.scale
    enc.set_scores(scale=0.125)
    assert enc.scale == pytest.approx(0.125 * factor, rel=1e-12)
    if name != "t5":
        assert default == pytest.approx(DH**-0.5 * factor, rel=1e-12)


def test_score_scale_equals_gemma2_eager_with_query_pre_attn_scalar():
    """Gemma 3's query_pre_attn_scalar: scaling = qpas**-0.5 on every plain backend."""
    q, k, v = _qkv(3, scale=1.0)
    enc = _enc("nope", scale=256**-0.5)
    qp, kp = _pos()
    module = types.SimpleNamespace(head_dim=DH, num_key_value_groups=1, training=False)
    causal = torch.zeros(L, L).masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    ref, _ = gemma2_eager(module, q, k, v, causal.view(1, 1, L, L), scaling=256**-0.5)
    for b in posenc.supported_backends(enc):
        out = attend(enc, q, k, v, qp, kp, AttentionMask(causal=True), backend=b)
        assert_close(out, ref.transpose(1, 2), n=N, msg=b)


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, -math.inf])
def test_set_scores_rejects_non_positive_or_non_finite(bad):
    enc = _enc("rope")
    with pytest.raises(ValueError, match=r"softcap must be a positive finite number or None, got"):
        enc.set_scores(softcap=bad)
    with pytest.raises(ValueError, match=r"scale must be a positive finite number or None, got"):
        enc.set_scores(scale=bad)


@pytest.mark.parametrize("bad", ["30", True, torch.tensor(2.0)])
def test_set_scores_rejects_non_numbers(bad):
    with pytest.raises(TypeError, match=r"softcap must be a positive finite number or None"):
        _enc("rope").set_scores(softcap=bad)
