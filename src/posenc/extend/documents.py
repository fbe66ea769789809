"""The documents of ``extend``'s text, for the truncated per-document perplexity protocol.

The YaRN repository's ``eval/perplexity.py`` (Peng et al. 2024; the curves its paper and README
publish) scores, for each evaluated length ``L``, the first ``L`` tokens of each document of
at least a minimum length (``--dataset-min-tokens``, ``--samples`` documents, ``--truncate``),
every token of that window scored, a beginning-of-sequence token first where the tokenizer has
one; the perplexity is ``exp`` of the mean of the documents' mean negative log-likelihoods.
``posenc extend --protocol truncated`` does the same on these documents:

* the embedded corpus (no ``--text``): the pydoc topics of its held-out tenth (one document per
  topic, :func:`posenc.data.embedded_documents`; the topic the tenth begins inside is kept from
  there on);
* ``--text FILE``: the file cut at every run of two or more blank lines or a form feed (one
  blank line separates paragraphs, not documents); a file with neither is one document.

The minimum length is the longest evaluated length, so every length scores the same documents
(a column reads as the same text at growing context), and ``--windows`` documents are taken:
the first that are long enough, in the order of the text. ``--text`` is read only as far as
that takes (a prefix, grown until it holds them).
"""

from __future__ import annotations

import re

import torch

from ..data import embedded_documents, read_text

__all__ = ["split_documents", "held_out_documents", "long_documents", "run_documents"]

_MAX_READ = 1 << 30  # bytes of --text read at most while looking for long documents
_BREAK = re.compile(rb"\n[ \t\r]*\n(?:[ \t\r]*\n)+|\f")


def split_documents(data: bytes) -> list[bytes]:
    """``data`` cut at every run of two or more blank lines or a form feed (empty pieces dropped)."""
    return [d for d in _BREAK.split(data) if d.strip()]


def held_out_documents() -> list[bytes]:
    """The embedded corpus's held-out tenth as its pydoc topics (see the module docstring)."""
    docs, at, out = embedded_documents(), 0, []
    total = sum(len(d) for d in docs) + 2 * (len(docs) - 1)  # joined by blank lines (posenc.data.embedded_corpus)
    start = total - total // 10
    for d in docs:
        end = at + len(d)
        if end > start:
            out.append(d[max(0, start - at) :])
        at = end + 2
    return out


def long_documents(text: str | None, tokens, bos: int | None, *, length: int, count: int) -> list[torch.Tensor]:
    """Up to ``count`` documents of at least ``length`` tokens (``bos`` first when given), each cut
    to ``length``, in the order of the text; ``tokens``: posenc.extend.passkey.Tokens."""
    head = [] if bos is None else [bos]

    def pick(docs: list[bytes]) -> list[torch.Tensor]:
        out = []
        for d in docs:
            ids = torch.cat((torch.tensor(head, dtype=torch.long), tokens.of_bytes(d)))
            if len(ids) >= length:
                out.append(ids[:length])
                if len(out) == count:
                    break
        return out

    if text is None:
        return pick(held_out_documents())
    size = 8 * count * length
    while True:
        data = read_text(text, max_bytes=size)
        whole = len(data) < size
        docs = split_documents(data)
        found = pick(docs if whole else docs[:-1])  # (the last piece of a prefix may be cut short)
        if len(found) == count or whole or size >= _MAX_READ:
            return found
        size *= 4


def run_documents(text: str | None, subject, *, longest: int, count: int) -> tuple[list[torch.Tensor], dict]:
    """The documents a run's truncated protocol scores (``count`` of at least ``longest`` tokens)
    and their record for ``config.json`` (``{"count", "min_tokens", "fingerprint"}``)."""
    import hashlib

    from .passkey import Tokens

    tokens = Tokens(subject.tokenizer, subject.vocab_size)
    bos = getattr(subject.tokenizer, "bos_token_id", None) if subject.tokenizer is not None else None
    docs = long_documents(text, tokens, bos, length=longest, count=count)
    h = hashlib.sha256()
    for d in docs:
        h.update(d.to(torch.int64).numpy().tobytes())
    return docs, {"count": len(docs), "min_tokens": longest, "fingerprint": h.hexdigest()[:16]}
