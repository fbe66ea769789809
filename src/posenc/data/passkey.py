"""Passkey retrieval, scaled down: can a model still find something far back?

After Mohtashami & Jaggi ("Landmark Attention", 2023) and PoSE (Zhu et al., ICLR 2024):
a random 5-digit key sits at a chosen depth inside filler text, and the sequence ends by
asking for it. Byte-level, with the filler drawn from the corpus (its train split for
training, its validation split for evaluation)::

    filler ... ␁ k1 k2 k3 k4 k5 filler ... ␁ k1 k2 k3 k4 k5
               ^ the key at depth d          ^ the question; the answer is scored

Scaled down in two ways, so that a 2-layer byte model trained at 64 tokens learns it in
the quick budget:

* the key and the question are marked by byte ``0x01`` instead of the papers' sentences
  ("The pass key is 48017. Remember it."), leaving room for filler;
* digit ``d`` in place ``j`` of the key is the byte ``0x80 + 10 j + d`` (each place has
  its own ten symbols, which the filler never holds: filler bytes that are marks or key
  symbols become spaces). Writing the key in ASCII digits would make retrieval a
  two-step induction circuit (find the earlier occurrence of the previous digit, copy
  its successor; Olsson et al. 2022), which this model does not form in the budget
  (0 % exact match after 1 600 steps, 47 % of digits right, in a trial); with one alphabet
  per place a single attention step finds "the place-j symbol" from the end, however far
  back. That is the question a position encoding decides: can attention still reach a
  token that far away, and tell it apart?

Exact match: a sample is solved when the argmax at all five answer positions is right,
what greedy decoding would answer (chance 1e-5).

Training puts the key at a uniformly random depth in sequences of the training length
and scores only the answer digits (``Batch.mask``), like evaluation, which scores them at
every evaluation length × :data:`DEPTHS` with fixed seeded samples. Scoring every token
instead (the filler as language modelling as well) left most models without the retrieval
step after 2 400 steps (exact match at the training length: alibi 0.3 %, t5 8.4 %, rope
13.1 %, sinusoidal 100 %); with the answer alone ALiBi reached 92 % at step 960.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from .tasks import Batch, step_generator

__all__ = ["PasskeyTask", "DEPTHS", "MARK", "KEY_DIGITS", "KEY_BASE", "key_digits"]

MARK = 1  # byte 0x01: marks the key and the question
KEY_DIGITS = 5
KEY_BASE = 0x80  # digit d in place j of the key: byte KEY_BASE + 10 j + d
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def key_digits(symbols: Tensor) -> Tensor:
    """The digits ``(..., 5)`` of key symbols ``(..., 5)`` (the inverse of the place coding)."""
    return (symbols - KEY_BASE) % 10


@dataclass
class PasskeyTask:
    """Passkey retrieval over a byte corpus; ``length`` means tokens, as for text.

    Args:
        train: ``(N,)`` bytes of the filler for training (the corpus' train split), uint8 or int64.
        val: ``(M,)`` bytes of the filler for evaluation (its validation split), uint8 or int64.
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
        fill = filler[starts[:, None] + torch.arange(n_fill)].long()  # (B, F): int64 whatever the filler's dtype
        special = (fill == MARK) | ((fill >= KEY_BASE) & (fill < KEY_BASE + 10 * KEY_DIGITS))
        fill = torch.where(special, ord(" "), fill)
        digits = torch.randint(0, 10, (count, KEY_DIGITS), generator=g) + KEY_BASE + 10 * torch.arange(KEY_DIGITS)
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
        """Training sequences of ``length`` tokens, keys at random depths; only the answer is
        scored (``mask``), as in evaluation."""
        g = step_generator(self.seed if seed is None else seed, step)
        return self.sample(length, batch_size, None, self.train, g)

    def eval_batches(self, length: int, batch_size: int, count: int, depth: float = 0.5) -> Iterator[Batch]:
        """``count`` fixed samples of ``length`` tokens with the key at ``depth``; only the
        answer digits are scored."""
        g = torch.Generator().manual_seed(10_000_019 * (self.seed + 1) + 7919 * length + int(1000 * depth))
        for s in range(0, count, batch_size):
            yield self.sample(length, min(batch_size, count - s), depth, self.val, g)
