"""The registry of encodings: :func:`register` (a class decorator), :func:`build`,
:func:`available`, :func:`get_class`, :func:`options_of`.

The encodings fill it (``@register``) when ``posenc`` imports :mod:`posenc.encodings`.
"""

from __future__ import annotations

import inspect

from .base import PositionEncoding

__all__ = ["register", "build", "available", "get_class", "options_of"]

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


def options_of(cls: type[PositionEncoding]) -> list[str]:
    """Keyword options an encoding accepts beyond heads, head_dim, max_len, causal."""
    params = inspect.signature(cls.__init__).parameters
    return [p for p in params if p not in ("self", "heads", "head_dim", "max_len", "causal")]


def build(
    name: str, *, heads: int, head_dim: int, max_len: int | None = None, causal: bool = True, **options
) -> PositionEncoding:
    """Build a registered encoding.

    Raises:
        ValueError: unknown name or option (the message lists the valid ones), or an
            option value out of range.
    """
    cls = get_class(name)
    valid = options_of(cls)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown} for encoding {name!r}; valid options: {', '.join(valid) or '(none)'}"
        )
    return cls(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal, **options)
