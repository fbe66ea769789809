"""The ``posenc`` command's parser and the flag values that are not a declared range.

A flag with a range reads its declaration (:mod:`posenc.fields`: ``type=Int(1, 10_000).parse``);
the parsers here are the others (paths, devices, analyze's encoding specs), used as
``argparse`` ``type=`` functions too, so a bad value is one line naming the flag, what is
allowed and what was given, and exit status 2::

    posenc bench: error: argument --repeats: must be an integer in 1..10000, got '0'

:class:`OneLineParser` is the ``ArgumentParser`` of the ``posenc`` command: its errors are
that one line (no usage block), exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .fields import split_list

__all__ = ["OneLineParser", "device_name", "fail", "nonempty_path", "spec_list"]

Error = argparse.ArgumentTypeError


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``prog: error: message``, exit 2.

    The usage block argparse prints above an error runs to a dozen lines for ``posenc
    bench``; the line naming the flag is what a reader needs (``--help`` has the rest).
    """

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def spec_list(text: str) -> str:
    """One ``--encodings`` argument of ``posenc analyze``: names or ``name@{json}``, separated by
    commas, none empty (the list rule, :func:`posenc.fields.split_list`). Kept as text
    (``posenc.analysis.specs.resolve`` parses it)."""
    split_list(text, "comma-separated encoding names (name or name@{json options})", json=True)
    return text


def nonempty_path(text: str) -> Path:
    """A path; empty text (which would mean the current folder) is refused."""
    if not text.strip():
        raise Error(f"expected a path, got {text!r}")
    if "\x00" in text:
        raise Error(f"a path cannot hold a NUL character, got {text!r}")
    return Path(text)


DEVICE_TYPES = ("cpu", "cuda")


def device_name(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``."""
    want = "expected cpu, cuda or cuda:N"
    kind, sep, index = text.strip().partition(":")
    if kind not in DEVICE_TYPES or (sep and (kind != "cuda" or not index.isdigit())):
        raise Error(f"{want}, got {text!r}")
    return text.strip()


def fail(prog: str, message: str) -> int:
    """Print ``prog: error: message`` as one line on stderr; return exit status 2."""
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2
