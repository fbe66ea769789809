"""Passkey retrieval as the Self-Extend and LongLoRA papers run it, on any model.

The prompt of Mohtashami & Jaggi (2023), reused by LongLoRA (Chen et al., ICLR 2024, §4.2)
and Self-Extend (Jin et al., ICML 2024, §4.2)::

    There is an important info hidden inside a lot of irrelevant text. Find it and memorize
    them. I will quiz you about the important information there.
    The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. (repeated)
    The pass key is 68513. Remember it. 68513 is the pass key.          <- at depth d of the filler
    The grass is green. ... (repeated)
    What is the pass key? The pass key is 68513

The sequence is ``length`` tokens in all (answer included); the key line sits after the
fraction ``d`` of the filler tokens. A trial is solved when the model's argmax at every
answer token is that token: what greedy decoding would answer (teacher-forced, so one
forward pass per trial). Keys are five random digits, seeded by (length, depth, trial).

Tokens: the tokenizer saved in ``MODEL`` when there is one (each piece encoded without
special tokens, then joined); otherwise the UTF-8 bytes are the tokens (ids 0..255), as
posenc's own data are, which needs a vocabulary of at least 256.
"""

from __future__ import annotations

import random

import torch

from .evaluate import token_scores

__all__ = ["DEPTHS", "Tokens", "passkey_ids", "passkey_accuracy"]

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
PREFIX = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there.\n"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
KEY_LINE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "What is the pass key? The pass key is"


class Tokens:
    """Text to token ids: ``tokenizer`` (HF, no special tokens) or UTF-8 bytes; every id is
    checked against the model's ``vocab_size`` when given (a tokenizer of another model is refused)."""

    def __init__(self, tokenizer=None, vocab_size: int | None = None) -> None:
        if tokenizer is None and vocab_size is not None and vocab_size < 256:
            raise ValueError(f"bytes as tokens need a vocabulary of >= 256 ids; the model has {vocab_size}")
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.name = "bytes (UTF-8, ids 0-255)" if tokenizer is None else f"tokenizer {type(tokenizer).__name__}"

    def __call__(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return self._checked(list(self.tokenizer.encode(text, add_special_tokens=False)))

    def _checked(self, ids: list[int]) -> list[int]:
        if self.vocab_size is None:
            return ids
        top = max(ids, default=0)
        if top >= self.vocab_size or min(ids, default=0) < 0:
            raise ValueError(
                f"the tokenizer gives id {top if top >= self.vocab_size else min(ids)}, outside the model's "
                f"vocabulary (ids 0..{self.vocab_size - 1}): the tokenizer saved in MODEL is not this model's"
            )
        return ids

    def of_bytes(self, data: bytes) -> torch.Tensor:
        if self.tokenizer is None:
            return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        return torch.tensor(self(data.decode("utf-8", errors="replace")), dtype=torch.long)


def passkey_ids(tokens: Tokens, length: int, depth: float, key: str) -> tuple[torch.Tensor, list[int]] | None:
    """``(ids (length,), answer_positions)``, or None when ``length`` leaves no room for filler."""
    pre, key_ids, q, ans = tokens(PREFIX), tokens(KEY_LINE.format(key=key)), tokens(QUESTION), tokens(" " + key)
    n_fill = length - len(pre) - len(key_ids) - len(q) - len(ans)
    if n_fill < 1:
        return None
    unit = tokens(FILLER)
    fill = (unit * (n_fill // len(unit) + 1))[:n_fill]
    at = int(round(depth * n_fill))
    ids = pre + fill[:at] + key_ids + fill[at:] + q + ans
    return torch.tensor(ids, dtype=torch.long), list(range(length - len(ans), length))


def min_length(tokens: Tokens) -> int:
    """The shortest passkey sequence (one filler token)."""
    return len(tokens(PREFIX + KEY_LINE.format(key="00000") + QUESTION + " 00000")) + 1


def passkey_accuracy(kind: str, model, tokens: Tokens, length: int, *, trials: int, chunk: int, device,
                     sink: dict | None = None, depths=DEPTHS) -> dict[str, float | None]:  # fmt: skip
    """Exact-match accuracy per depth (``{"0.25": 0.8, ...}``; None: too short for the prompt)."""
    out: dict[str, float | None] = {}
    for d in depths:
        solved, ran = 0, 0
        for t in range(trials):
            key = "".join(random.Random(f"{length}/{d}/{t}").choices("0123456789", k=5))
            made = passkey_ids(tokens, length, d, key)
            if made is None:
                break
            ids, where = made
            _, pred, _ = token_scores(kind, model, ids.to(device), chunk=chunk, sink=sink)
            solved += all(int(pred[p - 1]) == int(ids[p]) for p in where)
            ran += 1
        out[f"{d:g}"] = solved / ran if ran else None
    return out
