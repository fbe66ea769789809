"""The files a comparison writes: results.json/csv, table.md, report.md, the figures; and ``--merge``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..data.tasks import DEPTH_TASKS, depth_axis
from ..output import Column, Table, clean, write_csv, write_json, write_text
from .checks import model_names, parse_named
from .config import CompareConfig
from .diagnostics import mfu, run_health
from .extend import merge_extend
from .plots import draw_figures, per_position_absent, run_subtitle
from .reading import SPREAD_LIMIT, caveats, metric_name, summarize, train_spread
from .report_md import report_markdown, table_rows

__all__ = [
    "OUTPUTS",
    "outputs_of",
    "write_outputs",
    "results_table",
    "csv_rows",
    "merge_results",
    "metric_name",
    "run_subtitle",
    "per_position_absent",
]


# the files a comparison (or --merge) writes at the top of its folder, whatever its config
OUTPUTS = ("config.json", "results.json", "results.csv", "table.md", "report.md", "extrapolation.png",
           "per_position.png")  # fmt: skip


def outputs_of(config: dict[str, Any] | CompareConfig) -> list[str]:
    """The top-level files a run of ``config`` writes: :data:`OUTPUTS`, the heatmap of a task
    scored at several depths or densities (``<task>.png``: passkey, flip-flop), the
    ``extend.*`` files of an ``--extend`` run."""
    d = config.to_dict() if isinstance(config, CompareConfig) else config
    task = d.get("task")
    return [*OUTPUTS, *([f"{task}.png"] if task in DEPTH_TASKS else []),
            *(["extend.md", "extend.csv", "extend.png"] if d.get("extend") else []),
            *(["vocab.json"] if d.get("data_dir") else [])]  # fmt: skip


def results_table(results: dict[str, Any]) -> Table:
    """One row per encoding (the mean over seeds, with its interval), one column per
    evaluation length; the notes under it: intervals, the spread at the training length,
    MFU, and what the run cannot support."""
    cfg = results["config"]
    heads, rows, notes = table_rows(results)
    columns = [Column(heads[0], code=True), *(Column(h, "right") for h in heads[1:-1]), Column(heads[-1])]
    unit = "n" if cfg.get("task") and cfg.get("task") != "passkey" else "L"
    title = f"{metric_name(cfg)} by evaluation length (trained at {unit}={cfg['train_len']}; n/a: cannot run there)"
    return Table(columns, rows, title=title, notes=notes + caveats(results))


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """What the notes under the table say, as numbers: MFU (:func:`~posenc.compare.diagnostics.mfu`),
    the spread at the training length (max/min of the encodings other than nope), the
    encodings not converged, and those with a failed (NaN) or diverged run (never ranked)."""
    s = summarize(results)
    spread = train_spread(s)
    return {
        "mfu": mfu(results),
        "train_spread": None if spread is None else {"max_over_min": spread[0], "min": list(spread[1]),
                                                     "max": list(spread[2]), "limit": SPREAD_LIMIT},
        "not_converged": [e for e, c in s.converged.items() if c is False],
        "failed": [e for e, h in s.flagged.items() if h == "failed"],
        "diverged": [e for e, h in s.flagged.items() if h == "diverged"],
    }  # fmt: skip


def _depth_column(results: dict[str, Any], depth: float) -> str:
    """``accuracy_<column>_<100 · depth>``: ``accuracy_depth_50`` (passkey), ``accuracy_p_ignore_98`` (flip-flop)."""
    return f"accuracy_{depth_axis(results['config'].get('task')).column}_{round(100 * depth)}"


def csv_rows(results: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """results.csv: one row per encoding, seed and length, and its columns. A task scored at
    several variants (``"depths"``) adds one accuracy column per variant, in ascending order
    (:func:`_depth_column`); an entry not scored there (n/a) leaves them empty."""
    rows, depths = [], set()
    for r in results["runs"]:
        for e in r["eval"]:
            row = {**{k: r.get(k) for k in _RUN_COLS}, **{k: v for k, v in e.items() if k != "depths"}}
            for d in e.get("depths") or []:
                row[_depth_column(results, d["depth"])] = d["accuracy"]
                depths.add(d["depth"])
            rows.append(row)
    return rows, [*_CSV_COLS, *(_depth_column(results, d) for d in sorted(depths))]


_RUN_COLS = ("encoding", "seed", "params", "train_seconds", "train_tokens_per_s")
_CSV_COLS = (*_RUN_COLS, "length", "applicable", "loss", "ppl", "bpb", "accuracy", "token_accuracy", "tokens")


def write_outputs(out: Path, results: dict[str, Any]) -> Table:
    """Write config.json, results.json, results.csv, table.md, the figures and report.md;
    return the table."""
    out.mkdir(parents=True, exist_ok=True)
    runs = [{**r, "health": run_health(r, results["config"])} for r in results["runs"]]
    results = clean({**results, "runs": runs, "summary": summary(results)})
    write_json(out / "config.json", results["config"])
    write_json(out / "results.json", results)
    write_csv(out / "results.csv", *csv_rows(results))
    table = results_table(results)
    write_text(out / "table.md", table.markdown())
    figures = draw_figures(out, results)
    write_text(out / "report.md", report_markdown(results, figures))
    return table


# what may differ between the shards of one sweep; encoding_options may differ only for
# encodings one shard compares and another does not (a preset drops the options of
# encodings that are not compared), and the merged config holds the union of both
_SHARD_KEYS = ("encodings", "shard", "seeds", "workers", "encoding_options")


def _compared(cfg: dict[str, Any]) -> list[str]:
    """The model names a saved config compares (``all``: every registered encoding)."""
    if cfg["encodings"] == ["all"]:
        from ..registry import available

        return list(available())
    return model_names(cfg["encodings"])


def merge_results(dirs: list[Path]) -> dict[str, Any]:
    """Join the ``results.json`` of shards of one sweep (other encodings, or other seeds);
    their configs must agree.

    Raises:
        ValueError: a missing results.json, configs that differ (beyond encodings, seeds,
            shard and workers), an encoding compared with other options in two shards, or
            one encoding and seed present in two shards.
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
    runs, seen, named, options, entries = [], set(), {}, {}, []
    for d, part in zip(dirs, parts):
        cfg = {k: v for k, v in part["config"].items() if k not in _SHARD_KEYS}
        diff = sorted(k for k in set(cfg) | set(ref) if cfg.get(k) != ref.get(k))
        if diff:
            raise ValueError(f"--merge: {d} was run with a different config (fields {diff})")
        entries += [e for e in part["config"]["encodings"] if e not in entries]
        given = part["config"].get("encoding_options") or {}
        for name in _compared(part["config"]):  # an encoding is one model everywhere: same options
            first = options.setdefault(name, (given.get(name, {}), d))
            if first[0] != given.get(name, {}):
                raise ValueError(
                    f"--merge: {name!r} was run with options {first[0]} in {first[1]} but {given.get(name, {})} "
                    f"in {d}; merge runs of one configuration"
                )
        for name, pattern in parse_named(part["config"]["encodings"]).items():  # a NAME is one model everywhere
            first = named.setdefault(name, (pattern, d))
            if first[0] != pattern:
                raise ValueError(
                    f"--merge: name {name!r} stands for {first[0]!r} in {first[1]} but for {pattern!r} in {d}; "
                    "a name is one model: rename one of them"
                )
        for r in part["runs"]:
            key = (r["encoding"], r.get("seed", 0))
            if key in seen:
                raise ValueError(f"--merge: encoding {key[0]!r} with seed {key[1]} appears in more than one run")
            seen.add(key)
            runs.append(r)
    if entries != ["all"] and "all" in entries:  # an "all" shard beside others: every registered
        registered = _compared({"encodings": ["all"]})  # encoding by name, then the others' own models
        entries = [*registered, *(e for e in entries if e != "all" and e not in registered)]
    order = _compared({"encodings": entries})
    runs.sort(key=lambda r: (order.index(r["encoding"]) if r["encoding"] in order else len(order), r.get("seed", 0)))
    seeds = sorted({r.get("seed", 0) for r in runs})
    encoding_options = {name: opts for name, (opts, _) in options.items() if opts}
    config = {**parts[0]["config"], "shard": None, "seeds": seeds, "encodings": entries}
    if encoding_options or "encoding_options" in config:
        config["encoding_options"] = encoding_options
    envs = [p["environment"] for p in parts if p.get("environment")]
    merged = {"config": config, "runs": runs}
    extend = merge_extend(parts)  # each shard extended the models it trained
    if extend:
        merged["extend"] = extend
    if envs:  # MFU's denominator: the shards' processes' peaks
        merged["environment"] = {**envs[0], "merged_from": [str(d) for d in dirs]}
    return merged
