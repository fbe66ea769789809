"""Training-time position samplers: randomized positions (Ruoss et al., ACL 2023) and PoSE (Zhu et al., ICLR 2024)."""

from __future__ import annotations

import math

import pytest
import torch
from tests.conftest import assert_close

import posenc
from posenc.positions import pose_positions, randomized_positions


def test_rows_sorted_distinct_in_range():
    g = torch.Generator().manual_seed(0)
    pos = randomized_positions(64, 20, 50, generator=g)
    assert pos.shape == (64, 20) and pos.dtype == torch.int64
    assert (pos[:, 1:] > pos[:, :-1]).all()  # strictly increasing: sorted and distinct
    assert pos.min() >= 0 and pos.max() < 50
    assert len({tuple(r) for r in pos.tolist()}) > 60  # rows are independent draws


def test_full_range_is_arange_and_generator_reproduces():
    assert torch.equal(randomized_positions(3, 7, 7), torch.arange(7).expand(3, 7))
    a = randomized_positions(4, 5, 100, generator=torch.Generator().manual_seed(3))
    b = randomized_positions(4, 5, 100, generator=torch.Generator().manual_seed(3))
    c = randomized_positions(4, 5, 100, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_uniform_marginals():
    """Each position is in the sample with probability L / L_max (uniform L-subsets)."""
    n, L, M = 4000, 8, 32
    pos = randomized_positions(n, L, M, generator=torch.Generator().manual_seed(1))
    freq = torch.bincount(pos.flatten(), minlength=M).double() / n
    p = L / M
    tol = 5 * math.sqrt(p * (1 - p) / n)  # 5 sigma
    assert (freq - p).abs().max() < tol
    # the smallest of L uniform picks of M has mean (M + 1) / (L + 1) - 1
    assert abs(pos[:, 0].double().mean() - ((M + 1) / (L + 1) - 1)) < 0.15


@pytest.mark.parametrize(
    "args, match",
    [((2, 10, 5), "max_pos must be >= length"), ((0, 4, 8), "batch"), ((2, 4, 8.0), "max_pos")],
)
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        randomized_positions(*args)


def _sinusoid(pos: torch.Tensor, dim: int) -> torch.Tensor:
    """Vaswani et al.: PE[p, 2k] = sin(p / 10000^(2k/D)), PE[p, 2k+1] = cos(...), written out."""
    out = torch.zeros(*pos.shape, dim, dtype=torch.float64)
    for k in range(dim // 2):
        angle = pos.double() / 10000 ** (2 * k / dim)
        out[..., 2 * k], out[..., 2 * k + 1] = torch.sin(angle), torch.cos(angle)
    return out.float()


def test_sinusoidal_embeds_the_random_positions():
    torch.manual_seed(0)
    lm = posenc.TransformerLM(vocab_size=32, dim=16, depth=1, heads=2, encoding="sinusoidal", max_len=64)
    tokens = torch.randint(0, 32, (3, 10))
    pos = randomized_positions(3, 10, 64, generator=torch.Generator().manual_seed(0))
    got = lm.embed(tokens, lm.make_call(tokens, pos))
    want = lm.tok_emb(tokens) + _sinusoid(pos, 16)
    # angles p·ω (p < 64) in float64 here, float32 there: eps·64 apart; one embedding add
    assert_close(got, want, n=2, magnitude=64.0)


def test_rope_with_random_positions_depends_on_gaps_only():
    """q̃(p_i)·k̃(p_j) == q̃(p_i - p_j)·k̃(0) for every pair of sampled positions."""
    enc = posenc.build("rope", heads=2, head_dim=8, max_len=100)
    pos = randomized_positions(2, 6, 100, generator=torch.Generator().manual_seed(5))  # (B, L)
    q, k = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    qr, kr = enc.rotate(q, k, pos, pos)
    scores = qr @ kr.transpose(-1, -2)  # (B, H, L, L)
    for b in range(2):
        for i in range(6):
            for j in range(6):
                d = int(pos[b, i] - pos[b, j])
                q1, k1 = enc.rotate(q[b : b + 1, :, i : i + 1], k[b : b + 1, :, j : j + 1],
                                    torch.tensor([d]), torch.tensor([0]))  # fmt: skip
                # an 8-long dot product of rotations whose angles (positions < 100) round differently
                assert_close(scores[b, :, i, j], (q1 @ k1.transpose(-1, -2))[0, :, 0, 0], n=8 + 2, magnitude=100.0)


def test_alibi_bias_uses_random_gaps():
    enc = posenc.build("alibi", heads=4, head_dim=8, max_len=100)
    pos = randomized_positions(2, 5, 100, generator=torch.Generator().manual_seed(2))
    bias = enc.bias(pos, pos)  # (B, H, L, L)
    slopes = torch.tensor([2 ** (-8 * (h + 1) / 4) for h in range(4)])  # Press et al., 4 heads
    want = -(pos[:, None, :, None] - pos[:, None, None, :]).float() * slopes[None, :, None, None]
    assert_close(bias, want, n=2)  # slope·distance


@pytest.mark.parametrize("sampler", [randomized_positions, pose_positions], ids=["randomized", "pose"])
@pytest.mark.parametrize("name", ["sinusoidal", "rope", "alibi", "t5", "learned"])
def test_lm_trains_with_sampled_positions(name, sampler):
    """Positions reach the encoding (outputs change), gradients flow, and a few steps lower the loss."""
    torch.manual_seed(0)
    lm = posenc.TransformerLM(vocab_size=16, dim=32, depth=1, heads=2, encoding=name, max_len=128)
    tokens = torch.randint(0, 16, (4, 12))
    pos = sampler(4, 12, 128, generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(lm(tokens, pos=pos), lm(tokens))
    opt = torch.optim.Adam(lm.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss = torch.nn.functional.cross_entropy(
            lm(tokens[:, :-1], pos=pos[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3


# --------------------------------------------------------------------------- PoSE (Zhu et al., ICLR 2024)
def test_pose_rows_are_chunks_moved_right_inside_the_target_window():
    g = torch.Generator().manual_seed(0)
    for chunks in (1, 2, 3, 5):
        pos = pose_positions(200, 16, 100, chunks=chunks, generator=g)
        assert pos.shape == (200, 16) and pos.dtype == torch.int64
        assert (pos[:, 0] == 0).all()  # u_0 = 0
        steps = pos[:, 1:] - pos[:, :-1]
        assert (steps >= 1).all() and pos.max() < 100  # increasing, inside the target window
        jumps = (steps > 1).sum(-1)
        assert (jumps <= chunks - 1).all()  # contiguous chunks: at most N - 1 skips
        if chunks > 1:
            assert (jumps == chunks - 1).float().mean() > 0.5  # skips are usually non-zero


def test_pose_equals_arange_without_room_and_reproduces():
    assert torch.equal(pose_positions(3, 7, 7, chunks=3), torch.arange(7).expand(3, 7))
    a = pose_positions(4, 9, 50, generator=torch.Generator().manual_seed(3))
    b = pose_positions(4, 9, 50, generator=torch.Generator().manual_seed(3))
    c = pose_positions(4, 9, 50, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_pose_two_chunks_skip_and_cut_are_uniform():
    """N = 2: the skip u_1 is uniform on {0, ..., T - L} and the cut on {1, ..., L - 1}, so every
    relative distance up to T - 1 is trained (the point of PoSE)."""
    n, L, T = 6000, 8, 40
    pos = pose_positions(n, L, T, generator=torch.Generator().manual_seed(1))
    skip = pos[:, -1] - (L - 1)
    cut = (pos[:, 1:] - pos[:, :-1] > 1).float().argmax(-1) + 1  # first index of chunk 2 (if skipped)
    for values, support in ((skip, T - L + 1), (cut[skip > 0], L - 1)):
        freq = torch.bincount(values - values.min(), minlength=support).double() / values.numel()
        p = 1 / support
        assert freq.numel() == support and (freq - p).abs().max() < 5 * math.sqrt(p * (1 - p) / values.numel())
    assert int((pos[:, -1] - pos[:, 0]).max()) == T - 1


@pytest.mark.parametrize(
    "args, kw, match",
    [
        ((2, 10, 5), {}, "target_len must be >= length"),
        ((2, 4, 8), {"chunks": 5}, "chunks must be <= length"),
        ((2, 4, 8), {"chunks": 0}, "chunks must be a positive int"),
        ((0, 4, 8), {}, "batch must be a positive int"),
    ],
)
def test_pose_bad_arguments(args, kw, match):
    with pytest.raises(ValueError, match=match):
        pose_positions(*args, **kw)


@pytest.mark.parametrize("name", posenc.available())
def test_pose_positions_run_through_every_encoding(name):
    """A position sampler is a choice of ``pos``: every encoding takes it (tables need max_len >= T)."""
    torch.manual_seed(0)
    lm = posenc.TransformerLM(vocab_size=16, dim=16, depth=1, heads=2, encoding=name, max_len=64)
    pos = pose_positions(2, 10, 64, generator=torch.Generator().manual_seed(0))
    out = lm(torch.randint(0, 16, (2, 10)), pos=pos)
    assert out.shape == (2, 10, 16) and torch.isfinite(out).all()
