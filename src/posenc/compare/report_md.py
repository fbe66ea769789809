"""``report.md``: one page that reads itself, generated from a comparison's results.

The command, the reading (each published finding the run can speak to, whether this run
agrees and the numbers that decide it; what the run cannot support), the table with
intervals, rankings with ties, convergence, passkey retrieval by depth, the figures, the
environment and the full config. Every sentence is computed from ``results``; nothing is
written by hand about a particular run.
"""

from __future__ import annotations

import json
from typing import Any

from ..data.tasks import depth_axis
from .diagnostics import finite, mfu, run_convergence, run_health, still_improving
from .reading import SPREAD_LIMIT, Summary, caveats, findings, passkey_reach, summarize, train_spread
from .stats import Interval

__all__ = ["report_markdown", "table_rows", "fmt_interval", "status_of"]


def fmt_interval(i: Interval | None, metric: str) -> str:
    """``4.41 ± 0.05`` (t-interval), ``4.41 (4.38–4.45)`` (two seeds: min–max), ``4.41`` (one)."""
    if i is None:
        return "n/a"

    def f(v: float) -> str:
        if metric == "accuracy":
            return f"{100 * v:.1f}%"
        return f"{v:.2f}" if abs(v) < 1000 else f"{v:.3g}"

    if i.kind == "t95":
        return f"{f(i.mean)} ± {f(i.half_width)}"
    if i.kind == "range":
        return f"{f(i.mean)} ({f(i.lo)}–{f(i.hi)})"
    return f(i.mean)


def status_of(results: dict[str, Any], encoding: str) -> str:
    """``ok``, ``not converged: train longer (validation loss fell 4.1% over the last 20%)``,
    ``failed: training loss NaN from step 3``, ``diverged: training loss rose 114% (...)``
    (with several seeds: ``seed 1 diverged: ...``), or ``-`` (unknown)."""
    s = summarize(results)
    if encoding in s.flagged:
        why = s.why[encoding]
        return why if why.startswith(s.health[encoding]) else f"{s.health[encoding]} ({why})"
    convs = [run_convergence(r) for r in results["runs"] if r["encoding"] == encoding]
    flags = [c.get("converged") for c in convs]
    why = still_improving(convs)
    if why is not None:
        return f"not converged: train longer ({why})"
    return "ok" if flags and all(f is True for f in flags) else "-"


def interval_note(results: dict[str, Any]) -> str:
    seeds = results["config"].get("seeds") or [results["config"].get("seed", 0)]
    if len(seeds) >= 3:
        return f"mean ± 95 % t-interval of {len(seeds)} seeds ({', '.join(map(str, seeds))})"
    if len(seeds) == 2:
        return f"mean (min–max) of 2 seeds ({seeds[0]}, {seeds[1]})"
    return f"one seed ({seeds[0]}): no interval"


def table_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]], list[str]]:
    """``(headers, rows, notes)`` of the main table: one row per encoding, the metric at every
    evaluation length (with its interval over seeds), speed, and the convergence status."""
    s = summarize(results)
    cfg = results["config"]
    unit = "n" if cfg.get("task") and cfg.get("task") != "passkey" else "L"
    heads = ["encoding", "params", "train s", "tok/s"]
    heads += [f"{unit}={n}" + (" (train)" if n == s.train_len else "") for n in s.lengths] + ["status"]
    rows = []
    for enc in s.encodings:
        mine = [r for r in results["runs"] if r["encoding"] == enc]
        secs = sum(r.get("train_seconds") or 0.0 for r in mine) / len(mine)
        tps = [r["train_tokens_per_s"] for r in mine if r.get("train_tokens_per_s")]
        rows.append([enc, f"{mine[0].get('params', 0):,}", f"{secs:.1f}", f"{sum(tps) / len(tps):,.0f}" if tps else "-",
                     *(_cell(s, mine, enc, n) for n in s.lengths), status_of(results, enc)])  # fmt: skip
    unit = "words" if results["config"].get("data_dir") else "bytes"
    notes = [
        f"{'validation perplexity (' + unit + ')' if s.metric == 'ppl' else 'exact-match accuracy'}: "
        f"{interval_note(results)}"
    ]
    spread = train_spread(s)
    if spread is not None:
        ok = "within" if spread[0] <= SPREAD_LIMIT else "NOT within"
        notes.append(f"spread at the training length (encodings other than nope): max/min {spread[0]:.3f} "
                     f"({spread[2][0]} {spread[2][1]:.2f} / {spread[1][0]} {spread[1][1]:.2f}), {ok} {SPREAD_LIMIT}")  # fmt: skip
    m = mfu(results)
    if m is not None:
        notes.append(f"MFU {m['mfu']:.1%}: {m['flops_per_s'] / 1e9:.1f} GFLOP/s of training over a matmul peak of "
                     f"{m['peak_flops_per_s'] / 1e9:.1f} GFLOP/s measured in the same process")  # fmt: skip
    return heads, rows, notes


def _cell(s: Summary, runs: list[dict[str, Any]], enc: str, n: int) -> str:
    """The table's cell: the interval; ``NaN`` where the model ran but has no finite number
    (a failed run; ``inf``: a finite loss whose perplexity overflows); ``n/a`` where it cannot run."""
    cell = s.cells[enc].get(n)
    if cell is not None:
        return fmt_interval(cell, s.metric)
    ran = [e for r in runs for e in r["eval"] if e["length"] == n and e.get("applicable", True)]
    if not ran:
        return "n/a"
    return "inf" if any(finite(e.get("loss")) is not None for e in ran) else "NaN"


def _md_table(heads: list[str], rows: list[list[str]]) -> list[str]:
    out = [
        "| " + " | ".join(heads) + " |",
        "|" + "|".join("---" if k == 0 else "---:" for k in range(len(heads))) + "|",
    ]
    out += ["| " + " | ".join([f"`{r[0]}`", *(c.replace("|", "\\|") for c in r[1:])]) + " |" for r in rows]
    return out


def report_markdown(results: dict[str, Any], figures: list[str]) -> str:
    """The whole ``report.md`` (see the module docstring); ``figures``: PNG names in the run folder."""
    cfg = results["config"]
    s = summarize(results)
    lines = ["# posenc compare: report", ""]
    data = f"task {cfg['task']}" if cfg.get("task") else cfg.get("text") or cfg.get("dataset") or "the embedded corpus"
    wall = results.get("wall_seconds")
    lines += [f"{len(s.encodings)} encodings × {len(cfg.get('seeds') or [0])} seed(s), preset {cfg.get('preset')}, "
              f"{cfg.get('steps')} steps, {data}, trained at {s.train_len}"
              + (f"; wall time {wall:.0f} s" if wall else "") + ".", ""]  # fmt: skip
    lines += ["## Command", "", "```", results.get("command") or "(run through the Python API)", "```", ""]
    lines += [
        "## Reading",
        "",
        "Computed from the numbers below (`posenc.compare.reading`); it changes when they do.",
        "",
    ]
    found = findings(results)
    for f in found:
        lines.append(f"- **{f['verdict']}** — {f['source']}: {f['claim']}. Here: {f['evidence']}.")
    if not found:
        lines.append("- No published finding this run can speak to (it needs the encodings and lengths they compare).")
    reach = passkey_reach(s) if cfg.get("task") == "passkey" else {}
    for enc, n in reach.items():
        lines.append(f"- passkey, {enc}: " + (f"retrieved at every depth (>= 90 %) up to L={n}" if n else
                     "not retrieved at every depth (>= 90 %) even at the shortest length"))  # fmt: skip
    cav = caveats(results)
    if cav:
        lines += ["", "What this run cannot support:", ""] + [f"- {c}" for c in cav]
    heads, rows, notes = table_rows(results)
    lines += ["", "## Results", "", *_md_table(heads, rows), ""] + [f"{n}  " for n in notes]
    lines += ["", "## Ranking at each length", "", "Best first; `=` joins an encoding to the rank before it when "
              "this run cannot tell it apart from one of that rank (overlapping intervals: the 95 % t-interval of "
              "three or more seeds, the min–max range of two; with one seed, perplexities within 2 % or "
              "accuracies whose Wilson intervals overlap). Ties chain, so two members of one rank can differ; "
              "such pairs follow the ranking in brackets.", ""]  # fmt: skip
    for n in s.lengths:
        ranks = s.ranking(n)
        if ranks:
            apart = [f"{a} > {b}" for a, b in s.untied(n, ranks)]
            within = f" (within a rank: {', '.join(apart)})" if apart else ""
            lines.append(f"- L={n}: " + " > ".join(" = ".join(group) for group in ranks) + within)
    if s.flagged:
        lines.append("- not ranked: " + ", ".join(f"{e} ({state})" for e, state in s.flagged.items()))
    limit = next((r["convergence"].get("threshold") for r in results["runs"] if r.get("convergence")), None)
    limit = f"{limit:.0%}" if limit is not None else "the threshold"
    lines += ["", "## Convergence", "", "Validation loss at the training length during training. A model whose "
              f"validation loss fell more than {limit} over the last 20 % of the steps is still improving (without "
              "validation points: its training loss's least-squares line over that stretch decides; it is shown "
              "for every run, but it keeps falling on seen data after the validation loss has flattened).",
              ""]  # fmt: skip
    lines += ["| encoding | seed | validation loss (step: loss) | validation change, last 20 % "
              "| train-loss change, last 20 % | status |", "|---|---:|---|---:|---:|---|"]  # fmt: skip
    for r in results["runs"]:
        c = run_convergence(r)
        curve = ", ".join(f"{p['step']}: {p['loss']:.3f}" for p in r.get("val_curve", []) if p.get("loss") is not None)
        slope, drop = c.get("train_slope"), c.get("val_drop")
        health = run_health(r, cfg)
        state = {True: "converged", False: "not converged: train longer", None: "-"}[c.get("converged")]
        if health["state"] != "ok":  # never "converged"
            state = f"{health['state']}: {health['why']}"
        lines.append(f"| `{r['encoding']}` | {r.get('seed', 0)} | {curve or '-'} | "
                     f"{'-' if drop is None else f'{-drop:+.1%}'} | "
                     f"{'-' if slope is None else f'{slope:+.1%}'} | {state} |")  # fmt: skip
    depths = sorted({d for e in s.depths.values() for n in e.values() for d in n})
    if depths:  # a task scored at several depths / densities (passkey's key depths, flip-flop's p(ignore))
        axis = depth_axis(cfg.get("task"))
        what = "Exact match of the 5-digit key" if cfg.get("task") == "passkey" else "Accuracy"
        lines += ["", f"## {axis.title} by {axis.label.removeprefix('key ')}",
                  "", f"{what}; {axis.note}.", ""]  # fmt: skip
        lines += ["| encoding | length | " + " | ".join(axis.tick.format(d) for d in depths) + " |",
                  "|---|---:|" + "---:|" * len(depths)]  # fmt: skip
        for enc in s.encodings:
            for n in s.lengths:
                cell = s.depths[enc].get(n)
                if cell:
                    vals = [fmt_interval(cell.get(d), "accuracy") if cell.get(d) else "" for d in depths]
                    lines.append(f"| `{enc}` | {n} | " + " | ".join(vals) + " |")
    if figures:
        lines += ["", "## Figures", ""] + [f"![{f}]({f})" for f in figures]
    env = results.get("environment") or {}
    lines += ["", "## Environment", ""] + [f"- {k}: {v}" for k, v in env.items()]
    lines += ["", "## Config", "", "```json", json.dumps(cfg, indent=2, sort_keys=True), "```", ""]
    return "\n".join(lines)
