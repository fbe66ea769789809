"""The files a comparison writes: results.json/csv, table.md, two plots; and ``--merge``."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

__all__ = ["write_outputs", "markdown_table", "merge_results", "metric_name"]


def metric_name(config: dict[str, Any]) -> str:
    """``ppl`` for text, ``accuracy`` for synthetic tasks."""
    return "accuracy" if config.get("task") else "ppl"


def _fmt(entry: dict[str, Any], metric: str) -> str:
    if not entry.get("applicable", True) or entry.get(metric) is None:
        return "n/a"
    v = entry[metric]
    return f"{100 * v:.1f}%" if metric == "accuracy" else (f"{v:.2f}" if v < 1000 else f"{v:.3g}")


def markdown_table(results: dict[str, Any]) -> str:
    """One row per encoding, one column per evaluation length (ppl or accuracy)."""
    cfg, runs = results["config"], results["runs"]
    metric = metric_name(cfg)
    lens = sorted({e["length"] for r in runs for e in r["eval"]})
    unit = "n" if cfg.get("task") else "L"
    heads = [f"{unit}={n}" + (" (train)" if n == cfg["train_len"] else "") for n in lens]
    lines = [
        f"{metric} by evaluation length ({'trained at ' + unit + '=' + str(cfg['train_len'])}; n/a: cannot run there)",
        "",
        "| encoding | params | train s | tok/s | " + " | ".join(heads) + " |",
        "|---|---:|---:|---:|" + "---:|" * len(lens),
    ]
    for r in runs:
        by_len = {e["length"]: e for e in r["eval"]}
        cells = [_fmt(by_len[n], metric) if n in by_len else "" for n in lens]
        tps = r.get("train_tokens_per_s")
        tps = "-" if tps is None else f"{tps:,.0f}"
        row = f"| `{r['encoding']}` | {r['params']:,} | {r['train_seconds']:.1f} | {tps} | "
        lines.append(row + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _write_csv(path: Path, results: dict[str, Any]) -> None:
    cols = ["encoding", "params", "train_seconds", "train_tokens_per_s", "length", "applicable",
            "loss", "ppl", "bpb", "accuracy", "token_accuracy", "tokens"]  # fmt: skip
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in results["runs"]:
            for e in r["eval"]:
                w.writerow({**{k: r.get(k) for k in cols[:4]}, **{k: e.get(k) for k in cols[4:]}})


def _plots(out: Path, results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullLocator

    cfg, runs = results["config"], results["runs"]
    metric = metric_name(cfg)
    train_len = cfg["train_len"]

    color = {r["encoding"]: f"C{i % 10}" for i, r in enumerate(runs)}  # the same in both plots
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        pts = [(e["length"], e[metric]) for e in r["eval"] if e.get("applicable", True) and e.get(metric) is not None]
        if pts:
            x, y = zip(*pts)
            na = [e["length"] for e in r["eval"] if not e.get("applicable", True)]
            label = r["encoding"] + (f" (n/a at {', '.join(map(str, na))})" if na else "")
            ax.plot(x, y, marker="o", color=color[r["encoding"]], label=label)
    ax.axvline(train_len, color="gray", ls="--", lw=1, label="train length")
    ax.set_xscale("log", base=2)
    lens = sorted({e["length"] for r in runs for e in r["eval"]})
    ax.set_xticks(lens, [str(n) for n in lens])
    ax.xaxis.set_minor_locator(NullLocator())
    if metric == "ppl":
        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.set_ylabel("validation perplexity (bytes)")
    else:
        ax.set_ylabel("exact-match accuracy")
        ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("evaluation length" + (" (problem size n)" if cfg.get("task") else " (tokens)"))
    ax.set_title("Length extrapolation")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "extrapolation.png", dpi=120)
    plt.close(fig)

    # per-position loss at the longest length each encoding could run
    fig, ax = plt.subplots(figsize=(7, 4.5))
    longest = max(e["length"] for r in runs for e in r["eval"])
    for r in runs:
        e = next((e for e in r["eval"] if e["length"] == longest and e.get("applicable", True)), None)
        if e is None or not e.get("per_position"):
            continue
        x = [(b["start"] + b["end"]) / 2 for b in e["per_position"]]
        ax.plot(x, [b["loss"] for b in e["per_position"]], marker=".", color=color[r["encoding"]], label=r["encoding"])
    seq_train = 2 * train_len if cfg.get("task") else train_len
    ax.axvline(seq_train, color="gray", ls="--", lw=1, label="train length")
    ax.set_xlabel(f"position in a sequence of evaluation length {longest}")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title("Loss by position: where an encoding breaks")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "per_position.png", dpi=120)
    plt.close(fig)


def _clean(x: Any) -> Any:
    """JSON without NaN/inf (they become null)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def write_outputs(out: Path, results: dict[str, Any]) -> str:
    """Write config.json, results.json, results.csv, table.md and the plots; return the table."""
    out.mkdir(parents=True, exist_ok=True)
    results = _clean(results)
    (out / "config.json").write_text(json.dumps(results["config"], indent=2) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    _write_csv(out / "results.csv", results)
    table = markdown_table(results)
    (out / "table.md").write_text(table)
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
        parts.append(json.loads(p.read_text()))
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
