"""The figures of a comparison, drawn from its summary: extrapolation (mean over seeds with its
interval as a band), loss by position, and, for a task scored at several variants (passkey's key
depths, flip-flop's p(ignore)), heatmaps of length × variant per encoding (``<task>.png``).

Failed (NaN) and diverged models are not drawn in the line plots (their numbers would
squash every other curve); the legend names them, and the heatmap panel's title marks them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..data.lengths import sequence_length
from ..data.tasks import depth_axis
from ..output import length_axis, panel_grid, pyplot, readable_log_axis, save_figure
from .diagnostics import finite
from .reading import Summary
from .results import ModelRun

__all__ = ["draw_figures", "run_subtitle", "per_position_absent", "has_depths"]


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


def draw_figures(out: Path, s: Summary) -> list[str]:
    """Draw every figure of the run of ``s`` into ``out``; returns their file names."""
    color = {e: f"C{i % 10}" for i, e in enumerate(s.encodings)}  # the same in every figure
    names = [_extrapolation(out, s, color), _per_position(out, s, color)]
    if has_depths(s.results.runs):
        names.append(_depths(out, s))
    return names


def has_depths(runs: list[ModelRun]) -> bool:
    """Whether any evaluation of ``runs`` was scored at several variants (``depths``)."""
    return any(e.depths for r in runs for e in r.evals)


def _extrapolation(out: Path, s: Summary, color) -> str:
    plt = pyplot()
    cfg, metric = s.results.config, s.metric
    fig, ax = plt.subplots(figsize=(7.5, 5))
    plotted: list[float] = []
    for enc in s.encodings:
        cells = [(n, c) for n, c in s.cells[enc].items() if c is not None]
        if enc in s.flagged:  # a legend note instead of a line
            ax.plot([], [], ls="none", marker="x", color=color[enc], label=f"{enc}: not drawn ({s.flagged[enc]})")
            continue
        if not cells:
            continue
        x = [n for n, _ in cells]
        mean, lo, hi = ([getattr(c, k) for _, c in cells] for k in ("mean", "lo", "hi"))
        plotted += lo + hi
        na = [n for n, c in s.cells[enc].items() if c is None]
        label = enc + (f" (n/a at {', '.join(map(str, na))})" if na else "")
        ax.plot(x, mean, marker="o", color=color[enc], label=label)
        if any(c.has_width and c.kind != "wilson" for _, c in cells):  # an interval over seeds
            ax.fill_between(x, lo, hi, color=color[enc], alpha=0.2, lw=0)
    ax.axvline(cfg["train_len"], color="gray", ls="--", lw=1, label="train length")
    length_axis(ax, s.lengths)
    if metric == "ppl":
        if plotted:  # a log axis over nothing fails
            readable_log_axis(ax, plotted)
        ax.set_ylabel(f"validation perplexity ({'words' if cfg.get('data_dir') else 'bytes'})")
    else:
        mean = f" (mean over {depth_axis(cfg.get('task')).plural})" if has_depths(s.results.runs) else ""
        ax.set_ylabel("exact-match accuracy" + mean)
        ax.set_ylim(-0.02, 1.02)
    unit = " (problem size n)" if cfg.get("task") and cfg["task"] != "passkey" else " (tokens)"
    ax.set_xlabel("evaluation length" + unit)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    seeds = len(cfg.get("seeds") or [0])
    band = {1: None, 2: "bands: min–max of 2 seeds"}.get(seeds, f"bands: 95 % t-interval of {seeds} seeds")
    save_figure(fig, out / "extrapolation.png", title="Length extrapolation", subtitle=run_subtitle(cfg), footer=band)
    return "extrapolation.png"


def per_position_absent(runs: list[ModelRun], length: int, flagged: dict[str, str] | None = None) -> dict[str, str]:
    """Encodings with no per-position curve at ``length``, and why (the plot says so):
    not applicable, not evaluated, a NaN loss, or ``flagged`` (``{encoding: "failed" |
    "diverged"}``: not drawn)."""
    out = dict(flagged or {})
    for r in runs:
        e = r.at(length)
        if r.encoding in out:
            continue
        if e is None or not e.applicable or not e.per_position:
            out[r.encoding] = (e.reason if e is not None else None) or "not evaluated at this length"
        elif any(finite(b.loss) is None for b in e.per_position):
            out[r.encoding] = "failed: NaN loss"
    return out


def _per_position(out: Path, s: Summary, color) -> str:
    """Loss by position at the longest length (mean over seeds), and its difference from
    ``nope``'s (where an encoding breaks)."""
    plt = pyplot()
    cfg, runs = s.results.config, s.results.runs
    longest = max(s.lengths)
    absent = per_position_absent(runs, longest, s.flagged)
    curves: dict[str, tuple[list[float], list[float]]] = {}
    for enc in s.encodings:
        if enc in absent:
            continue
        es = [r.at(longest) for r in s.runs_of(enc)]
        x = [(b.start + b.end) / 2 for b in es[0].per_position]
        y = [sum(e.per_position[k].loss for e in es) / len(es) for k in range(len(x))]
        curves[enc] = (x, y)
    base = curves.get("nope")
    panels = 2 if base is not None and len(curves) > 1 else 1
    fig, axes = plt.subplots(panels, 1, figsize=(7.5, 4.2 * panels), sharex=True, squeeze=False)
    seq_train = sequence_length(cfg.get("task"), cfg["train_len"])  # in the tokens of the x axis
    ax = axes[0, 0]
    for name, (x, y) in curves.items():
        ax.plot(x, y, marker=".", color=color[name], label=name)
    broken = {k: v for k, v in absent.items() if v.startswith(("failed", "diverged"))}
    for name, why in broken.items():  # a legend note instead of a line
        ax.plot([], [], ls="none", marker="x", color=color[name], label=f"{name}: not drawn ({why})")
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
    footer = "not drawn: " + "; ".join(f"{k}: {v}" if k in broken else f"{k}: n/a ({v})" for k, v in absent.items())
    footer = footer if absent else None
    title = f"Loss by position at length {longest}: where an encoding breaks"
    save_figure(fig, out / "per_position.png", title=title, subtitle=run_subtitle(cfg), footer=footer)
    return "per_position.png"


def _depths(out: Path, s: Summary) -> str:
    """One heatmap per encoding: exact-match accuracy by evaluation length (rows) and variant
    (columns: key depth, p(ignore); named by :func:`posenc.data.tasks.depth_axis`), the mean
    over seeds written in each cell; ``<task>.png``."""
    task = s.task
    axis = depth_axis(task)
    depths = sorted({d for by_len in s.depths.values() for cell in by_len.values() for d in cell})
    fig, axes_of = panel_grid(len(s.encodings), 1, 4, size=(2.9, 2.6))
    image = None
    for k, enc in enumerate(s.encodings):
        ax = axes_of(k)[0]
        grid = [[(s.depths[enc].get(n) or {}).get(d) for d in depths] for n in s.lengths]
        vals = [[float("nan") if c is None else c.mean for c in row] for row in grid]
        image = ax.imshow(vals, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        for i, row in enumerate(vals):
            for j, v in enumerate(row):
                text = "n/a" if v != v else f"{100 * v:.0f}"
                ax.text(
                    j, i, text, ha="center", va="center", fontsize=7, color="white" if v != v or v < 0.6 else "black"
                )
        ax.set_xticks(range(len(depths)), [axis.tick.format(d) for d in depths])
        ax.set_yticks(range(len(s.lengths)), [str(n) for n in s.lengths])
        ax.set_title(enc + (f" ({s.flagged[enc]})" if enc in s.flagged else ""))
        ax.set_xlabel(axis.label)
        ax.set_ylabel("length")
    if image is not None:
        fig.colorbar(image, ax=[a for k in range(len(s.encodings)) for a in axes_of(k)], shrink=0.8,
                     label="exact match")  # fmt: skip
    name = f"{task or 'depths'}.png"
    save_figure(fig, out / name, title=f"{axis.title}: exact match (%) by length and {axis.label}",
                subtitle=run_subtitle(s.results.config), footer=axis.note or None)  # fmt: skip
    return name
