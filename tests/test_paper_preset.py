"""The paper preset's model pieces: adaptive input and adaptive softmax against transcriptions
of fairseq's formulas, pre-norm without a final norm, gradient accumulation, and float32
position tables under bf16 autocast."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import posenc
from conftest import tolerance
from posenc.adaptive import AdaptiveInput, check_cutoffs
from posenc.compare.train import accumulation_steps
from posenc.train import Trainer, lm_loss
from posenc.train.loop import micro_batches

V, D, CUT = 60, 32, [10, 30]


def _lm(**kw) -> posenc.TransformerLM:
    torch.manual_seed(0)
    return posenc.TransformerLM(V, D, 2, 4, "rope", 32, adaptive_cutoffs=CUT, final_norm=False, **kw)


def test_adaptive_input_is_fairseqs_band_embedding_then_projection():
    # fairseq AdaptiveInput: band i of ids [c_{i-1}, c_i) embeds in int(D // 4**i) dims, then a
    # bias-free Linear(dim_i, D); written per token from the formula, not from posenc's forward
    torch.manual_seed(1)
    emb = AdaptiveInput(V, D, CUT, factor=4.0)
    assert [e.weight.shape[1] for e in emb.embeddings] == [32, 8, 2]
    assert [e.weight.shape[0] for e in emb.embeddings] == [10, 20, 30]
    tokens = torch.tensor([[0, 9, 10, 29, 30, 59], [5, 15, 45, 1, 2, 3]])
    got = emb(tokens)
    for b in range(2):
        for t in range(6):
            tok = int(tokens[b, t])
            band = sum(tok >= c for c in CUT)
            lo = ([0, *CUT])[band]
            e = emb.embeddings[band].weight[tok - lo]  # (dim_band,)
            want = emb.projections[band].weight @ e  # W (D, dim_band) e
            torch.testing.assert_close(got[b, t], want, **tolerance(n=e.numel()))
    # fairseq's init: embeddings N(0, 1/dim_i) (std checked on the 32-dim band), projections Xavier
    big = AdaptiveInput(20000, 64, [16000], factor=4.0)
    assert big.embeddings[0].weight.std().item() == pytest.approx(64**-0.5, rel=0.05)
    bound = math.sqrt(6 / (16 + 64))
    assert big.projections[1].weight.abs().max().item() <= bound


def test_adaptive_softmax_log_probs_are_the_two_level_factorisation():
    # fairseq/torch adaptive softmax: head over the shortlist + one row per cluster; a tail
    # word's log-prob is head[cluster] + log_softmax(h P_c^T O_c^T)[word - lo]
    model = _lm(tie_embeddings=False).eval()
    tokens = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(2))
    h = {}
    model.blocks[-1].register_forward_hook(lambda m, i, o: h.setdefault("x", o))
    lp = model(tokens)  # (2, 12, V)
    x = h["x"].flatten(0, 1)  # no final norm: the last block's output goes to the head
    head = model.head
    head_lp = F.log_softmax(x @ head.head.weight.T, -1)  # (N, 10 + 2)
    want = [head_lp[:, :10]]
    for c, (lo, hi) in enumerate([(10, 30), (30, 60)]):
        down, out = head.tail[c][0].weight, head.tail[c][1].weight
        assert out.shape == (hi - lo, D // 4 ** (c + 1))  # band c + 1: its words, dim D / 4^(c+1)
        want.append(head_lp[:, 10 + c : 11 + c] + F.log_softmax(x @ down.T @ out.T, -1))
    want = torch.cat(want, -1).view(2, 12, V)
    torch.testing.assert_close(lp, want, **tolerance(n=2 * D + V))
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(2, 12), **tolerance(n=V))
    # the loss path: -log p(target) from the bands the targets fall in, equal to the full log-probs
    targets = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
    nll = model(tokens, targets=targets)
    torch.testing.assert_close(nll, -want.gather(-1, targets[..., None])[..., 0], **tolerance(n=2 * D + V))
    batch = posenc.data.Batch(tokens, targets, None)
    torch.testing.assert_close(lm_loss(model, batch), nll.mean(), **tolerance(n=2 * D + V + 24))


def test_tied_adaptive_bands_share_one_tensor_and_are_trained_once():
    tied, untied = _lm(tie_embeddings=True), _lm(tie_embeddings=False)
    for i, tail in enumerate(tied.head.tail):
        assert tail[1].weight is tied.tok_emb.embeddings[i + 1].weight
    shared = sum(e.weight.numel() for e in tied.tok_emb.embeddings[1:])
    assert untied.num_params() - tied.num_params() == shared == 20 * 8 + 30 * 2


def test_final_norm_false_feeds_the_last_block_to_the_head():
    torch.manual_seed(0)
    m = posenc.TransformerLM(50, 16, 2, 2, "alibi", 16, final_norm=False).eval()
    assert isinstance(m.ln_f, torch.nn.Identity) and not any(k.startswith("ln_f") for k in m.state_dict())
    h = {}
    m.blocks[-1].register_forward_hook(lambda mod, i, o: h.setdefault("x", o))
    logits = m(torch.arange(10)[None] % 50)
    torch.testing.assert_close(logits, h["x"] @ m.head.weight.T, **tolerance(n=16))


def test_old_configs_and_checkpoints_load_unchanged(tmp_path):
    torch.manual_seed(0)
    m = posenc.TransformerLM(50, 16, 1, 2, "rope", 16)
    d = m.config.to_dict()
    for k in ("final_norm", "adaptive_cutoffs", "adaptive_factor"):  # a config written before these fields
        d.pop(k)
    cfg = posenc.ModelConfig.from_dict(d)
    assert cfg.final_norm is True and cfg.adaptive_cutoffs is None
    m2 = posenc.TransformerLM(config=cfg)
    m2.load_state_dict(m.state_dict())  # strict: the same keys (ln_f included)
    t = torch.arange(8)[None]
    torch.testing.assert_close(m2(t), m(t), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("cutoffs", "match"),
    [([30, 10], "strictly increasing"), ([0, 10], "strictly increasing"), ([10, 60], "vocab_size=60"),
     ([], "non-empty"), ([True], "list of ints")],
)  # fmt: skip
def test_bad_cutoffs_are_refused(cutoffs, match):
    with pytest.raises(ValueError, match=match):
        posenc.ModelConfig(vocab_size=V, dim=D, depth=1, heads=2, adaptive_cutoffs=cutoffs)
    with pytest.raises(ValueError, match="adaptive_factor"):
        posenc.ModelConfig(vocab_size=V, dim=D, depth=1, heads=2, adaptive_cutoffs=CUT, adaptive_factor=0.5)
    assert check_cutoffs([10, 30], 60) == [10, 30]


def test_accumulation_arithmetic_and_refusals():
    # 73 728 tokens / 512 = 144 sequences per update, whatever the processes
    assert accumulation_steps(144, 8, 2) == 9
    assert accumulation_steps(144, 1, 2) == 72
    assert accumulation_steps(144, 2, None) == 1
    with pytest.raises(
        ValueError,
        match=r"--micro-batch 5: 144 sequences .* 8 processes .* micro-batches that do: \[1, 2, 3, 6, 9, 18\]",
    ):
        accumulation_steps(144, 8, 5)
    with pytest.raises(ValueError, match="144 sequences per update do not divide over 7 processes"):
        accumulation_steps(144, 7, None)
    with pytest.raises(ValueError, match="do not divide into 3 micro-batches"):
        micro_batches(torch.zeros(4, 2), 3)
    with pytest.raises(ValueError, match="accumulate must be an int >= 1"):
        Trainer(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), accumulate=0)


def test_accumulated_step_equals_one_step_on_the_whole_batch():
    # the mean of k equal parts' mean losses is the whole batch's mean: same gradient, same update
    tokens = torch.randint(0, V, (8, 12), generator=torch.Generator().manual_seed(4))
    batch = posenc.data.Batch(tokens[:, :-1], tokens[:, 1:], None)
    grads, losses = [], []
    for k in (1, 4):
        m = _lm(tie_embeddings=True)
        tr = Trainer(m, torch.optim.SGD(m.parameters(), lr=0.0), accumulate=k)
        losses.append(tr.step(batch))
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    torch.testing.assert_close(losses[1], losses[0], **tolerance(n=8 * 11))
    torch.testing.assert_close(
        grads[1], grads[0], **tolerance(n=8 * 11 * (2 * D + V), magnitude=float(grads[0].abs().max()))
    )


def test_position_tables_stay_float32_under_bf16_autocast():
    # Press et al.'s four encodings (the paper preset's): every table they build under a bf16
    # autocast is float32 and equal to the one built outside it
    from posenc import build

    pos = torch.arange(40)[None]
    kw = {"heads": 4, "head_dim": 8, "max_len": 32, "causal": True}
    sin, rope, alibi, t5 = (build(n, **kw) for n in ("sinusoidal", "rope", "alibi", "t5"))
    make = {
        "sinusoidal": lambda: sin.table(pos),
        "rope": lambda: rope._cos_sin(pos, rope.frequencies(40)),
        "alibi": lambda: alibi.bias(pos, pos),
        "t5": lambda: t5.bias(pos, pos),
    }
    for name, fn in make.items():
        ref = fn()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = fn()
        for a, b in zip(ref if isinstance(ref, tuple) else (ref,), got if isinstance(got, tuple) else (got,)):
            assert b.dtype == torch.float32, (name, b.dtype)
            torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_adaptive_input_is_scaled_by_sqrt_d_as_fairseqs_decoder_scales_it():
    # fairseq TransformerDecoder.forward_embedding: x = embed_scale * embed_tokens(tokens), with
    # embed_scale = sqrt(D) (base_lm_architecture: no_scale_embedding False), before positions
    model = _lm().eval()
    tokens = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(12)[None]
    got = model.embed(tokens, model.make_call(tokens, pos))
    want = math.sqrt(model.config.dim) * model.tok_emb(tokens)  # rope: no input stage after it
    torch.testing.assert_close(got, want, **tolerance(n=model.config.dim))
