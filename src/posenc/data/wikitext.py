"""WikiText-103, word level, from a local directory (``compare --data-dir DIR``; never downloaded).

The directory holds ``wiki.train.tokens``, ``wiki.valid.tokens`` and ``wiki.test.tokens``
(Merity et al. 2016's word-level release; the files are already tokenized, unknown words are
``<unk>``). The vocabulary is built from the training file as ``fairseq-preprocess`` builds
its dictionary, so ids match fairseq's ``dict.txt`` order:

* every line is split on whitespace and ends with an end-of-line token (fairseq's ``</s>``;
  an empty line is that token alone);
* the four specials first (``<s>``, ``<pad>``, ``</s>``, ``<unk>``: ids 0-3), then the words of
  the training file by count, most frequent first, ties in alphabetical order, no threshold;
* padded with ``madeupword0000``, ``madeupword0001``, ... to a multiple of 8 (fairseq's
  ``--padding-factor 8``).

A word of the validation or test file missing from the vocabulary reads as ``<unk>``. The
vocabulary is kept as JSON (``vocab.json`` in the run folder; :func:`save_vocab`), never a pickle.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from . import DataError, TextData

__all__ = ["SPECIALS", "EOS", "WikiTextData", "build_vocab", "encode_file", "load_vocab", "load_wikitext", "save_vocab"]

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
EOS, UNK = 2, 3
SPLITS = ("train", "valid", "test")
_FORMAT = "posenc-wikitext-vocab/1"


def _path(data_dir: str | Path, split: str) -> Path:
    d = Path(data_dir)
    if not d.is_dir():
        raise DataError(f"--data-dir: {str(d)!r} is not a directory (it must hold wiki.{{train,valid,test}}.tokens)")
    p = d / f"wiki.{split}.tokens"
    if not p.is_file():
        raise DataError(f"--data-dir: {str(p)!r} not found (the directory must hold wiki.{{train,valid,test}}.tokens)")
    return p


def _lines(path: Path):
    try:
        with open(path, encoding="utf-8") as f:
            yield from f
    except UnicodeDecodeError as e:
        raise DataError(f"--data-dir: {str(path)!r} is not UTF-8 ({e})") from None
    except OSError as e:
        raise DataError(f"--data-dir: cannot read {str(path)!r} ({e.strerror or e})") from None


def build_vocab(train_file: str | Path, padding_factor: int = 8) -> list[str]:
    """The symbols of the vocabulary, id order (see the module doc)."""
    counts: Counter[str] = Counter()
    for line in _lines(Path(train_file)):
        counts.update(line.split())
    for s in SPECIALS:
        counts.pop(s, None)  # "<unk>" of the text is the special, not a word
    words = sorted(counts, key=lambda w: (-counts[w], w))
    symbols = SPECIALS + words
    k = 0
    while len(symbols) % padding_factor:
        symbols.append(f"madeupword{k:04d}")
        k += 1
    return symbols


def encode_file(path: str | Path, index: dict[str, int]) -> torch.Tensor:
    """The ids of every line's words, each line closed by ``</s>``, as one ``(N,)`` int32 stream."""
    ids: list[int] = []
    for line in _lines(Path(path)):
        ids.extend(index.get(w, UNK) for w in line.split())
        ids.append(EOS)
    return torch.tensor(ids, dtype=torch.int32)


def save_vocab(path: str | Path, symbols: list[str], train_bytes: int) -> None:
    """``symbols`` as JSON, with the size of the training file they were counted in."""
    from ..output import write_json

    write_json(path, {"format": _FORMAT, "train_bytes": train_bytes, "symbols": symbols})


def load_vocab(path: str | Path, train_bytes: int) -> list[str] | None:
    """The symbols of a :func:`save_vocab` file counted on a training file of ``train_bytes``
    bytes; None when the file is missing. A file of another format or another training
    file is a :class:`DataError`."""
    p = Path(path)
    if not p.exists():
        return None
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"vocabulary {str(p)!r} is unreadable ({e}); delete it to rebuild it") from None
    ok = isinstance(d, dict) and d.get("format") == _FORMAT and isinstance(d.get("symbols"), list)
    if not ok or not all(isinstance(s, str) for s in d["symbols"]):
        raise DataError(f"vocabulary {str(p)!r} is not a {_FORMAT} file; delete it to rebuild it")
    if d.get("train_bytes") != train_bytes:
        raise DataError(
            f"vocabulary {str(p)!r} was built from a wiki.train.tokens of {d.get('train_bytes')} bytes, "
            f"this one has {train_bytes}: not the same corpus"
        )
    return d["symbols"]


class WikiTextData(TextData):
    """A word-level corpus served as :class:`TextData` serves bytes: random training windows
    of the train stream by ``(seed, step)``, evaluation windows of the validation stream."""

    def __init__(self, train: torch.Tensor, val: torch.Tensor, symbols: list[str], seed: int = 0) -> None:
        self.train, self.val, self.symbols, self.seed = train, val, symbols, seed
        self.vocab_size = len(symbols)
        self.val_fraction = 0.0
        self.train_doc_starts = None
        self.doc_starts = None
        self.data = b""


def load_wikitext(
    data_dir: str | Path,
    *,
    vocab_file: str | Path | None = None,
    seed: int = 0,
    eval_split: str = "valid",
    longest: int = 1,
) -> WikiTextData:
    """The corpus of ``data_dir``, its vocabulary read from ``vocab_file`` when that exists
    (a resumed run), else built from the training file.

    Raises:
        DataError: the directory or a file is missing or unreadable, ``vocab_file`` is not
            the vocabulary of this training file, or a split is shorter than ``longest + 1``
            tokens (the longest training or evaluation window).
    """
    if eval_split not in ("valid", "test"):
        raise ValueError(f"eval_split must be valid or test, got {eval_split!r}")
    paths = {s: _path(data_dir, s) for s in SPLITS}
    size = paths["train"].stat().st_size
    symbols = load_vocab(vocab_file, size) if vocab_file is not None else None
    if symbols is None:
        symbols = build_vocab(paths["train"])
    index = {s: i for i, s in enumerate(symbols)}
    train, val = encode_file(paths["train"], index), encode_file(paths[eval_split], index)
    if min(len(train), len(val)) < longest + 1:
        raise DataError(
            f"--data-dir: {str(data_dir)!r} holds {len(train)} train and {len(val)} {eval_split} tokens; the longest "
            f"window needs {longest + 1}: give more text or shorter --eval-lens / --train-len"
        )
    data = WikiTextData(train, val, symbols, seed=seed)
    data.train_bytes = size
    return data
