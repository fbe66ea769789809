"""The files a comparison writes: results.json/csv, table.md, two plots; and ``--merge``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..output import Column, Table, clean, length_axis, pyplot, readable_log_axis, save_figure, write_csv, write_json

__all__ = ["write_outputs", "results_table", "merge_results", "metric_name", "run_subtitle", "per_position_absent"]


def metric_name(config: dict[str, Any]) -> str:
    """``ppl`` for text, ``accuracy`` for synthetic tasks."""
    return "accuracy" if config.get("task") else "ppl"


def _fmt(entry: dict[str, Any], metric: str) -> str:
    if not entry.get("applicable", True) or entry.get(metric) is None:
        return "n/a"
    v = entry[metric]
    return f"{100 * v:.1f}%" if metric == "accuracy" else (f"{v:.2f}" if v < 1000 else f"{v:.3g}")


def results_table(results: dict[str, Any]) -> Table:
    """One row per encoding, one column per evaluation length (ppl or accuracy)."""
    cfg, runs = results["config"], results["runs"]
    metric = metric_name(cfg)
    lens = sorted({e["length"] for r in runs for e in r["eval"]})
    unit = "n" if cfg.get("task") else "L"
    heads = [f"{unit}={n}" + (" (train)" if n == cfg["train_len"] else "") for n in lens]
    columns = [Column("encoding", code=True), *(Column(h, "right") for h in ["params", "train s", "tok/s", *heads])]
    rows = []
    for r in runs:
        by_len = {e["length"]: e for e in r["eval"]}
        tps = r.get("train_tokens_per_s")
        rows.append([r["encoding"], f"{r['params']:,}", f"{r['train_seconds']:.1f}", "-" if tps is None else f"{tps:,.0f}",
                     *(_fmt(by_len[n], metric) if n in by_len else "" for n in lens)])  # fmt: skip
    title = f"{metric} by evaluation length (trained at {unit}={cfg['train_len']}; n/a: cannot run there)"
    return Table(columns, rows, title=title)


def _csv_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**{k: r.get(k) for k in _RUN_COLS}, **e} for r in results["runs"] for e in r["eval"]]


_RUN_COLS = ("encoding", "params", "train_seconds", "train_tokens_per_s")
_CSV_COLS = (*_RUN_COLS, "length", "applicable", "loss", "ppl", "bpb", "accuracy", "token_accuracy", "tokens")


def run_subtitle(cfg: dict[str, Any]) -> str:
    """One line naming the run: preset, steps, seed(s), data."""
    if cfg.get("task"):
        data = f"task {cfg['task']}"
    elif cfg.get("text"):
        data = f"text {Path(cfg['text']).name}"
    elif cfg.get("dataset"):
        data = f"dataset {cfg['dataset']}"
    else:
        data = "embedded pydoc corpus"
    seeds = cfg.get("seeds") or [cfg.get("seed", 0)]
    seed = f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {','.join(map(str, seeds))}"
    return f"preset {cfg.get('preset')}, {cfg.get('steps')} steps, {seed}, {data}, trained at {cfg.get('train_len')}"


def _plots(out: Path, results: dict[str, Any]) -> None:
    plt = pyplot()
    cfg, runs = results["config"], results["runs"]
    metric = metric_name(cfg)
    subtitle = run_subtitle(cfg)
    color = {r["encoding"]: f"C{i % 10}" for i, r in enumerate(runs)}  # the same in both plots
    fig, ax = plt.subplots(figsize=(7.5, 5))
    plotted: list[float] = []
    for r in runs:
        pts = [(e["length"], e[metric]) for e in r["eval"] if e.get("applicable", True) and e.get(metric) is not None]
        if pts:
            x, y = zip(*pts)
            plotted += list(y)
            na = [e["length"] for e in r["eval"] if not e.get("applicable", True)]
            label = r["encoding"] + (f" (n/a at {', '.join(map(str, na))})" if na else "")
            ax.plot(x, y, marker="o", color=color[r["encoding"]], label=label)
    ax.axvline(cfg["train_len"], color="gray", ls="--", lw=1, label="train length")
    length_axis(ax, [e["length"] for r in runs for e in r["eval"]])
    if metric == "ppl":
        readable_log_axis(ax, plotted)
        ax.set_ylabel("validation perplexity (bytes)")
    else:
        ax.set_ylabel("exact-match accuracy")
        ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("evaluation length" + (" (problem size n)" if cfg.get("task") else " (tokens)"))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, out / "extrapolation.png", title="Length extrapolation", subtitle=subtitle)
    _per_position_plot(out, runs, cfg, color, subtitle)


def per_position_absent(runs: list[dict[str, Any]], length: int) -> dict[str, str]:
    """Encodings with no per-position curve at ``length``, and why (the plot says so)."""
    out = {}
    for r in runs:
        e = next((e for e in r["eval"] if e["length"] == length), None)
        if e is None or not e.get("applicable", True) or not e.get("per_position"):
            out[r["encoding"]] = (e or {}).get("reason") or "not evaluated at this length"
    return out


def _per_position_plot(out: Path, runs: list[dict[str, Any]], cfg: dict[str, Any], color, subtitle: str) -> None:
    """Loss by position at the longest length, and its difference from ``nope`` (where each breaks)."""
    plt = pyplot()
    longest = max(e["length"] for r in runs for e in r["eval"])
    absent = per_position_absent(runs, longest)
    curves = {}
    for r in runs:
        e = next((e for e in r["eval"] if e["length"] == longest), None)
        if r["encoding"] not in absent:
            curves[r["encoding"]] = ([(b["start"] + b["end"]) / 2 for b in e["per_position"]],
                                     [b["loss"] for b in e["per_position"]])  # fmt: skip
    base = curves.get("nope")
    panels = 2 if base is not None and len(curves) > 1 else 1
    fig, axes = plt.subplots(panels, 1, figsize=(7.5, 4.2 * panels), sharex=True, squeeze=False)
    seq_train = 2 * cfg["train_len"] if cfg.get("task") else cfg["train_len"]
    ax = axes[0, 0]
    for name, (x, y) in curves.items():
        ax.plot(x, y, marker=".", color=color[name], label=name)
    ax.set_ylabel("loss (nats / token)")
    if panels == 2:
        ax2 = axes[1, 0]
        for name, (x, y) in curves.items():
            if name != "nope" and len(y) == len(base[1]):
                ax2.plot(x, [a - b for a, b in zip(y, base[1])], marker=".", color=color[name], label=name)
        ax2.axhline(0, color="black", lw=0.8)
        ax2.set_ylabel("loss − nope's loss (nats / token)")
    for a in axes[:, 0]:
        a.axvline(seq_train, color="gray", ls="--", lw=1, label="train length")
        a.grid(True, alpha=0.3)
        a.legend(fontsize=8)
    axes[-1, 0].set_xlabel(f"position in a sequence of evaluation length {longest}")
    footer = "not drawn: " + "; ".join(f"{k}: n/a ({v})" for k, v in absent.items()) if absent else None
    title = f"Loss by position at length {longest}: where an encoding breaks"
    save_figure(fig, out / "per_position.png", title=title, subtitle=subtitle, footer=footer)


def write_outputs(out: Path, results: dict[str, Any]) -> Table:
    """Write config.json, results.json, results.csv, table.md and the plots; return the table."""
    out.mkdir(parents=True, exist_ok=True)
    results = clean(results)
    write_json(out / "config.json", results["config"])
    write_json(out / "results.json", results)
    write_csv(out / "results.csv", _csv_rows(results), _CSV_COLS)
    table = results_table(results)
    (out / "table.md").write_text(table.markdown())
    _plots(out, results)
    return table


_SHARD_KEYS = ("encodings", "shard")


def merge_results(dirs: list[Path]) -> dict[str, Any]:
    """Join the ``results.json`` of shards of one sweep; their configs must agree.

    Raises:
        ValueError: a missing results.json, configs that differ (beyond encodings and
            shard), or an encoding present in two shards.
    """
    if not dirs:
        raise ValueError("--merge needs at least one run directory")
    parts = []
    for d in dirs:
        p = Path(d) / "results.json"
        if not p.is_file():
            raise ValueError(f"--merge: {str(p)!r} not found (is {str(d)!r} a finished run?)")
        try:
            parts.append(json.loads(p.read_text()))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"--merge: {str(p)!r} is not valid JSON ({e})") from None
    ref = {k: v for k, v in parts[0]["config"].items() if k not in _SHARD_KEYS}
    runs, seen, encodings = [], set(), []
    for d, part in zip(dirs, parts):
        cfg = {k: v for k, v in part["config"].items() if k not in _SHARD_KEYS}
        diff = sorted(k for k in set(cfg) | set(ref) if cfg.get(k) != ref.get(k))
        if diff:
            raise ValueError(f"--merge: {d} was run with a different config (fields {diff})")
        for r in part["runs"]:
            if r["encoding"] in seen:
                raise ValueError(f"--merge: encoding {r['encoding']!r} appears in more than one run")
            seen.add(r["encoding"])
            runs.append(r)
            encodings.append(r["encoding"])
    order = parts[0]["config"]["encodings"]
    runs.sort(key=lambda r: order.index(r["encoding"]) if r["encoding"] in order else len(order))
    config = {**parts[0]["config"], "shard": None}
    return {"config": config, "runs": runs}
