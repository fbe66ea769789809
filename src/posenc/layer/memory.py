"""Transformer-XL's segment-level recurrence as a cache policy: :class:`LayerMemory`, one per
layer, held by a model's :class:`SegmentMemory` (:meth:`posenc.TransformerLM.init_memory`).

A memory answers the questions every layer cache answers (:class:`posenc.KVCache`), so the
layer has one path for both: its keys are the memory's rows followed by the new ones
(:meth:`LayerMemory.key_rows`), and it writes no keys (``stores_keys`` False).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .cache import CachePolicy, InputHistory, cat_positions

__all__ = ["LayerMemory", "SegmentMemory"]


class LayerMemory(CachePolicy):
    """One layer's Transformer-XL memory, a cache policy: the keys of a call are the memory's
    rows followed by the new ones.

    It keeps the attention inputs ``(B, ≤M, D)`` of the last ``memory_len`` tokens (detached,
    the paper's stop-gradient ``SG(h)``) and their positions; :meth:`key_rows` returns them
    followed by the new rows, and keeps the last ``memory_len`` of both for the next segment.
    Keys and values are projected from all of them at every call (so ``W_K``/``W_V`` learn
    from the memory's tokens too); nothing is written (``stores_keys`` False).
    """

    stores_keys = False  # (so the layer never calls an update: the keys are projected from the rows)

    def __init__(self, memory_len: int, rows: Tensor | None = None, pos: Tensor | None = None, seen: int | None = None):
        self.memory_len = memory_len
        self.rows, self.pos = rows, pos
        self.length = (0 if rows is None else rows.shape[1]) if seen is None else seen  # tokens seen
        self.inputs: InputHistory | None = None
        self.carry = None  # an encoding's read_input state runs over all the rows at every call

    @classmethod
    def given(cls, rows: Tensor, pos: Tensor) -> LayerMemory:
        """A memory holding ``rows`` ``(B, M, D)`` at ``pos`` ``(B|1, M[, A])`` (a bare layer's ``memory=``)."""
        return cls(rows.shape[1], rows, pos)

    def key_rows(self, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        """The memory's rows followed by ``x``, and their positions; remembers the last ``memory_len``."""
        if self.rows is None:
            rows, rows_pos = x, pos
        else:
            if self.rows.shape[0] != x.shape[0]:
                raise ValueError(f"memory holds batch size {self.rows.shape[0]}, got a batch of {x.shape[0]}")
            rows, rows_pos = torch.cat((self.rows.to(x.dtype), x), 1), cat_positions(self.pos, pos)  # (B, M + L, D)
        self.rows, self.pos = rows[:, -self.memory_len :].detach(), rows_pos[:, -self.memory_len :]
        self.length += x.shape[1]
        return rows, rows_pos

    def reset(self) -> None:
        self.rows = self.pos = None
        self.length, self.carry = 0, None


@dataclass
class SegmentMemory:
    """Transformer-XL memory of a model: one :class:`LayerMemory` per layer.

    ``seen`` counts the tokens passed so far, which is where the next segment's default
    positions start; ``pos`` the positions the memories hold ``(B|1, ≤M)`` (None before the
    first segment).
    """

    memory_len: int
    layers: list[LayerMemory]

    @classmethod
    def empty(cls, memory_len: int, depth: int) -> SegmentMemory:
        return cls(memory_len, [LayerMemory(memory_len) for _ in range(depth)])

    @property
    def seen(self) -> int:
        return self.layers[0].length

    @property
    def pos(self) -> Tensor | None:
        return self.layers[0].pos

    @property
    def length(self) -> int:
        return 0 if self.pos is None else self.pos.shape[1]

    def reset(self) -> None:
        for m in self.layers:
            m.reset()
