"""Tables, files and plots from the benchmark rows.

``write_outputs`` writes ``layers.json``/``layers.csv``, ``throughput.json``/``.csv``,
``machine.json``, ``graph_breaks.json``, ``time_vs_length.png`` (log-log) to a folder;
:func:`posenc.bench.markdown.markdown_report` renders the same tables as Markdown
(``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

from pathlib import Path

from ..output import Table, length_axis, make_console, pyplot, readable_log_axis, save_figure, write_csv, write_json
from .hf_model import hf_model_table
from .kv_cache import kv_cache_table

__all__ = [
    "ratio_table",
    "speedup_table",
    "memory_table",
    "profile_table",
    "breaks_table",
    "hf_table",
    "throughput_table",
    "write_outputs",
]


def _timed(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("kind", "time") == "time"]


def _memory_only(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("kind", "time") == "memory"]


def _labels(rows: list[dict]) -> list[tuple[str, bool]]:
    seen: dict[tuple[str, bool], None] = {}
    for r in rows:
        seen.setdefault((r["label"], r["causal"]), None)
    return list(seen)


def _lengths(rows: list[dict]) -> list[int]:
    return sorted({r["L"] for r in rows})


def _find(rows, label, causal, L, mode):
    for r in rows:
        if r["label"] == label and r["causal"] == causal and r["L"] == L and r["mode"] == mode:
            return r
    return None


def _cell_time(r) -> str:
    if r is None:
        return ""
    if r["status"] != "ok":
        return "skip" if r["status"].startswith("skipped") else "error"
    return (
        f"{r['ratio']:.2f}× ({r['time_s'] * 1e3:.0f} ms)" if r["ratio"] is not None else f"{r['time_s'] * 1e3:.0f} ms"
    )


def _backend(rows, label, causal) -> str:
    """The backend a case ran, or each one and the length it took over from where ``auto``
    changed with the length (``"dense; blockwise from 2048"``)."""
    runs: list[tuple[str, int]] = []  # (backend, first length), in length order
    for r in sorted((r for r in rows if r["label"] == label and r["causal"] == causal), key=lambda r: r["L"]):
        if r["backend"] and (not runs or runs[-1][0] != r["backend"]):
            runs.append((r["backend"], r["L"]))
    return "; ".join(name if i == 0 else f"{name} from {L}" for i, (name, L) in enumerate(runs))


def ratio_table(rows: list[dict], mode: str) -> tuple[list[str], list[list[str]]]:
    """Time ratio to the baseline (and median ms) per case and length."""
    rows = _timed(rows)
    Ls = _lengths(rows)
    head = ["layer", "mask", "backend"] + [f"L={L}" for L in Ls]
    body = []
    for label, causal in _labels(rows):
        cells = [_cell_time(_find(rows, label, causal, L, mode)) for L in Ls]
        body.append([label, "causal" if causal else "bidir", _backend(rows, label, causal)] + cells)
    return head, body


def memory_table(rows: list[dict], mode: str = "fwd+bwd") -> tuple[list[str], list[list[str]]]:
    """Peak memory (MiB) and ratio to the baseline per case and length (timed and
    memory-only rows alike)."""
    Ls = _lengths(rows)
    head = ["layer", "mask"] + [f"L={L}" for L in Ls]
    body = []
    for label, causal in _labels(rows):
        cells = []
        for L in Ls:
            r = _find(rows, label, causal, L, mode)
            if r is None or r["status"] != "ok" or r["peak_bytes"] is None:
                cells.append(
                    "" if r is None or r["status"] == "ok" else "skip" if "skipped" in r["status"] else "error"
                )
                continue
            mib = r["peak_bytes"] / 2**20
            cells.append(f"{mib:.0f} MiB ({r['peak_ratio']:.1f}×)" if r["peak_ratio"] else f"{mib:.0f} MiB")
        body.append([label, "causal" if causal else "bidir"] + cells)
    return head, body


def profile_table(rows: list[dict], mode: str = "fwd+bwd") -> tuple[list[str], list[list[str]]]:
    """Where each profiled posenc case spends its step, at the longest length profiled."""
    rows = [r for r in _timed(rows) if r["mode"] == mode and r.get("profile")]
    head = ["layer", "mask", "backend", "L", "ratio", "top operators by self time (share of the step)"]
    body = []
    for label, causal in _labels(rows):
        r = max((r for r in rows if r["label"] == label and r["causal"] == causal), key=lambda r: r["L"])
        ops = ", ".join(f"{o['name']} {100 * o['share']:.0f} %" for o in r["profile"][:5])
        ratio = f"{r['ratio']:.2f}×" if r["ratio"] is not None else ""
        body.append([label, "causal" if causal else "bidir", r["backend"], str(r["L"]), ratio, ops])
    return head, body


def speedup_table(rows: list[dict], mode: str) -> tuple[list[str], list[list[str]]]:
    """Reference time / posenc time (> 1: posenc faster) for each reference layer."""
    rows = _timed(rows)
    Ls = _lengths(rows)
    head = ["reference", "posenc", "mask"] + [f"L={L}" for L in Ls]
    body = []
    for label, causal in _labels(rows):
        ref = next((r for r in rows if r["label"] == label and r["impl"] not in ("posenc",)), None)
        if ref is None:
            continue
        enc = ref["encoding"]
        mine = f"posenc:{enc}"
        cells = []
        for L in Ls:
            a, b = _find(rows, label, causal, L, mode), _find(rows, mine, causal, L, mode)
            if a and b and a["status"] == b["status"] == "ok":
                cells.append(f"{a['time_s'] / b['time_s']:.2f}×")
            else:
                cells.append("")
        body.append([label, mine, "causal" if causal else "bidir"] + cells)
    return head, body


def throughput_table(trows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """posenc and x-transformers tokens/s per encoding; step time against posenc ``nope`` of the same run."""
    packed = any(r["impl"] == "posenc-packed" for r in trows)
    head = ["encoding", "posenc tok/s", "step / nope"] + (["packed step / plain"] if packed else [])
    head += ["x-transformers tok/s", "posenc / x-transformers"]
    body = []
    nope = next((r for r in trows if r["encoding"] == "nope" and r["impl"] == "posenc" and r["status"] == "ok"), None)
    for enc in dict.fromkeys(r["encoding"] for r in trows if r["impl"] != "hf-llama"):
        p = next((r for r in trows if r["encoding"] == enc and r["impl"] == "posenc"), None)
        x = next((r for r in trows if r["encoding"] == enc and r["impl"] == "x-transformers"), None)

        def f(r):
            if r is None:
                return "—"
            return f"{r['tokens_per_s']:.0f}" if r["status"] == "ok" else "error"

        ratio = ""
        if p and x and p["status"] == x["status"] == "ok":
            ratio = f"{p['tokens_per_s'] / x['tokens_per_s']:.2f}×"
        vs_nope = f"{nope['tokens_per_s'] / p['tokens_per_s']:.2f}×" if nope and p and p["status"] == "ok" else ""
        cells = [enc, f(p), vs_nope]
        if packed:
            k = next((r for r in trows if r["encoding"] == enc and r["impl"] == "posenc-packed"), None)
            ok = k and p and k["status"] == p["status"] == "ok"
            cells.append(f"{p['tokens_per_s'] / k['tokens_per_s']:.2f}×" if ok else "")
        body.append(cells + [f(x), ratio])
    return head, body


def hf_table(trows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """HF Llama converted by :func:`posenc.hf.convert` per encoding against the stock model."""
    rows = [r for r in trows if r["impl"] == "hf-llama"]
    stock = next((r for r in rows if r["encoding"] == "stock" and r["status"] == "ok"), None)
    head, body = ["model", "step ms", "step / stock"], []
    for r in rows:
        name = "stock HF LlamaForCausalLM (sdpa)" if r["encoding"] == "stock" else f"posenc.hf.convert: {r['encoding']}"
        if r["status"] != "ok":
            body.append([name, r["status"].split(":")[0], ""])
            continue
        ratio = f"{r['step_s'] / stock['step_s']:.2f}×" if stock else ""
        body.append([name, f"{1000 * r['step_s']:.0f}", ratio])
    return head, body


def _md(head, body) -> str:
    return Table(head, body).markdown().rstrip("\n")


def print_tables(
    rows, trows, console=None, breaks: list[dict] | None = None, krows: list[dict] | None = None, hrows=None
) -> None:
    console = console or make_console()

    def show(title, head, body):
        Table(head, body, title=title).print(console)

    modes = sorted({r["mode"] for r in _timed(rows)}, reverse=True)
    for mode in modes:
        show(f"{mode}: time / plain SDPA (median ms)", *ratio_table(rows, mode))
    if any(r["peak_bytes"] is not None for r in rows):
        show("fwd+bwd peak memory (× plain SDPA)", *memory_table(rows))
    h, b = profile_table(rows)
    if b:
        show("fwd+bwd: where the step goes", h, b)
    for mode in modes:
        h, b = speedup_table(rows, mode)
        if b:
            show(f"{mode}: reference time / posenc time (> 1: posenc faster)", h, b)
    if trows:
        show("training throughput, TransformerLM vs x-transformers", *throughput_table(trows))
        if any(r["impl"] == "hf-llama" for r in trows):
            show("training step, HF Llama converted vs stock", *hf_table(trows))
    if breaks:
        show("torch.compile graph breaks", *breaks_table(breaks))
    if krows:
        show("KV cache after decoding: grouped k/v against full heads (measured)", *kv_cache_table(krows))
    if hrows:
        show("HF checkpoint: posenc.hf.convert against stock HF (thread CPU ms, same process)", *hf_model_table(hrows))


def plot(rows: list[dict], path: Path, subtitle: str | None = None) -> None:
    rows = _timed(rows)
    plt = pyplot()
    modes = sorted({r["mode"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, len(modes), figsize=(7 * len(modes), 5.5), squeeze=False)
    labels = _labels(rows)
    colors = plt.get_cmap("tab20")(range(20))
    for ax, mode in zip(axes[0], modes):
        for n, (label, causal) in enumerate(labels):
            pts = sorted(
                (r["L"], r["time_s"])
                for r in rows
                if r["label"] == label and r["causal"] == causal and r["mode"] == mode and r["status"] == "ok"
            )
            if not pts:
                continue
            style = "-" if label.startswith(("posenc", "sdpa")) else "--"
            name = label + ("" if causal else " (bidir)")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3, label=name, color=colors[n % 20])
        length_axis(ax, [r["L"] for r in rows])
        readable_log_axis(ax, [r["time_s"] for r in rows if r["mode"] == mode and r["status"] == "ok"])
        ax.set_xlabel("sequence length L")
        ax.set_ylabel("seconds (median)")
        ax.set_title(f"one attention layer, {mode}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    save_figure(fig, path, title="Time of one attention layer against sequence length", subtitle=subtitle)


def breaks_table(breaks: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Graph breaks of ``torch.compile`` per encoding (:func:`posenc.bench.compile.graph_breaks`)."""
    head = ["encoding", "graphs", "breaks", "reasons"]
    body = []
    for b in breaks:
        if b.get("error"):
            body.append([f"`{b['encoding']}`", "error", "", b["error"]])
        else:
            body.append([f"`{b['encoding']}`", str(b["graphs"]), str(b["breaks"]), "<br>".join(b["reasons"]) or "—"])
    return head, body


def write_outputs(
    out: Path,
    rows: list[dict],
    trows: list[dict],
    machine: dict,
    config: dict,
    breaks: list[dict] | None = None,
    krows: list[dict] | None = None,
    hrows: list[dict] | None = None,
) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    if hrows:
        write_json(out / "hf_model.json", {"machine": machine, "rows": hrows})
        write_csv(out / "hf_model.csv", hrows)
        paths += [out / "hf_model.json", out / "hf_model.csv"]
    if krows:
        write_json(out / "kv_cache.json", {"machine": machine, "rows": krows})
        write_csv(out / "kv_cache.csv", krows)
        paths += [out / "kv_cache.json", out / "kv_cache.csv"]
    if breaks:
        write_json(out / "graph_breaks.json", {"torch": machine.get("torch"), "rows": breaks})
        paths.append(out / "graph_breaks.json")
    p = out / "layers.json"
    write_json(p, {"machine": machine, "config": config, "rows": rows})
    paths.append(p)
    write_csv(out / "layers.csv", rows)
    paths.append(out / "layers.csv")
    if trows:
        write_json(out / "throughput.json", {"machine": machine, "rows": trows})
        write_csv(out / "throughput.csv", trows)
        paths += [out / "throughput.json", out / "throughput.csv"]
    write_json(out / "machine.json", machine)
    paths.append(out / "machine.json")
    if any(r["status"] == "ok" and r["time_s"] is not None for r in rows):
        subtitle = (f"{machine.get('cpu', '?')}, torch {machine.get('torch', '?')}, {machine.get('torch_threads', '?')} "
                    f"threads, {machine.get('device', '?')}; B={config['batch']}, H={config['heads']}, "
                    f"Dh={config['head_dim']}, {config['dtype']}")  # fmt: skip
        plot(rows, out / "time_vs_length.png", subtitle)
        paths.append(out / "time_vs_length.png")
    return paths
