"""Typed command-line values: each parser turns one flag's text into a value or refuses it.

Used as ``argparse`` ``type=`` functions, so a bad value is one line naming the flag,
its allowed range and what was given, and exit status 2::

    posenc bench: error: argument --repeats: must be an integer in 1..10000, got '0'

Every parser refuses empty text, NaN and ±inf, values outside its range and text of the
wrong type. :class:`OneLineParser` is the ``ArgumentParser`` of the ``posenc`` command:
its errors are that one line (no usage block), exit status 2.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = [
    "OneLineParser",
    "choice_list",
    "device_name",
    "finite_float",
    "int_in",
    "int_list",
    "nonempty_path",
    "spec_list",
]

Error = argparse.ArgumentTypeError


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``prog: error: message``, exit 2.

    The usage block argparse prints above an error runs to a dozen lines for ``posenc
    bench``; the line naming the flag is what a reader needs (``--help`` has the rest).
    """

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def _range_text(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"in {lo}..{hi}"
    if lo is not None:
        return f">= {lo}"
    return f"<= {hi}"


def int_in(
    lo: int | None = None, hi: int | None = None, *, odd: bool = False, even: bool = False, multiple: int = 1
) -> Callable:
    """An integer in ``lo..hi`` (either end open when None); ``odd``/``even``: only those;
    ``multiple``: only multiples of it."""
    kind = "an odd integer" if odd else "an even integer" if even else "an integer"
    kind = f"a multiple of {multiple}" if multiple > 1 else kind
    want = f"must be {kind} {_range_text(lo, hi)}"

    def parse(text: str) -> int:
        try:
            v = int(text.strip())
        except (ValueError, AttributeError):
            raise Error(f"{want}, got {text!r}") from None
        outside = (lo is not None and v < lo) or (hi is not None and v > hi)
        if outside or (odd and v % 2 == 0) or (even and v % 2) or v % multiple:
            raise Error(f"{want}, got {text!r}")
        return v

    parse.__name__ = "int"
    return parse


def finite_float(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False) -> Callable:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``); NaN and ±inf refused."""
    if lo is not None and hi is not None:
        want = f"must be a finite number {'>' if lo_open else '>='} {lo:g} and <= {hi:g}"
    elif lo is not None:
        want = f"must be a finite number {'>' if lo_open else '>='} {lo:g}"
    else:
        want = f"must be a finite number <= {hi:g}"

    def parse(text: str) -> float:
        try:
            v = float(text)
        except (ValueError, TypeError):
            raise Error(f"{want}, got {text!r}") from None
        if not math.isfinite(v):
            raise Error(f"{want}, got {text!r}")
        if lo is not None and (v < lo or (lo_open and v == lo)) or (hi is not None and v > hi):
            raise Error(f"{want}, got {text!r}")
        return v

    parse.__name__ = "float"
    return parse


def _items(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def int_list(lo: int | None = 1, hi: int | None = None) -> Callable:
    """Comma-separated integers in ``lo..hi``, at least one."""
    one = int_in(lo, hi)
    want = f"comma-separated integers {_range_text(lo, hi)}"

    def parse(text: str) -> list[int]:
        items = _items(text)
        if not items:
            raise Error(f"expected {want}, got {text!r}")
        out = []
        for v in items:
            try:
                out.append(one(v))
            except Error:
                raise Error(f"expected {want}, got {v!r} in {text!r}") from None
        return out

    parse.__name__ = "int list"
    return parse


def choice_list(choices: Iterable[str] | None = None, what: str = "value", *, repeats: bool = False) -> Callable:
    """Comma-separated names, at least one; each one of ``choices`` when given (None: the
    caller checks them). Repeats are dropped, order kept (``repeats``: kept)."""
    choices = None if choices is None else list(choices)

    def parse(text: str) -> list[str]:
        items = _items(text) if repeats else list(dict.fromkeys(_items(text)))
        if not items:
            among = f" from {', '.join(choices)}" if choices is not None else ""
            raise Error(f"expected comma-separated {what}s{among}; got {text!r}")
        bad = [v for v in items if choices is not None and v not in choices]
        if bad:
            raise Error(f"unknown {what}(s) {', '.join(map(repr, bad))}; choose from {', '.join(choices)}")
        return items

    parse.__name__ = f"{what} list"
    return parse


def spec_list(text: str) -> str:
    """One ``--encodings`` argument of ``posenc analyze``: names or ``name@{json}``, separated by
    commas; at least one. Kept as text (``posenc.analysis.specs.resolve`` parses it)."""
    from .analysis.specs import split_specs

    if not split_specs([text]):
        raise Error(f"expected encoding names (name or name@{{json options}}, separated by commas), got {text!r}")
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
