"""The word lists RULER's tasks draw from, read from the ``wonderwords`` package (no download).

* :data:`niah_keys`: lm-eval's ``prepare_niah.WORDS``, ``sorted(set(f"{adj}-{noun}"))`` over
  wonderwords' adjectives and nouns (6.2 million strings). lm-eval builds the list (16 s,
  0.8 GB); :class:`PairWords` answers its length and any index without building it, so
  ``rng.choice`` draws the same word from the same random state.
* :func:`cwe_words`: lm-eval's ``cwe_utils.WORDS``, the sorted nouns, adjectives and verbs,
  shuffled once by ``random.Random(42)`` (and that generator's state after it).
"""

from __future__ import annotations

import bisect
import random
from functools import cache

__all__ = ["PairWords", "niah_keys", "cwe_words", "need_wonderwords"]


def need_wonderwords():
    """The ``wonderwords`` categories, or a one-line error naming the extra that installs it."""
    try:
        import wonderwords
    except ImportError:
        raise ValueError(
            "RULER's tasks draw words from the `wonderwords` package, which is not installed; "
            "install it with `pip install wonderwords` (or `pip install posenc[lmeval]`)"
        ) from None
    return wonderwords.RandomWord()._categories


class PairWords:
    """``sorted(set(f"{a}-{b}" for a in first for b in second))`` as a lazy sequence.

    Sorted by ``a + "-"``, the first words fall into groups: a word and those that extend it
    with ``-`` ("blue", "blue-eyed") interleave their pairs; every other group's pairs form
    one block, in the order of ``second``. A group of several words is built in full (a few
    times ``len(second)`` strings); the others are indexed.
    """

    def __init__(self, first, second) -> None:
        self.second = sorted(set(second))
        groups: list[list[str]] = []
        for a in sorted(set(first), key=lambda a: a + "-"):
            if groups and (a + "-").startswith(groups[-1][0] + "-"):
                groups[-1].append(a)
            else:
                groups.append([a])
        self.blocks: list[str | list[str]] = []
        self.starts: list[int] = []
        n = 0
        for g in groups:
            self.starts.append(n)
            if len(g) == 1:
                self.blocks.append(g[0])
                n += len(self.second)
            else:
                merged = sorted({f"{a}-{b}" for a in g for b in self.second})
                self.blocks.append(merged)
                n += len(merged)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> str:
        if not 0 <= i < self.n:
            raise IndexError(i)
        k = bisect.bisect_right(self.starts, i) - 1
        block, j = self.blocks[k], i - self.starts[k]
        return block[j] if isinstance(block, list) else f"{block}-{self.second[j]}"


@cache
def niah_keys() -> PairWords:
    c = need_wonderwords()
    return PairWords(c["adjectives"], c["nouns"])


@cache
def cwe_words() -> tuple[tuple[str, ...], tuple]:
    """``(words, state)``: the shuffled list and the state of ``random.Random(42)`` after the
    shuffle (lm-eval's module-level ``RNG``, which goes on to shuffle every word list)."""
    c = need_wonderwords()
    words = sorted({w for x in ("noun", "adjective", "verb") for w in c[x]})
    rng = random.Random(42)
    rng.shuffle(words)
    return tuple(words), rng.getstate()
