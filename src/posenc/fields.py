"""Every range declared once: a field's type and allowed values in one declaration, read by
the library's checks, the configs' checks and every command's flags.

A declaration goes on a dataclass field, or next to the parser of a flag without one::

    @dataclass
    class CompareConfig:
        dim: int = Int(1, 65536).field(64)
        lr: float = Float(0, 100, lo_open=True).field(1e-2)
        seeds: list[int] = ListOf(Int(0, 2**31 - 1), distinct=True).field([0])

    p.add_argument("--repeats", type=Int(1, 10_000).parse, default=5)

Three readers:

* :func:`check` checks every declared field of a dataclass instance: one ``ValueError``,
  ``"<field> must be <what is allowed>, got <value>"``;
* ``decl.parse`` is a flag's ``argparse`` ``type=``: the text as a value of the declared type
  in the declared range, or ``argparse.ArgumentTypeError`` (``must be an integer in 1..10000,
  got '0'``; argparse names the flag, exit status 2);
* ``decl.convert`` reads the type only, for a flag that becomes a config field whose own check
  names the flag: ``posenc compare --dim 0`` and ``"dim": 0`` in a ``--config`` file get one
  message.

One list rule for every comma-separated flag (:func:`split_list`): the text is split at every
comma (outside JSON brackets and strings where the items are JSON) and each item stripped; an
empty value or an empty item (``512,,1024``, ``0,``) is refused, naming the value and the
items allowed.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "DROPOUT", "SEED", "Bool", "Choice", "Decl", "Float", "Int", "ListOf", "Map", "Str", "check", "declared", "split_list",
]  # fmt: skip

_KEY = "posenc.range"  # where a dataclass field's metadata holds its declaration
Error = argparse.ArgumentTypeError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decl:
    """What every declaration has: ``optional`` (None allowed), a ``note`` said after the range
    (why it is there), and ``flag``, a parser of the flag's text in place of :meth:`convert`."""

    optional: bool = False
    note: str = ""
    flag: Callable[[str], Any] | None = None

    def field(self, default: Any = dataclasses.MISSING) -> Any:
        """A ``dataclasses.field`` carrying this declaration (a list or dict default is copied per instance)."""
        meta = {_KEY: self}
        if isinstance(default, (list, dict)):
            return dataclasses.field(default_factory=functools.partial(copy.deepcopy, default), metadata=meta)
        return dataclasses.field(default=default, metadata=meta)

    # --- what a declaration defines
    def accepts(self, value: Any, owner: Any = None) -> bool:
        """``value`` is of the declared type and in range (``owner``: the instance, for bounds named by field)."""
        raise NotImplementedError

    def text(self, owner: Any = None, *, flag: bool = False, plural: bool = False) -> str:
        """What is allowed, in words: ``an int in [1, 65536]`` (``flag``: ``an integer in 1..65536``)."""
        raise NotImplementedError

    def convert(self, text: str) -> Any:
        """The flag's text as a value of the declared type (here: the text, a string); the range
        is left to :meth:`check` (a bool is a switch, ``--x``/``--no-x``; a :class:`Map` has a ``flag``)."""
        return text

    # --- derived
    def check(self, name: str, value: Any, owner: Any = None, *, none: str = "None") -> None:
        """``ValueError`` naming ``name``, the value and what is allowed, unless :meth:`accepts`."""
        if (value is None and self.optional) or self.accepts(value, owner):
            return
        unset = f" or {none}" if self.optional else ""
        raise ValueError(f"{name} must be {self.text(owner)}{unset}, got {value!r}")

    def reader(self) -> Callable[[str], Any]:
        """The flag's parser: ``flag`` where the declaration has one, else :meth:`convert`."""
        return self.flag if self.flag is not None else self.convert

    def parse(self, text: str) -> Any:
        """A flag's ``argparse`` ``type=``: the value, type and range checked."""
        if self.flag is not None:
            value = self.flag(text)  # its own errors name what is wrong
        else:
            try:
                value = self.convert(text)
            except (Error, ValueError, TypeError):
                value = _REFUSED
        if value is _REFUSED or not self.accepts(value):
            raise Error(f"must be {self.text(flag=True)}, got {text!r}")
        return value

    def _note(self) -> str:
        return f" ({self.note})" if self.note else ""


_REFUSED = object()  # a flag's text that is not of the declared type


@dataclasses.dataclass(frozen=True)
class Int(Decl):
    """An int in ``lo..hi`` (an end None: open); ``at_most`` names another field of the same
    dataclass, a bound too (``Int(0, 100_000, at_most="steps")``: at most the value of ``steps``).
    ``odd``/``even``/``multiple``: only those."""

    lo: int | None = None
    hi: int | None = None
    at_most: str | None = None
    odd: bool = False
    even: bool = False
    multiple: int = 1

    def _hi(self, owner: Any) -> tuple[int | None, str | None]:
        """The upper bound, and the field named when that field's value is the bound."""
        bound = getattr(owner, self.at_most) if self.at_most is not None and owner is not None else None
        if bound is not None and (self.hi is None or bound <= self.hi):
            return bound, self.at_most
        return self.hi, None

    def accepts(self, value: Any, owner: Any = None) -> bool:
        if not isinstance(value, int) or isinstance(value, bool):
            return False
        hi, _ = self._hi(owner)
        inside = (self.lo is None or value >= self.lo) and (hi is None or value <= hi)
        parity = not (self.odd and value % 2 == 0) and not (self.even and value % 2)
        return inside and parity and not value % self.multiple

    def text(self, owner: Any = None, *, flag: bool = False, plural: bool = False) -> str:
        noun = ("integer" if flag else "int") + ("s" if plural else "")
        if self.multiple > 1:
            kind = f"{'multiples' if plural else 'a multiple'} of {self.multiple}"
        elif self.odd or self.even:
            kind = f"{'' if plural else 'an '}{'odd' if self.odd else 'even'} {noun}"
        elif self.lo == 1 and self.hi is None and not flag:
            return f"{'' if plural else 'a '}positive {noun}{self._note()}"
        else:
            kind = noun if plural else f"an {noun}"
        hi, name = self._hi(owner)
        hi = f"{name}={hi}" if name is not None else hi
        lo = self.lo
        if lo is not None and hi is not None:
            where = f"in {lo}..{hi}" if flag else f"in [{lo}, {hi}]"
        elif lo is not None:
            where = f">= {lo}"
        elif hi is not None:
            where = f"<= {hi}"
        else:
            return kind + self._note()
        return f"{kind} {where}{self._note()}"

    def convert(self, text: str) -> int:
        try:
            return int(text.strip())
        except (ValueError, AttributeError):
            raise Error(f"must be {self.text(flag=True)}, got {text!r}") from None


@dataclasses.dataclass(frozen=True)
class Float(Decl):
    """A finite number in ``[lo, hi]`` (``lo_open``/``hi_open``: that end excluded; an end None: open)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def accepts(self, value: Any, owner: Any = None) -> bool:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            return False
        above = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        below = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        return above and below

    def text(self, owner: Any = None, *, flag: bool = False, plural: bool = False) -> str:
        kind = "finite numbers" if plural else "a finite number"
        gt, lt = (">" if self.lo_open else ">="), ("<" if self.hi_open else "<=")
        if self.lo is not None and self.hi is not None:
            if flag:
                return f"{kind} {gt} {self.lo:g} and {lt} {self.hi:g}{self._note()}"
            ends = f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
            return f"{kind} in {ends}{self._note()}"
        if self.lo is not None:
            return f"{kind} {gt} {self.lo:g}{self._note()}"
        if self.hi is not None:
            return f"{kind} {lt} {self.hi:g}{self._note()}"
        return kind + self._note()

    def convert(self, text: str) -> float:
        try:
            return float(text)
        except (ValueError, TypeError):
            raise Error(f"must be {self.text(flag=True)}, got {text!r}") from None


@dataclasses.dataclass(frozen=True)
class Bool(Decl):
    """True or False (a flag: ``--x`` / ``--no-x``)."""

    def accepts(self, value: Any, owner: Any = None) -> bool:
        return isinstance(value, bool)

    def text(self, owner: Any = None, *, flag: bool = False, plural: bool = False) -> str:
        return "bools" if plural else "a bool"


@dataclasses.dataclass(frozen=True)
class Str(Decl):
    """A non-empty string (not only spaces); ``what`` names it in a list's words (``encodings``)."""

    what: str = "string"

    def accepts(self, value: Any, owner: Any = None) -> bool:
        return isinstance(value, str) and bool(value.strip())

    def text(self, owner: Any = None, *, flag: bool = False, plural: bool = False) -> str:
        if self.what != "string":
            return f"{self.what}s" if plural else f"a {self.what}"
        return "non-empty strings" if plural else "a non-empty string"


@dataclasses.dataclass(frozen=True)
class Choice(Decl):
    """One of ``values``: a sequence, or a function returning one (a registry read when checked)."""

    values: Iterable[str] | Callable[[], Iterable[str]] = ()
    what: str = "value"

    def __post_init__(self) -> None:  # a sequence (an iterator too) is read once
        if not callable(self.values):
            object.__setattr__(self, "values", tuple(self.values))

    def names(self) -> list[str]:
        return list(self.values() if callable(self.values) else self.values)  # a registry: read now

    def accepts(self, value: Any, owner: Any = None) -> bool:
        return isinstance(value, str) and value in self.names()

    def text(self, owner: Any = None, *, flag: bool = False, plural: bool = False) -> str:
        return f"{self.what}s from {', '.join(self.names())}" if plural else f"one of {', '.join(self.names())}"

    def parse(self, text: str) -> str:
        if text not in self.names():
            raise Error(f"unknown {self.what} {text!r}; allowed: {', '.join(self.names())}")
        return text


@dataclasses.dataclass(frozen=True)
class Map(Decl):
    """A dict of name -> dict (per-name options); ``what`` says so in words."""

    what: str = "a dict of names to dicts"

    def accepts(self, value: Any, owner: Any = None) -> bool:
        return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, dict) for k, v in value.items())

    def text(self, owner: Any = None, *, flag: bool = False, plural: bool = False) -> str:
        return self.what


@dataclasses.dataclass(frozen=True)
class ListOf(Decl):
    """A non-empty list of ``item`` values; ``distinct``: no repeats, ``increasing``: strictly
    increasing. A flag: comma-separated items (:func:`split_list`; ``json``: JSON items), each
    read by ``item``; ``dedupe``: repeats dropped, order kept."""

    item: Decl = dataclasses.field(default_factory=Str)
    distinct: bool = False
    increasing: bool = False
    dedupe: bool = False
    json: bool = False

    def accepts(self, value: Any, owner: Any = None) -> bool:
        if not isinstance(value, list) or not value or not all(self.item.accepts(v, owner) for v in value):
            return False
        if self.distinct and len(set(value)) != len(value):
            return False
        return not self.increasing or all(a < b for a, b in zip(value, value[1:]))

    def text(self, owner: Any = None, *, flag: bool = False, plural: bool = False) -> str:
        items = self.item.text(owner, flag=flag, plural=True)
        if flag:
            return f"comma-separated {items}{self._note()}"
        order = ("distinct " if self.distinct else "") + ("strictly increasing " if self.increasing else "")
        return f"a non-empty list of {order}{items}{self._note()}"

    def convert(self, text: str) -> list:
        items = split_list(text, self.text(flag=True), json=self.json)
        out = []
        for v in items:
            try:
                out.append(self.item.convert(v))
            except Error:
                raise Error(f"expected {self.text(flag=True)}, got {v!r} in {text!r}") from None
        return list(dict.fromkeys(out)) if self.dedupe else out

    def unknown(self, values: list) -> str | None:
        """A list of choices: the words naming those of ``values`` that are none of them
        (``unknown mask 'x'; allowed: causal, bidir``); None when all are."""
        if not isinstance(self.item, Choice):
            return None
        allowed = self.item.names()
        bad = list(dict.fromkeys(v for v in values if v not in allowed))
        if not bad:
            return None
        what = self.item.what + ("s" if len(bad) > 1 else "")
        return f"unknown {what} {', '.join(map(repr, bad))}; allowed: {', '.join(allowed)}"

    def parse(self, text: str) -> list:
        if self.flag is not None:
            return Decl.parse(self, text)
        items = split_list(text, self.text(flag=True), json=self.json)
        if (bad := self.unknown(items)) is not None:
            raise Error(bad)
        out = []
        for v in items:
            try:
                out.append(self.item.parse(v))
            except Error:
                raise Error(f"expected {self.text(flag=True)}, got {v!r} in {text!r}") from None
        if self.dedupe:
            out = list(dict.fromkeys(out))
        if not self.accepts(out):  # distinct, increasing
            raise Error(f"expected {self.text(flag=True)} ({self.text()}), got {text!r}")
        return out


# ============================================================================ shared ranges
# A dropout probability: posenc.Attention's attn_dropout, ModelConfig's and CompareConfig's dropouts.
DROPOUT = Float(0.0, 1.0, hi_open=True)
# The seed of a trained model (compare's --seeds, and the --seed that names one of its
# checkpoints to extend or study): what torch.manual_seed and a checkpoint's name take.
SEED = Int(0, 2**31 - 1)


# ============================================================================ readers
def declared(cls: Any) -> dict[str, Decl]:
    """Field name -> declaration, for the declared fields of dataclass ``cls`` (or of an
    instance's class), in field order."""
    return dict(_declared(cls if isinstance(cls, type) else type(cls)))


@functools.cache
def _declared(cls: type) -> tuple[tuple[str, Decl], ...]:
    return tuple((f.name, f.metadata[_KEY]) for f in dataclasses.fields(cls) if _KEY in f.metadata)


def check(obj: Any, prefix: str = "", *, none: str = "None") -> None:
    """``ValueError`` for the first declared field of dataclass instance ``obj`` that is of the
    wrong type or out of range: ``"<prefix><field> must be <allowed>[ or <none>], got <value>"``.

    Fields are checked in order, so a bound named by field (``Int(0, at_most="steps")``) is read
    after that field has passed its own check."""
    for name, decl in _declared(type(obj)):
        decl.check(prefix + name, getattr(obj, name), obj, none=none)


def split_list(text: str, items: str = "values", *, json: bool = False) -> list[str]:
    """The one list rule of every comma-separated flag: ``"a, b"`` -> ``["a", "b"]``; an empty
    value or an empty item (``"0,,1"``, ``"0,"``, ``","``) is refused (``ArgumentTypeError``
    naming the value and ``items``, the allowed items in words). ``json``: a comma inside JSON
    brackets, braces or a quoted string does not split."""
    parts = [x.strip() for x in (_split_outside_json(text) if json else text.split(","))]
    if not all(parts):
        raise Error(f"expected {items} (none empty), got {text!r}")
    return parts


def _split_outside_json(s: str) -> list[str]:
    """``s`` split at the commas outside ``[]``, ``{}`` and ``"..."`` (a backslash escapes
    inside quotes); an unclosed bracket or quote runs to the end."""
    parts, start, depth, quoted, escaped = [], 0, 0, False, False
    for i, c in enumerate(s):
        if quoted:
            escaped, quoted = (False, True) if escaped else (c == "\\", c != '"')
        elif c == '"':
            quoted = True
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth = max(0, depth - 1)
        elif c == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    return [*parts, s[start:]]
