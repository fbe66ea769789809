"""A 2-D task for ``posenc compare --task grid``: the symbol above each cell of a grid.

A grid of ``h × w`` random symbols is read row by row, each row closed by an end-of-row
token (so a model over flattened tokens can find row boundaries)::

    tokens:   x_00 .. x_0(w-1) EOL  x_10 .. x_1(w-1) EOL  ...      (h·(w + 1) tokens)
    targets:  at cell (r, c), r >= 1: x_(r-1)c, the symbol directly above it

Every cell of rows ``1 .. h-1`` is scored. In 2-D the answer is always one key away at
offset ``(-1, 0)``; over flattened tokens it is ``w + 1`` tokens back, a distance that
changes with the width. Training draws ``h, w`` uniformly from ``[2, n]`` per batch;
evaluation uses ``k × k`` grids, so sizes past ``n`` are grids never seen (rows, columns
and flattened distances all beyond training).

Positions: :attr:`Batch.pos` holds each token's ``(row, column)``, ``(B, L, 2)`` (the
end-of-row token at column ``w``); :func:`positions_for` turns them into what a model's
encodings read: ``arange`` over the flattened tokens (1 axis), ``(row, column)`` (2), or
``(0, row, column)`` (3: M-RoPE's (t, h, w) of an image, Qwen2-VL).

Token ids: ``0`` is EOL, symbols are ``1 .. num_symbols``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from .tasks import Batch, step_generator

__all__ = ["GridTask", "positions_for"]

EOL = 0


def positions_for(pos: Tensor | None, axes: int) -> Tensor | None:
    """Grid positions ``(B, L, 2)`` as a model with ``axes`` coordinates per position reads them.

    ``axes = 1``: None (``arange`` over the row-major flattened tokens); 2: unchanged; 3:
    ``(0, row, column)``. Positions without an axis dimension pass through.
    """
    if pos is None or pos.dim() != 3:
        return pos
    if axes == 1:
        return None
    if axes == 2:
        return pos
    if axes == 3:
        return torch.cat((torch.zeros_like(pos[..., :1]), pos), -1)
    raise ValueError(f"grid positions have 2 axes; a model reading axes={axes} cannot take them")


@dataclass
class GridTask:
    """The grid task; ``length`` everywhere is the grid side ``n``.

    Args:
        num_symbols: alphabet of the cells.
        seed: the batches of step ``s`` depend only on ``(seed, s)``.
    """

    num_symbols: int = 16
    seed: int = 0

    kind = "task"
    name = "grid"

    def __post_init__(self) -> None:
        if self.num_symbols < 2:
            raise ValueError(f"num_symbols must be >= 2, got {self.num_symbols}")

    @property
    def vocab_size(self) -> int:
        return 1 + self.num_symbols

    def seq_len(self, n: int) -> int:
        """Tokens of an ``n × n`` grid: ``n·(n + 1)``."""
        return n * (n + 1)

    def sample(self, h: int, w: int, count: int, g: torch.Generator) -> Batch:
        """``count`` grids of ``h × w``: tokens, targets, mask ``(count, h·(w+1))``, positions ``(count, L, 2)``."""
        for name, v in (("rows", h), ("columns", w)):
            if not isinstance(v, int) or v < 2:
                raise ValueError(f"grid {name} must be an int >= 2, got {v!r}")
        cells = torch.randint(1, self.num_symbols + 1, (count, h, w), generator=g)  # (B, h, w)
        tokens = torch.cat((cells, torch.full((count, h, 1), EOL)), -1)  # (B, h, w+1)
        targets = torch.zeros_like(tokens)
        targets[:, 1:, :w] = cells[:, :-1]  # the symbol above
        mask = torch.zeros_like(tokens, dtype=torch.bool)
        mask[:, 1:, :w] = True
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w + 1), indexing="ij")
        pos = torch.stack((rows, cols), -1).reshape(1, h * (w + 1), 2).expand(count, -1, -1)  # (B, L, 2)
        return Batch(tokens.flatten(1), targets.flatten(1), mask.flatten(1), pos)

    def train_batch(self, step: int, batch_size: int, length: int, seed: int | None = None) -> Batch:
        """One grid shape per batch, ``h, w`` uniform in ``[2, length]``."""
        if length < 2:
            raise ValueError(f"grid side must be >= 2, got {length}")
        g = step_generator(self.seed if seed is None else seed, step)
        h, w = (int(v) for v in torch.randint(2, length + 1, (2,), generator=g))
        return self.sample(h, w, batch_size, g)

    def eval_batches(self, length: int, batch_size: int, count: int) -> Iterator[Batch]:
        """``count`` fixed ``length × length`` grids (seeded apart from training)."""
        g = torch.Generator().manual_seed(10_000_019 * (self.seed + 1) + length)
        for s in range(0, count, batch_size):
            yield self.sample(length, length, min(batch_size, count - s), g)
