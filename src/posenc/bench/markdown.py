"""The Markdown report of ``posenc bench`` (``benchmarks/RESULTS.md``): the tables of
:mod:`posenc.bench.report` with the command, the machine and the method in words."""

from __future__ import annotations

from .hf_model import hf_model_table
from .kv_cache import kv_cache_table
from .report import (
    _md,
    _memory_only,
    _timed,
    breaks_table,
    hf_table,
    memory_table,
    profile_table,
    ratio_table,
    speedup_table,
    throughput_table,
)

__all__ = ["markdown_report"]


def _allocator_line(m: dict) -> str:
    """How the C allocator was set (``posenc.tune_allocator``, ``--allocator``)."""
    a = m.get("allocator")
    if not a:
        return "C allocator: the C library's defaults (`--allocator default`)."
    return (
        f"C allocator: {a['libc']} tuned by `posenc.tune_allocator` (mmap threshold {a['mmap_threshold'] / 2**20:.0f} "
        f"MiB, trim threshold {a['trim_threshold'] / 2**20:.0f} MiB: freed blocks stay in the heap)."
    )


def markdown_report(
    rows,
    trows,
    machine: dict,
    command: str,
    config: dict,
    notes: str = "",
    plot_path: str | None = None,
    breaks: list[dict] | None = None,
    krows: list[dict] | None = None,
    hrows: list[dict] | None = None,
) -> str:
    m = machine
    parts = [
        "# posenc bench: results",
        "",
        f"Generated {m['date_utc']} by:",
        "",
        "```",
        command,
        "```",
        "",
        f"Machine: {m['cpu']}, {m['cpu_count']} CPUs, torch {m['torch']} with {m['torch_threads']} threads, "
        f"device `{m['device']}`" + (f" ({m['gpu']})" if "gpu" in m else "") + f", Python {m['python']}. "
        f"Load average (1 min) at the start: {m.get('loadavg_1m', '?')}, at the end: {m.get('loadavg_1m_end', '?')}. "
        + _allocator_line(m),
        "",
        f"Layer: B = {config['batch']}, H = {config['heads']}, Dh = {config['head_dim']}, "
        f"{config['dtype']}, q/k/v/o projections included; {config['warmup']} warm-up run, then up to "
        f"{config['repeats']} rounds that run every case once in turn (median time shown). Ratios are to plain SDPA "
        "with no position (posenc `nope`, `sdpa` backend) at the same length and mask: the median of the "
        "per-round ratios to the baseline run of the same round.",
        "",
    ]
    if notes:
        parts += [notes, ""]
    modes = sorted({r["mode"] for r in _timed(rows)}, reverse=True)
    for mode in modes:
        parts += [f"## {mode}: time / plain SDPA (median ms)", "", _md(*ratio_table(rows, mode)), ""]
    if any(r["peak_bytes"] is not None for r in rows):
        parts += [
            "## fwd+bwd peak memory (× plain SDPA)",
            "",
            "CPU: peak of live torch tensor bytes during one step, from `torch.profiler` "
            "memory events (allocations − frees in time order), above what was alive before the step; "
            "CUDA: `torch.cuda.max_memory_allocated` above the allocation before the step."
            + (
                " Memory-only rows measured with `--memory-method rss`: the peak resident memory "
                "(`ru_maxrss`) of a fresh process that built the layer and ran one step, Python and "
                "torch included (about 250–300 MiB before the step): what has to fit in RAM."
                if any(r.get("memory_method") == "rss" for r in _memory_only(rows))
                else ""
            )
            + (
                f" At L = {', '.join(str(L) for L in sorted({r['L'] for r in _memory_only(rows)}))} the posenc layers "
                "and the baseline ran one untimed step each (memory only; the references hold L×L tensors)."
                if _memory_only(rows)
                else ""
            ),
            "",
            _md(*memory_table(rows)),
            "",
        ]
    h, b = profile_table(rows)
    if b:
        parts += [
            "## fwd+bwd: where the step goes",
            "",
            "One profiled step per posenc layer after the timed rounds (`torch.profiler`), at the longest "
            "length profiled: the operators with the most self time and their share of the summed self "
            "time. This is what bounds a ratio.",
            "",
            _md(h, b),
            "",
        ]
    for mode in modes:
        h, b = speedup_table(rows, mode)
        if b:
            parts += [f"## {mode}: reference time / posenc time (> 1: posenc faster)", "", _md(h, b), ""]
    if trows:
        parts += [
            "## Training throughput: TransformerLM vs x-transformers",
            "",
            "Tokens per second of AdamW training steps (forward, loss, backward, step)"
            + (
                f": batch {config['train']['batch']} × L = {config['train']['seq_len']}, D = {config['train']['dim']}, "
                f"{config['train']['depth']} layers, {config['train']['heads']} heads."
                if "train" in config
                else "."
            ),
            "",
            _md(*throughput_table(trows)),
            "",
        ]
    if any(r["impl"] == "hf-llama" for r in trows or []):
        parts += [
            "## Training step: HF Llama converted by posenc.hf against stock HF",
            "",
            "A stock `LlamaForCausalLM` (`sdpa`) of the throughput size and `posenc.hf.convert` copies of it "
            "take the same AdamW steps (the model's own shifted loss).",
            "",
            _md(*hf_table(trows)),
            "",
        ]
    if breaks:
        parts += [
            "## torch.compile graph breaks",
            "",
            "`torch._dynamo.explain` of a whole TransformerLM forward (vocab 64, D = 32, 2 layers, 2 heads, L = 16).",
            "",
            _md(*breaks_table(breaks)),
            "",
        ]
    if krows:
        parts += [
            "## KV cache of grouped k/v against full heads",
            "",
            "Two TransformerLM of the same shape but `kv_heads` decode the same tokens one at a time from an "
            "empty cache. KV cache: the bytes of the storages the cache holds afterwards (keys, values, "
            "positions of every layer); decode peak: the peak allocation of the whole decode, cache included "
            "(CPU: live torch tensor bytes from `torch.profiler`; CUDA: `torch.cuda.max_memory_allocated`). "
            'Both measured; "full / this" is the full-heads figure over this row\'s.',
            "",
            _md(*kv_cache_table(krows)),
            "",
        ]
    if hrows:
        parts += [
            "## A real checkpoint: posenc.hf.convert against stock HF",
            "",
            "The checkpoint loaded twice per method in one process: stock HF with the method's own "
            "`rope_parameters`, and the same weights converted by `posenc.hf.convert`. Prefill: one forward "
            "over the prompt with a cache; decode: the median step of the greedy tokens after it. CPU time of "
            "the calling thread (`time.thread_time`; CUDA: synchronised wall time), interleaved rounds; the "
            "ratio is the median of the rounds' posenc / stock.",
            "",
            _md(*hf_model_table(hrows)),
            "",
        ]
    if plot_path:
        parts += [f"![time vs length]({plot_path})", ""]
    return "\n".join(parts)
