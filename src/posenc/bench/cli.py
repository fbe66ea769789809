"""Speed and memory of each encoding's attention layer against plain SDPA and the references.

``posenc bench`` times one attention layer per encoding (forward, forward+backward;
median after warm-up, causal and/or bidirectional), records peak memory (also at long
lengths, untimed), profiles where each step goes, compares with the original
implementations doing the same work, measures whole-model training throughput against
x-transformers, lists ``torch.compile`` graph breaks, prints tables and writes
JSON/CSV, a log-log plot, the machine record and a Markdown report. Exit status 1 when
a case failed (its row says why); 2 for bad arguments, an ``--out`` that cannot be
written or that another posenc process holds (``<out>/.lock``), or a file that cannot be
written; 130 on Ctrl-C. Every one of these is one line on stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from ..allocator import tune_allocator
from ..attend.backends import backend_names
from ..cli_types import device_name, nonempty_path
from ..fields import Choice, Float, Int, ListOf
from ..output import OutputFolder, Table, check_creatable, make_console, write_csv, write_json, write_text
from ..registry import available
from .compile import graph_breaks
from .extension import ExtensionConfig, extension_markdown, extension_table, run_extension
from .hf_model import HF_METHODS, HFModelConfig, run_hf_model
from .kv_cache import KVCacheConfig, run_kv_cache
from .markdown import markdown_report
from .measure import machine_record
from .report import print_tables, write_outputs
from .runner import MASKS, MODES, BenchConfig, run_layers
from .throughput import ThroughputConfig, run_throughput

DEFAULT_LENGTHS = [512, 1024, 2048, 4096, 8192]
MAX_L = 1 << 20  # longest sequence a flag takes (1M tokens)
# the head size of the throughput and KV-cache models (H = train_dim // 64): x-transformers'
# default, so that its models have the heads posenc's have
TRAIN_HEAD_DIM = 64

# The ranges of the flags (posenc.fields; bench's flags have no config field of their own).
# Lists of names: split by the list rule when parsed, their names checked by _check (exit 2).
LENGTHS = ListOf(Int(1, MAX_L))
NAMES = {
    "--encodings": ListOf(Choice(available, what="encoding"), dedupe=True),
    "--masks": ListOf(Choice(MASKS, what="mask"), dedupe=True),
    "--modes": ListOf(Choice(MODES, what="mode"), dedupe=True),
    "--backends": ListOf(Choice(backend_names, what="backend"), dedupe=True),
    "--hf-methods": ListOf(Choice(HF_METHODS, what="method"), dedupe=True),
}
BATCH = Int(1, 4096)  # sequences per batch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--encodings", type=NAMES["--encodings"].convert, default=None, help="comma-separated names (default: all)"
    )
    p.add_argument("--lengths", type=LENGTHS.parse, default=None, help="comma-separated L (default 512..8192)")
    p.add_argument(
        "--memory-lengths",
        type=LENGTHS.parse,
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
    p.add_argument("--batch", type=BATCH.parse, default=1)
    p.add_argument("--heads", type=Int(1, 1024).parse, default=8)
    p.add_argument(
        "--head-dim", type=Int(2, 4096, even=True).parse, default=64, help="rotary encodings rotate pairs of dims"
    )
    p.add_argument(
        "--windows",
        type=LENGTHS.parse,
        default=[],
        help="also each posenc layer with a sliding window of W keys (W,...)",
    )
    p.add_argument(
        "--masks", type=NAMES["--masks"].convert, default=["causal"], help="causal and/or bidir (default causal)"
    )
    p.add_argument("--device", type=device_name, default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=Int(1, 1024).parse, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument(
        "--allocator",
        choices=("tuned", "default"),
        default="tuned",
        help="tuned (default): glibc keeps freed blocks in its heap (posenc.tune_allocator), so one case's "
        "timing does not depend on what ran before it in the process; default: the C library's own settings",
    )
    p.add_argument("--modes", type=NAMES["--modes"].convert, default=list(MODES), help="fwd and/or fwd+bwd")
    p.add_argument("--warmup", type=Int(0, 10_000).parse, default=1)
    p.add_argument("--repeats", type=Int(1, 10_000).parse, default=5)
    p.add_argument(
        "--backends",
        type=NAMES["--backends"].convert,
        default=["auto"],
        help="posenc backends to time per encoding (auto = what the layer picks; others where supported)",
    )
    p.add_argument("--chunk-size", type=Int(1, MAX_L).parse, default=1024, help="query chunk of the chunked backend")
    p.add_argument("--no-references", action="store_true", help="skip HF / x-transformers layers")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory run")
    p.add_argument("--profile", action="store_true", help="top operators of each posenc layer (one profiled step)")
    p.add_argument(
        "--graph-breaks", action="store_true", help="torch.compile graph breaks of a TransformerLM per encoding"
    )
    p.add_argument(
        "--max-seconds",
        type=Float(0, 1e6, lo_open=True).parse,
        default=60.0,
        help="skip longer L for a case slower than this per run",
    )
    p.add_argument("--throughput", action=argparse.BooleanOptionalAction, default=True, help="training tokens/s")
    p.add_argument("--train-len", type=Int(1, 65536).parse, default=256, help="sequence length of the throughput runs")
    p.add_argument("--train-batch", type=BATCH.parse, default=8)
    p.add_argument(
        "--train-dim",
        type=Int(TRAIN_HEAD_DIM, 65536, multiple=TRAIN_HEAD_DIM).parse,
        default=256,
        help=f"model width of the throughput runs: train_dim // {TRAIN_HEAD_DIM} heads of {TRAIN_HEAD_DIM} dims, "
        "as x-transformers' are",
    )
    p.add_argument("--train-depth", type=Int(1, 256).parse, default=4, help="layers of the throughput runs")
    p.add_argument("--train-packed", action="store_true", help="also train each posenc model on packed documents")
    p.add_argument(
        "--train-hf",
        action="store_true",
        help="also HF Llama converted by posenc.hf vs the stock model (needs the transformers package)",
    )
    p.add_argument(
        "--kv-cache",
        action="store_true",
        help="also the KV-cache memory of decoding with grouped k/v (kv_heads = H/4) against full heads, "
        "measured on a --train-dim/--train-depth rope model (H = train_dim // 64)",
    )
    p.add_argument("--kv-tokens", type=Int(1, MAX_L).parse, default=256, help="tokens decoded by --kv-cache")
    p.add_argument("--kv-heads", type=Int(1, 1024).parse, default=None, help="k/v heads of --kv-cache (default H/4)")
    p.add_argument(
        "--hf-model",
        type=nonempty_path,
        default=None,
        help="also a local HF checkpoint (config.json + safetensors): prefill and per-token decode of "
        "posenc.hf.convert against stock HF, per --hf-methods and --hf-lengths",
    )
    p.add_argument("--hf-methods", type=NAMES["--hf-methods"].convert, default=["rope", "yarn"],
                   help=f"methods of --hf-model ({', '.join(HF_METHODS)}; default rope,yarn)")  # fmt: skip
    p.add_argument("--hf-lengths", type=LENGTHS.parse, default=[2048, 8192], help="prompt tokens of --hf-model")
    p.add_argument("--hf-steps", type=Int(1, 10_000).parse, default=8, help="tokens decoded per --hf-model round")
    p.add_argument(
        "--hf-rounds",
        type=Int(1, 1000).parse,
        default=2,
        help="interleaved rounds of --hf-model (which model runs first alternates)",
    )
    p.add_argument(
        "--extension",
        action="store_true",
        help="also ReRoPE, Self-Extend and DCA against plain RoPE on one SmolLM2-sized attention layer, chunked "
        "prefill as posenc extend runs it (maps and chunked backends; ratio to rope in the same run)",
    )
    p.add_argument("--extension-lengths", type=LENGTHS.parse, default=[2048, 4096, 8192],
                   help="tokens of the --extension prefills (default 2048,4096,8192)")  # fmt: skip
    p.add_argument("--extension-chunk", type=Int(1, MAX_L).parse, default=512, help="tokens per call of --extension")
    p.add_argument("--extension-hf", action="store_true",
                   help="also the --extension prefills through posenc.hf.convert on a one-layer HF Llama")  # fmt: skip
    p.add_argument("--extension-model", type=nonempty_path, default=None,
                   help="the --extension-hf path on this local HF checkpoint instead of a one-layer random Llama")  # fmt: skip
    p.add_argument("--extension-rounds", type=Int(1, 1000).parse, default=2, help="interleaved rounds of --extension")
    p.add_argument("--out", type=nonempty_path, default=Path("bench-results"), help="output folder")
    p.add_argument(
        "--markdown", type=nonempty_path, default=None, help="also write a Markdown report (RESULTS.md) here"
    )
    p.add_argument("--notes", default="", help="free text put in the Markdown report (e.g. machine contention)")
    p.add_argument("--quiet", action="store_true")


def _check(args: argparse.Namespace) -> str:
    """Names a flag does not know, flags that are fine alone but not together, or that this
    machine cannot serve: one sentence naming them (ValueError). Returns the device."""
    for flag, decl in NAMES.items():
        unknown = decl.unknown(getattr(args, flag[2:].replace("-", "_")) or [])
        if unknown is not None:
            raise ValueError(f"{flag}: {unknown}")
    timed = not args.memory_only
    if args.memory_only and not args.memory_lengths:
        raise ValueError("--memory-only needs --memory-lengths")
    if args.memory_method == "rss" and args.device not in (None, "cpu"):
        raise ValueError(f"--memory-method rss measures a CPU process; got --device {args.device}")
    if args.memory_method == "rss" and not args.memory_lengths:
        raise ValueError("--memory-method rss applies at --memory-lengths; give them")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device} given but CUDA is not available")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    training = args.throughput and timed
    for flag, on in (("--train-packed", args.train_packed), ("--train-hf", args.train_hf)):
        if on and not training:
            raise ValueError(f"{flag} is part of the throughput runs, which --no-throughput / --memory-only skip")
    if args.train_hf and importlib.util.find_spec("transformers") is None:
        raise ValueError(
            "--train-hf needs the 'transformers' package, which is not installed (pip install 'posenc[hf]')"
        )
    kv_flags = args.kv_heads is not None or args.kv_tokens != 256
    if kv_flags and not args.kv_cache:
        raise ValueError("--kv-heads/--kv-tokens set the --kv-cache run; add --kv-cache")
    heads = args.train_dim // TRAIN_HEAD_DIM
    if args.kv_cache and args.kv_heads is not None and heads % args.kv_heads:
        raise ValueError(f"--kv-heads {args.kv_heads} must divide the {heads} heads of the model (train_dim // 64)")
    hf_flags = args.hf_methods != ["rope", "yarn"] or args.hf_lengths != [2048, 8192]
    if (hf_flags or args.hf_steps != 8 or args.hf_rounds != 2) and args.hf_model is None:
        raise ValueError("--hf-methods/--hf-lengths/--hf-steps/--hf-rounds set the --hf-model run; add --hf-model DIR")
    if args.hf_model is not None:
        if not (args.hf_model / "config.json").is_file():
            raise ValueError(f"--hf-model {str(args.hf_model)!r}: no config.json there (a local HF checkpoint folder)")
        if importlib.util.find_spec("transformers") is None:
            raise ValueError("--hf-model needs the 'transformers' package (pip install 'posenc[hf]')")
    ext_flags = args.extension_lengths != [2048, 4096, 8192] or args.extension_chunk != 512
    if (ext_flags or args.extension_rounds != 2 or args.extension_hf) and not args.extension:
        raise ValueError(
            "--extension-lengths/--extension-chunk/--extension-rounds/--extension-hf set the --extension run; "
            "add --extension"
        )
    if args.extension_model is not None:
        if not args.extension_hf:
            raise ValueError("--extension-model sets the --extension-hf path; add --extension --extension-hf")
        if not (args.extension_model / "config.json").is_file():
            raise ValueError(
                f"--extension-model {str(args.extension_model)!r}: no config.json there (a local HF checkpoint folder)"
            )
    if args.extension_hf and importlib.util.find_spec("transformers") is None:
        raise ValueError("--extension-hf needs the 'transformers' package (pip install 'posenc[hf]')")
    if args.profile and not timed:
        raise ValueError("--profile profiles the timed lengths, which --memory-only skips")
    if args.markdown is not None:
        if args.markdown.is_dir():
            raise ValueError(f"--markdown {str(args.markdown)!r} is a folder; give a file name (RESULTS.md)")
        check_creatable(args.markdown.parent, "--markdown", shown=args.markdown)
    return device


def run(args: argparse.Namespace) -> int:
    encodings = args.encodings or [n for n in available() if n != "nope"]
    try:
        device = _check(args)
        with OutputFolder(args.out, tool="posenc bench"):  # checked writable, held until the end
            return _run(args, encodings, device)
    except ValueError as e:  # bad flags, an unusable or busy --out, a file that cannot be written
        print(f"posenc bench: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, encodings: list[str], device: str) -> int:
    lengths = [] if args.memory_only else sorted(set(args.lengths or DEFAULT_LENGTHS))
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
            heads=args.train_dim // TRAIN_HEAD_DIM,
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
    krows = []
    if args.kv_cache:
        heads = args.train_dim // TRAIN_HEAD_DIM
        kcfg = KVCacheConfig(dim=args.train_dim, depth=args.train_depth, heads=heads, kv_heads=args.kv_heads,
                             tokens=args.kv_tokens, device=device, dtype=args.dtype)  # fmt: skip
        krows = run_kv_cache(kcfg, progress=say)
        config["kv_cache"] = asdict(kcfg)
    hrows = []
    if args.hf_model is not None:
        hcfg = HFModelConfig(path=str(args.hf_model), methods=tuple(args.hf_methods), lengths=tuple(args.hf_lengths),
                             steps=args.hf_steps, rounds=args.hf_rounds, device=device, dtype=args.dtype)  # fmt: skip
        hrows = run_hf_model(hcfg, progress=say)
        config["hf_model"] = asdict(hcfg)
    erows = []
    if args.extension:
        ecfg = ExtensionConfig(lengths=tuple(args.extension_lengths), chunk=args.extension_chunk,
                               rounds=args.extension_rounds, device=device, dtype=args.dtype,
                               paths=("layer", "hf") if args.extension_hf else ("layer",),
                               model=None if args.extension_model is None else str(args.extension_model))  # fmt: skip
        erows = run_extension(ecfg, progress=say)
        config["extension"] = asdict(ecfg)
    paths = write_outputs(args.out, rows, trows, machine, config, breaks, krows, hrows)
    if erows:
        write_json(args.out / "extension.json", {"machine": machine, "rows": erows})
        write_csv(args.out / "extension.csv", erows)
        paths += [args.out / "extension.json", args.out / "extension.csv"]
    if not args.quiet:
        print_tables(rows, trows, breaks=breaks, krows=krows, hrows=hrows)
        if erows:
            title = "two-map extension methods: chunked prefill, thread CPU ms per token, ratio to rope (same run)"
            Table(*extension_table(erows), title=title).print(make_console())
        print(f"wrote {', '.join(str(p) for p in paths)}")
    if args.markdown:
        command = "posenc bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if len(sys.argv) > 1 else ""
        plot_src = args.out / "time_vs_length.png"
        plot_rel = os.path.relpath(plot_src, args.markdown.parent) if plot_src.exists() else None
        text = markdown_report(
            rows,
            trows,
            machine,
            command,
            config,
            notes=args.notes,
            plot_path=plot_rel,
            breaks=breaks,
            krows=krows,
            hrows=hrows,
        )
        if erows:
            text = (
                text.rstrip("\n")
                + "\n\n"
                + "\n".join(extension_markdown(erows, Table(*extension_table(erows)).markdown().rstrip("\n")))
            )
        write_text(args.markdown, text)
        if not args.quiet:
            print(f"wrote {args.markdown}")
    errors = [f"{r['label']} L={r['L']} {r['mode']}: {r['status']}" for r in rows if r["status"].startswith("error")]
    errors += [f"train {r['impl']}:{r['encoding']}: {r['status']}" for r in trows if r["status"].startswith("error")]
    errors += [f"graph breaks {b['encoding']}: {b['error']}" for b in breaks if b.get("error")]
    errors += [f"kv cache kv_heads={r['kv_heads']}: {r['status']}" for r in krows if r["status"] != "ok"]
    errors += [
        f"hf model {r['method']} {r['tokens']} {r['phase']}: {r['status']}" for r in hrows if r["status"] != "ok"
    ]
    errors += [f"extension {r['path']} {r['method']} {r['backend']} {r['tokens']}: {r['status']}"
               for r in erows if r["status"] != "ok"]  # fmt: skip
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors else 0
