"""Speed and memory of each encoding's attention layer against plain SDPA and the references.

``posenc bench`` times one attention layer per encoding (forward, forward+backward;
median after warm-up, causal and/or bidirectional), records peak memory (also at long
lengths, untimed), profiles where each step goes, compares with the original
implementations doing the same work, measures whole-model training throughput against
x-transformers, lists ``torch.compile`` graph breaks, prints tables and writes
JSON/CSV, a log-log plot, the machine record and a Markdown report. Exit status 1 when
a case failed (its row says why), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from ..allocator import tune_allocator
from ..base import available
from .compile import graph_breaks
from .markdown import markdown_report
from .measure import machine_record
from .report import print_tables, write_outputs
from .runner import MASKS, MODES, BenchConfig, run_layers
from .throughput import ThroughputConfig, run_throughput

DEFAULT_LENGTHS = [512, 1024, 2048, 4096, 8192]


def _int_list(s: str) -> list[int]:
    try:
        out = [int(v) for v in s.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from e
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"lengths must be positive integers, got {s!r}")
    return out


def _str_list(s: str) -> list[str]:
    return [v.strip() for v in s.split(",") if v.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--encodings", type=_str_list, default=None, help="comma-separated names (default: all)")
    p.add_argument("--lengths", type=_int_list, default=None, help="comma-separated L (default 512..8192)")
    p.add_argument(
        "--memory-lengths",
        type=_int_list,
        default=[],
        help="comma-separated L at which only peak memory is measured (one untimed fwd+bwd per posenc layer)",
    )
    p.add_argument("--memory-only", action="store_true", help="skip the timed lengths (with --memory-lengths)")
    p.add_argument(
        "--memory-method",
        choices=("profiler", "rss"),
        default="profiler",
        help="at --memory-lengths on CPU: live torch tensor bytes from the profiler, or the peak resident "
        "memory of a fresh process per case (what must fit in the machine's RAM)",
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument(
        "--windows", type=_int_list, default=[], help="also each posenc layer with a sliding window of W keys (W,...)"
    )
    p.add_argument("--masks", type=_str_list, default=["causal"], help="causal and/or bidir (default causal)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument(
        "--allocator",
        choices=("tuned", "default"),
        default="tuned",
        help="tuned (default): glibc keeps freed blocks in its heap (posenc.tune_allocator), so one case's "
        "timing does not depend on what ran before it in the process; default: the C library's own settings",
    )
    p.add_argument("--modes", type=_str_list, default=list(MODES), help="fwd and/or fwd+bwd")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--backends",
        type=_str_list,
        default=["auto"],
        help="posenc backends to time per encoding (auto = what the layer picks; others where supported)",
    )
    p.add_argument("--chunk-size", type=int, default=1024, help="query chunk of the chunked backend")
    p.add_argument("--no-references", action="store_true", help="skip HF / x-transformers layers")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory run")
    p.add_argument("--profile", action="store_true", help="top operators of each posenc layer (one profiled step)")
    p.add_argument(
        "--graph-breaks", action="store_true", help="torch.compile graph breaks of a TransformerLM per encoding"
    )
    p.add_argument("--max-seconds", type=float, default=60.0, help="skip longer L for a case slower than this per run")
    p.add_argument("--throughput", action=argparse.BooleanOptionalAction, default=True, help="training tokens/s")
    p.add_argument("--train-len", type=int, default=256, help="sequence length of the throughput runs")
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--train-dim", type=int, default=256, help="model width of the throughput runs")
    p.add_argument("--train-depth", type=int, default=4, help="layers of the throughput runs")
    p.add_argument("--train-packed", action="store_true", help="also train each posenc model on packed documents")
    p.add_argument("--train-hf", action="store_true", help="also HF Llama converted by posenc.hf vs the stock model")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder")
    p.add_argument("--markdown", type=Path, default=None, help="also write a Markdown report (RESULTS.md) here")
    p.add_argument("--notes", default="", help="free text put in the Markdown report (e.g. machine contention)")
    p.add_argument("--quiet", action="store_true")


def run(args: argparse.Namespace) -> int:
    names = available()
    encodings = args.encodings or [n for n in names if n != "nope"]
    unknown = [e for e in encodings if e not in names]
    if unknown:
        print(f"unknown encoding(s) {unknown}; available: {', '.join(names)}", file=sys.stderr)
        return 2
    bad_modes = [m for m in args.modes if m not in MODES]
    if bad_modes:
        print(f"unknown mode(s) {bad_modes}; choose from {MODES}", file=sys.stderr)
        return 2
    bad_masks = [m for m in args.masks if m not in MASKS]
    if bad_masks or not args.masks:
        print(f"unknown mask(s) {bad_masks or args.masks}; choose from {MASKS}", file=sys.stderr)
        return 2
    if args.memory_only and not args.memory_lengths:
        print("--memory-only needs --memory-lengths", file=sys.stderr)
        return 2
    if args.memory_method == "rss" and args.device not in (None, "cpu"):
        print(f"--memory-method rss measures a CPU process; got --device {args.device}", file=sys.stderr)
        return 2
    lengths = [] if args.memory_only else sorted(set(args.lengths or DEFAULT_LENGTHS))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda given but CUDA is not available", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.allocator == "tuned":
        tune_allocator()

    cfg = BenchConfig(
        encodings=encodings,
        lengths=lengths,
        batch=args.batch,
        heads=args.heads,
        head_dim=args.head_dim,
        masks=tuple(dict.fromkeys(args.masks)),
        device=device,
        dtype=args.dtype,
        modes=tuple(args.modes),
        warmup=args.warmup,
        repeats=args.repeats,
        backends=tuple(args.backends),
        references=not args.no_references,
        memory=not args.no_memory,
        chunk_size=args.chunk_size,
        max_seconds=args.max_seconds,
        memory_lengths=sorted(set(args.memory_lengths)),
        memory_method=args.memory_method,
        profile=args.profile,
        windows=sorted(set(args.windows)),
    )
    machine = machine_record(torch.device(device))
    say = (lambda s: None) if args.quiet else (lambda s: print(f"  {s}", file=sys.stderr, flush=True))
    rows = [asdict(r) for r in run_layers(cfg, progress=say)]
    trows, tcfg = [], None
    if args.throughput and not args.memory_only:
        tcfg = ThroughputConfig(
            encodings=["nope"] + encodings,
            seq_len=args.train_len,
            batch=args.train_batch,
            dim=args.train_dim,
            depth=args.train_depth,
            heads=max(1, args.train_dim // 64),
            device=device,
            packed=args.train_packed,
            hf=args.train_hf,
        )
        trows = run_throughput(tcfg, progress=say)
    try:
        machine["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    breaks = graph_breaks(["nope", *encodings], progress=say) if args.graph_breaks else []
    config = asdict(cfg) | {"train": asdict(tcfg)} if tcfg is not None else asdict(cfg)
    paths = write_outputs(args.out, rows, trows, machine, config, breaks)
    if not args.quiet:
        print_tables(rows, trows, breaks=breaks)
        print(f"wrote {', '.join(str(p) for p in paths)}")
    if args.markdown:
        command = "posenc bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if len(sys.argv) > 1 else ""
        plot_src = args.out / "time_vs_length.png"
        plot_rel = os.path.relpath(plot_src, args.markdown.parent) if plot_src.exists() else None
        text = markdown_report(
            rows, trows, machine, command, config, notes=args.notes, plot_path=plot_rel, breaks=breaks
        )
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)
        if not args.quiet:
            print(f"wrote {args.markdown}")
    errors = [f"{r['label']} L={r['L']} {r['mode']}: {r['status']}" for r in rows if r["status"].startswith("error")]
    errors += [f"train {r['impl']}:{r['encoding']}: {r['status']}" for r in trows if r["status"].startswith("error")]
    errors += [f"graph breaks {b['encoding']}: {b['error']}" for b in breaks if b.get("error")]
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors else 0
