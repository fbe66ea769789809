"""posenc.train: the one training loop of compare, analyze and bench."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import posenc
from posenc.data import Batch, step_generator
from posenc.train import Every, Runtime, Trainer, TrainState, adamw, cosine_schedule, lm_loss


def _batch_at(step: int) -> Batch:
    """Random bytes that depend on the step only."""
    t = torch.randint(0, 32, (4, 17), generator=step_generator(3, step))
    return Batch(t[:, :-1], t[:, 1:], None)


def _trainer(seed: int = 0) -> Trainer:
    torch.manual_seed(seed)
    model = posenc.TransformerLM(32, 16, 1, 2, "rope", 16, dropout=0.2)  # dropout: the RNG state matters
    return Trainer(model, adamw(model, lr=1e-2), schedule=cosine_schedule(1e-2, 8, warmup=2), grad_clip=1.0)


def test_resume_from_a_checkpoint_is_bit_identical(tmp_path):
    ref = _trainer()
    full = ref.fit(_batch_at, 8)
    assert full.step == 8 and len(full.losses) == 8 and full.tokens == 8 * 4 * 16

    first = _trainer()
    half = first.fit(_batch_at, 4)
    first.save(tmp_path / "c.pt", half, note="mine")
    torch.manual_seed(123)  # the global RNG moves on; the checkpoint must restore it
    _ = torch.rand(10)

    second = _trainer(seed=99)  # other initial weights: the checkpoint must replace them
    saved, extra = posenc.load_checkpoint(tmp_path / "c.pt")
    assert extra["note"] == "mine" and extra["step"] == 4
    second.model.load_state_dict(saved.state_dict())
    resumed = second.fit(_batch_at, 8, state=second.load_state_dict(extra))
    assert resumed.losses == full.losses
    for a, b in zip(ref.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_schedule_sets_the_rate_of_each_step():
    tr = _trainer()
    seen = []
    tr.fit(_batch_at, 3, callbacks=[Every(1, lambda s: seen.append(tr.optimizer.param_groups[0]["lr"]))])
    lr_at = cosine_schedule(1e-2, 8, warmup=2)
    assert seen == [lr_at(0), lr_at(1), lr_at(2)]


def test_every_calls_at_multiples_before_until():
    calls = []
    cb = Every(3, lambda s: calls.append(s.step), until=9)
    for step in range(1, 11):
        cb.on_step(TrainState(step=step))
    assert calls == [3, 6]
    with pytest.raises(ValueError, match="n >= 1"):
        Every(0, print)


def test_shard_keeps_this_process_rows_and_checks_divisibility():
    b = _batch_at(0)._replace(mask=torch.ones(4, 16, dtype=torch.bool))
    part = Runtime(rank=1, world=2).shard(b)
    assert isinstance(part, Batch) and part.pos is None
    assert torch.equal(part.tokens, b.tokens[2:]) and torch.equal(part.mask, b.mask[2:])
    assert torch.equal(Runtime(rank=0, world=2).shard(b.tokens), b.tokens[:2])
    with pytest.raises(ValueError, match=r"batch_size=4 must be divisible by the number of processes \(3\)"):
        Runtime(rank=0, world=3).shard(b)
    with pytest.raises(TypeError, match="tensor or a tuple"):
        Runtime().shard([b.tokens])


def test_lm_loss_scores_the_masked_tokens_at_the_given_positions():
    torch.manual_seed(0)
    lm = posenc.TransformerLM(32, 16, 1, 2, "learned", 64)
    b = _batch_at(0)
    mask = torch.zeros(4, 16, dtype=torch.bool)
    mask[:, -3:] = True
    logits = lm(b.tokens)
    per_tok = nn.functional.cross_entropy(logits.flatten(0, 1), b.targets.flatten(), reduction="none").view(4, 16)
    expect = per_tok[:, -3:].mean()
    assert torch.allclose(lm_loss(lm, b._replace(mask=mask)), expect, rtol=1e-6, atol=0)
    pos = torch.arange(16).repeat(4, 1) + 40  # learned positions 40..55: a different loss
    assert not torch.allclose(lm_loss(lm, b._replace(pos=pos)), lm_loss(lm, b))


def test_custom_loss_on_tuple_batches():
    """The shape of analyze's padding probe: any module, a tuple batch, a loss of (net, batch)."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    net = nn.Linear(4, 3)
    tr = Trainer(
        net, torch.optim.Adam(net.parameters(), lr=0.1), loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])
    )
    state = tr.fit(lambda step: (x, y), 30)
    assert len(state.losses) == 30 and state.losses[-1] < 0.8 * state.losses[0]
