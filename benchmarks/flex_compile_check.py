"""FlexAttention's compile cache on CUDA: what a process that runs many shapes pays.

posenc compiles ``flex_attention`` once with static shapes (``posenc.attend.flex``). Two checks:

* ``entries``: one flex call per (encoding, length), forward, in one process: more compiled
  entries than dynamo's default limit of 8. Prints each case's time after its compile, and
  dynamo's frame counts. ``--no-limit`` calls the compiled function without posenc's raised
  limit (the behaviour before ``FLEX_RECOMPILE_LIMIT``): past 8 entries dynamo runs it uncompiled.
* ``decode``: KV-cache decoding of one attention layer (one query per step over a growing key
  count), per-step time with ``backend="flex"`` (a compile per new key count), ``"dense"`` and
  ``"auto"`` (which picks dense for fewer than ``FLEX_MIN_QUERIES`` queries).

    python benchmarks/flex_compile_check.py entries [--no-limit]
    python benchmarks/flex_compile_check.py decode

Timings are wall-clock with ``torch.cuda.synchronize()``, median of ``--repeats``; read them as
ratios within one run. ``--device cpu`` runs the same code on the CPU (FlexAttention uncompiled
there: a dry run of this script, not a measurement).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time

import torch

import posenc
import posenc.attend.flex
from posenc import registry
from posenc.cli_types import OneLineParser, device_name
from posenc.fields import Choice, Int, ListOf


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls."""
    out = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def frames() -> str:
    c = torch._dynamo.utils.counters
    return f"dynamo frames {dict(c['frames'])}, unique graphs {c['stats'].get('unique_graphs', 0)}"


def entries(args, device) -> None:
    if args.no_limit:  # the compiled call as it was before posenc raised the limit
        posenc.attend.flex._recompile_limit = contextlib.nullcontext
    print(f"entries: limit {'dynamo default' if args.no_limit else posenc.attend.flex.FLEX_RECOMPILE_LIMIT}", flush=True)
    for name in args.encodings:
        for L in args.lengths:
            torch.manual_seed(0)
            attn = posenc.Attention(args.heads * 64, args.heads, name, head_dim=64, max_len=2 * L, backend="flex")
            attn = attn.to(device=device, dtype=torch.bfloat16).eval()
            x = torch.randn(1, L, args.heads * 64, device=device, dtype=torch.bfloat16)
            with torch.no_grad():
                sync(device)
                t = time.perf_counter()
                attn(x)  # the compile (or the uncompiled fallback)
                sync(device)
                first = time.perf_counter() - t
                ms = 1e3 * timed(lambda a=attn, x=x: a(x), device, args.repeats)
            print(f"  {name:7s} L={L:5d}: first call {first:6.2f} s, then {ms:8.3f} ms", flush=True)
    print("  " + frames(), flush=True)


def decode(args, device) -> None:
    H, D, P = args.heads, 64, args.prefill
    for backend in args.backends:
        torch._dynamo.reset()
        torch.manual_seed(0)
        attn = posenc.Attention(H * D, H, "alibi", head_dim=D, max_len=P + args.steps + 1)
        attn = attn.to(device=device, dtype=torch.bfloat16).eval()
        x = torch.randn(1, P + args.steps, H * D, device=device, dtype=torch.bfloat16)
        cache = attn.init_cache(1, P + args.steps)
        times = []
        with torch.no_grad():
            attn(x[:, :P], cache=cache, backend="dense")  # the prompt: the same for every run
            for t in range(P, P + args.steps):
                sync(device)
                t0 = time.perf_counter()
                attn(x[:, t : t + 1], cache=cache, backend=backend)
                sync(device)
                times.append(time.perf_counter() - t0)
        ran = attn.resolve_backend(backend, device.type, 1, P + 1)
        print(
            f"decode {backend:5s} (runs {ran}): step 1 {1e3 * times[0]:8.1f} ms, steps 2-{args.steps} "
            f"median {1e3 * statistics.median(times[1:]):8.2f} ms, total {sum(times):6.2f} s; {frames()}",
            flush=True,
        )


def flex_encodings(names) -> list[str]:
    """Those of ``names`` (registered) that ``backend="flex"`` can run (``entries`` runs only flex).
    Each is built to know, so only the names asked for are, and only by ``entries``."""
    out = []
    for name in names:
        enc = posenc.build(name, heads=2, head_dim=16, max_len=64, causal=True)
        if "flex" in posenc.supported_backends(enc):
            out.append(name)
    return out


def main(argv=None) -> int:
    ap = OneLineParser(prog="flex_compile_check.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("check", choices=["entries", "decode"])
    ap.add_argument("--device", type=device_name, default="cuda")
    ap.add_argument(
        "--encodings",
        type=ListOf(Choice(registry.available, what="encoding"), dedupe=True).parse,
        default="alibi,t5,fire,kerple,fox",
        help="entries: encodings that backend='flex' runs",
    )
    ap.add_argument("--lengths", type=ListOf(Int(1, 1 << 20)).parse, default="1024,2048")
    ap.add_argument("--heads", type=Int(1, 256).parse, default=16)
    ap.add_argument("--prefill", type=Int(1, 1 << 20).parse, default=1024)
    ap.add_argument("--steps", type=Int(2, 100_000).parse, default=12)
    ap.add_argument("--repeats", type=Int(1, 10_000).parse, default=5)
    ap.add_argument("--no-limit", action="store_true")
    ap.add_argument(
        "--backends",
        type=ListOf(Choice(["auto", *posenc.BACKENDS], what="backend")).parse,
        default="flex,dense,auto",
        help="decode: the backends, in this order; a name may repeat (a second dense run after the first)",
    )
    args = ap.parse_args(argv)
    if args.check == "entries":
        ok = flex_encodings(args.encodings)
        if bad := [n for n in args.encodings if n not in ok]:
            runs = ", ".join(flex_encodings(registry.available()))
            ap.error(f"argument --encodings: backend 'flex' cannot run {', '.join(map(repr, bad))}; it runs {runs}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"argument --device: {args.device!r} asked for, but this torch sees no CUDA device (use --device cpu)")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    (entries if args.check == "entries" else decode)(args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
