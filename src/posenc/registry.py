"""The registry of encodings: :func:`register` (a class decorator), :func:`build`,
:func:`available`, :func:`get_class`, :func:`options_of`.

The encodings fill it (``@register``) when ``posenc`` imports :mod:`posenc.encodings`. A name
is one class: :func:`build` never picks another one from the options (a variant with other
stages is registered under its own name, and an option only it takes is refused with that name).
"""

from __future__ import annotations

import inspect

from .base import PositionEncoding

__all__ = [
    "register",
    "build",
    "available",
    "get_class",
    "options_of",
    "own_options",
    "related",
    "unknown_options",
    "variant_hint",
]

_REGISTRY: dict[str, type[PositionEncoding]] = {}


def register(cls: type[PositionEncoding]) -> type[PositionEncoding]:
    """Class decorator: add an encoding to the registry under ``cls.name``."""
    if not (isinstance(cls, type) and issubclass(cls, PositionEncoding)):
        raise TypeError(f"register expects a PositionEncoding subclass, got {cls!r}")
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"an encoding named {cls.name!r} is already registered ({_REGISTRY[cls.name].__name__})")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> list[str]:
    """Names of every registered encoding, sorted."""
    return sorted(_REGISTRY)


def get_class(name: str) -> type[PositionEncoding]:
    if not isinstance(name, str):
        raise TypeError(f"encoding name must be a str, got {type(name).__name__}")
    if name not in _REGISTRY:
        raise ValueError(f"unknown encoding {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def own_options(cls: type[PositionEncoding]) -> list[str]:
    """Keyword options ``cls.__init__`` takes beyond heads, head_dim, max_len, causal (a
    ``**options`` passed on to the parent class: the parent's)."""
    out = []
    for p in inspect.signature(cls.__init__).parameters.values():
        if p.kind is p.VAR_KEYWORD:
            parent = next(c for c in cls.__mro__[1:] if issubclass(c, PositionEncoding))
            out += [o for o in own_options(parent) if o not in out]
        elif p.name not in ("self", "heads", "head_dim", "max_len", "causal"):
            out.append(p.name)
    return out


def options_of(cls: type[PositionEncoding]) -> list[str]:
    """Keyword options the class ``cls`` takes (its own and those it passes on to its parent).
    An option of a variant (``nope-temperature``'s ``attn_scale``) is the variant's only: a
    variant with other stages is built by its registered name."""
    return own_options(cls)


def related(cls: type[PositionEncoding], options) -> list[str]:
    """The registered names of the classes of ``cls``'s family (a common base below
    :class:`PositionEncoding`) that take every option in ``options``: what to build instead
    when ``cls`` does not take them (``nope`` with ``attn_scale``: ``nope-temperature``)."""

    def family(c: type) -> set[type]:
        return {b for b in c.__mro__ if issubclass(b, PositionEncoding) and b is not PositionEncoding}

    mine = family(cls)
    return [n for n, c in sorted(_REGISTRY.items()) if c is not cls and family(c) & mine and set(options) <= set(own_options(c))]  # fmt: skip


def variant_hint(name: str, unknown) -> str:
    """``"; 'nope-temperature' takes them, ..."`` when a registered class of ``name``'s family
    takes every option in ``unknown`` (a variant with other stages, which posenc once built from
    the options); else ``""``. Appended to the message that refuses them."""
    others = related(get_class(name), unknown)
    return f"; {' or '.join(map(repr, others))} takes them, a registered class of its own: build it by that name" if others else ""  # fmt: skip


def unknown_options(name: str, unknown: list[str], valid: list[str]) -> str:
    """The one-line message for options ``unknown`` that encoding ``name`` does not take."""
    return f"unknown option(s) {unknown} for encoding {name!r}; valid options: {', '.join(valid) or '(none)'}" + variant_hint(name, unknown)  # fmt: skip


def build(
    name: str, *, heads: int, head_dim: int, max_len: int | None = None, causal: bool = True, **options
) -> PositionEncoding:
    """Build the registered encoding ``name`` with ``options``.

    Raises:
        ValueError: unknown name or option (the message names the variant that takes it, or
            lists the valid ones), or an option value out of range.
    """
    cls = get_class(name)
    valid = options_of(cls)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(unknown_options(name, unknown, valid))
    return cls(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal, **options)
