"""Argument checks shared by every public constructor: types from the annotations, finite numbers.

One rule for the encodings' options (:func:`posenc.build`, or a class called directly),
:class:`posenc.Attention`, :class:`posenc.ModelConfig` and :class:`posenc.LayerSpec`:

* a parameter annotated ``bool`` takes a bool only (``causal="no"`` is truthy, not False);
* ``int`` an integer (not a bool, not a float), ``float`` any real number but a bool;
* ``str``, ``dict``, ``list``/``tuple`` (either sequence) as annotated; None where the
  annotation allows it; a parameter annotated otherwise (tensors, modules, ``Any``) is not
  type-checked;
* no float anywhere in a value may be NaN or infinite (nested dicts and lists included:
  ``rope_scaling={"factor": nan}``).

A wrong type raises ``TypeError``, a non-finite number ``ValueError``; both name the owner,
the parameter, the value and what is allowed. The checks run once, at construction.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .fields import DROPOUT

__all__ = [
    "check_args",
    "check_device_type",
    "check_dropout",
    "check_finite",
    "check_memory",
    "check_table_len",
    "checked_init",
    "hints_of",
    "ignoring_keywords",
    "memory_of",
    "missing_keywords",
    "position_checked",
    "score_setting",
]

# what a parameter accepts, from its annotation: a tuple of these names, or None (anything)
_SIMPLE = {bool: "bool", int: "int", float: "float", str: "str", dict: "dict", list: "seq", tuple: "seq"}
_WORDS = {
    "bool": "a bool",
    "int": "an int",
    "float": "a number",
    "str": "a str",
    "dict": "a dict",
    "seq": "a list or tuple",
    "none": "None",
}


def _kinds(ann: Any) -> frozenset[str] | None:
    """The kinds of value an annotation allows (see :data:`_WORDS`); None: not checked."""
    if ann is None or ann is type(None):
        return frozenset({"none"})
    origin = typing.get_origin(ann)
    if origin in (typing.Union, types.UnionType):
        parts = [_kinds(a) for a in typing.get_args(ann)]
        return None if any(p is None for p in parts) else frozenset().union(*parts)
    base = origin if origin is not None else ann
    if base in _SIMPLE:
        return frozenset({_SIMPLE[base]})
    if isinstance(base, type) and issubclass(base, Mapping):
        return frozenset({"dict"})
    if isinstance(base, type) and issubclass(base, Sequence) and base is not str:
        return frozenset({"seq"})
    return None


@functools.cache
def hints_of(fn: Callable) -> dict[str, frozenset[str] | None]:
    """Parameter name -> allowed kinds, from ``fn``'s annotations (a class: its fields')."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve: leave those parameters unchecked
        hints = {}
    return {name: _kinds(ann) for name, ann in hints.items() if name != "return"}


def _is(kind: str, value: Any) -> bool:
    if kind == "none":
        return value is None
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "dict":
        return isinstance(value, Mapping)
    return isinstance(value, (list, tuple))  # "seq"


def check_finite(owner: str, name: str, value: Any) -> None:
    """``ValueError`` if ``value`` is, or holds (in dicts, lists, tuples), a NaN or infinite number."""
    bad = _non_finite(value)
    if bad is not None:
        where, v = bad
        raise ValueError(f"{owner}: {name}{where}={v!r} is not a finite number; allowed: finite numbers")


def _non_finite(value: Any, where: str = "") -> tuple[str, Any] | None:
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, numbers.Integral)):
        return None if math.isfinite(value) else (where, value)
    if isinstance(value, Mapping):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for k, v in items:
        bad = _non_finite(v, f"{where}[{k!r}]")
        if bad is not None:
            return bad
    return None


def check_args(owner: str, fn: Callable, values: Mapping[str, Any]) -> None:
    """Check ``values`` (parameter name -> value) against ``fn``'s annotations (see the module doc).

    ``owner`` starts the message (``"Attention"``, ``"encoding 'rope'"``).
    """
    hints = hints_of(fn)
    for name, value in values.items():
        kinds = hints.get(name)
        if kinds is not None and not any(_is(k, value) for k in kinds):
            allowed = " or ".join(_WORDS[k] for k in sorted(kinds, key=list(_WORDS).index))
            raise TypeError(f"{owner}: {name} must be {allowed}, got {value!r} ({type(value).__name__})")
        check_finite(owner, name, value)


def checked_init(init: Callable, skip: tuple[str, ...] = ()) -> Callable:
    """An encoding's ``init`` with its options checked (:func:`check_args`; ``skip``: arguments
    ``init`` checks itself).

    The checks run after ``init``, so that an encoding's own message, which names the range,
    wins where it has one ("axes must be a positive int", "alpha must be in [0, 1)"); where
    ``init`` accepted the value (a truthy ``"no"`` for a bool, ``base=nan`` past ``base > 1``)
    or failed on it with an error of another kind, the shared check raises.
    """
    sig = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        try:
            given = sig.bind(self, *args, **kwargs).arguments
        except TypeError:
            given = {}  # the call itself raises the TypeError that says what is wrong
        given = {k: v for k, v in given.items() if k not in ("self", *skip)}
        for name, p in sig.parameters.items():
            if p.kind is inspect.Parameter.VAR_KEYWORD and name in given:
                given.update(given.pop(name))
        owner = f"encoding {getattr(type(self), 'name', '') or type(self).__name__!r}"
        try:
            init(self, *args, **kwargs)
        except (ValueError, TypeError):
            raise
        except Exception:
            check_args(owner, init, given)  # a wrong type or a NaN that broke init: say so instead
            raise
        check_args(owner, init, given)

    return __init__


def position_checked(fn: Callable, position_args: tuple[str, ...]) -> Callable:
    """Stage method ``fn`` whose ``IndexError`` (a table read past its end) becomes the ``ValueError``
    of ``self._position_message`` about its ``position_args``; nothing is checked (and no
    host sync happens) on a call that succeeds."""
    sig = inspect.signature(fn)
    names = [n for n in sig.parameters if n in position_args]
    if not names:
        return fn

    @functools.wraps(fn)
    def stage(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # (a try block would cost torch.compile a graph break)
            return fn(self, *args, **kwargs)
        try:
            return fn(self, *args, **kwargs)
        except IndexError:
            message = self._position_message(sig.bind(self, *args, **kwargs).arguments, names)
            if message is None:
                raise
        raise ValueError(message)

    stage.checks_positions = True
    return stage


# device types torch knows (torch.device accepts them); others are checked once per name
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu", "hip", "xla", "meta", "hpu", "mtia", "privateuseone")
_known_devices: set[str] = set(DEVICE_TYPES)


def check_device_type(device_type: str) -> None:
    """``ValueError`` unless ``device_type`` is a torch device type (``"cpu"``, ``"cuda"``, ...), no index."""
    if isinstance(device_type, str) and device_type in _known_devices:
        return
    try:
        ok = isinstance(device_type, str) and torch.device(device_type).type == device_type
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"device_type must be a torch device type such as {', '.join(map(repr, DEVICE_TYPES))}, got {device_type!r}"
        )
    _known_devices.add(device_type)


def missing_keywords(fn: Callable, names: tuple[str, ...]) -> tuple[str, ...]:
    """The keywords of ``names`` that ``fn`` does not take (none when it takes ``**kwargs``)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return ()
    return tuple(n for n in names if n not in params)


def ignoring_keywords(fn: Callable, names: tuple[str, ...]) -> Callable:
    """A method written without the keywords ``names`` (an encoding that reads nothing of the
    call but its arguments), callable with them."""

    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        for n in names:
            kwargs.pop(n, None)
        return fn(self, *args, **kwargs)

    return method


def score_setting(name: str, value: Any) -> float | None:
    """``value`` as a float when it is a positive finite number, None for None; else
    ``TypeError`` (not a number) or ``ValueError`` (not positive and finite), naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a positive finite number or None, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number or None, got {value!r}")
    return float(value)


def check_dropout(p, name: str = "dropout") -> float:
    """``p`` when it is a dropout probability (:data:`posenc.fields.DROPOUT`, a finite number in
    ``[0, 1)``); else ``ValueError``."""
    if type(p) is float and 0.0 <= p < 1.0:  # (every call of every attention layer: the common case first)
        return p
    DROPOUT.check(name, p)
    return float(p)


# The most positions a position table may hold (the rows of a learned table, the distances of
# a clipped relative one): 2^24, past any context a model is trained for; a larger size is a
# typo, refused before the allocator is asked for the table.
MAX_TABLE_LEN = 2**24


def check_table_len(enc, name: str, value) -> None:
    """``ValueError`` when the option ``name`` of encoding ``enc`` (an int, or a tuple of them
    per axis) sizes a position table past :data:`MAX_TABLE_LEN` positions."""
    sizes = value if isinstance(value, tuple) else (value,)
    if any(isinstance(n, int) and not isinstance(n, bool) and n > MAX_TABLE_LEN for n in sizes):
        owner = f"encoding {getattr(type(enc), 'name', '') or type(enc).__name__!r}"
        raise ValueError(
            f"{owner}: {name}={value!r} is more positions than a position table holds; allowed: at most "
            f"{MAX_TABLE_LEN} (2**24)"
        )


def memory_of(device: torch.device) -> int | None:
    """Bytes of memory ``device`` has: a CUDA device's own, the machine's physical memory for
    the others (``os.sysconf``); None where unknown or nothing is allocated (``meta``)."""
    if device.type == "meta":
        return None
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # a platform without these names
        return None


def check_memory(owner: str, nbytes: int, device=None) -> None:
    """``ValueError`` when ``nbytes`` to allocate on ``device`` (None: torch's default) pass
    all the memory it has (:func:`memory_of`), naming the bytes needed; checked before the
    allocator is asked, which would fail with its own words or leave it to the OOM killer."""
    device = torch.device(device) if device is not None else torch.empty(0).device
    total = memory_of(device)
    if total is not None and nbytes > total:
        raise ValueError(
            f"{owner}: needs {nbytes:,} bytes, more than the {total:,} bytes of memory of this machine's "
            f"{device.type} device"
        )
