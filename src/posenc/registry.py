"""The registry of encodings: :func:`register` (a class decorator), :func:`build`,
:func:`available`, :func:`get_class`, :func:`options_of`.

The encodings fill it (``@register``) when ``posenc`` imports :mod:`posenc.encodings`.
"""

from __future__ import annotations

import inspect

from .base import PositionEncoding

__all__ = ["register", "build", "available", "get_class", "options_of", "own_options", "resolve"]

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
    """Keyword options an encoding name accepts: the class's own and its variants' (the
    registered classes :func:`build` makes instead when their own options are given)."""
    out = own_options(cls)
    for v in _variants(cls):
        out += [o for o in own_options(get_class(v)) if o not in out]
    return out


def _variants(cls: type[PositionEncoding]) -> tuple[str, ...]:
    """The variants a class declares itself (a subclass, e.g. xPos of RoPE, has its own)."""
    return cls.__dict__.get("variants", ())


def resolve(name: str, options: dict) -> type[PositionEncoding]:
    """The class :func:`build` makes for ``name`` with ``options``: a variant of it (another
    registered class, with other stages) when an option only the variant takes is given,
    e.g. ``nope`` with ``attn_scale``: ``nope-temperature``; else the class itself (a
    variant's option given as None means "not this variant")."""
    cls = get_class(name)
    mine, given = set(own_options(cls)), {k for k, v in options.items() if v is not None}
    for v in _variants(cls):
        vcls = get_class(v)
        if (set(own_options(vcls)) - mine) & given:
            return vcls
    return cls


def build(
    name: str, *, heads: int, head_dim: int, max_len: int | None = None, causal: bool = True, **options
) -> PositionEncoding:
    """Build a registered encoding (or the variant its options name: :func:`resolve`).

    Raises:
        ValueError: unknown name or option (the message lists the valid ones), or an
            option value out of range.
    """
    cls = resolve(name, options)
    mine = set(own_options(cls))
    options = {k: v for k, v in options.items() if k in mine or v is not None}  # (None: the variant is off)
    valid = options_of(cls)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        what = repr(name) if cls.name == name else f"{cls.name!r} (what {name!r} builds with these options)"
        raise ValueError(
            f"unknown option(s) {unknown} for encoding {what}; valid options: {', '.join(valid) or '(none)'}"
        )
    return cls(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal, **options)
