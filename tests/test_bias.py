"""``alibi``, ``kerple``, ``fire``: parity with Bloom, MPT, x-transformers and the papers'
code; the FlexAttention ``score_mod`` equals the dense ``bias``."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import assert_close, attention_n

import posenc

L = 12


def _causal_softmax(scores: torch.Tensor) -> torch.Tensor:
    n = scores.shape[-1]
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)


# --------------------------------------------------------------------------- ALiBi
@pytest.mark.parametrize("heads", [4, 6, 8, 12])
def test_alibi_equals_bloom_build_alibi_tensor(heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    torch.manual_seed(0)
    B = 2
    attention_mask = torch.ones(B, L, dtype=torch.long)
    attention_mask[1, :3] = 0  # left padding in the second sequence
    bloom = build_alibi_tensor(attention_mask, heads, torch.float32).view(B, heads, 1, L)  # slope·key position
    pos = ((attention_mask.cumsum(-1) - 1) * attention_mask).clamp(min=0)  # Bloom's own positions
    enc = posenc.build("alibi", heads=heads, head_dim=8)
    scores = torch.randn(B, heads, L, L)
    keep = attention_mask.bool()[:, None, None, :] & torch.ones(L, L, dtype=torch.bool).tril()
    ref = torch.softmax((scores + bloom).masked_fill(~keep, float("-inf")), -1)
    got = torch.softmax((scores + enc.bias(pos, pos)).masked_fill(~keep, float("-inf")), -1)
    valid = attention_mask.bool()[:, None, :, None]  # rows of padded queries are all -inf in Bloom too
    # one bias add, a softmax over L keys: n = L + 2 (slopes differ from Bloom's by an ulp)
    assert_close(got.masked_fill(~valid, 0), ref.masked_fill(~valid, 0), n=L + 2)


@pytest.mark.parametrize("heads", [4, 6, 16])
def test_alibi_equals_mpt_build_mpt_alibi_tensor(heads):
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    torch.manual_seed(0)
    mpt = build_mpt_alibi_tensor(heads, L)  # (H, 1, L): slope·(j - L + 1)
    enc = posenc.build("alibi", heads=heads, head_dim=8)
    scores = torch.randn(1, heads, L, L)
    pos = torch.arange(L)
    assert_close(_causal_softmax(scores + enc.bias(pos, pos)), _causal_softmax(scores + mpt), n=L + 2)


@pytest.mark.parametrize("heads,alibi_heads", [(8, 8), (8, 3), (6, 6), (12, 5)])
def test_alibi_equals_x_transformers(heads, alibi_heads):
    from x_transformers.x_transformers import AlibiPositionalBias

    ref = AlibiPositionalBias(heads=alibi_heads, total_heads=heads)(L, L)  # (H, L, L): -|j - i|·m, 0 past alibi_heads
    pos = torch.arange(L)
    sym = posenc.build("alibi", heads=heads, head_dim=8, causal=False, alibi_num_heads=alibi_heads)
    assert_close(sym.bias(pos, pos), ref.float(), n=2)  # slope·distance: one product, one rounding each
    causal = posenc.build("alibi", heads=heads, head_dim=8, alibi_num_heads=alibi_heads)
    lower = torch.ones(L, L, dtype=torch.bool).tril()
    assert_close(causal.bias(pos, pos)[:, lower], ref.float()[:, lower], n=2)
    assert torch.all(causal.slopes[alibi_heads:] == 0)


def test_alibi_options_are_checked():
    with pytest.raises(ValueError, match="alibi_num_heads must be an int in"):
        posenc.build("alibi", heads=4, head_dim=8, alibi_num_heads=5)
    assert posenc.build("alibi", heads=4, head_dim=8).to(torch.bfloat16).slopes.dtype == torch.float32


# --------------------------------------------------------------------------- Kerple
def _kerple_paper(kind: str, r1: torch.Tensor, r2: torch.Tensor, n: int) -> torch.Tensor:
    """Transcribed from the KERPLE repo (gpt-neox ParallelKerpleLog / kerple_power), causal."""
    diff = torch.tril(torch.arange(n).view(n, 1).repeat(1, n) + torch.arange(0, -n, -1)).float()  # i - j
    if kind == "log":  # bias_p = r1, bias_a = r2
        return -r1.view(-1, 1, 1) * torch.log(1 + r2.view(-1, 1, 1) * diff)
    return -r1.view(-1, 1, 1) * diff ** r2.view(-1, 1, 1)  # bias_a = r1, bias_p = r2


@pytest.mark.parametrize("kernel", ["log", "power"])
def test_kerple_equals_paper_formula(kernel):
    torch.manual_seed(0)
    enc = posenc.build("kerple", heads=4, head_dim=8, kernel=kernel)
    r1, r2 = enc.coefficients()
    pos = torch.arange(L)
    lower = torch.ones(L, L, dtype=torch.bool).tril()
    ref = _kerple_paper(kernel, r1.detach(), r2.detach(), L)
    assert_close(enc.bias(pos, pos)[:, lower], ref[:, lower], n=4)  # -r1·log(1 + r2·d) or -r1·d^r2: 4 ops
    sym = posenc.build("kerple", heads=4, head_dim=8, kernel=kernel, causal=False)
    sym.load_state_dict(enc.state_dict())
    b = sym.bias(pos, pos)
    assert torch.equal(b, b.transpose(-1, -2))  # bidirectional: a kernel of |i - j|


@pytest.mark.parametrize("kernel", ["log", "power"])
def test_kerple_parameters_stay_positive_and_gradients_are_finite(kernel):
    enc = posenc.build("kerple", heads=3, head_dim=8, kernel=kernel)
    with torch.no_grad():
        enc.r1_raw.fill_(-30.0)
        enc.r2_raw.copy_(torch.tensor([-30.0, 0.0, 30.0]))
    r1, r2 = enc.coefficients()
    assert torch.all(r1 > 0) and torch.all(r2 > 0)
    if kernel == "power":
        assert torch.all(r2 <= 2)
    pos = torch.arange(L)
    enc.bias(pos, pos).sum().backward()
    assert torch.isfinite(enc.r1_raw.grad).all() and torch.isfinite(enc.r2_raw.grad).all()
    with pytest.raises(ValueError, match="kernel must be"):
        posenc.build("kerple", heads=2, head_dim=8, kernel="gauss")


# --------------------------------------------------------------------------- FIRE
class _PaperFIRE(torch.nn.Module):
    """The PyTorch listing of Li et al. 2023 (appendix), unchanged but for the arguments."""

    def __init__(self, num_heads=12, mlp_width=32, init_c=0.1, init_L=512.0, eps=1e-6):
        super().__init__()
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(1, mlp_width), torch.nn.ReLU(), torch.nn.Linear(mlp_width, num_heads)
        )
        self.c = torch.nn.Parameter(torch.tensor(init_c))
        self.init_L = torch.nn.Parameter(torch.tensor(init_L), requires_grad=False)
        self.L_multiplier = torch.nn.Parameter(torch.tensor(1.0))
        self.eps = eps

    def forward(self, x):
        seq_length = x.size(1)
        positions = torch.arange(seq_length, dtype=torch.float, device=x.device)
        rel_distance = positions[:, None] - positions[None, :]
        threshold = torch.abs(self.L_multiplier * self.init_L)
        pos_normalizer = torch.max(positions, threshold)
        pos_normalizer = pos_normalizer[:, None]
        rel_distance = torch.log(torch.abs(self.c * rel_distance) + 1)
        pos_normalizer = torch.log(torch.abs(self.c * pos_normalizer) + 1) + self.eps
        normalized_distance = rel_distance / pos_normalizer
        fire_bias = self.mlp(normalized_distance.unsqueeze(-1))
        return fire_bias.unsqueeze(0).permute(0, 3, 1, 2)


@pytest.mark.parametrize("causal", [True, False])
def test_fire_equals_paper_listing(causal):
    torch.manual_seed(0)
    n = 24
    enc = posenc.build("fire", heads=4, head_dim=8, causal=causal, init_L=8.0)  # n > L_thr: interpolation active
    paper = _PaperFIRE(num_heads=4, init_L=8.0)
    with torch.no_grad():
        paper.mlp.load_state_dict(enc.mlp.state_dict())
        paper.c.fill_(0.37)
        enc.c.fill_(0.37)
        paper.L_multiplier.fill_(1.3)
        enc.L_multiplier.fill_(1.3)
    pos = torch.arange(n)
    ref = paper(torch.zeros(1, n, 1))[0]
    got = enc.bias(pos, pos)
    assert_close(got, ref, n=paper.mlp[0].out_features + 8)  # MLP of width 32 + ψ's 8 ops
    # gradients of every parameter (the MLP's, c, the threshold multiplier) equal the listing's
    w = torch.randn_like(ref)
    (got * w).sum().backward()
    (ref * w).sum().backward()
    assert enc.c.grad.abs() > 0 and enc.L_multiplier.grad.abs() > 0
    mine = dict(enc.named_parameters())
    for name, p in paper.named_parameters():
        if p.grad is None:
            continue
        # each gradient sums n² pairs' contributions, each through the width-32 MLP and ψ
        assert_close(mine[name].grad, p.grad, n=n * n + 40, magnitude=float(w.abs().sum()) / n, msg=name)


def test_relu_mlp_1d_is_the_mlp():
    """The piecewise evaluation against the plain MLP in float64, values and gradients, with
    the corner cases of its pieces: a unit with w1 = 0 (on or off everywhere), two units with
    the same kink, inputs on both sides of every kink and beyond the outermost ones."""
    from posenc.encodings.fire import relu_mlp_1d

    torch.manual_seed(0)
    W, H = 12, 3
    w1, b1 = torch.randn(W, dtype=torch.float64), torch.randn(W, dtype=torch.float64)
    w1[0], b1[0] = 0.0, 0.7  # constant, on
    w1[1], b1[1] = 0.0, -0.2  # constant, off
    w1[3], b1[3] = 2 * w1[2], 2 * b1[2]  # the same kink as unit 2
    w2, b2 = torch.randn(H, W, dtype=torch.float64), torch.randn(H, dtype=torch.float64)
    kinks = (-b1 / w1)[w1 != 0]
    u = torch.cat([torch.linspace(-4, 4, 57, dtype=torch.float64), kinks + 1e-3, kinks - 1e-3]).view(7, 11)
    leaves = [t.clone().requires_grad_() for t in (u, w1, b1, w2, b2)]
    got = relu_mlp_1d(*leaves)
    ref_leaves = [t.clone().requires_grad_() for t in (u, w1, b1, w2, b2)]
    uu, a1, c1, a2, c2 = ref_leaves
    ref = torch.relu(uu.unsqueeze(-1) * a1 + c1) @ a2.t() + c2
    assert got.shape == ref.shape == (*u.shape, H)
    assert_close(got, ref, n=2 * W, dtype=torch.float64)
    g = torch.randn_like(ref)
    for a, b, name in zip(
        torch.autograd.grad(got, leaves, g), torch.autograd.grad(ref, ref_leaves, g), ["u", "w1", "b1", "w2", "b2"]
    ):
        assert_close(a, b, n=u.numel() * 2 * W, dtype=torch.float64, msg=name)
    assert torch.autograd.gradcheck(lambda x: relu_mlp_1d(x, w1, b1, w2, b2), (u.clone().requires_grad_(),))


def test_fire_depends_on_query_position_past_threshold():
    enc = posenc.build("fire", heads=2, head_dim=8, init_L=4.0)
    assert enc.relative is False
    b = enc.bias(torch.arange(20), torch.arange(20))  # (H, L, L)
    assert not torch.allclose(b[:, 10, 5], b[:, 15, 10])  # same distance 5, different normaliser
    assert_close(b[:, 2, 0], b[:, 3, 1], n=enc.mlp_width + 8)  # below L_thr: a function of i - j only


# --------------------------------------------------------------------------- score_mod == dense
CASES = [
    ("alibi", {}),
    ("alibi", {"alibi_num_heads": 3}),
    ("kerple", {"kernel": "log"}),
    ("kerple", {"kernel": "power"}),
    ("fire", {"init_L": 6.0, "mlp_width": 8}),
]


def _randomise(enc):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))


def _positions():
    return torch.stack((torch.arange(10), torch.arange(5, 15)))  # (B=2, L): per-sequence offsets


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name,opts", CASES, ids=[f"{n}-{o}" for n, o in CASES])
def test_score_mod_materialised_equals_dense_bias_with_gradients(name, opts, causal):
    """Every (b, h, i, j) through the closure equals ``bias``, and so do the parameter gradients."""
    enc = posenc.build(name, heads=4, head_dim=8, causal=causal, **opts)
    assert enc.defines("score_mod")
    _randomise(enc)
    pos = _positions()
    B, n = pos.shape
    mod = enc.score_mod(pos, pos)
    b, h = torch.arange(B).view(-1, 1, 1, 1), torch.arange(4).view(1, -1, 1, 1)
    i, j = torch.arange(n).view(1, 1, -1, 1), torch.arange(n).view(1, 1, 1, -1)
    via_mod = mod(torch.zeros(B, 4, n, n), b, h, i, j)
    dense = enc.bias(pos, pos)
    n_ops = getattr(enc, "mlp_width", 0) + 8  # FIRE's MLP, else a few elementwise ops
    assert_close(via_mod, dense, n=n_ops)
    w = torch.randn(B, 4, n, n)
    params = [p for p in enc.parameters() if p.requires_grad]
    if params:
        g_mod = torch.autograd.grad((via_mod * w).sum(), params)
        g_dense = torch.autograd.grad((enc.bias(pos, pos) * w).sum(), params)
        for a, c in zip(g_mod, g_dense, strict=True):
            assert_close(a, c, n=2 * n_ops + B * n * n)  # backward: the chain again, summed over B·n² entries


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name,opts", CASES, ids=[f"{n}-{o}" for n, o in CASES])
def test_flex_attention_equals_dense(name, opts, causal):
    """FlexAttention with the score_mod (eager, CPU forward) equals dense-bias SDPA."""
    torch.manual_seed(0)
    attn = posenc.Attention(32, 4, name, causal=causal, **opts)
    _randomise(attn.encoding)
    x = torch.randn(2, 10, 32)
    pos = _positions()
    with torch.no_grad():
        flex = attn(x, pos, backend="flex")
        dense = attn(x, pos, backend="dense")
    assert_close(flex, dense, n=attention_n(dim=32, head_dim=8, length=10) + 40)


def test_fire_default_threshold_is_the_papers_512():
    """Code, docstring and docs/rotary.md agree with the paper's listing: ``init_L = 512``."""
    for max_len in (None, 128, 8192):
        enc = posenc.build("fire", heads=2, head_dim=8, max_len=max_len)
        assert float(enc.init_L) == 512.0 and float(enc.L_multiplier.detach()) == 1.0
    assert float(_PaperFIRE().init_L) == 512.0
