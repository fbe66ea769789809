"""Kazemnejad et al. 2023's length-generalisation suite, in their formats.

"The Impact of Positional Encoding on Length Generalization in Transformers" (NeurIPS
2023) trains decoder-only models on sizes up to ``L`` and tests them on sizes ``L + 1 ..
2 L``. Their code (github.com/McGill-NLP/length-generalization) draws each problem in
``scripts/dataset_builders/make_*_dataset.py`` (with ``numpy.random``) and writes it as
text in ``src/data/data_instance_processor/*`` (the "classic" setting: no scratchpad); a
decoder-only sample is ``prompt + sep + target + </s>`` (``s2s_dl_factory.py``, the
separator from ``configs/data/s2s_*.jsonnet``) and only the target is trained
(``decoder_only_mask_inputs``). This module is our own code for the same algorithms: given
the same ``numpy.random.RandomState``, each ``draw`` returns the record their builder
writes and :func:`texts` the strings their processor makes of it
(``tests/test_kazemnejad_tasks.py`` checks both against transcriptions of the originals)::

    kaz-copy        Copy: <3> <41> <7> [SEP] <3> <41> <7></s>
    kaz-addition    Compute 4 7 + 9 ? The answer is 5 6.</s>
    kaz-lego        If c = +1, q = - c, t = + q. Then, what is the value of t? The answer is -1.</s>

Tasks (size ``n``; the original's builder and option): ``kaz-copy`` / ``kaz-copy-2x`` (n
symbols; ``make_copy_dataset`` ``copy_multi_char`` / ``_2x``), ``kaz-reverse`` /
``kaz-reverse-2x`` (``make_reverse_dataset`` ``multi_char`` / ``_2x``), ``kaz-addition`` (n
= the longer operand's digits), ``kaz-poly`` (n terms, answer mod 10), ``kaz-sort`` (n
symbols of 50, ``--single_digit``), ``kaz-sort-multi`` (n numbers in [10, 9999]),
``kaz-sum`` (n digits 1-9, answer mod 10), ``kaz-parity`` (n bits), ``kaz-lego`` (a chain
of n variables, the query in its second half).

Differences, all of tokenisation or sampling around the same records:

* Tokens: the original runs T5's SentencePiece tokenizer over the text; posenc splits it
  into words, single digits and single punctuation marks (``[SEP]``, ``[NEXT]``, ``</s>``
  and the symbols ``<k>`` one token each), its own vocabulary of :data:`VOCAB`. The
  symbols of copy, reverse and sort are ``<0> .. <99>``: the original takes the first 100
  (sort: 50) strings T5 keeps as one token each (``get_unique_tokens``); to a model trained
  from scratch only their number matters.
* Sizes: the original writes equal numbers of samples per training size in
  ``[train_min, L]`` (default ``train_min`` 4) and per test size in ``[L + 1, 2 L]``;
  posenc draws each training sample's size uniformly in ``[min_size, L]`` (1; LEGO: 2, the
  smallest chain with a query) and evaluates one column per size ``n`` (the original's test
  set is the mixture of the columns ``L + 1 .. 2 L``). Addition's size is the pair of digit
  counts, each uniform in training; column ``n`` takes the pairs whose longer operand has
  ``n`` digits, uniformly (the original's test bins: one operand past ``L``).
* LEGO: the original writes one sample per query of the chain's second half; posenc draws
  one of those queries uniformly per chain.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from .tasks import KAZEMNEJAD_TASKS, Batch

__all__ = ["KAZEMNEJAD_TASKS", "KazemnejadTask", "SYMBOLS", "VOCAB", "draw", "texts", "tokenize"]

SYMBOLS = tuple(f"<{i}>" for i in range(100))  # the stand-ins of T5's first 100 one-token strings
_LETTERS = tuple("abcdefghijklmnopqrstuvwxyz")
_WORDS = ("Copy", "Reverse", "Compute", "The", "answer", "is", "Evaluate", "at", "in", "Sort", "the", "following",
          "list", "sorted", "Is", "number", "of", "even", "sequence", "Yes", "No", "If", "Then", "what", "value")  # fmt: skip
VOCAB = ("<pad>", "</s>", "[SEP]", "[NEXT]", *map(str, range(10)), *"+-*=?.,[]':", *_WORDS, *_LETTERS, *SYMBOLS)
_ID = {w: i for i, w in enumerate(VOCAB)}
PAD, EOS = 0, 1
_TOKEN = re.compile(r"\[[A-Z]+\]|<\d+>|[A-Za-z]+|\d|\S")
ALL_VARS = _LETTERS  # make_lego_dataset.py's ALL_VARS
LEGO_VALUES = ("-1", "+1")  # its NICE_VALUES (the processor's {"0": "-1", "1": "+1"})
PARITY_ANSWER = {0: "Yes", 1: "No"}  # "Is the number of 1's even": the processor's NICE_VALUES
MAX_DIGITS = 18  # numpy.random.randint draws int64: 10**18 is the largest bound it takes


def tokenize(text: str) -> list[str]:
    """Words, single digits and single punctuation marks; ``[SEP]``, ``[NEXT]``, ``<k>`` whole."""
    return _TOKEN.findall(text)


def number_to_string(x: int) -> str:
    """The original's ``number_to_string``: digits apart, a negative sign as ``"- "``."""
    return "- " + number_to_string(-x) if x < 0 else " ".join(str(x))


# ---------------------------------------------------------------- the builders' draws
def _symbols(rs: np.random.RandomState, n: int, k: int) -> list[str]:
    return [SYMBOLS[i] for i in rs.randint(0, k, n)]


def _draw_copy(rs, n):
    tokens = _symbols(rs, n, 100)
    return {"repeat": n, "src_seq": " ".join(tokens), "tgt_seq": " ".join(tokens), "cat": n}


def _draw_copy_2x(rs, n):
    s = " ".join(_symbols(rs, n, 100))
    return {"repeat": n, "src_seq": s, "tgt_seq": s + " [NEXT] " + s, "cat": n}


def _draw_reverse(rs, n):
    tokens = _symbols(rs, n, 100)
    return {"repeat": n, "src_seq": " ".join(tokens), "tgt_seq": " ".join(tokens[::-1]), "cat": n}


def _draw_reverse_2x(rs, n):
    tokens = _symbols(rs, n, 100)
    r = " ".join(tokens[::-1])
    return {"repeat": n, "src_seq": " ".join(tokens), "tgt_seq": r + " [NEXT] " + r, "cat": n}


def _operand(rs, digits: int) -> int:
    low = 10 ** (digits - 1)
    return int(rs.randint(0 if low == 1 else low, 10**digits))


def _draw_addition(rs, size):
    da, db = size
    a = _operand(rs, da)
    b = _operand(rs, db)
    return {"a": a, "b": b, "sum": a + b, "cat": f"{da}-by-{db}"}


def _draw_poly(rs, n):
    coeffs = rs.randint(-3, 4, (n,)).tolist()
    degrees = rs.randint(0, 4, (n,)).tolist()
    x = int(rs.randint(-2, 3))
    ans = sum(c * x**d for c, d in zip(coeffs, degrees))
    return {"coeffs": coeffs, "degrees": degrees, "x": x, "answer": ans, "cat": n}


def _draw_sort(rs, n):
    ids = rs.randint(0, 50, n)
    return {"token_ids": ids.tolist(), "src_seq": [SYMBOLS[i] for i in ids],
            "tgt_seq": [SYMBOLS[i] for i in np.sort(ids)], "cat": n}  # fmt: skip


def _draw_sort_multi(rs, n):
    nums = rs.randint(10, 10000, n)
    return {"src_seq": nums.tolist(), "tgt_seq": np.sort(nums).tolist(), "cat": n}


def _draw_sum(rs, n):
    values = rs.randint(1, 10, (n,)).tolist()
    return {"values": values, "answer": sum(values), "cat": n}


def _draw_parity(rs, n):
    values = rs.randint(0, 2, (n,)).tolist()
    return {"values": values, "answer": sum(values) % 2, "cat": n}


def _draw_lego(rs, n):
    values = rs.randint(0, 2, (n,)).tolist()
    order = [ALL_VARS[i] for i in rs.permutation(len(ALL_VARS)).tolist()]
    clauses = [f"{order[0]} = {LEGO_VALUES[values[0]]}"]
    clauses += [f"{order[i]} = {'+' if values[i] == values[i - 1] else '-'} {order[i - 1]}" for i in range(1, n)]
    truth = [(order[i], str(values[i])) for i in range(n)]
    q = int(rs.randint(n // 2 + n % 2, n))  # posenc's pick among the original's queries (second half)
    return {"clauses": clauses, "truth_values": truth, "query": order[q], "cat": (n, q)}


# ---------------------------------------------------------------- the processors' texts
def _list(items) -> str:
    return ", ".join(items)


_TEXTS: dict[str, Callable[[dict], tuple[str, str, str]]] = {  # (prompt, separator, target)
    "kaz-copy": lambda r: (f"Copy: {r['src_seq']} ", "[SEP] ", r["tgt_seq"]),
    "kaz-copy-2x": lambda r: (f"Copy: {r['src_seq']} ", "[SEP] ", r["tgt_seq"]),
    "kaz-reverse": lambda r: (f"Reverse: {r['src_seq']} ", "[SEP] ", r["tgt_seq"]),
    "kaz-reverse-2x": lambda r: (f"Reverse: {r['src_seq']} ", "[SEP] ", r["tgt_seq"]),
    "kaz-addition": lambda r: (f"Compute {number_to_string(r['a'])} + {number_to_string(r['b'])} ? ", "",
                               f"The answer is {number_to_string(r['sum'])}."),
    "kaz-poly": lambda r: ("Evaluate at x = {} in {} ? ".format(number_to_string(r["x"]), " + ".join(
                               f"{number_to_string(c)} * x ** {number_to_string(d)}"
                               for c, d in zip(r["coeffs"], r["degrees"]))), "",
                           f"The answer is {number_to_string(r['answer'] % 10)}."),
    "kaz-sort": lambda r: (f"Sort the following list [ {_list(r['src_seq'])} ]. ", "",
                           f"The sorted list is [ {_list(r['tgt_seq'])} ]."),
    "kaz-sort-multi": lambda r: (f"Sort the following list [ {_list(map(number_to_string, r['src_seq']))} ]. ", "",
                                 f"The sorted list is [ {_list(map(number_to_string, r['tgt_seq']))} ]."),
    "kaz-sum": lambda r: ("Compute: {} .".format(" + ".join(map(str, r["values"]))), "[SEP] ",
                          f"The answer is {number_to_string(r['answer'] % 10)} ."),
    "kaz-parity": lambda r: (f"Is the number of 1's even in the sequence [ {_list(map(str, r['values']))} ] ? ", "",
                             f"The answer is {PARITY_ANSWER[r['answer']]}."),
    "kaz-lego": lambda r: (f"If {_list(r['clauses'])}. Then, what is the value of {r['query']}? ", "",
                           "The answer is {}.".format(LEGO_VALUES[int(dict(r["truth_values"])[r["query"]])])),
}  # fmt: skip

# name: (draw, smallest size, largest size or None, input tokens of the longest sample = a n + b)
_SPECS = {
    "kaz-copy": (_draw_copy, 1, None, (2, 3)),
    "kaz-copy-2x": (_draw_copy_2x, 1, None, (3, 4)),
    "kaz-reverse": (_draw_reverse, 1, None, (2, 3)),
    "kaz-reverse-2x": (_draw_reverse_2x, 1, None, (3, 4)),
    "kaz-addition": (_draw_addition, 1, MAX_DIGITS, (3, 8)),
    "kaz-poly": (_draw_poly, 1, None, (8, 12)),
    "kaz-sort": (_draw_sort, 1, None, (4, 12)),
    "kaz-sort-multi": (_draw_sort_multi, 1, None, (10, 12)),
    "kaz-sum": (_draw_sum, 1, None, (2, 8)),
    "kaz-parity": (_draw_parity, 1, None, (2, 18)),
    "kaz-lego": (_draw_lego, 2, len(ALL_VARS), (5, 16)),
}
if tuple(_SPECS) != KAZEMNEJAD_TASKS:  # the names posenc.data.tasks lists for every task
    raise RuntimeError(f"kazemnejad: tasks {tuple(_SPECS)} differ from posenc.data.tasks {KAZEMNEJAD_TASKS}")


def draw(name: str, rs: np.random.RandomState, size) -> dict:
    """One record of task ``name`` as its builder writes it (``size``: ``n``; addition: the
    digit counts ``(a, b)``), drawn from ``rs`` as the builder draws from ``numpy.random``."""
    return _SPECS[name][0](rs, size)


def texts(name: str, record: dict) -> tuple[str, str]:
    """``(prompt + separator, target)``: the strings the original's processor and
    decoder-only tokenize function make of ``record`` (``</s>`` follows the target)."""
    prompt, sep, target = _TEXTS[name](record)
    return prompt + sep, target


def _rs(*key) -> np.random.RandomState:
    h = hashlib.sha256("/".join(map(str, key)).encode()).digest()
    return np.random.RandomState(int.from_bytes(h[:4], "little"))


@dataclass
class KazemnejadTask:
    """One task of :data:`KAZEMNEJAD_TASKS`; ``length`` means the task's size ``n``.

    Args:
        name: the task.
        seed: the batches of step ``s`` depend only on ``(seed, s)``.
    """

    name: str
    seed: int = 0

    kind = "task"
    vocab_size = len(VOCAB)

    def __post_init__(self) -> None:
        if self.name not in _SPECS:
            raise ValueError(f"unknown task {self.name!r}; Kazemnejad et al.'s: {', '.join(KAZEMNEJAD_TASKS)}")
        _, self.min_size, self.max_size, self._len = _SPECS[self.name]

    def seq_len(self, n: int) -> int:
        """Input tokens of the longest sample of size ``n`` (evaluation batches are padded to it)."""
        a, b = self._len
        return a * n + b

    def _check(self, n: int, what: str) -> None:
        top = self.max_size if self.max_size is not None else float("inf")
        if not isinstance(n, int) or isinstance(n, bool) or not self.min_size <= n <= top:
            bound = f"[{self.min_size}, {self.max_size}]" if self.max_size else f">= {self.min_size}"
            raise ValueError(f"{self.name}: {what} must be an int {bound}, got {n!r}")

    def tokens(self, record: dict) -> tuple[list[int], int]:
        """A record's token ids (``</s>`` last) and the number of prompt tokens."""
        prompt, target = texts(self.name, record)
        words = tokenize(prompt), tokenize(target)
        try:
            ids = [_ID[w] for w in words[0] + words[1]] + [EOS]
        except KeyError as e:  # a format this vocabulary does not cover: a bug, said plainly
            raise ValueError(f"{self.name}: token {e.args[0]!r} is not in the vocabulary") from None
        return ids, len(words[0])

    def batch(self, records: list[dict], width: int | None = None) -> Batch:
        """Records as a right-padded batch of ``width`` input tokens (None: the longest);
        ``mask`` marks every target token (``</s>`` included), the original's labels."""
        rows = [self.tokens(r) for r in records]
        width = max(len(ids) for ids, _ in rows) - 1 if width is None else width
        seq = torch.full((len(rows), width + 1), PAD, dtype=torch.long)  # (B, L+1)
        mask = torch.zeros(len(rows), width, dtype=torch.bool)  # (B, L)
        for b, (ids, p) in enumerate(rows):
            seq[b, : len(ids)] = torch.tensor(ids)
            mask[b, p - 1 : len(ids) - 1] = True  # targets p .. end are predicted at p - 1 ..
        return Batch(seq[:, :-1], seq[:, 1:], mask)

    def _column(self, rs: np.random.RandomState, n: int):
        """The size of a sample of column ``n``: ``n``; addition: a digit pair with max ``n``."""
        if self.name != "kaz-addition":
            return n
        k = int(rs.randint(0, 2 * (n - self.min_size) + 1))  # (n, j) for j = min..n, then (j, n) for j < n
        return (n, self.min_size + k) if k <= n - self.min_size else (self.min_size + k - (n - self.min_size) - 1, n)

    def _train_size(self, rs: np.random.RandomState, length: int):
        if self.name == "kaz-addition":
            return int(rs.randint(self.min_size, length + 1)), int(rs.randint(self.min_size, length + 1))
        return int(rs.randint(self.min_size, length + 1))

    def _records(self, n: int, count: int, rs: np.random.RandomState) -> list[dict]:
        """``count`` records of column ``n`` drawn from ``rs``."""
        self._check(n, "size")
        return [draw(self.name, rs, self._column(rs, n)) for _ in range(count)]

    def sample(self, n: int, count: int, rs: np.random.RandomState) -> Batch:
        """``count`` samples of column ``n``, padded to ``seq_len(n)``."""
        return self.batch(self._records(n, count, rs), self.seq_len(n))

    def train_batch(self, step: int, batch_size: int, length: int, seed: int | None = None) -> Batch:
        """Samples of sizes uniform in ``[min_size, length]``, padded to the longest row."""
        self._check(length, "the training length")
        rs = _rs(self.name, self.seed if seed is None else seed, step)
        return self.batch([draw(self.name, rs, self._train_size(rs, length)) for _ in range(batch_size)])

    def eval_records(self, length: int, count: int) -> list[dict]:
        """The records of :meth:`eval_batches` (same order): each has the builder's ``cat``."""
        return self._records(length, count, _rs(self.name, "eval", self.seed, length))

    def eval_batches(self, length: int, batch_size: int, count: int) -> Iterator[Batch]:
        """``count`` fixed samples of column ``length`` (seeded apart from training)."""
        records = self.eval_records(length, count)
        for s in range(0, count, batch_size):
            yield self.batch(records[s : s + batch_size], self.seq_len(length))
