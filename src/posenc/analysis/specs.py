"""Which encodings to analyse: ``name`` or ``name@{json options}``, lists separated by
commas or spaces as ``compare --encodings`` takes them, ``all`` for every registered one."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..registry import available, get_class

__all__ = ["Spec", "resolve", "split_specs"]


@dataclass
class Spec:
    """An encoding name with build options, written ``name`` or ``name@{json options}``.

    ``rope@{"base": 500000}`` or ``rope@{"rope_scaling": {"rope_type": "linear", "factor": 4}}``.
    """

    name: str
    options: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        if not self.options:
            return self.name
        return self.name + " " + ",".join(f"{k}={v}" for k, v in self.options.items())

    @property
    def slug(self) -> str:
        """A file name for the spec: ``rope``, ``rope_base=500000``."""
        return "".join(c if c.isalnum() or c in "-=." else "_" for c in self.label).strip("_")

    @classmethod
    def parse(cls, text: str) -> Spec:
        name, sep, opts = text.partition("@")
        if not name:
            raise ValueError(f"encoding spec {text!r} has no name; write name or name@{{json options}}")
        if not sep:
            return cls(name)
        try:
            options = json.loads(opts)
        except json.JSONDecodeError as e:
            raise ValueError(f'options of {text!r} are not valid JSON ({e}); e.g. rope@{{"base": 500000}}') from e
        if not isinstance(options, dict):
            raise ValueError(f"options of {text!r} must be a JSON object, got {type(options).__name__}")
        return cls(name, options)


def split_specs(args: list[str]) -> list[str]:
    """``--encodings`` as compare takes it: names separated by commas or spaces (or both).

    Commas inside a spec's JSON options (``rope@{"base": 1, "x": 2}``) do not split it.
    """
    out: list[str] = []
    for arg in args:
        depth, start = 0, 0
        for i, ch in enumerate(arg):
            depth += (ch in "{[") - (ch in "}]")
            if ch == "," and depth == 0:
                out.append(arg[start:i])
                start = i + 1
        out.append(arg[start:])
    return [s.strip() for s in out if s.strip()]


def resolve(specs: list[str], *, want=None) -> tuple[list[Spec], list[str]]:
    """Parse encoding specs (``name`` or ``name@{json}``; ``"all"`` = every registered one).

    Args:
        specs: the specs, each possibly a comma-separated list (see :func:`split_specs`).
        want: optional predicate ``cls -> str | None``; a returned string is the reason
            the analysis does not apply to that encoding (skipped with a note).

    Returns:
        ``(kept, notes)``.

    Raises:
        ValueError: an unknown encoding name (the message lists the registered ones).
    """

    names = available()
    out: list[Spec] = []
    notes: list[str] = []
    expanded: list[str] = []
    for s in split_specs(specs):
        expanded.extend(names if s == "all" else [s])
    seen = set()
    for text in expanded:
        spec = Spec.parse(text)
        if spec.label in seen:
            continue
        seen.add(spec.label)
        cls = get_class(spec.name)  # ValueError: unknown encoding, listing the valid names
        if want is not None:
            reason = want(cls)
            if reason:
                notes.append(f"skipped {spec.label!r}: {reason}")
                continue
        out.append(spec)
    return out, notes
