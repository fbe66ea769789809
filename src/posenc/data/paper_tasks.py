"""Two tasks exactly as the papers that judge position encodings generate them.

``count`` — the counting task of CoPE (Golovneva et al., "Contextual Position Encoding:
Learning to Count What's Important", 2024), generated as facebookresearch/RAM
``projects/cope/scripts/count_data_gen.py`` does (read there; this is our own code for
the same sampling algorithm, checked draw for draw against a transcription in
``tests/test_paper_tasks.py``)::

    a = 0 ; pass; pass; a ++; b = 0 ; pass; a ++; ... pass; print a  2

A program of ``nsteps`` statements over ``nvars`` variables (``a``, ``b``, ``c`` for the
default 3): each statement is drawn SET : pass : INCREMENT = 1 : 50 : 7 (``"v = 0 ;"``
on any variable, ``"pass;"``, ``"v ++;"`` on a set variable); an increment with no set
variable or past the cap of 10 is redrawn. Then ``print v`` names a set variable (a
program that sets none is drawn again, ``nsteps`` included) and the answer is its
value. Tokens are the original's words (its tokenizer splits on spaces: ``pass;`` and
``++;`` are one word each). Sizes count statements: training draws ``nsteps`` uniformly
from ``[3, n]`` per sequence (the original's ``randint(3, max_steps)``); evaluation at
size ``n`` uses exactly ``n`` statements, one column per length (the original's test set
is the mixture of the columns up to ``max_steps``). Rows have different token counts and
are padded on the right, as the original's collator does: after the answer, so a causal
model never sees the padding.

``flip-flop`` — Flip-Flop language modelling (Liu, Ash, Goel, Krishnamurthy, Zhang,
"Exposing Attention Glitches with Flip-Flop Language Modeling", NeurIPS 2023). Its
generator is not published as code; this transcribes the paper's definition and the
authors' dataset card (huggingface.co/datasets/synthseq/flipflop: 256 instructions,
80 % ignore, 10 % read, 10 % write; tokens ``w r i 0 1`` = ids 0-4)::

    w 1 i 0 i 1 r 1 w 0 i 1 ... r 0

Pairs of an instruction and a bit: the first instruction is ``w``, the last ``r``, the
others drawn i.i.d. with p(w) = p(r) = (1 - p(i)) / 2; the bits of ``w`` and ``i`` are
uniform, the bit after each ``r`` is the last written bit, and those bits are the
answers (scored; exact match: every read of a sequence right). Sizes count
instructions and training uses exactly ``n`` (the paper trains at a fixed T = 512 tokens,
256 instructions) at p(i) = 0.8. The paper tests at p(i) = 0.8, 0.98 (sparse) and 0.1
(dense): they are the task's evaluation variants, served through the hook the passkey
task uses for its depths (``depths``; :func:`posenc.compare.evaluate.evaluate` scores
each and reports their mean as ``accuracy``, each under ``"depths"`` as
``{"depth": p_ignore, "accuracy": ...}``).
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .tasks import Batch, step_generator

__all__ = [
    "CountTask",
    "FlipFlopTask",
    "PAPER_TASKS",
    "COUNT_WEIGHTS",
    "COUNT_VOCAB",
    "MAX_VALUE",
    "FLIPFLOP_VOCAB",
    "P_IGNORE_TRAIN",
    "P_IGNORE_TESTS",
    "count_program",
    "flip_flop",
    "paper_task",
]

PAPER_TASKS = ("count", "flip-flop")

# ---------------------------------------------------------------- count (CoPE)

COUNT_WEIGHTS = {"set": 1, "pass": 50, "increment": 7}  # the original's OP_WEIGHTS, in its order
MAX_VALUE = 10  # an increment past it is redrawn
VARIABLES = list(string.ascii_lowercase)
PAD = 0
# every word the programs use; id 0 pads (the original's "<pad>" is its id 0 too)
COUNT_VOCAB = ("<pad>", "=", ";", "pass;", "++;", "print", *map(str, range(MAX_VALUE + 1)), *VARIABLES)
_COUNT_ID = {w: i for i, w in enumerate(COUNT_VOCAB)}
_TRIALS = 100  # redraws of one statement before giving up (the original's limit)


def count_program(rng: random.Random, nsteps: int, nvars: int) -> tuple[list[str], str, int] | None:
    """One program of ``nsteps`` statements, drawn with ``rng`` as the original draws it.

    Returns:
        ``(statements, v, value)``: the statements (``"a = 0 ;"``, ``"pass;"``, ``"a ++;"``),
        the printed variable and its value; None when no variable was set (the caller
        draws again).
    """
    names = VARIABLES[:nvars]
    ops, weights = list(COUNT_WEIGHTS), list(COUNT_WEIGHTS.values())
    values: dict[str, int] = {}  # in the order variables were first set (print draws from it)
    out: list[str] = []
    for _ in range(nsteps):
        for _ in range(_TRIALS):
            op = rng.choices(ops, weights, k=1)[0]
            if op == "set":
                v = rng.choice(names)
                values[v] = 0
                out.append(f"{v} = 0 ;")
                break
            if op == "pass":
                out.append("pass;")
                break
            if values:  # increment a set variable, unless it is at the cap
                v = rng.choice(list(values))
                if values[v] < MAX_VALUE:
                    values[v] += 1
                    out.append(f"{v} ++;")
                    break
        else:
            raise RuntimeError(f"count: no statement drawn in {_TRIALS} trials")
    if not values:
        return None
    v = rng.choice(list(values))
    return out, v, values[v]


@dataclass
class CountTask:
    """CoPE's counting task; ``length`` means statements (``max_steps`` in training).

    Args:
        nvars: variables (the paper: 1, 3 or 5; the original's default 3).
        seed: the batches of step ``s`` depend only on ``(seed, s)``.
    """

    nvars: int = 3
    seed: int = 0

    kind = "task"
    name = "count"
    vocab_size = len(COUNT_VOCAB)

    def __post_init__(self) -> None:
        if not 1 <= self.nvars <= len(VARIABLES):
            raise ValueError(f"count: nvars must be in [1, {len(VARIABLES)}], got {self.nvars!r}")

    def seq_len(self, n: int) -> int:
        """Input tokens of the longest program of ``n`` statements (every one a 4-word SET),
        ``print v`` included; evaluation batches are padded to it."""
        return 4 * n + 2

    def draw(self, rng: random.Random, nsteps: int | None, max_steps: int) -> list[str]:
        """The words of one sample: ``nsteps`` statements (None: ``randint(3, max_steps)``,
        drawn again with the program when it sets no variable), ``print v``, the value."""
        while True:
            n = rng.randint(3, max_steps) if nsteps is None else nsteps
            prog = count_program(rng, n, self.nvars)
            if prog is not None:
                statements, v, value = prog
                return " ".join(statements).split() + ["print", v, str(value)]

    def batch(self, samples: list[list[str]], width: int | None = None) -> Batch:
        """Samples (lists of words) as a right-padded batch of ``width`` input tokens
        (None: the longest); ``mask`` marks each row's answer target."""
        ids = [[_COUNT_ID[w] for w in s] for s in samples]
        width = max(len(r) for r in ids) - 1 if width is None else width
        seq = torch.full((len(ids), width + 1), PAD, dtype=torch.long)  # (B, L+1)
        mask = torch.zeros(len(ids), width, dtype=torch.bool)  # (B, L)
        for b, r in enumerate(ids):
            seq[b, : len(r)] = torch.tensor(r)
            mask[b, len(r) - 2] = True  # the target after "print v": the value
        return Batch(seq[:, :-1], seq[:, 1:], mask)

    def sample(self, n: int, count: int, rng: random.Random) -> Batch:
        """``count`` programs of exactly ``n`` statements, padded to ``seq_len(n)``."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"count: size must be a positive int (statements), got {n!r}")
        return self.batch([self.draw(rng, n, n) for _ in range(count)], self.seq_len(n))

    def train_batch(self, step: int, batch_size: int, length: int, seed: int | None = None) -> Batch:
        """Programs of ``randint(3, length)`` statements each (the original's training
        distribution with ``max_steps = length``), padded to the longest row."""
        if length < 3:
            raise ValueError(f"count: the training length (max_steps) must be >= 3, got {length}")
        rng = random.Random(f"count/{self.seed if seed is None else seed}/{step}")
        return self.batch([self.draw(rng, None, length) for _ in range(batch_size)])

    def eval_batches(self, length: int, batch_size: int, count: int) -> Iterator[Batch]:
        """``count`` fixed programs of exactly ``length`` statements (seeded apart from training)."""
        rng = random.Random(f"count-eval/{self.seed}/{length}")
        for s in range(0, count, batch_size):
            yield self.sample(length, min(batch_size, count - s), rng)


# ---------------------------------------------------------------- flip-flop (Liu et al.)

FLIPFLOP_VOCAB = ("w", "r", "i", "0", "1")  # the dataset card's ids 0-4
W, R, I, BIT0 = 0, 1, 2, 3
P_IGNORE_TRAIN = 0.8
P_IGNORE_TESTS = (0.8, 0.98, 0.1)  # in-distribution, sparse, dense


def flip_flop(n: int, count: int, p_ignore: float, g: torch.Generator) -> torch.Tensor:
    """``count`` flip-flop strings of ``n`` instructions, ``(count, 2 n)`` token ids.

    The first instruction is ``w``, the last ``r``; the others are ``w``, ``r``, ``i``
    with probabilities ``(1 - p_ignore) / 2``, ``(1 - p_ignore) / 2``, ``p_ignore``.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        raise ValueError(f"flip-flop: size must be an int >= 2 (instructions), got {n!r}")
    if not 0 <= p_ignore <= 1:
        raise ValueError(f"flip-flop: p_ignore must be in [0, 1], got {p_ignore!r}")
    p_rw = (1 - p_ignore) / 2
    probs = torch.tensor([p_rw, p_rw, p_ignore])
    ins = torch.multinomial(probs.expand(count, 3), n, replacement=True, generator=g)  # (B, n) in {W, R, I}
    ins[:, 0], ins[:, -1] = W, R
    bits = torch.randint(0, 2, (count, n), generator=g)  # (B, n) the bits of w and i
    at = torch.arange(n).expand(count, n)
    last_w = torch.where(ins == W, at, -1).cummax(1).values  # (B, n) index of the last write so far (>= 0)
    bits = torch.where(ins == R, bits.gather(1, last_w), bits)
    return torch.stack([ins, bits + BIT0], -1).flatten(1)  # (B, 2n): instruction, bit, ...


@dataclass
class FlipFlopTask:
    """Flip-flop language modelling; ``length`` means instructions (a sequence is 2 n tokens).

    Args:
        p_ignore: p(i) of the training strings (the paper's 0.8).
        seed: the batches of step ``s`` depend only on ``(seed, s)``.
    """

    p_ignore: float = P_IGNORE_TRAIN
    seed: int = 0

    kind = "task"
    name = "flip-flop"
    vocab_size = len(FLIPFLOP_VOCAB)
    # the evaluation variants (evaluate() reads them as passkey's depths): p(i) of each test set
    depths = P_IGNORE_TESTS

    def seq_len(self, n: int) -> int:
        """Input tokens for ``n`` instructions (the last bit is never an input)."""
        return 2 * n - 1

    def sample(self, n: int, count: int, p_ignore: float, g: torch.Generator) -> Batch:
        """``count`` strings of ``n`` instructions; ``mask`` marks the bit after every read."""
        seq = flip_flop(n, count, p_ignore, g)
        tokens, targets = seq[:, :-1], seq[:, 1:]
        return Batch(tokens, targets, tokens == R)

    def train_batch(self, step: int, batch_size: int, length: int, seed: int | None = None) -> Batch:
        """Strings of exactly ``length`` instructions at the training p(i)."""
        g = step_generator(self.seed if seed is None else seed, step)
        return self.sample(length, batch_size, self.p_ignore, g)

    def eval_batches(self, length: int, batch_size: int, count: int, depth: float = P_IGNORE_TRAIN) -> Iterator[Batch]:
        """``count`` fixed strings of ``length`` instructions at p(i) = ``depth``."""
        g = torch.Generator().manual_seed(10_000_019 * (self.seed + 1) + 7919 * length + int(1000 * depth))
        for s in range(0, count, batch_size):
            yield self.sample(length, min(batch_size, count - s), depth, g)


def paper_task(name: str, seed: int = 0) -> CountTask | FlipFlopTask:
    """The task ``name`` (one of :data:`PAPER_TASKS`) with the papers' defaults."""
    if name == "count":
        return CountTask(seed=seed)
    if name == "flip-flop":
        return FlipFlopTask(seed=seed)
    raise ValueError(f"unknown paper task {name!r}; tasks: {', '.join(PAPER_TASKS)}")
