"""Passkey retrieval, scaled down: can a model still find something far back?

After Mohtashami & Jaggi ("Landmark Attention", 2023) and PoSE (Zhu et al., ICLR 2024):
a random 5-digit key sits at a chosen depth inside filler text, and the sequence ends by
asking for it. Byte-level, with the filler drawn from the corpus (its train split for
training, its validation split for evaluation)::

    filler ... ␁ 4 8 0 1 7 filler ... ␁ 4 8 0 1 7
               ^ the key at depth d     ^ the question; the answer digits are scored

The key and the question are marked by byte ``0x01``, which prose never holds (filler
bytes ``0x01`` become spaces), instead of the papers' sentences ("The pass key is 48017.
Remember it."), so that a 2-layer byte model trained at 64 tokens has room for filler.
What is asked is the same: copy a token sequence from an arbitrary distance back (an
induction head's job, Olsson et al. 2022). Exact match: a sample is solved when the
argmax at all five answer positions is right, what greedy decoding would answer.

Training puts the key at a uniformly random depth in sequences of the training length
and scores every token: the filler as language modelling, the answer as retrieval
(``Batch.mask`` is all true). Evaluation scores only the answer digits, at every
evaluation length × :data:`DEPTHS`, with fixed seeded samples.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from .tasks import Batch, step_generator

__all__ = ["PasskeyTask", "DEPTHS", "MARK", "KEY_DIGITS"]

MARK = 1  # byte 0x01: marks the key and the question
KEY_DIGITS = 5
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
_DIGIT0 = ord("0")


@dataclass
class PasskeyTask:
    """Passkey retrieval over a byte corpus; ``length`` means tokens, as for text.

    Args:
        train: ``(N,)`` int64 bytes of the filler for training (the corpus' train split).
        val: ``(M,)`` int64 bytes of the filler for evaluation (its validation split).
        seed: the batches of step ``s`` depend only on ``(seed, s)``.
    """

    train: Tensor
    val: Tensor
    seed: int = 0

    kind = "task"
    name = "passkey"
    vocab_size = 256
    depths = DEPTHS
    # the key (mark + digits) and the question (mark + answer digits; the last digit is
    # never an input) take this many of the L + 1 bytes of a sequence
    overhead = 2 * (1 + KEY_DIGITS)

    def seq_len(self, length: int) -> int:
        """Tokens in a sequence of evaluation length ``length`` (the length itself)."""
        return length

    def sample(self, length: int, count: int, depth: float | None, filler: Tensor, g: torch.Generator) -> Batch:
        """``count`` sequences of ``length`` input tokens with the key at ``depth`` of the
        filler (0: the first bytes, 1: right before the question; None: uniform per row).

        Returns:
            ``Batch`` of ``(count, length)`` tokens and targets; ``mask`` marks the
            ``KEY_DIGITS`` answer targets.

        Raises:
            ValueError: ``length`` leaves no room for the key and the question, exceeds
                the filler, or ``depth`` is outside ``[0, 1]``.
        """
        if not isinstance(length, int) or isinstance(length, bool) or length < self.overhead:
            raise ValueError(f"passkey length must be an int >= {self.overhead} (key and question), got {length!r}")
        if len(filler) < length + 1:
            raise ValueError(f"passkey length {length} exceeds the filler text ({len(filler)} bytes)")
        if depth is not None and not 0 <= depth <= 1:
            raise ValueError(f"passkey depth must be in [0, 1], got {depth!r}")
        n_fill = length + 1 - self.overhead  # filler bytes around the key
        starts = torch.randint(0, len(filler) - n_fill + 1, (count,), generator=g)  # (B,)
        fill = filler[starts[:, None] + torch.arange(n_fill)]  # (B, F)
        fill = torch.where(fill == MARK, ord(" "), fill)
        digits = torch.randint(0, 10, (count, KEY_DIGITS), generator=g) + _DIGIT0  # (B, 5)
        key = torch.cat([torch.full((count, 1), MARK), digits], 1)  # (B, 6)
        if depth is None:
            before = torch.randint(0, n_fill + 1, (count, 1), generator=g)  # (B, 1)
        else:
            before = torch.full((count, 1), int(round(depth * n_fill)))
        # sequence index p holds: filler p (p < k), key p - k, filler p - 6, question p - F - 6
        p = torch.arange(length + 1)[None, :]  # (1, L+1)
        k, w = before, 1 + KEY_DIGITS
        fill_idx = torch.where(p < k, p, p - w).clamp(0, n_fill - 1)
        key_idx = torch.where(p < k + w, p - k, p - n_fill - w).clamp(0, w - 1)
        is_key = ((p >= k) & (p < k + w)) | (p >= n_fill + w)
        seq = torch.where(is_key, key.gather(1, key_idx.expand(count, -1)), fill.gather(1, fill_idx.expand(count, -1)))
        tokens, targets = seq[:, :-1], seq[:, 1:]
        mask = torch.zeros_like(targets, dtype=torch.bool)
        mask[:, -KEY_DIGITS:] = True  # the answer: the digits after the question mark
        return Batch(tokens, targets, mask)

    def train_batch(self, step: int, batch_size: int, length: int, seed: int | None = None) -> Batch:
        """Training sequences of ``length`` tokens, keys at random depths; every target is
        scored (``mask`` all true): the filler as language, the answer as retrieval."""
        g = step_generator(self.seed if seed is None else seed, step)
        b = self.sample(length, batch_size, None, self.train, g)
        return Batch(b.tokens, b.targets, torch.ones_like(b.mask))

    def eval_batches(self, length: int, batch_size: int, count: int, depth: float = 0.5) -> Iterator[Batch]:
        """``count`` fixed samples of ``length`` tokens with the key at ``depth``; only the
        answer digits are scored."""
        g = torch.Generator().manual_seed(10_000_019 * (self.seed + 1) + 7919 * length + int(1000 * depth))
        for s in range(0, count, batch_size):
            yield self.sample(length, min(batch_size, count - s), depth, self.val, g)
