"""RULER's part of ``posenc extend``'s outputs: the table (method × task × length) and the reading.

A cell's ``"ruler"`` holds ``{task: {"score": percent or None, ...}}``; a method's average at a
length is the mean over the tasks scored there. The reading names, per method, RULER's
effective length: the longest length whose average is above :data:`posenc.extend.ruler.THRESHOLD`
(85.6, Llama2-7B at 4K), and says when the threshold is out of reach of every method (a small
model: the comparison then rests on the averages, not on the effective length).
"""

from __future__ import annotations

from ...output import Column, Table
from . import THRESHOLD, effective_length

__all__ = ["ruler_table", "ruler_reading", "average", "ruler_rows"]


def average(cell: dict) -> float | None:
    vals = [v["score"] for v in (cell.get("ruler") or {}).values() if v.get("score") is not None]
    return sum(vals) / len(vals) if vals else None


def _tasks(cells: list[dict]) -> list[str]:
    return list(dict.fromkeys(t for c in cells for t in (c.get("ruler") or {})))


def ruler_table(methods: list[str], lengths: list[int], at: dict, train: int, samples: int) -> Table | None:
    tasks = _tasks(list(at.values()))
    if not tasks:
        return None
    rows = []
    for m in methods:
        for t in [*tasks, "average"]:
            row = [m, t]
            for n in lengths:
                c = at.get((m, n), {})
                if not c.get("ruler"):
                    row.append("n/a" if c and (not c.get("applicable") or c.get("tasks_why")) else "")
                    continue
                v = average(c) if t == "average" else (c["ruler"].get(t) or {}).get("score")
                row.append("-" if v is None else f"{v:.1f}")
            rows.append(row)
    heads = [f"L={n}" + (" (train)" if n == train else "") for n in lengths]
    return Table([Column("method", code=True), Column("task", code=True), *(Column(h, "right") for h in heads)], rows,
                 title=f"RULER tasks: score in % (string match of every reference, part credit), {samples} samples "
                       f"per task and length, greedy; effective length: the longest length whose average is above "
                       f"{THRESHOLD:g}")  # fmt: skip


def ruler_reading(methods: list[str], lengths: list[int], at: dict) -> list[str]:
    if not any(at.get((m, n), {}).get("ruler") for m in methods for n in lengths):
        return []
    eff, best = {}, {}
    for m in methods:
        scores = {n: average(at[(m, n)]) for n in lengths if at.get((m, n), {}).get("ruler")}
        if scores:
            eff[m] = effective_length(scores)
            best[m] = max((s for s in scores.values() if s is not None), default=None)
    out = []
    if all(v is None for v in eff.values()):
        top = max((v for v in best.values() if v is not None), default=None)
        shown = "no score" if top is None else f"the best average is {top:.1f}"
        out.append(f"RULER: no method is above {THRESHOLD:g} (Llama2-7B at 4K, RULER's bar) at any length ({shown}); "
                   "no effective length, compare the averages instead.")  # fmt: skip
    else:
        out.append("RULER effective length (longest length averaging above " + f"{THRESHOLD:g}): "
                   + ", ".join(f"`{m}` {'none' if v is None else v}" for m, v in eff.items()) + ".")  # fmt: skip
    last = lengths[-1]
    ranked = sorted(((average(at[(m, last)]), m) for m in methods if at.get((m, last), {}).get("ruler")
                     and average(at[(m, last)]) is not None), reverse=True)  # fmt: skip
    if ranked:
        out.append(f"RULER average at L={last}: " + ", ".join(f"`{m}` {v:.1f}" for v, m in ranked) + ".")
    return out


def ruler_rows(cells: list[dict]) -> list[dict]:
    """``results.csv`` rows: one per (method, length, task), and the average."""
    rows = []
    for c in cells:
        for t, v in (c.get("ruler") or {}).items():
            rows.append(
                {"method": c["method"], "length": c["length"], "setting": f"ruler {t}", "ruler": v.get("score")}
            )
        if c.get("ruler"):
            rows.append({"method": c["method"], "length": c["length"], "setting": "ruler average", "ruler": average(c)})
    return rows
