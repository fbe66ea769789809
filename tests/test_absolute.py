"""hierarchical and multiplicative (and learned's limit), against their formulas written out."""

from __future__ import annotations

import math

import pytest
import torch
from tests.conftest import assert_close

import posenc
from posenc.conversions import learned_to_hierarchical
from posenc.encodings.absolute import Hierarchical


def _vaswani(L: int, D: int) -> torch.Tensor:
    """PE[p, 2k] = sin(p / 10000^(2k/D)), PE[p, 2k+1] = cos(...), written out."""
    pe = torch.zeros(L, D, dtype=torch.float64)
    for p in range(L):
        for i in range(0, D, 2):
            pe[p, i] = math.sin(p / 10000 ** (i / D))
            pe[p, i + 1] = math.cos(p / 10000 ** (i / D))
    return pe.float()


def test_hierarchical_reproduces_table_below_n_exactly():
    enc = posenc.build("hierarchical", heads=2, head_dim=4, max_len=10)
    pos = torch.arange(10)
    assert torch.equal(enc.positions(pos), enc.table.weight[pos])


def test_hierarchical_matches_su_formula():
    n, a = 6, 0.4
    enc = posenc.build("hierarchical", heads=1, head_dim=4, max_len=n, alpha=a)
    p = enc.table.weight.detach().double()  # p_1 .. p_n in the paper's 1-based notation
    u = [(p[i] - a * p[0]) / (1 - a) for i in range(n)]
    expected = torch.stack([a * u[(t // n)] + (1 - a) * u[t % n] for t in range(n * n)])  # q_{(i-1)n+j}
    assert_close(enc.positions(torch.arange(n * n)).double(), expected, n=4, dtype=torch.float32)  # a·u_i + (1-a)·u_j


def test_hierarchical_limit_is_n_squared_and_learned_keeps_raising():
    enc = posenc.build("hierarchical", heads=1, head_dim=4, max_len=5)
    x = torch.zeros(1, 1, 4)
    enc.embed(x, torch.tensor([[24]]))  # n² - 1 works
    # checked once at the door (the layer or the model), not in the stage method
    with pytest.raises(ValueError, match=r"0\.\.24 \(table_len² = 5², max_len=5\).*25"):
        posenc.Attention(4, 1, enc)(x, pos=torch.tensor([[25]]))
    learned = posenc.Attention(4, 1, "learned", max_len=5)
    with pytest.raises(ValueError, match="max_len=5"):
        learned(x, pos=torch.tensor([[5]]))


def test_hierarchical_bad_options():
    with pytest.raises(ValueError, match="alpha must be in"):
        posenc.build("hierarchical", heads=1, head_dim=4, max_len=5, alpha=1.0)
    with pytest.raises(ValueError, match="needs max_len or table_len"):
        posenc.build("hierarchical", heads=1, head_dim=4)


def test_from_learned_encoding():
    learned = posenc.build("learned", heads=2, head_dim=4, max_len=8)
    hier = Hierarchical.from_learned(learned, alpha=0.3)
    assert hier.alpha == 0.3 and torch.equal(hier.table.weight, learned.table.weight)
    x, pos = torch.randn(2, 8, 8), torch.arange(8)
    assert torch.equal(hier.embed(x, pos), learned.embed(x, pos))
    with pytest.raises(TypeError, match="Learned"):
        Hierarchical.from_learned(hier)


def test_trained_learned_model_converts_without_retraining(tmp_path):
    torch.manual_seed(0)
    lm = posenc.TransformerLM(32, 16, 2, 2, encoding="learned", max_len=8)
    opt = torch.optim.SGD(lm.parameters(), lr=0.1)
    t = torch.randint(0, 32, (4, 8))
    for _ in range(3):  # "trained": weights moved away from their init
        loss = torch.nn.functional.cross_entropy(lm(t).flatten(0, 1), t.roll(-1, 1).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    new = learned_to_hierarchical(lm, alpha=0.4)
    assert new.config.encoding == "hierarchical"
    with torch.no_grad():
        assert torch.equal(new(t), lm(t))  # identical below max_len
        long = new(torch.randint(0, 32, (1, 64)))  # 8² = 64 positions
        with pytest.raises(ValueError, match="max_len"):
            lm(torch.randint(0, 32, (1, 9)))
    assert long.shape == (1, 64, 32)
    posenc.save_checkpoint(tmp_path / "h.pt", new)
    back, _ = posenc.load_checkpoint(tmp_path / "h.pt")
    with torch.no_grad():
        assert torch.equal(back(t), new(t))
    with pytest.raises(ValueError, match="encoding='learned'"):
        learned_to_hierarchical(new)


def test_multiplicative_sinusoidal_matches_formula():
    enc = posenc.build("multiplicative", heads=2, head_dim=4, strength=0.5)
    x = torch.randn(2, 12, 8)
    expected = x * (1 + 0.5 * _vaswani(12, 8))
    assert_close(enc.embed(x, torch.arange(12)), expected, n=3)  # x·(1 + s·p): a table entry, 2 ops


def test_multiplicative_is_well_conditioned_at_init():
    enc = posenc.build("multiplicative", heads=2, head_dim=8, strength=0.5)
    m = enc.multiplier(torch.arange(512))
    assert m.min() >= 0.5 and m.max() <= 1.5  # no coordinate zeroed or flipped
    x = torch.randn(4, 512, 16)
    ratio = enc.embed(x, torch.arange(512)).pow(2).mean() / x.pow(2).mean()
    assert 0.25 < ratio < 2.25  # second moment kept within (1 ± β)²


def test_multiplicative_learned_table():
    enc = posenc.build("multiplicative", heads=1, head_dim=4, max_len=6, table="learned", strength=0.1)
    x, pos = torch.randn(1, 6, 4), torch.arange(6)
    assert_close(enc.embed(x, pos), x * (1 + 0.1 * enc.table.weight[pos]), n=2)
    assert not enc.extrapolates
    with pytest.raises(ValueError, match="max_len=6"):
        enc.check_length(pos + 1)
    with pytest.raises(ValueError, match="table must be"):
        posenc.build("multiplicative", heads=1, head_dim=4, table="rope")
