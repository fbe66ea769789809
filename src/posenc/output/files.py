"""JSON and CSV files with one float policy.

Every JSON file posenc writes goes through :func:`clean`: NaN and ±inf become ``null``
(strict JSON has no spelling for them, and a reader must not take a missing value
for a number), tuples become lists, and floats keep their shortest round-trip form
unless ``digits`` rounds them to that many significant digits (values that came from
float32 tensors carry no more than 7).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["clean", "write_csv", "write_json"]


def clean(x: Any, digits: int | None = None) -> Any:
    """``x`` with NaN/inf floats as None, tuples as lists, floats rounded to ``digits`` significant digits."""
    if isinstance(x, float):
        if not math.isfinite(x):
            return None
        return float(f"{x:.{digits}g}") if digits else x
    if isinstance(x, dict):
        return {k: clean(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v, digits) for v in x]
    return x


def write_json(path: str | Path, data: Any, *, digits: int | None = None) -> Path:
    """Write ``clean(data, digits)`` as strict JSON (``allow_nan=False``), creating the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean(data, digits), indent=1, allow_nan=False) + "\n")
    return path


def write_csv(path: str | Path, rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> Path | None:
    """One line per row (``columns``: default the first row's keys; others ignored).

    Lists become ``;``-joined numbers (6 significant digits); NaN/inf and None become empty
    cells, as in the JSON. Writes nothing for no rows and returns None.
    """
    if not rows:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cols = list(columns or rows[0])

    def cell(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return ";".join(f"{t:.6g}" if isinstance(t, float) else str(t) for t in v)
        if isinstance(v, float) and not math.isfinite(v):
            return ""
        return v

    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: cell(r.get(k)) for k in cols})
    return path
