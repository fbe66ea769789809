"""Attention-probability dropout (``Attention(attn_dropout=)``, ``ModelConfig.attn_dropout``,
``posenc.attend.backends.attend(dropout=)``): off in eval on every backend, on in training, unbiased,
the same mask through a recomputed backward, transcriptions of HF's eager attention and of
SDPA's own dropout; ``flex`` (FlexAttention has none) refuses it and ``"auto"`` avoids it; HF
models keep their ``attention_dropout`` (GPT-2's ``attn_pdrop``) and match stock HF in training.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from tests.conftest import DIM, HEAD_DIM, HEADS, assert_close, attention_n
from tests.test_contract import ALL_BACKEND_CASES, L, _x, make_attn

import posenc
from posenc.attend.backends import attend, select_backend

P = 0.5
N = attention_n(dim=DIM, head_dim=HEAD_DIM, length=L)
CASES = [c for c in ALL_BACKEND_CASES if c[2] != "flex"]


@pytest.mark.parametrize("name,causal,backend", CASES, ids=lambda v: str(v))
def test_off_in_eval_on_in_training(name, causal, backend):
    """Every encoding on every backend that runs dropout: eval equals the layer without
    dropout bit for bit; training drops probabilities (another output, finite, and different
    draws differ), and the gradients reach every parameter."""
    plain = make_attn(name, causal)
    attn = make_attn(name, causal, attn_dropout=P)
    attn.load_state_dict(plain.state_dict())
    x, pos = _x(), torch.stack([torch.arange(L), torch.arange(L) + 3])
    want = plain.eval()(x, pos=pos, backend=backend)
    assert torch.equal(attn.eval()(x, pos=pos, backend=backend), want)
    attn.train()
    torch.manual_seed(0)
    a = attn(x, pos=pos, backend=backend)
    b = attn(x, pos=pos, backend=backend)
    assert torch.isfinite(a).all() and not torch.equal(a, want) and not torch.equal(a, b)
    torch.manual_seed(0)
    assert torch.equal(attn(x, pos=pos, backend=backend), a)  # the same seed, the same mask
    a.square().sum().backward()
    assert all(p.grad is not None for p in attn.parameters())


@pytest.mark.parametrize("name,backend", [("nope", "sdpa"), ("alibi", "dense"), ("t5", "dense"),
                                          ("shaw", "chunked"), ("xl", "blockwise"), ("rope", "eager")])  # fmt: skip
def test_unbiased(name, backend):
    """Dropout rescales what it keeps by 1 / (1 - p): the mean output over many draws is the
    eval output (the layer is linear in the probabilities). 2 000 draws at p = 0.5: the mean's
    standard error is about 2 % of the spread of one draw; bound 6 standard errors."""
    attn = make_attn(name, True, attn_dropout=P)
    x = _x(B=1)
    with torch.no_grad():
        want = attn.eval()(x, backend=backend)
        attn.train()
        torch.manual_seed(0)
        draws = torch.stack([attn(x, backend=backend) for _ in range(2000)])
    err = draws.std(0) / 2000**0.5
    assert ((draws.mean(0) - want).abs() <= 6 * err + 1e-6).all()


def test_eager_transcribes_hf_eager_attention():
    """HF's ``eager_attention_forward``, written out: ``softmax(q kᵀ · scale + mask)``, then
    ``F.dropout(p, training=True)``, then ``@ v``. Under the same seed posenc's ``eager`` and
    ``chunked`` backends draw the same mask, so the outputs agree element-wise."""
    attn = make_attn("nope", True, attn_dropout=P).train()
    x = _x(B=2)
    B = x.shape[0]
    q = attn.q_proj(x).view(B, L, HEADS, HEAD_DIM).transpose(1, 2)
    k = attn.k_proj(x).view(B, L, HEADS, HEAD_DIM).transpose(1, 2)
    v = attn.v_proj(x).view(B, L, HEADS, HEAD_DIM).transpose(1, 2)
    s = q @ k.transpose(-1, -2) * HEAD_DIM**-0.5
    s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    torch.manual_seed(7)
    w = F.dropout(torch.softmax(s, dim=-1), P, training=True)
    want = attn.o_proj((w @ v).transpose(1, 2).reshape(B, L, DIM))
    for backend in ("eager", "chunked"):
        torch.manual_seed(7)
        assert_close(attn(x, backend=backend), want, n=N, msg=backend)


def test_sdpa_draws_sdpa_own_mask():
    """``sdpa`` and ``dense`` hand ``dropout_p`` to ``F.scaled_dot_product_attention``: the same
    call with the same seed gives the same output."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, HEADS, L, HEAD_DIM, generator=g) for _ in range(3))
    pos = torch.arange(L)[None]
    mask = posenc.AttentionMask(causal=True)
    torch.manual_seed(5)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=P)
    torch.manual_seed(5)
    got = attend(posenc.build("nope", heads=HEADS, head_dim=HEAD_DIM), q, k, v, pos, pos, mask, dropout=P)
    assert torch.equal(got, want)


def test_recomputed_backward_keeps_the_mask():
    """``chunked``/``dense`` recompute their blocks in backward above a saved-score budget
    (``torch.utils.checkpoint``, which restores the RNG): the gradients equal those of the
    run that kept its scores, under the same seed."""
    out = {}
    for name, backend in (("shaw", "chunked"), ("t5", "dense")):
        for budget in (0, 2**40):
            attn = make_attn(name, True, attn_dropout=P, chunk_size=3).train()
            attn.checkpoint_bytes = budget
            x = _x().requires_grad_(True)
            torch.manual_seed(11)
            y = attn(x, backend=backend)
            (y * torch.linspace(-1, 1, DIM)).sum().backward()
            out[budget] = [y.detach(), x.grad, *(p.grad for p in attn.parameters())]
        for a, b in zip(out[0], out[2**40], strict=True):
            assert_close(a, b, n=2 * N, msg=f"{name}/{backend}")


def test_flex_refuses_dropout_and_auto_avoids_it():
    alibi = posenc.build("alibi", heads=HEADS, head_dim=16)  # flex runs heads of 16+ on CUDA
    assert select_backend(alibi, "cuda") == "flex"
    assert select_backend(alibi, "cuda", dropout=True) == "dense"
    with pytest.raises(ValueError, match="backend 'flex' has no attention dropout, got attn_dropout=0.1"):
        posenc.Attention(DIM, HEADS, "alibi", backend="flex", attn_dropout=0.1)
    q = torch.randn(1, HEADS, L, HEAD_DIM)
    pos = torch.arange(L)[None]
    with pytest.raises(ValueError, match="backend 'flex' has no attention dropout"):
        attend(alibi, q, q, q, pos, pos, posenc.AttentionMask(causal=True), backend="flex", dropout=0.1)
    for bad in (1.0, -0.1, "0.1", True, float("nan")):
        with pytest.raises(ValueError, match=r"attn_dropout must be a finite number in \[0, 1\)"):  # Attention too
            posenc.Attention(DIM, HEADS, "rope", attn_dropout=bad)
        with pytest.raises(ValueError, match=r"attn_dropout must be a finite number in \[0, 1\)"):
            posenc.ModelConfig(vocab_size=8, dim=DIM, depth=1, heads=HEADS, attn_dropout=bad)


def test_model_config_fields_reach_the_layers_and_the_mlp():
    lm = posenc.TransformerLM(vocab_size=16, dim=DIM, depth=2, heads=HEADS, attn_dropout=0.1, activation_dropout=0.2)
    assert [b.attn.attn_dropout for b in lm.blocks] == [0.1, 0.1]
    assert [b.mlp.act_drop.p for b in lm.blocks] == [0.2, 0.2]
    assert posenc.ModelConfig.from_dict(lm.config.to_dict()).activation_dropout == 0.2
    tokens = torch.randint(0, 16, (2, L))
    lm.eval()
    a = lm(tokens)
    assert torch.equal(a, lm(tokens))
    lm.train()
    assert not torch.equal(lm(tokens), a)
    # 0 (the default) adds no module: checkpoints of models without it load unchanged
    plain = posenc.TransformerLM(vocab_size=16, dim=DIM, depth=1, heads=HEADS)
    assert isinstance(plain.blocks[0].mlp.act_drop, torch.nn.Identity)


def test_hf_gpt2_keeps_its_attention_dropout_and_equals_stock_in_training():
    """A converted GPT-2 with ``attn_pdrop = 0.1`` (its default) runs HF's own dropout:
    under the same seed, in training, its logits equal stock GPT-2's with
    ``attn_implementation="sdpa"`` (both draw the mask in SDPA), and in eval they equal too."""
    transformers = pytest.importorskip("transformers")
    import posenc.hf as ph

    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, attn_pdrop=0.1,
                                  resid_pdrop=0.0, embd_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    stock = transformers.GPT2LMHeadModel(cfg)
    stock.config._attn_implementation = "sdpa"
    ours = ph.convert(copy.deepcopy(stock))  # the model's own scheme: learned positions, then plain attention
    ids = torch.randint(0, 64, (2, 12))
    seen = {}
    for mode in ("eval", "train"):
        getattr(stock, mode)(), getattr(ours, mode)()
        torch.manual_seed(1)
        want = stock(ids).logits
        torch.manual_seed(1)
        seen[mode] = got = ours(ids).logits
        assert_close(got, want, n=2 * (attention_n(dim=32, length=12) + 7 * 32), msg=mode)
    assert not torch.allclose(seen["train"], seen["eval"])  # dropout was on in training
    torch.manual_seed(2)
    assert not torch.equal(ours(ids).logits, want)  # another seed, another mask
