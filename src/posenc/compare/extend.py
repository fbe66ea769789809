"""``posenc compare --extend``: the trained rotary models run past their training length by
changing only how positions enter attention, without retraining (issue 14 item 6).

For every trained model whose encoding a method of ``--extend`` applies to
(:func:`posenc.extend.methods.applies`: ``rope`` takes all of them, ``xpos`` ``none`` and
``ntk``), the model is rebuilt with the method's options (:func:`~posenc.extend.methods.with_options`:
the same weights) and evaluated at every evaluation length as the comparison evaluates
(perplexity, or accuracy for ``--task``), one setting per method
(:func:`~posenc.extend.methods.method_options`, shared with ``posenc extend``).
:func:`merge_extend` joins the ``"extend"`` rows of sharded runs. The table and ``extend.png``
have one row / line per (encoding, method); ``results.json`` gets an ``"extend"`` list with the
options used. A model whose training failed (NaN) or diverged
(:func:`~posenc.compare.diagnostics.run_health`) is not extended: the table's notes name it; a
NaN from an extension reads ``NaN``.
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoint import load_checkpoint
from ..extend.methods import EXTEND_METHODS, applies, describe, method_classes, method_options, with_options
from ..output import Column, Table, length_axis, pyplot, readable_log_axis, save_figure, write_csv, write_text
from .diagnostics import finite, run_health
from .evaluate import EvalSettings, evaluate
from .results import Evaluation, ExtendRow, ModelRun, RunResults
from .train import checkpoint_path

__all__ = ["run_extend", "extend_table", "write_extend", "merge_extend"]


def run_extend(cfg, source, ckpt_dir: Path, runs: list[ModelRun], *, device, log=print) -> list[ExtendRow]:
    """Evaluate every trained model of ``runs`` that a method of ``cfg.extend`` applies to, once per
    method and evaluation length; the model is read from its checkpoint in ``ckpt_dir``."""
    settings = EvalSettings.from_config(cfg)
    lens = cfg.eval_lens_sorted
    train_tokens, longest = source.seq_len(cfg.train_len), source.seq_len(max(lens))
    out, unhealthy = [], set()
    for run in runs:
        name = run.encoding
        methods = [m for m in cfg.extend if applies(m, name)]
        if not methods:
            continue
        seed = run.seed
        health = run_health(run, cfg.to_dict())
        if health["state"] != "ok":  # nothing to extend: extend_table's notes name it
            log(f"extend {name} seed {seed}: not extended, {health['state']} ({health['why']})")
            unhealthy.add(name)
            continue
        trained, _ = load_checkpoint(checkpoint_path(ckpt_dir, cfg, name, seed), map_location=device)
        enc = trained.encodings[0]
        for m in methods:
            opts = method_options(
                m, train_tokens=train_tokens, longest_tokens=longest, base=enc.base, rotary_dim=enc.rotary_dim
            )
            try:
                model = with_options(trained, method_classes(m), **opts)
            except ValueError as e:  # e.g. rope_extension on axial RoPE (positions with axes)
                log(f"extend {name} / {m}: not applicable ({e})")
                continue
            log(f"extend {name} / {m} ({describe(m, opts)}): evaluating at {', '.join(map(str, lens))}")
            evals = [evaluate(model, source, n, device=device, settings=settings) for n in lens]
            out.append(ExtendRow(name, seed, m, opts, describe(m, opts), evals))
    skipped = sorted({r.encoding for r in runs} - {e.encoding for e in out} - unhealthy)
    if skipped:
        log(f"extend: no method applies to {', '.join(skipped)} (rotary encodings only)")
    return out


def _cell(e: Evaluation, metric: str) -> str:
    if not e.applicable:
        return "n/a"
    v = finite(e.value(metric))
    if v is None:  # ran, but no number: a NaN loss (inf: a finite loss whose perplexity overflows)
        return "inf" if finite(e.loss) is not None else "NaN"
    return f"{100 * v:.1f}%" if metric == "accuracy" else (f"{v:.2f}" if v < 1000 else f"{v:.3g}")


def extend_table(results: RunResults) -> Table:
    """One row per (encoding, method), one column per evaluation length."""
    cfg, rows_in, metric = results.config, results.extend or [], results.metric
    lens = sorted({e.length for r in rows_in for e in r.evals})
    unit = "n" if cfg.get("task") else "L"
    heads = [f"{unit}={n}" + (" (train)" if n == cfg["train_len"] else "") for n in lens]
    cols = [Column("encoding", code=True), Column("method", code=True), Column("setting"),
            *(Column(h, "right") for h in heads)]  # fmt: skip
    rows = []
    for r in rows_in:
        by_len = {e.length: e for e in r.evals}
        rows.append([r.encoding, r.method, r.setting, *(_cell(by_len[n], metric) for n in lens)])
    title = f"{metric} by evaluation length, trained at {unit}={cfg['train_len']}, extended at inference only"
    return Table(cols, rows, title=title, notes=not_extended(results))


def not_extended(results: RunResults) -> list[str]:
    """One note per trained model an extension method applies to that failed or diverged (not extended)."""
    cfg, methods = results.config, results.config.get("extend") or EXTEND_METHODS
    notes = []
    for r in results.runs:
        if any(applies(m, r.encoding) for m in methods):
            h = run_health(r, cfg)
            if h["state"] != "ok":
                notes.append(f"not extended: {r.encoding} seed {r.seed}, {h['state']} ({h['why']})")
    return notes


def write_extend(out: Path, results: RunResults, subtitle: str | None = None) -> Table:
    """``extend.md``, ``extend.csv`` and ``extend.png`` (one panel per encoding, a line per method)."""
    table = extend_table(results)
    write_text(out / "extend.md", table.markdown())
    cols = ("encoding", "method", "setting", "length", "applicable", "loss", "ppl", "bpb", "accuracy", "tokens")
    rows = [{"encoding": r.encoding, "method": r.method, "setting": r.setting, **e.to_json()}
            for r in results.extend for e in r.evals]  # fmt: skip
    write_csv(out / "extend.csv", rows, cols)
    cfg, metric = results.config, results.metric
    names = list(dict.fromkeys(r.encoding for r in results.extend))
    plt = pyplot()
    fig, axes = plt.subplots(1, len(names), figsize=(6.5 * len(names), 4.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        plotted: list[float] = []
        for r in (x for x in results.extend if x.encoding == name):
            pts = [(e.length, finite(e.value(metric))) for e in r.evals if e.applicable]
            pts = [(n, v) for n, v in pts if v is not None]  # a NaN or inf is not drawn
            if pts:
                xs, ys = zip(*pts)
                plotted += list(ys)
                ax.plot(xs, ys, marker="o", color=f"C{EXTEND_METHODS.index(r.method)}", label=r.method)
        ax.axvline(cfg["train_len"], color="gray", ls="--", lw=1, label="train length")
        length_axis(ax, [e.length for r in results.extend for e in r.evals])
        if metric == "ppl":
            readable_log_axis(ax, plotted)
            ax.set_ylabel("validation perplexity (bytes)")
        else:
            ax.set_ylabel("exact-match accuracy")
            ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("evaluation length" + (" (problem size n)" if cfg.get("task") else " (tokens)"))
        ax.set_title(name)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, out / "extend.png", title="Context extension at inference (no retraining)", subtitle=subtitle)
    return table


def merge_extend(parts: list[RunResults]) -> list[ExtendRow]:
    """The ``--extend`` rows of sharded runs (``parts``), joined: each shard
    extended the models it trained, so rows are unique by (encoding, seed, method); a row
    two shards both hold must be the same row (same options and evaluations).

    Raises:
        ValueError: two shards hold different rows for one (encoding, seed, method).
    """
    rows: dict[tuple, ExtendRow] = {}
    for i, part in enumerate(parts):
        for r in part.extend or []:
            key = (r.encoding, r.seed, r.method)
            if key in rows and rows[key] != r:
                raise ValueError(
                    f"--merge: the runs hold different extend rows for {key[0]} seed {key[1]} / {key[2]} "
                    f"(run {i + 1} differs from an earlier one): were they run with the same config?"
                )
            rows.setdefault(key, r)
    return list(rows.values())
