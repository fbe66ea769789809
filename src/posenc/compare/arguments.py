"""The parsers of ``posenc compare``'s list and mapping flags (``--encodings``,
``--encoding-options``, ``--eval-lens``, ``--seeds``): argparse ``type`` functions that
raise :class:`argparse.ArgumentTypeError` naming the value."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

__all__ = ["parse_encoding_options", "split_encodings"]


def parse_encoding_options(s: str) -> dict[str, dict[str, Any]]:
    """``"t5.max_distance=64,rope.base=500"`` -> ``{"t5": {"max_distance": 64}, "rope": {"base": 500}}``;
    a JSON value keeps its commas (``rope.rope_scaling={"rope_type":"yarn","factor":4}``)."""
    out: dict[str, dict[str, Any]] = {}
    for item in _items(s, json_values=True):
        key, sep, raw = item.partition("=")
        name, dot, opt = key.partition(".")
        if not (sep and dot and name and opt):
            raise argparse.ArgumentTypeError(f"expected ENCODING.OPTION=VALUE, got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw  # a bare string
        out.setdefault(name, {})[opt] = value
    return out


def split_encodings(s: str) -> list[str]:
    """``"rope,irope=rope*3,nope;alibi"`` -> ``["rope", "irope=rope*3,nope", "alibi"]``: a
    ``NAME=PATTERN`` entry runs to the next ``;`` (or the end), other entries end at ``,``."""
    out, rest = [], s
    while rest.strip():
        head, _, tail = rest.partition(";")
        names = head.split(",")
        for i, item in enumerate(names):
            if "=" in item.split("(")[0]:  # NAME=PATTERN: the rest of this ';' part
                out.append(",".join(names[i:]).strip())
                break
            if item.strip():
                out.append(item.strip())
        rest = tail
    return out


def _items(s: str, *, json_values: bool = False) -> list[str]:
    """``"a, b"`` -> ``["a", "b"]``; an empty item (``"0,,1"``, ``"0,"``) is an error, not skipped.
    ``json_values``: a comma inside JSON brackets, braces or a quoted string does not split."""
    items = [x.strip() for x in (_split_outside_json(s) if json_values else s.split(","))]
    if not all(items):
        raise argparse.ArgumentTypeError(f"expected comma-separated values with none empty, got {s!r}")
    return items


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


def _int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in _items(s)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _eval_lens(s: str) -> list[int | str]:
    """``--eval-lens``: ints or multiples of the training length (``4x``: resolved by
    :func:`posenc.compare.config.resolve_eval_lens` once the training length is settled)."""
    try:
        return [x if re.fullmatch(r"[0-9]+x", x) else int(x) for x in _items(s)]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers or multiples such as 4x, got {s!r}"
        ) from None
