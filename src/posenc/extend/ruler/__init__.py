"""RULER's synthetic tasks in ``posenc extend --tasks``: generated here, scored as RULER scores them.

Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language Models?"
(COLM 2024). The tasks, templates and distributions are lm-eval 0.4.13's port
(``lm_eval/tasks/ruler``), under lm-eval's task names; every one needs no download:

==================  ==================================================================
``niah_single_1``   one needle (word key, 7-digit value) in the noise haystack
``niah_multikey_2`` one needle among distractor needles (the whole haystack is needles)
``niah_multikey_3`` the same with UUID keys and values
``niah_multivalue_noise``  four values under one key, noise haystack (lm-eval's
                    ``niah_multivalue`` uses the essay haystack, a download)
``niah_multiquery_noise``  four keys asked at once, noise haystack (likewise)
``ruler_vt``        variable tracking: 1 chain of 4 hops, with a one-shot example
``ruler_cwe``       common-words extraction: the 10 most repeated words of a list
``ruler_fwe``       frequent-words extraction: the 3 most frequent coded words
==================  ==================================================================

Samples are sized to the evaluated length with the model's tokenizer (special tokens
included, as lm-eval counts). The seeds are lm-eval's defaults (``random`` 0, ``numpy`` 1234):
the samples of one task at one length equal lm-eval's in a fresh process
(tests/test_extend_ruler.py). A sample is scored by RULER's ``string_match_all``: the share
of its reference strings found (case-insensitive) in the greedy output, so a multi-answer
task gives part credit. :data:`THRESHOLD` is RULER's bar for "effective length".
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .aggregate import cwe_samples, fwe_samples, vt_samples
from .niah import niah_samples

__all__ = ["TASKS", "Task", "THRESHOLD", "PY_SEED", "NP_SEED", "samples", "check_tasks", "effective_length"]

PY_SEED, NP_SEED = 0, 1234  # lm-eval's simple_evaluate defaults: random_seed, numpy_random_seed
# RULER's threshold: Llama2-7B's average at 4K, 85.6 (the paper's Table 3 and NVIDIA/RULER's README,
# where e.g. GPT-4-1106 scores 87.0 at 64K and 81.2 at 128K: effective length 64K). The effective
# length is the longest length whose average over the tasks exceeds it.
THRESHOLD = 85.6


@dataclass(frozen=True)
class Task:
    """One task: its generator ``make(tokenizer, length, n, rng, np_rng)``, generation budget and
    the delimiter lm-eval puts between the input and the answer prefix."""

    make: Callable
    max_gen_toks: int
    target_delimiter: str = " "
    words: bool = True  # draws from wonderwords' lists


def _niah(**kw) -> Callable:
    return lambda tok, length, n, rng, np_rng: niah_samples(tok, length, n, rng, **kw)


TASKS: dict[str, Task] = {
    "niah_single_1": Task(_niah(type_haystack="repeat", type_needle_k="words", type_needle_v="numbers"), 128),
    "niah_multikey_2": Task(_niah(type_haystack="needle", type_needle_k="words", type_needle_v="numbers"), 128),
    "niah_multikey_3": Task(
        _niah(type_haystack="needle", type_needle_k="uuids", type_needle_v="uuids"), 128, words=False
    ),
    "niah_multivalue_noise": Task(
        _niah(type_haystack="repeat", type_needle_k="words", type_needle_v="numbers", num_needle_v=4), 128
    ),
    "niah_multiquery_noise": Task(
        _niah(type_haystack="repeat", type_needle_k="words", type_needle_v="numbers", num_needle_q=4), 128
    ),
    "ruler_vt": Task(lambda tok, length, n, rng, np_rng: vt_samples(tok, length, n, rng, np_rng), 30, words=False),
    "ruler_cwe": Task(lambda tok, length, n, rng, np_rng: cwe_samples(tok, length, n, rng), 120, "\n\n"),
    "ruler_fwe": Task(lambda tok, length, n, rng, np_rng: fwe_samples(tok, length, n, rng), 50, words=False),
}


def check_tasks(names: list[str]) -> list[str]:
    """``names`` if every one is a task here; else one ``ValueError`` naming the unknown and the allowed."""
    bad = [n for n in names if n not in TASKS]
    if bad:
        raise ValueError(f"--tasks: {', '.join(map(repr, bad))} is not a RULER task posenc generates; allowed: "
                         f"{', '.join(TASKS)}")  # fmt: skip
    if any(TASKS[n].words for n in names):
        from .words import need_wonderwords

        try:
            need_wonderwords()
        except ValueError as e:
            raise ValueError(f"--tasks: {e}") from None
    return names


def samples(task: str, tokenizer, length: int, n: int, *, seed: int = PY_SEED, np_seed: int = NP_SEED) -> list[dict]:
    """``n`` samples of ``task`` at ``length`` tokens, from ``random.Random(seed)`` and
    ``numpy.random.RandomState(np_seed)``: lm-eval's for the same seeds (its global ``random``
    seeded with ``seed``, ``numpy`` with ``np_seed``)."""
    return TASKS[check_tasks([task])[0]].make(tokenizer, length, n, random.Random(seed),
                                              np.random.RandomState(np_seed))  # fmt: skip


def effective_length(scores: dict[int, float], threshold: float = THRESHOLD) -> int | None:
    """RULER's effective length: the longest length whose score (0-100, the mean over tasks)
    is above ``threshold``; None when none is."""
    above = [n for n, s in scores.items() if s is not None and s > threshold]
    return max(above) if above else None
