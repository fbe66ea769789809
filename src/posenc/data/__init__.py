"""Data for ``posenc compare``: byte-level text corpora and synthetic tasks.

Every source is byte-level or a small symbol vocabulary, so no tokenizer and no
download is needed:

* :func:`embedded_corpus` — the English prose of Python's own documentation
  (``pydoc_data.topics``, ~465 kB, part of every CPython);
* :func:`read_text` — any UTF-8 file (``--text FILE``);
* :func:`load_hf_dataset` — a Hugging Face dataset (``--dataset NAME``); optional,
  it needs the ``datasets`` package and the hub (or its local cache) and fails with a
  :class:`DataError` that says so;
* :mod:`posenc.data.tasks` — ``copy``, ``reverse``, ``sort``, ``associative-recall``;
* :mod:`posenc.data.passkey` — passkey retrieval from filler text of a corpus.
* :mod:`posenc.data.grid` — ``grid``: the symbol above each cell of a 2-D grid.
* :mod:`posenc.data.paper_tasks` — ``count`` (CoPE's counting) and ``flip-flop`` (Liu et
  al. 2023), generated as the papers generate them.
* :mod:`posenc.data.kazemnejad` — Kazemnejad et al. 2023's suite (``kaz-copy``,
  ``kaz-addition``, ``kaz-lego``, ...) in their formats.

:class:`TextData` splits a byte string deterministically into train and validation
(the last ``val_fraction`` of the bytes) and serves batches that depend only on
``(seed, step)``, so every encoding sees the same data in the same order and a resumed
run sees what an uninterrupted one would.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .grid import GridTask, positions_for
from .kazemnejad import KAZEMNEJAD_TASKS, KazemnejadTask
from .paper_tasks import PAPER_TASKS, CountTask, FlipFlopTask, paper_task
from .passkey import PasskeyTask
from .tasks import TASK_NAMES, TASKS, Batch, SyntheticTask, step_generator

__all__ = [
    "Batch",
    "CountTask",
    "DataError",
    "FlipFlopTask",
    "PasskeyTask",
    "GridTask",
    "KAZEMNEJAD_TASKS",
    "KazemnejadTask",
    "TASKS",
    "TASK_NAMES",
    "SyntheticTask",
    "TextData",
    "embedded_corpus",
    "embedded_documents",
    "document_starts",
    "load_hf_dataset",
    "load_source",
    "read_text",
    "positions_for",
    "step_generator",
]


class DataError(RuntimeError):
    """A data source cannot be loaded (missing file, package, or network)."""


def embedded_corpus() -> bytes:
    """Python's documentation prose (``pydoc_data.topics``), topics in sorted order, UTF-8."""
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # stripped-down Python builds
        raise DataError("the embedded corpus needs the stdlib module pydoc_data.topics; use --text FILE") from e
    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def embedded_documents() -> list[bytes]:
    """The embedded corpus as its documents (one per pydoc topic, sorted), UTF-8.

    ``b"\\n\\n".join(embedded_documents()) == embedded_corpus()``.
    """
    try:
        from pydoc_data.topics import topics
    except ImportError as e:
        raise DataError("the embedded corpus needs the stdlib module pydoc_data.topics; use --text FILE") from e
    return [topics[k].encode("utf-8") for k in sorted(topics)]


def document_starts(data: bytes) -> list[int]:
    """Byte offsets where the documents of ``data`` start (the first is 0): a document
    (a paragraph) ends at every blank line, which stays with it.

    The embedded corpus holds 2608 of them, median 115 bytes.
    """
    return [0, *(m.end() for m in re.finditer(rb"\n\s*\n", data) if m.end() < len(data))]


def read_text(path: str | Path, *, max_bytes: int | None = None) -> bytes:
    """The bytes of a UTF-8 text file (validated as UTF-8); with ``max_bytes``, at most its
    first ``max_bytes`` (a UTF-8 sequence cut at the end is dropped), so a huge file costs
    only the part asked for.

    Raises:
        DataError: no such file, not a regular file (a folder, a FIFO, a device), unreadable,
            empty, or not UTF-8; the message names the path.
    """
    if not str(path).strip():
        raise DataError("--text must name a file, got ''")
    p = Path(path)
    if p.is_dir():
        raise DataError(f"--text: {str(p)!r} is a directory, not a text file")
    if not p.exists():
        raise DataError(f"--text: no such file {str(p)!r}")
    if not p.is_file():  # a FIFO would block, a device (/dev/zero) never ends
        raise DataError(f"--text: {str(p)!r} is not a regular file (a FIFO, a device or a socket); give a text file")
    try:
        with open(p, "rb") as f:
            data = f.read() if max_bytes is None else f.read(min(max_bytes, os.fstat(f.fileno()).st_size))
    except OSError as e:
        raise DataError(f"--text: cannot read {str(p)!r} ({e.strerror or e})") from None
    if not data.strip():
        raise DataError(f"--text: {str(p)!r} is empty")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        cut = max_bytes is not None and len(data) == max_bytes and e.start >= len(data) - 3
        if not cut:
            raise DataError(f"--text: {str(p)!r} is not UTF-8 ({e})") from e
        data = data[: e.start]  # the prefix ends inside one character
    return data


def load_hf_dataset(
    name: str, config: str | None = None, split: str = "train", field: str = "text", max_bytes: int = 20_000_000
) -> bytes:
    """The ``field`` column of a Hugging Face dataset, joined with newlines, up to ``max_bytes``.

    Raises:
        DataError: ``datasets`` is not installed, the hub cannot be reached (and the
            dataset is not cached), or the column does not exist.
    """
    try:
        import datasets
    except ImportError as e:
        raise DataError(
            f"--dataset {name!r} needs the optional package 'datasets' (pip install datasets); "
            "use the embedded corpus or --text FILE instead"
        ) from e
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as e:  # network, unknown name, bad config: all reported the same way
        raise DataError(
            f"could not load dataset {name!r} (config={config!r}, split={split!r}) from the Hugging Face hub "
            f"or its local cache: {type(e).__name__}: {e}"
        ) from e
    parts, size = [], 0
    try:
        for row in ds:
            if field not in row:
                raise DataError(f"dataset {name!r} has no column {field!r}; columns: {sorted(row)}")
            b = str(row[field]).encode("utf-8")
            parts.append(b)
            size += len(b) + 1
            if size >= max_bytes:
                break
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"reading dataset {name!r} failed: {type(e).__name__}: {e}") from e
    if not parts:
        raise DataError(f"dataset {name!r} split {split!r} is empty")
    return b"\n".join(parts)[:max_bytes]


@dataclass
class TextData:
    """Byte-level language modelling data with a deterministic train/validation split.

    ``train`` and ``val`` hold the bytes as uint8 tensors (one byte per token, and nothing
    per byte beside them); the batches are int64.

    Args:
        data: the corpus bytes.
        val_fraction: the last fraction of the bytes held out for evaluation.
        seed: data seed; the training batch of step ``s`` depends only on ``(seed, s)``.
        doc_starts: byte offsets where documents start (:func:`document_starts`): training
            windows are then packed sequences, each carrying its document ids (positions
            restart per document in :class:`posenc.TransformerLM`), and a target that
            begins a document is not scored (no document predicts the next). None: plain
            windows of the byte stream.
    """

    data: bytes
    val_fraction: float = 0.1
    seed: int = 0
    doc_starts: list[int] | None = None

    kind = "text"
    vocab_size = 256

    def __post_init__(self) -> None:
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        # the bytes stay uint8 (one byte per token: an 86 MB file is 86 MB here, not 688 MB as
        # int64); batches convert only their windows to int64
        t = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
        n_val = int(len(t) * self.val_fraction)
        self.train, self.val = t[: len(t) - n_val], t[len(t) - n_val :]
        if len(self.train) < 2 or len(self.val) < 2:
            raise ValueError(f"corpus of {len(t)} bytes is too small to split")
        # (S,) int64, sorted: where the training split's documents after the first start. The
        # document of byte i is the number of starts <= i, looked up per batch (no per-byte table)
        self.train_doc_starts = None
        if self.doc_starts is not None:
            starts = torch.tensor([s for s in self.doc_starts if 0 < s < len(self.train)], dtype=torch.long)
            self.train_doc_starts = torch.unique(starts)  # sorted

    def seq_len(self, length: int) -> int:
        """Tokens in a sequence of evaluation length ``length`` (the length itself)."""
        return length

    def train_batch(self, step: int, batch_size: int, length: int, seed: int | None = None) -> Batch:
        """Random windows of the train split: the same for a given ``(seed, step)`` (``seed``: this object's by default)."""
        if length + 1 > len(self.train):
            raise ValueError(f"train length {length} exceeds the train split ({len(self.train)} bytes)")
        g = step_generator(self.seed if seed is None else seed, step)
        starts = torch.randint(0, len(self.train) - length, (batch_size,), generator=g)  # (B,)
        idx = starts[:, None] + torch.arange(length + 1)  # (B, L+1)
        w = self.train[idx].long()
        if self.train_doc_starts is None:
            return Batch(w[:, :-1], w[:, 1:], None)
        d = torch.searchsorted(self.train_doc_starts, idx, right=True)  # (B, L+1) document of each byte
        docs = d[:, :-1] - d[:, :1]  # ids 0, 1, ... in each window
        return Batch(w[:, :-1], w[:, 1:], d[:, 1:] == d[:, :-1], None, docs)

    def eval_windows(self, length: int, max_tokens: int, stride: int | None = None) -> tuple[Tensor, Tensor]:
        """Windows of the validation split for evaluation at ``length``.

        Non-overlapping windows by default (``stride=None``); with ``stride < length``,
        sliding windows that score only their last ``stride`` tokens (except the first,
        which scores all), so every token is predicted once with up to ``length - stride``
        tokens of extra context. At most ``max_tokens // stride`` windows (at least 1).

        Returns:
            ``(windows, score_from)``: ``(N, length + 1)`` int64 tokens+next token, and
            ``(N,)`` the first scored index of each window.

        Raises:
            ValueError: the validation split is shorter than ``length + 1`` bytes.
        """
        step = length if stride is None else stride
        if not 1 <= step <= length:
            raise ValueError(f"stride must be in [1, {length}], got {stride}")
        if length + 1 > len(self.val):
            raise ValueError(f"eval length {length} exceeds the validation split ({len(self.val)} bytes)")
        n = max(1, min((len(self.val) - length - 1) // step + 1, max_tokens // step))
        starts = torch.arange(n) * step  # (N,)
        windows = self.val[starts[:, None] + torch.arange(length + 1)].long()  # (N, L+1)
        score_from = torch.full((n,), length - step, dtype=torch.long)
        score_from[0] = 0
        return windows, score_from

    def eval_batches(self, length: int, batch_size: int, max_tokens: int, stride: int | None = None) -> Iterator[Batch]:
        """Evaluation batches: ``mask`` marks the scored targets of each window."""
        windows, score_from = self.eval_windows(length, max_tokens, stride)
        for s in range(0, len(windows), batch_size):
            w, f = windows[s : s + batch_size], score_from[s : s + batch_size]
            mask = torch.arange(length)[None, :] >= f[:, None]  # (b, L)
            yield Batch(w[:, :-1], w[:, 1:], mask)


def load_source(
    *,
    task: str | None = None,
    text: str | Path | None = None,
    dataset: str | None = None,
    dataset_config: str | None = None,
    dataset_split: str = "train",
    dataset_field: str = "text",
    val_fraction: float = 0.1,
    seed: int = 0,
    longest: int = 1,
    packed: bool = False,
) -> TextData | SyntheticTask | GridTask | PasskeyTask | CountTask | FlipFlopTask | KazemnejadTask:
    """The data source named by at most one of ``task``, ``text`` or ``dataset``; the
    embedded corpus when none is. ``task="passkey"`` draws its filler from the text the
    other arguments name (the embedded corpus by default).

    Args:
        longest: the longest window (training or evaluation length) the text validation
            split must hold.
        packed: train on packed documents (text only): paragraphs, ending at blank lines.

    Raises:
        DataError: the source cannot be loaded, or its validation split is shorter than
            ``longest + 1`` bytes (the message names the source).
    """
    if packed and task is not None:
        raise DataError(f"packed documents need a text source; --task {task} has none")
    if task == "grid":
        return GridTask(seed=seed)
    if task in PAPER_TASKS:
        return paper_task(task, seed=seed)
    if task in KAZEMNEJAD_TASKS:
        return KazemnejadTask(task, seed=seed)
    if task is not None and task != "passkey":
        return SyntheticTask(task, seed=seed)
    if text is not None:
        data, name = read_text(text), f"--text {str(text)!r}"
    elif dataset is not None:
        data, name = load_hf_dataset(dataset, dataset_config, dataset_split, dataset_field), f"--dataset {dataset!r}"
    else:
        data, name = embedded_corpus(), "the embedded corpus"
    starts = None
    if packed:
        starts = document_starts(data)
    try:
        source = TextData(data, val_fraction=val_fraction, seed=seed, doc_starts=starts)
    except ValueError as e:
        raise DataError(f"{name}: {e}") from None
    if len(source.val) < longest + 1:
        raise DataError(
            f"{name}: its validation split ({len(source.val)} bytes, the last {val_fraction:.0%}) is shorter "
            f"than the longest evaluation length + 1 ({longest + 1}); give more text or shorter --eval-lens"
        )
    return PasskeyTask(source.train, source.val, seed=seed) if task == "passkey" else source
