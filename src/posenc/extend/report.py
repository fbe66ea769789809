"""The files of ``posenc extend``: tables, ``results.csv``, plots and ``report.md``.

The reading in ``report.md`` is computed from the numbers:

* the in-window reference is the sliding-window perplexity of ``none`` at the training length
  (or, without that cell, at the longest length within it); a method *holds* at a length
  when its perplexity there, and at every shorter length, is within ``within`` % of it;
* passkey *breaks* at the first length whose accuracy (mean over depths) falls below half
  the method's accuracy at the longest length within the training window; when ``none``
  retrieves under 20 % within the window, the reading says that passkey measures nothing
  on this model.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..output import Column, Table, length_axis, pyplot, readable_log_axis, save_figure, write_csv, write_text
from .lmeval import lm_eval_reading, lm_eval_rows, lm_eval_table
from .ruler.report import average, ruler_reading, ruler_rows, ruler_table

__all__ = ["tables", "write_outputs", "reading", "shown", "protocols", "protocol_keys", "FILES"]

FILES = ("config.json", "results.json", "results.csv", "table.md", "report.md", "ppl.png", "passkey.png")


def shown(label: str, out: Path) -> str:
    """The model as the plots and ``report.md``'s heading name it: its path relative to the
    run folder ``out`` when it lies inside it or beside it (``../model``), else its directory's
    name, never the absolute (often temporary) path; a compare run's ``(encoding, seed)`` kept."""
    m = re.fullmatch(r"(.*?)( \([^()]*, seed [^()]*\))?", label)
    path, tail = m.group(1), m.group(2) or ""
    rel = os.path.relpath(path, os.path.abspath(out))
    near = rel not in (".", "..") and not rel.startswith(".." + os.sep + "..") and rel != ".." + os.sep
    return (rel if near else Path(path).name) + tail


def _ppl(v) -> str:
    return "NaN/inf" if v is None else (f"{v:.2f}" if v < 1000 else f"{v:.3g}")


def _mean(pk: dict | None) -> float | None:
    vals = [v for v in (pk or {}).values() if v is not None]
    return sum(vals) / len(vals) if vals else None


def _grid(results: dict) -> tuple[list[str], list[int], dict]:
    cells = results["cells"]
    methods = [m for m in results["settings"]["methods"] if any(c["method"] == m for c in cells)]
    lengths = sorted({c["length"] for c in cells})
    return methods, lengths, {(c["method"], c["length"]): c for c in cells}


def protocols(results: dict) -> list[tuple[str, str, str]]:
    """``[(protocol, cell key, label)]`` of the run's perplexity columns, in ``--protocol``'s order
    (a run of posenc before ``--protocol``: sliding and non-overlapping)."""
    from .evaluate import PROTOCOLS

    chosen = results["settings"].get("protocols") or ["sliding", "windows"]
    return [(p, *PROTOCOLS[p]) for p in chosen]


def protocol_keys(settings: dict) -> dict[str, dict[str, str]]:
    """results.json's label of every perplexity column: ``{protocol: {"key": cell key, "label": ...}}``."""
    return {p: {"key": key, "label": label} for p, key, label in protocols({"settings": settings})}


def _primary(results: dict) -> tuple[str, str]:
    """``(cell key, label)`` of the protocol the reading holds the methods to: the first chosen."""
    _, key, label = protocols(results)[0]
    return key, label


def _columns(results: dict, at: dict, lengths: list[int]) -> list[tuple[int, list[str], str]]:
    """``[(length, cell keys, label)]``: a column per length and protocol. Where a length was scored
    in one window or at a stride of the whole window (``one_pass``), sliding and non-overlapping are one
    computation: one column."""
    protos = protocols(results)
    out = []
    for n in lengths:
        once = any(c.get("one_pass") for (_, k), c in at.items() if k == n)
        keys = {p for p, _, _ in protos}
        for p, key, label in protos:
            if once and {"sliding", "windows"} <= keys and p in ("sliding", "windows"):
                if p == "sliding":
                    out.append((n, [key], "sliding = non-overlapping (same windows)"))
                continue
            out.append((n, [key], label))
    return out


def tables(results: dict) -> list[Table]:
    """Perplexity (a column per length and protocol, each labelled by its protocol) and
    passkey/time/memory, one row per method."""
    methods, lengths, at = _grid(results)
    train = results["train_len"]
    cols = _columns(results, at, lengths)
    heads = [f"L={n}" + (" (train)" if n == train else "") for n in lengths]
    ppl_rows, pk_rows = [], []
    for m in methods:
        setting = next((c["setting"] for c in results["cells"] if c["method"] == m), "")
        row, pk = [m, setting], [m]
        for n, keys, _ in cols:
            c = at.get((m, n))
            mark = (
                "" if c is None else "= none" if c.get("same_as_none") else "n/a" if not c.get("applicable") else None
            )
            row.append(mark if mark is not None else _ppl(c.get(keys[0])) if keys[0] in c else "-")
        for n in lengths:
            c = at.get((m, n))
            if c is None:
                pk.append("")
            elif c.get("same_as_none"):  # an identity setting, not scored again (its "why" says why)
                pk.append("= none")
            elif not c.get("applicable"):
                pk.append("n/a")
            else:
                acc = _mean(c.get("passkey"))
                pk.append(("-" if acc is None else f"{100 * acc:.0f}%") + f" · {c['ms_per_token']:.2f} ms")
        ppl_rows.append(row), pk_rows.append(pk)
    s = results["settings"]
    stride = f"stride {s['stride']}" if s["stride"] else "stride min(256, L/2)"
    if s.get("stride_factor", 1) > 1:
        stride += f" x{s['stride_factor']} (at most L)"
    said = {"sliding": f"sliding: sliding window, {stride}", "windows": "non-overlapping: windows of L",
            "truncated": "truncated per document: the first L tokens of each of "
                         f"{(s.get('documents') or {}).get('count', 0)} documents"}  # fmt: skip
    once = ("; one window, or a stride of a whole window: the two are the same computation, shown once"
            if any("same windows" in label for _, _, label in cols) else "")  # fmt: skip
    how = "; ".join(said[p] for p, _, _ in protocols(results))
    t1 = Table([Column("method", code=True), Column("setting"),
                *(Column(f"L={n}{' (train)' if n == train else ''} {label}", "right") for n, _, label in cols)],
               ppl_rows, title=f"perplexity by length and protocol ({how}{once}); "
                               f"trained at L={train}{_cut(results)}")  # fmt: skip
    t2 = Table([Column("method", code=True), *(Column(h, "right") for h in heads)], pk_rows,
               title=f"passkey exact match (mean over depths, {s['passkey_trials']} trials per depth) · "
                     "prefill wall time per token (one pass on a possibly shared machine: not a benchmark)")  # fmt: skip
    t3 = ruler_table(methods, lengths, at, train, s.get("task_samples", 0))
    t4 = lm_eval_table(methods, lengths, at, train)
    return [t1, t2, *(t for t in (t3, t4) if t is not None)]


def _cut(results: dict) -> str:
    """What ``--budget`` cut (posenc.extend.budget), for a title: ``"; windows 4 -> 1 per length to fit --budget 20m"``."""
    b = results.get("budget")
    return f"; {', '.join(b['cuts'])} to fit --budget {b['budget']}" if b and b["cuts"] else ""


def reading(results: dict, within: float) -> list[str]:
    """Sentences computed from the cells (see the module docstring)."""
    methods, lengths, at = _grid(results)
    train = results["train_len"]
    key, label = _primary(results)
    inside = [n for n in lengths if n <= train]
    ref_cell = at.get(("none", max(inside))) if inside else None
    out = [f"Cut{_cut(results)[1:]}: fewer samples than asked, so noisier numbers."] if _cut(results) else []
    if ref_cell is None or ref_cell.get(key) is None:
        out.append("No in-window perplexity of `none` (no length <= the training length, or it failed): "
                   "no reference to hold the methods to.")  # fmt: skip
    else:
        ref = ref_cell[key]
        limit = ref * (1 + within / 100)
        out.append(f"In-window reference: `none` at L={ref_cell['length']}, perplexity {ref:.3f}; "
                   f"a method holds while its perplexity stays <= {limit:.3f} (+{within:g} %); read in the {label} "
                   "column.")  # fmt: skip
        held = {}
        for m in methods:
            best = None
            for n in lengths:
                c = at.get((m, n))
                if c is None or not c.get("applicable"):
                    continue
                if c.get(key) is None or round(c[key], 3) > round(limit, 3):  # as printed
                    break
                best = n
            held[m] = best
        far = max((v for v in held.values() if v is not None), default=None)
        if far is None:
            out.append("No method holds even at the shortest length.")
        else:
            who = [m for m, v in held.items() if v == far]
            out.append(f"Furthest within +{within:g} %: {', '.join(f'`{m}`' for m in who)} up to L={far} "
                       f"({far / train:g}x the training length).")  # fmt: skip
        kept = [f"`{m}` {v}" for m, v in held.items() if v is not None]
        if kept:
            out.append("Held up to (tokens): " + ", ".join(kept) + ".")
        for m in methods:
            if held.get(m) is None and any(at.get((m, n), {}).get("applicable") for n in lengths):
                out.append(f"`{m}` is above +{within:g} % already at its shortest length.")
        last = lengths[-1]
        ranked = sorted((at[(m, last)][key], m) for m in methods
                         if at.get((m, last), {}).get(key) is not None)  # fmt: skip
        if ranked:
            out.append(f"At L={last}: " + _ranking(ranked) + ".")
    out += _passkey_reading(methods, lengths, at, inside)
    return out + ruler_reading(methods, lengths, at) + lm_eval_reading(methods, lengths, at)


def _ranking(ranked: list[tuple[float, str]]) -> str:
    """```a` 9.500 < `b` 10.500``: values equal as printed (3 decimals) are joined by ``=``."""
    out = f"`{ranked[0][1]}` {ranked[0][0]:.3f}"
    for (u, _), (v, m) in zip(ranked, ranked[1:]):
        out += f" {'=' if f'{u:.3f}' == f'{v:.3f}' else '<'} `{m}` {v:.3f}"
    return out


def _passkey_reading(methods, lengths, at, inside) -> list[str]:
    if not inside or not any(at.get((m, n), {}).get("passkey") for m in methods for n in lengths):
        return []
    base = _mean(at.get(("none", max(inside)), {}).get("passkey"))
    if base is not None and base < 0.2:
        return [f"Passkey: `none` retrieves {100 * base:.0f} % within its training window; this model does "
                "not do the task, so the passkey columns say nothing about the methods."]  # fmt: skip
    out = []
    for m in methods:
        own = _mean(at.get((m, max(inside)), {}).get("passkey"))
        if own is None:
            continue
        past = [n for n in lengths if n > max(inside) and _mean(at.get((m, n), {}).get("passkey")) is not None]
        broke = next((n for n in past if _mean(at[(m, n)]["passkey"]) < own / 2), None)
        after = (f"breaks (below half of that) at L={broke}." if broke else
                 f"does not break up to L={past[-1]}." if past else "nothing past the training window was measured.")  # fmt: skip
        out.append(f"Passkey `{m}`: {100 * own:.0f} % within the window; " + after)
    return out


def method_colors(n: int) -> list:
    """One colour per method line: matplotlib's ten-colour cycle, or ``tab20``'s twenty past ten
    (``extend`` runs eleven methods: the cycle would draw the first and the eleventh alike)."""
    from matplotlib import colormaps

    return [f"C{i}" for i in range(n)] if n <= 10 else [colormaps["tab20"](i % 20) for i in range(n)]


def _plots(out: Path, results: dict, subtitle: str) -> None:
    methods, lengths, at = _grid(results)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    plotted, colors = [], method_colors(len(methods))
    for i, m in enumerate(methods):
        for (_, key, _), ls in zip(protocols(results), ("-", ":", "--")):
            one = key == "ppl_windows" and "ppl" in {k for _, k, _ in protocols(results)}  # (one pass: one line)
            pts = [(n, at[(m, n)][key]) for n in lengths if at.get((m, n), {}).get(key) is not None
                   and not (one and at[(m, n)].get("one_pass"))]  # fmt: skip
            if pts:
                xs, ys = zip(*pts)
                plotted += ys
                ax.plot(xs, ys, ls=ls, marker="o", color=colors[i], label=m if ls == "-" else None)
    ax.axvline(results["train_len"], color="gray", ls="--", lw=1, label="training length")
    length_axis(ax, lengths)
    readable_log_axis(ax, plotted)
    ax.set_xlabel("evaluation length (tokens)")
    lines = ", ".join(f"{ls}: {label}" for (_, _, label), ls in zip(protocols(results), ("solid", "dotted", "dashed")))
    ax.set_ylabel(f"perplexity ({lines})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, out / "ppl.png", title="Perplexity past the training length", subtitle=subtitle)
    with_pk = [m for m in methods if any(at.get((m, n), {}).get("passkey") for n in lengths)]
    if not with_pk:
        return
    cols = min(4, len(with_pk))
    rows = (len(with_pk) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.9 * rows), squeeze=False)
    depths = list(next(at[(m, n)]["passkey"] for m in with_pk for n in lengths if at.get((m, n), {}).get("passkey")))
    for ax, m in zip(axes.flat, with_pk):
        grid = [[(at.get((m, n), {}).get("passkey") or {}).get(d) for n in lengths] for d in depths]
        data = [[float("nan") if v is None else v for v in r] for r in grid]
        im = ax.imshow(data, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7, rotation=45)
        ax.set_yticks(range(len(depths)), depths, fontsize=7)
        ax.set_title(m, fontsize=9)
        for j, r in enumerate(grid):
            for k, v in enumerate(r):
                if v is not None:
                    ax.text(k, j, f"{100 * v:.0f}", ha="center", va="center", fontsize=6, color="w" if v < 0.6 else "k")
    for ax in list(axes.flat)[len(with_pk) :]:
        ax.axis("off")
    fig.colorbar(im, ax=axes, shrink=0.8, label="exact match")
    fig.supxlabel("length (tokens)"), fig.supylabel("key depth")
    save_figure(fig, out / "passkey.png", title="Passkey retrieval by length and depth", subtitle=subtitle)


def _ran_with(results: dict) -> list[str]:
    """The head's record of what each method ran with (posenc.extend.record), and the versions."""
    from .record import describe_record

    s, v = results["settings"], results.get("versions") or {}
    rec = s.get("ran_with") or {}
    if not rec and not v:
        return []
    out = ["## What each method ran with", ""]
    if v:
        out += [f"{s['dtype']} on {s['device']}; " + ", ".join(f"{k} {x}" for k, x in v.items() if x) + ".", ""]
    out += [f"- `{m}`: {describe_record(r)}" for m, r in rec.items()]
    return [*out, ""]


def write_outputs(out: Path, results: dict, *, within: float, command: str) -> list[Table]:
    """``table.md``, ``results.csv``, ``ppl.png``, ``passkey.png``, ``report.md``."""
    tabs = tables(results)
    write_text(out / "table.md", "\n\n".join(t.markdown() for t in tabs) + "\n")
    cols = ("method", "setting", "length", "applicable", "why", "ppl", "ppl_windows", "ppl_truncated", "nll",
            "nll_windows", "nll_truncated", "documents", "tokens", "stride", "windows", "passkey_mean", "ruler",
            "lm_eval", "ms_per_token", "kv_bytes", "cuda_peak_bytes", "rss_peak_bytes")  # fmt: skip
    rows = [
        {**c, "passkey_mean": _mean(c.get("passkey")), "ruler": average(c), "lm_eval": None} for c in results["cells"]
    ]
    rows += [{"method": c["method"], "length": c["length"], "setting": f"passkey depth {d}", "passkey_mean": v}
             for c in results["cells"] for d, v in (c.get("passkey") or {}).items()]  # fmt: skip
    rows += ruler_rows(results["cells"]) + lm_eval_rows(results["cells"])
    write_csv(out / "results.csv", [{k: r.get(k) for k in cols} for r in rows], cols)
    subtitle = f"{shown(results['model'], out)} · trained at {results['train_len']} tokens"
    _plots(out, results, subtitle)
    s = results["settings"]
    lines = [f"# posenc extend: {shown(results['model'], out)}", "", f"Command: `{command}`", "",
             f"Trained at {results['train_len']} tokens; text: {s['text']} ({s['tokens_source']}); "
             f"{s['windows']} windows per length; chunked prefill of {s['chunk']} tokens; device {s['device']}.", "",
             *_ran_with(results), "## Reading", "", *(f"- {r}" for r in reading(results, within)), "",
             "## Tables", "", *(t.markdown() + "\n" for t in tabs),
             "![perplexity](ppl.png)", "", "![passkey](passkey.png)", ""]  # fmt: skip
    write_text(out / "report.md", "\n".join(lines))
    return tabs
