"""Synthetic length-generalisation tasks: copy, reverse, sort, associative recall.

Each task turns a problem of size ``n`` into one token sequence for a causal LM::

    copy / reverse / sort:   x_1 .. x_n  SEP  y_1 .. y_n      (y = x, x reversed, x sorted)
    associative-recall:      k_1 v_1 .. k_n v_n  SEP  k_q  v_q (k_q one of the keys)

The model is trained with teacher forcing on the answer tokens only (``mask``) and
judged by exact match: a sequence counts as solved when the argmax prediction of every
answer token is right, which is what greedy decoding would produce. Training draws a
size uniformly in ``[1, n_train]`` per batch; evaluation uses sizes up to and past
``n_train`` (Delétang et al., "Neural Networks and the Chomsky Hierarchy", ICLR 2023;
Ruoss et al. 2023 use the same protocol).

Token ids: ``0`` is ``SEP``; symbols are ``1 .. num_symbols``; for associative recall
keys and values are drawn from disjoint ranges.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "Batch",
    "DepthAxis",
    "KAZEMNEJAD_TASKS",
    "SyntheticTask",
    "TASKS",
    "TASK_NAMES",
    "depth_axis",
    "step_generator",
]

SEP = 0


class Batch(NamedTuple):
    """``tokens``, ``targets`` ``(B, L)`` int64; ``mask`` ``(B, L)`` bool of scored targets or None (all);
    ``pos`` ``(B, L)`` int64 positions, ``(B, L, A)`` with axes (the grid task), or None (``arange``);
    ``documents`` ``(B, L)`` int64 document ids of packed sequences (``TransformerLM``'s
    ``document_ids``), or None (one document per row)."""

    tokens: Tensor
    targets: Tensor
    mask: Tensor | None
    pos: Tensor | None = None
    documents: Tensor | None = None


def step_generator(seed: int, step: int) -> torch.Generator:
    """A CPU generator that depends only on ``(seed, step)``: batches independent of history."""
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + int(step))


TASKS = ("copy", "reverse", "sort", "associative-recall")  # SyntheticTask's
# Kazemnejad et al. 2023's suite in their formats (posenc.data.kazemnejad)
KAZEMNEJAD_TASKS = ("kaz-copy", "kaz-copy-2x", "kaz-reverse", "kaz-reverse-2x", "kaz-addition", "kaz-poly",
                    "kaz-sort", "kaz-sort-multi", "kaz-sum", "kaz-parity", "kaz-lego")  # fmt: skip
# every task posenc compare offers (posenc.data.grid, .passkey, .paper_tasks, .kazemnejad)
TASK_NAMES = (*TASKS, "grid", "passkey", "count", "flip-flop", *KAZEMNEJAD_TASKS)


class DepthAxis(NamedTuple):
    """How a task names its evaluation variants (a source's ``depths``, scored one by one:
    the passkey's key depths, flip-flop's p(ignore)): ``label`` and ``plural`` for figures,
    ``column`` for results.csv (``accuracy_<column>_<round(100 · depth)>``), ``tick`` the
    format of one value, ``title`` and ``note`` for the figure."""

    label: str
    plural: str
    column: str
    tick: str
    title: str
    note: str


_DEPTH_AXES = {
    "passkey": DepthAxis("key depth", "depths", "depth", "{:.0%}", "Passkey retrieval",
                         "depth 0 %: the key opens the text; 100 %: right before the question"),
    "flip-flop": DepthAxis("p(ignore)", "p(ignore) values", "p_ignore", "{:g}", "Flip-flop",
                           "p(ignore) 0.8: the training density; 0.98: sparse; 0.1: dense (Liu et al. 2023)"),
}  # fmt: skip
DEPTH_TASKS = tuple(_DEPTH_AXES)  # the tasks scored at several depths / densities (a heatmap each)


def depth_axis(task: str | None) -> DepthAxis:
    """The naming of ``task``'s evaluation variants (:class:`DepthAxis`); a task without
    its own gets neutral names ("variant")."""
    default = DepthAxis("variant", "variants", "depth", "{:g}", f"task {task}", "")
    return _DEPTH_AXES.get(task, default)


@dataclass
class SyntheticTask:
    """A synthetic task; ``length`` everywhere means the problem size ``n``.

    Args:
        name: one of :data:`TASKS`.
        num_symbols: alphabet size of the items (copy/reverse/sort) or of the values
            (recall; keys use their own ``max_keys`` symbols).
        max_keys: key alphabet for associative recall (bounds the largest ``n``).
        seed: the batches of step ``s`` depend only on ``(seed, s)``.
    """

    name: str
    num_symbols: int = 16
    max_keys: int = 256
    seed: int = 0

    kind = "task"

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ValueError(f"unknown task {self.name!r}; tasks: {', '.join(TASKS)}")
        if self.num_symbols < 2:
            raise ValueError(f"num_symbols must be >= 2, got {self.num_symbols}")

    @property
    def vocab_size(self) -> int:
        extra = self.max_keys if self.name == "associative-recall" else 0
        return 1 + self.num_symbols + extra

    def seq_len(self, n: int) -> int:
        """Model input length for size ``n`` (the last answer token is never an input)."""
        return 2 * n + 2 if self.name == "associative-recall" else 2 * n

    def sample(self, n: int, count: int, g: torch.Generator) -> Batch:
        """``count`` problems of size ``n``: tokens, targets and answer mask, each ``(count, seq_len(n))``."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"task size must be a positive int, got {n!r}")
        S = self.num_symbols
        if self.name == "associative-recall":
            if n > self.max_keys:
                raise ValueError(f"associative-recall size {n} exceeds max_keys={self.max_keys}")
            keys = torch.rand(count, self.max_keys, generator=g).argsort(-1)[:, :n] + 1 + S  # (B, n) distinct
            vals = torch.randint(1, S + 1, (count, n), generator=g)  # (B, n)
            q = torch.randint(0, n, (count,), generator=g)  # (B,)
            rows = torch.arange(count)
            pairs = torch.stack([keys, vals], -1).flatten(1)  # (B, 2n)
            seq = torch.cat(
                [pairs, torch.full((count, 1), SEP), keys[rows, q, None], vals[rows, q, None]], 1
            )  # (B, 2n+3)
            n_answer = 1
        else:
            x = torch.randint(1, S + 1, (count, n), generator=g)  # (B, n)
            y = {"copy": x, "reverse": x.flip(1), "sort": x.sort(1).values}[self.name]
            seq = torch.cat([x, torch.full((count, 1), SEP), y], 1)  # (B, 2n+1)
            n_answer = n
        tokens, targets = seq[:, :-1], seq[:, 1:]
        mask = torch.zeros_like(targets, dtype=torch.bool)
        mask[:, -n_answer:] = True
        return Batch(tokens, targets, mask)

    def train_batch(self, step: int, batch_size: int, length: int, seed: int | None = None) -> Batch:
        """A batch of one size drawn uniformly from ``[1, length]`` (``seed``: this object's by default)."""
        g = step_generator(self.seed if seed is None else seed, step)
        n = int(torch.randint(1, length + 1, (1,), generator=g))
        return self.sample(n, batch_size, g)

    def eval_batches(self, length: int, batch_size: int, count: int) -> Iterator[Batch]:
        """``count`` fixed problems of size ``length`` (seeded apart from training)."""
        g = torch.Generator().manual_seed(10_000_019 * (self.seed + 1) + length)
        for s in range(0, count, batch_size):
            yield self.sample(length, min(batch_size, count - s), g)
