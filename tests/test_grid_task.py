"""The 2-D grid task (``posenc compare --task grid``, issue 14 item 4)."""

from __future__ import annotations

import json

import pytest
import torch
from tests.test_compare import TINY, run_cli

from posenc.compare import preset_config
from posenc.data import TASK_NAMES, GridTask, load_source, positions_for
from posenc.data.grid import EOL


def test_sample_layout():
    task = GridTask(num_symbols=5)
    b = task.sample(3, 4, 2, torch.Generator().manual_seed(0))
    L = 3 * 5
    assert b.tokens.shape == b.targets.shape == b.mask.shape == (2, L) and b.pos.shape == (2, L, 2)
    grid = b.tokens.view(2, 3, 5)
    assert (grid[:, :, 4] == EOL).all() and (grid[:, :, :4] >= 1).all() and (grid[:, :, :4] <= 5).all()
    for r in range(3):
        for c in range(5):
            t = r * 5 + c
            assert b.pos[0, t].tolist() == [r, c]
            scored = r >= 1 and c < 4
            assert bool(b.mask[0, t]) is scored
            if scored:  # the symbol directly above: w + 1 = 5 tokens back
                assert torch.equal(b.targets[:, t], b.tokens[:, t - 5])
    assert task.seq_len(4) == 20 and task.vocab_size == 6


def test_batches_are_deterministic_and_sized():
    task = GridTask(seed=3)
    shapes = set()
    for step in range(40):
        a, b = task.train_batch(step, 2, 5), task.train_batch(step, 2, 5)
        assert torch.equal(a.tokens, b.tokens)
        h, w = a.pos[0, -1].tolist()  # the last token: EOL of the last row, at column w
        assert 2 <= h + 1 <= 5 and 2 <= w <= 5
        shapes.add((h + 1, w))
    assert len(shapes) > 5
    e1, e2 = list(task.eval_batches(6, 4, 6)), list(task.eval_batches(6, 4, 6))
    assert [x.tokens.shape for x in e1] == [(4, 42), (2, 42)] and all(
        torch.equal(x.tokens, y.tokens) for x, y in zip(e1, e2)
    )
    with pytest.raises(ValueError, match="grid rows must be an int >= 2, got 1"):
        task.sample(1, 4, 1, torch.Generator())
    with pytest.raises(ValueError, match="grid side must be >= 2"):
        task.train_batch(0, 2, 1)
    with pytest.raises(ValueError, match="num_symbols must be >= 2"):
        GridTask(num_symbols=1)


def test_positions_for_each_kind_of_model():
    pos = GridTask().sample(2, 3, 2, torch.Generator()).pos  # (2, 8, 2)
    assert positions_for(pos, 1) is None  # arange over the row-major tokens
    assert positions_for(pos, 2) is pos
    p3 = positions_for(pos, 3)
    assert p3.shape == (2, 8, 3) and (p3[..., 0] == 0).all() and torch.equal(p3[..., 1:], pos)
    with pytest.raises(ValueError, match="axes=4"):
        positions_for(pos, 4)
    flat = torch.arange(5)[None]
    assert positions_for(flat, 3) is flat and positions_for(None, 2) is None


def test_config_and_source():
    assert "grid" in TASK_NAMES
    assert isinstance(load_source(task="grid"), GridTask)
    with pytest.raises(ValueError, match="grid task has 2-D"):
        preset_config("quick", task="grid", randomized_positions=True)


def test_compare_grid_runs_every_kind_of_position(tmp_path):
    """1-D rope (flattened), axial rope, M-RoPE and 2-D sinusoidal through training and evaluation."""
    common = [*TINY[: TINY.index("--train-len")], "--batch-size", "4", "--warmup", "2", "--eval-samples", "8",
              "--no-progress", "--task", "grid", "--train-len", "3", "--eval-lens", "3,4", "--steps", "2"]  # fmt: skip
    a, b = tmp_path / "a", tmp_path / "b"
    assert run_cli(*common, "--encodings", "rope,mrope,sinusoidal", "--encoding-options", "sinusoidal.axes=2",
                   "--out", str(a)) == 0  # fmt: skip
    assert run_cli(*common, "--encodings", "rope", "--encoding-options", "rope.axes=2", "--out", str(b)) == 0
    for out in (a, b):
        res = json.loads((out / "results.json").read_text())
        for r in res["runs"]:
            assert [e["length"] for e in r["eval"]] == [3, 4]
            for e in r["eval"]:
                assert e["tokens"] == 8 * (e["length"] - 1) * e["length"] and 0 <= e["token_accuracy"] <= 1
