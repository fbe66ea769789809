"""TUPE (``tupe``): against the paper's formula written out (no installable reference exists).

Ke et al. 2021 (ICLR version), eq. (7)-(11): for head h,

    α_ij = (x_i W_Q)(x_j W_K)ᵀ/√(2d) + reset_θ(v_ij, i, j)
    v_ij = (p_i U_Q)(p_j U_K)ᵀ/√(2d) [+ b_{j-i}]                  (TUPE-A [TUPE-R])
    reset_θ(v, i, j) = v if i ≠ [CLS] and j ≠ [CLS];  θ₁ if i = [CLS];  θ₂ if i ≠ [CLS], j = [CLS]

with ``p = LayerNorm(P)``. Eq. (11) (TUPE-R) applies ``reset_θ`` to the sum, so it replaces
the whole positional term v_ij, the relative bias b_{j-i} included (the official code gives
[CLS] pairs buckets of their own).
"""

from __future__ import annotations

import math

import pytest
import torch
from tests.conftest import assert_close, attention_n

import posenc
from posenc import functional as PF

H, DH = 2, 4
D = H * DH


def _formula(attn, x, pos, causal):
    """Every term of eq. (7)-(11) looped over (h, i, j); then softmax, values, output."""
    enc = attn.encoding
    B, L, _ = x.shape
    q = attn.q_proj(x).view(B, L, H, DH)
    k = attn.k_proj(x).view(B, L, H, DH)
    v = attn.v_proj(x).view(B, L, H, DH)
    p = enc.pos_ln(enc.pos_emb(pos))  # (L, D)
    pq = enc.pos_q(p).view(L, H, DH)
    pk = enc.pos_k(p).view(L, H, DH)
    s = torch.empty(B, H, L, L)
    for h in range(H):
        for i in range(L):
            for j in range(L):
                content = (q[:, i, h] * k[:, j, h]).sum(-1) / math.sqrt(2 * DH)
                v_ij = (pq[i, h] * pk[j, h]).sum() / math.sqrt(2 * DH)
                if enc.relative_bias:
                    bucket = PF.t5_relative_position_bucket(
                        torch.tensor(int(pos[j] - pos[i])),
                        bidirectional=not causal,
                        num_buckets=enc.num_buckets,
                        max_distance=enc.max_distance,
                    )
                    v_ij = v_ij + enc.relative_attention_bias.weight[bucket, h]
                if enc.untie_cls and pos[i] == 0:  # reset_θ: the whole positional term
                    v_ij = enc.cls_to_others[h]
                elif enc.untie_cls and pos[j] == 0:
                    v_ij = enc.others_to_cls[h]
                s[:, h, i, j] = content + v_ij
                if causal and j > i:
                    s[:, h, i, j] = float("-inf")
    o = torch.softmax(s, -1) @ v.transpose(1, 2)  # (B, H, L, Dh)
    return attn.o_proj(o.transpose(1, 2).reshape(B, L, D))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "opts", [{}, {"untie_cls": True}, {"relative_bias": True}, {"relative_bias": True, "untie_cls": True}]
)
def test_formula(opts, causal):
    torch.manual_seed(0)
    attn = posenc.Attention(D, H, "tupe", causal=causal, max_len=16, num_buckets=8, max_distance=10, **opts)
    enc = attn.encoding
    with torch.no_grad():
        for prm in enc.parameters():  # non-trivial LayerNorm, biases and [CLS] scalars
            torch.nn.init.normal_(prm)
    x = torch.randn(2, 12, D)
    pos = torch.arange(12)
    with torch.no_grad():
        ref = _formula(attn, x, pos, causal)
        for backend in ("dense", "chunked", "eager"):
            # + the positional dot product (LayerNorm over D, U_Q/U_K over D, a Dh-long product)
            assert_close(attn(x, backend=backend), ref, n=attention_n(dim=D, head_dim=DH, length=12) + 3 * D + DH)


def test_untie_cls_only_touches_position_zero():
    torch.manual_seed(1)
    enc = posenc.build("tupe", heads=H, head_dim=DH, max_len=10, causal=False, untie_cls=True)
    with torch.no_grad():
        enc.cls_to_others.copy_(torch.tensor([1.5, -2.0]))
        enc.others_to_cls.copy_(torch.tensor([0.25, 3.0]))
    b = enc.bias(torch.arange(6), torch.arange(6))
    assert torch.equal(b[:, 0, :], torch.tensor([[1.5] * 6, [-2.0] * 6]))
    assert torch.equal(b[:, 1:, 0], torch.tensor([[0.25] * 5, [3.0] * 5]))
    plain = posenc.build("tupe", heads=H, head_dim=DH, max_len=10, causal=False)
    plain.load_state_dict({k: v for k, v in enc.state_dict().items() if "cls" not in k})
    assert torch.equal(b[:, 1:, 1:], plain.bias(torch.arange(6), torch.arange(6))[:, 1:, 1:])  # same computation


def test_untie_cls_resets_the_relative_bias_too():
    """With TUPE-R, the [CLS] row and column do not vary with distance (eq. 9)."""
    torch.manual_seed(3)
    enc = posenc.build(
        "tupe", heads=H, head_dim=DH, max_len=16, causal=False, relative_bias=True, untie_cls=True, num_buckets=8
    )
    with torch.no_grad():
        torch.nn.init.normal_(enc.relative_attention_bias.weight)
    b = enc.bias(torch.arange(12), torch.arange(12))  # (H, L, L)
    assert torch.equal(b[:, 0, :], enc.cls_to_others.detach().view(H, 1).expand(H, 12))
    assert torch.equal(b[:, 1:, 0], enc.others_to_cls.detach().view(H, 1).expand(H, 11))


def test_shared_across_layers_untied_from_input():
    lm = posenc.TransformerLM(20, D, 3, H, "tupe", max_len=16)
    assert len(lm.encodings) == 1 and lm.input_encoding is None  # positions never enter the token stream
    x = torch.randn(1, 5, D)
    assert torch.equal(lm.encodings[0].embed(x, torch.arange(5)), x)


def test_absolute_not_shift_invariant_and_max_len():
    torch.manual_seed(2)
    enc = posenc.build("tupe", heads=H, head_dim=DH, max_len=16)
    assert not enc.relative and not enc.extrapolates
    assert enc.scale == pytest.approx((2 * DH) ** -0.5)
    assert not torch.allclose(
        enc.bias(torch.arange(5), torch.arange(5)), enc.bias(torch.arange(5) + 3, torch.arange(5) + 3)
    )
    with pytest.raises(ValueError, match="max_len=16"):  # checked at the door, once per call
        enc.check_length(torch.arange(17))
    with pytest.raises(ValueError, match="max_len"):
        posenc.build("tupe", heads=H, head_dim=DH)
    with pytest.raises(ValueError, match="max_distance"):
        posenc.build("tupe", heads=H, head_dim=DH, max_len=8, relative_bias=True, num_buckets=32, max_distance=4)
