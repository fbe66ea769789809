"""The files a comparison writes: results.json/csv, table.md, report.md, the figures; and ``--merge``.

:func:`write_outputs` summarises the run once (:func:`~posenc.compare.reading.summarize`) and hands
that summary to the table, the figures and ``report.md``: one page that reads itself. The
command, the reading (each published finding the run can speak to, whether this run agrees and
the numbers that decide it; what the run cannot support), the table with intervals, rankings
with ties, convergence, accuracy by task variant, the figures, the environment and the full
config. Every sentence is computed from the results; nothing is written by hand about a run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..data.tasks import DEPTH_TASKS, depth_axis
from ..output import Column, Table, write_csv, write_json, write_text
from .checks import model_names, parse_named
from .config import CompareConfig
from .diagnostics import finite, mfu, still_improving
from .extend import merge_extend
from .plots import draw_figures
from .reading import SPREAD_LIMIT, Summary, caveats, findings, passkey_reach, summarize, train_spread
from .results import Interval, ModelRun, RunResults, load_results

__all__ = ["OUTPUTS", "outputs_of", "write_outputs", "results_table", "notes_json", "csv_rows", "merge_results",
           "report_markdown", "table_rows", "fmt_interval", "status_of"]  # fmt: skip


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


def write_outputs(out: Path, results: RunResults) -> Table:
    """Write config.json, results.json, results.csv, table.md, the figures and report.md;
    return the table. Here the run is summarised, once; ``results`` gets each run's health and
    the table's notes as numbers (results.json's ``"summary"``)."""
    out.mkdir(parents=True, exist_ok=True)
    s = summarize(results)  # the one summary of the run: the table, the figures, report.md and the reading read it
    for run, health in zip(results.runs, s.run_health):
        run.health = health
        run.include("health")
    results.notes = notes_json(s)
    results.include("notes")
    write_json(out / "config.json", results.config)
    write_json(out / "results.json", results.to_json())
    write_csv(out / "results.csv", *csv_rows(results))
    table = results_table(s)
    write_text(out / "table.md", table.markdown())
    figures = draw_figures(out, s)
    write_text(out / "report.md", report_markdown(s, figures))
    return table


def results_table(s: Summary | RunResults) -> Table:
    """One row per encoding (the mean over seeds, with its interval), one column per
    evaluation length; the notes under it: intervals, the spread at the training length,
    MFU, and what the run cannot support. Given the results rather than their summary (the
    console's table of ``posenc compare``, after :func:`~posenc.compare.compare` returned), it
    summarises them."""
    s = summarize(s) if isinstance(s, RunResults) else s
    heads, rows, notes = table_rows(s)
    columns = [Column(heads[0], code=True), *(Column(h, "right") for h in heads[1:-1]), Column(heads[-1])]
    title = f"{s.metric} by evaluation length (trained at {_unit(s)}={s.train_len}; n/a: cannot run there)"
    return Table(columns, rows, title=title, notes=notes + caveats(s))


def notes_json(s: Summary) -> dict[str, Any]:
    """What the notes under the table say, as numbers: MFU (:func:`~posenc.compare.diagnostics.mfu`),
    the spread at the training length (max/min of the encodings other than nope), the
    encodings not converged, and those with a failed (NaN) or diverged run (never ranked)."""
    spread = train_spread(s)
    return {
        "mfu": mfu(s.results),
        "train_spread": None if spread is None else {"max_over_min": spread[0], "min": list(spread[1]),
                                                     "max": list(spread[2]), "limit": SPREAD_LIMIT},
        "not_converged": [e for e, c in s.converged.items() if c is False],
        "failed": [e for e, h in s.flagged.items() if h == "failed"],
        "diverged": [e for e, h in s.flagged.items() if h == "diverged"],
    }  # fmt: skip


def csv_rows(results: RunResults) -> tuple[list[dict[str, Any]], list[str]]:
    """results.csv: one row per encoding, seed and length, and its columns. A task scored at
    several variants adds one accuracy column per variant, in ascending order:
    ``accuracy_<column>_<100 · variant>`` (``accuracy_depth_50``: passkey; ``accuracy_p_ignore_98``:
    flip-flop); an entry not scored there (n/a) leaves them empty."""
    rows, depths = [], set()
    column = lambda d: f"accuracy_{depth_axis(results.task).column}_{round(100 * d)}"  # noqa: E731
    for r in results.runs:
        run = dict(zip(_RUN_COLS, (r.encoding, r.seed, r.params, r.train_seconds, r.train_tokens_per_s)))
        for e in r.evals:
            row = {**run, **{k: v for k, v in e.to_json().items() if k != "depths"}}
            for d in e.depths or []:
                row[column(d.depth)] = d.accuracy
                depths.add(d.depth)
            rows.append(row)
    return rows, [*_RUN_COLS, *_EVAL_COLS, *(column(d) for d in sorted(depths))]


_RUN_COLS = ("encoding", "seed", "params", "train_seconds", "train_tokens_per_s")
_EVAL_COLS = ("length", "applicable", "loss", "ppl", "bpb", "accuracy", "token_accuracy", "tokens")


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


def merge_results(dirs: list[Path]) -> RunResults:
    """Join the ``results.json`` of shards of one sweep (other encodings, or other seeds);
    their configs must agree.

    Raises:
        ValueError: a missing or unreadable results.json, configs that differ (beyond encodings,
            seeds, shard and workers), an encoding compared with other options in two shards, or
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
            parts.append(load_results(p))
        except ValueError as e:
            raise ValueError(f"--merge: {e}") from None
    ref = {k: v for k, v in parts[0].config.items() if k not in _SHARD_KEYS}
    runs: list[ModelRun] = []
    seen, named, options, entries = set(), {}, {}, []
    for d, part in zip(dirs, parts):
        cfg = {k: v for k, v in part.config.items() if k not in _SHARD_KEYS}
        diff = sorted(k for k in set(cfg) | set(ref) if cfg.get(k) != ref.get(k))
        if diff:
            raise ValueError(f"--merge: {d} was run with a different config (fields {diff})")
        entries += [e for e in part.config["encodings"] if e not in entries]
        given = part.config.get("encoding_options") or {}
        for name in _compared(part.config):  # an encoding is one model everywhere: same options
            first = options.setdefault(name, (given.get(name, {}), d))
            if first[0] != given.get(name, {}):
                raise ValueError(
                    f"--merge: {name!r} was run with options {first[0]} in {first[1]} but {given.get(name, {})} "
                    f"in {d}; merge runs of one configuration"
                )
        for name, pattern in parse_named(part.config["encodings"]).items():  # a NAME is one model everywhere
            first = named.setdefault(name, (pattern, d))
            if first[0] != pattern:
                raise ValueError(
                    f"--merge: name {name!r} stands for {first[0]!r} in {first[1]} but for {pattern!r} in {d}; "
                    "a name is one model: rename one of them"
                )
        for r in part.runs:
            if (r.encoding, r.seed) in seen:
                raise ValueError(f"--merge: encoding {r.encoding!r} with seed {r.seed} appears in more than one run")
            seen.add((r.encoding, r.seed))
            runs.append(r)
    if entries != ["all"] and "all" in entries:  # an "all" shard beside others: every registered
        registered = _compared({"encodings": ["all"]})  # encoding by name, then the others' own models
        entries = [*registered, *(e for e in entries if e != "all" and e not in registered)]
    order = _compared({"encodings": entries})
    runs.sort(key=lambda r: (order.index(r.encoding) if r.encoding in order else len(order), r.seed))
    encoding_options = {name: opts for name, (opts, _) in options.items() if opts}
    config = {**parts[0].config, "shard": None, "seeds": sorted({r.seed for r in runs}), "encodings": entries}
    if encoding_options or "encoding_options" in config:
        config["encoding_options"] = encoding_options
    merged = RunResults(config, runs=runs, layout=("config", "runs"))
    extend = merge_extend(parts)  # each shard extended the models it trained
    if extend:
        merged.extend = extend
        merged.include("extend")
    envs = [p.environment for p in parts if p.environment]
    if envs:  # MFU's denominator: the shards' processes' peaks
        merged.environment = {**envs[0], "merged_from": [str(d) for d in dirs]}
        merged.include("environment")
    return merged


# ------------------------------------------------------------------ the table and report.md
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


def status_of(s: Summary, encoding: str) -> str:
    """``ok``, ``not converged: train longer (validation loss fell 4.1% over the last 20%)``,
    ``failed: training loss NaN from step 3``, ``diverged: training loss rose 114% (...)``
    (with several seeds: ``seed 1 diverged: ...``), or ``-`` (unknown)."""
    if encoding in s.flagged:
        why = s.why[encoding]
        return why if why.startswith(s.health[encoding]) else f"{s.health[encoding]} ({why})"
    convs = s.convergence_of(encoding)
    why = still_improving(convs)
    if why is not None:
        return f"not converged: train longer ({why})"
    return "ok" if convs and all(c.get("converged") is True for c in convs) else "-"


def _unit(s: Summary) -> str:
    return "n" if s.task and s.task != "passkey" else "L"


def interval_note(config: dict[str, Any]) -> str:
    seeds = config.get("seeds") or [config.get("seed", 0)]
    if len(seeds) >= 3:
        return f"mean ± 95 % t-interval of {len(seeds)} seeds ({', '.join(map(str, seeds))})"
    if len(seeds) == 2:
        return f"mean (min–max) of 2 seeds ({seeds[0]}, {seeds[1]})"
    return f"one seed ({seeds[0]}): no interval"


def table_rows(s: Summary) -> tuple[list[str], list[list[str]], list[str]]:
    """``(headers, rows, notes)`` of the main table: one row per encoding, the metric at every
    evaluation length (with its interval over seeds), speed, and the convergence status."""
    heads = ["encoding", "params", "train s", "tok/s"]
    heads += [f"{_unit(s)}={n}" + (" (train)" if n == s.train_len else "") for n in s.lengths] + ["status"]
    rows = []
    for enc in s.encodings:
        mine = s.runs_of(enc)
        secs = sum(r.train_seconds or 0.0 for r in mine) / len(mine)
        tps = [r.train_tokens_per_s for r in mine if r.train_tokens_per_s]
        rows.append([enc, f"{mine[0].params or 0:,}", f"{secs:.1f}", f"{sum(tps) / len(tps):,.0f}" if tps else "-",
                     *(_cell(s, mine, enc, n) for n in s.lengths), status_of(s, enc)])  # fmt: skip
    unit = "words" if s.results.config.get("data_dir") else "bytes"
    notes = [
        f"{'validation perplexity (' + unit + ')' if s.metric == 'ppl' else 'exact-match accuracy'}: "
        f"{interval_note(s.results.config)}"
    ]
    spread = train_spread(s)
    if spread is not None:
        ok = "within" if spread[0] <= SPREAD_LIMIT else "NOT within"
        notes.append(f"spread at the training length (encodings other than nope): max/min {spread[0]:.3f} "
                     f"({spread[2][0]} {spread[2][1]:.2f} / {spread[1][0]} {spread[1][1]:.2f}), {ok} {SPREAD_LIMIT}")  # fmt: skip
    m = mfu(s.results)
    if m is not None:
        notes.append(f"MFU {m['mfu']:.1%}: {m['flops_per_s'] / 1e9:.1f} GFLOP/s of training over a matmul peak of "
                     f"{m['peak_flops_per_s'] / 1e9:.1f} GFLOP/s measured in the same process")  # fmt: skip
    return heads, rows, notes


def _cell(s: Summary, runs: list[ModelRun], enc: str, n: int) -> str:
    """The table's cell: the interval; ``NaN`` where the model ran but has no finite number
    (a failed run; ``inf``: a finite loss whose perplexity overflows); ``n/a`` where it cannot run."""
    cell = s.cells[enc].get(n)
    if cell is not None:
        return fmt_interval(cell, s.metric)
    ran = [e for r in runs for e in r.evals if e.length == n and e.applicable]
    if not ran:
        return "n/a"
    return "inf" if any(finite(e.loss) is not None for e in ran) else "NaN"


def _md_table(heads: list[str], rows: list[list[str]]) -> list[str]:
    out = [
        "| " + " | ".join(heads) + " |",
        "|" + "|".join("---" if k == 0 else "---:" for k in range(len(heads))) + "|",
    ]
    out += ["| " + " | ".join([f"`{r[0]}`", *(c.replace("|", "\\|") for c in r[1:])]) + " |" for r in rows]
    return out


def report_markdown(s: Summary, figures: list[str]) -> str:
    """The whole ``report.md`` (see the module docstring); ``figures``: PNG names in the run folder."""
    results, cfg = s.results, s.results.config
    lines = ["# posenc compare: report", ""]
    data = f"task {cfg['task']}" if cfg.get("task") else cfg.get("text") or cfg.get("dataset") or "the embedded corpus"
    wall = results.wall_seconds
    lines += [f"{len(s.encodings)} encodings × {len(cfg.get('seeds') or [0])} seed(s), preset {cfg.get('preset')}, "
              f"{cfg.get('steps')} steps, {data}, trained at {s.train_len}"
              + (f"; wall time {wall:.0f} s" if wall else "") + ".", ""]  # fmt: skip
    lines += ["## Command", "", "```", results.command or "(run through the Python API)", "```", ""]
    lines += [
        "## Reading",
        "",
        "Computed from the numbers below (`posenc.compare.reading`); it changes when they do.",
        "",
    ]
    found = findings(s)
    for f in found:
        lines.append(f"- **{f.verdict}** — {f.source}: {f.claim}. Here: {f.evidence}.")
    if not found:
        lines.append("- No published finding this run can speak to (it needs the encodings and lengths they compare).")
    reach = passkey_reach(s) if cfg.get("task") == "passkey" else {}
    for enc, n in reach.items():
        lines.append(f"- passkey, {enc}: " + (f"retrieved at every depth (>= 90 %) up to L={n}" if n else
                     "not retrieved at every depth (>= 90 %) even at the shortest length"))  # fmt: skip
    cav = caveats(s)
    if cav:
        lines += ["", "What this run cannot support:", ""] + [f"- {c}" for c in cav]
    heads, rows, notes = table_rows(s)
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
    limit = next((r.convergence.get("threshold") for r in results.runs if r.convergence), None)
    limit = f"{limit:.0%}" if limit is not None else "the threshold"
    lines += ["", "## Convergence", "", "Validation loss at the training length during training. A model whose "
              f"validation loss fell more than {limit} over the last 20 % of the steps is still improving (without "
              "validation points: its training loss's least-squares line over that stretch decides; it is shown "
              "for every run, but it keeps falling on seen data after the validation loss has flattened).",
              ""]  # fmt: skip
    lines += ["| encoding | seed | validation loss (step: loss) | validation change, last 20 % "
              "| train-loss change, last 20 % | status |", "|---|---:|---|---:|---:|---|"]  # fmt: skip
    for r, c, health in zip(results.runs, s.run_convergence, s.run_health):
        curve = ", ".join(f"{p.step}: {p.loss:.3f}" for p in r.val_curve or [] if p.loss is not None)
        slope, drop = c.get("train_slope"), c.get("val_drop")
        state = {True: "converged", False: "not converged: train longer", None: "-"}[c.get("converged")]
        if health["state"] != "ok":  # never "converged"
            state = f"{health['state']}: {health['why']}"
        lines.append(f"| `{r.encoding}` | {r.seed} | {curve or '-'} | "
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
    env = results.environment or {}
    lines += ["", "## Environment", ""] + [f"- {k}: {v}" for k, v in env.items()]
    lines += ["", "## Config", "", "```json", json.dumps(cfg, indent=2, sort_keys=True), "```", ""]
    return "\n".join(lines)
