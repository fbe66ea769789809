"""Time one TransformerLM forward with and without the per-call position-table memo.

Issue #25 item 3: RoPE's cos/sin and T5's bucket indices are computed once per model call
(:class:`posenc.context.Tables`) and shared by the layers that share an encoding. This
script times a ``--depth``-layer model's forward (eval, no grad, float32, batch 1) at
``--length`` tokens, alternating, in the same process, the memo on and the memo off
(``Tables.get`` patched, here only, to call ``make()`` every time), and prints the
median and spread of each and the ratio on/off. It also checks that both give the same
logits (``torch.equal``) and how many lookups the memo answered.

    .venv/bin/python benchmarks/forward_tables.py --encodings rope,t5 --depth 12 \\
        --length 2048 --dim 256 --heads 4 --repeats 7

Timings on a shared machine are noisy: read the spread (min..max) beside the medians.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from contextlib import contextmanager

import torch

import posenc
import posenc.context


@contextmanager
def memo(enabled: bool):
    """``Tables.get`` as it is (``enabled``) or always calling ``make()`` (no memo)."""
    original = posenc.context.Tables.get
    if not enabled:
        posenc.context.Tables.get = lambda self, owner, name, inputs, make: make()
    try:
        yield
    finally:
        posenc.context.Tables.get = original


def count_hits() -> tuple[list[int], object]:
    """Record ``Tables.hits`` of every Tables made (for the report); returns (hits, restore)."""
    made: list[posenc.context.Tables] = []
    init = posenc.context.Tables.__init__

    def tracking(self):
        init(self)
        made.append(self)

    posenc.context.Tables.__init__ = tracking
    return made, init


def run(args) -> list[str]:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    lines = []
    for name in args.encodings.split(","):
        model = posenc.TransformerLM(256, args.dim, args.depth, args.heads, encoding=name, max_len=args.length)
        model.eval()
        tokens = torch.randint(0, 256, (1, args.length))
        times: dict[bool, list[float]] = {False: [], True: []}
        outs = {}
        with torch.no_grad():
            for enabled in (False, True):  # warm-up, and the outputs to compare
                with memo(enabled):
                    outs[enabled] = model(tokens)
            made, init = count_hits()
            try:
                with memo(True):
                    model(tokens)
            finally:
                posenc.context.Tables.__init__ = init
            hits = made[0].hits if made else 0
            for _ in range(args.repeats):
                for enabled in (False, True):  # alternate, so both see the same load
                    with memo(enabled):
                        t0 = time.perf_counter()
                        model(tokens)
                        times[enabled].append((time.perf_counter() - t0) * 1e3)
        off, on = statistics.median(times[False]), statistics.median(times[True])
        same = torch.equal(outs[False], outs[True])
        lines.append(
            f"{name:5s} memo off: median {off:9.2f} ms (min {min(times[False]):.2f}, max {max(times[False]):.2f})  "
            f"memo on: median {on:9.2f} ms (min {min(times[True]):.2f}, max {max(times[True]):.2f})  "
            f"on/off {on / off:.3f}  memo hits per forward {hits}  equal logits {same}"
        )
        print(lines[-1], flush=True)
    return lines


def _median_ms(f, n: int) -> float:
    f()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def _layer_costs(name: str, args, pos: torch.Tensor) -> tuple[float, float]:
    """Median ms of one layer's stage call that makes its tables, and of one that reads them."""
    hd = args.dim // args.heads
    enc = posenc.build(name, heads=args.heads, head_dim=hd, max_len=args.length)
    x = torch.randn(1, args.heads, args.length, hd)
    ctx = posenc.Context(pos, pos, tables=posenc.context.Tables())
    if name == "t5":  # the blockwise path's per-call tables (auto picks blockwise at this length)
        return _median_ms(lambda: enc.distance_terms(x, x), 30), _median_ms(
            lambda: enc.distance_terms(x, x, ctx=ctx), 30
        )
    # the q/k tables, and the rotation itself, which the memo does not save
    return _median_ms(lambda: enc.rotate(x, x, pos, pos), 30), _median_ms(
        lambda: enc.rotate(x, x, pos, pos, ctx=ctx), 30
    )


def tables_alone(args) -> None:
    """What the memo saves per layer: one layer's tables, computed and read from the memo."""
    torch.set_num_threads(args.threads)
    pos = torch.arange(args.length).unsqueeze(0)
    for name in args.encodings.split(","):
        made, read = _layer_costs(name, args, pos)
        print(
            f"{name:5s} one layer's stage call: tables made {made:.3f} ms, tables from the memo {read:.3f} ms "
            f"(saves {made - read:.3f} ms per layer that reads them; median of 30)",
            flush=True,
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--encodings", default="rope,t5", help="comma-separated encoding names (default rope,t5)")
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5, help="timed forwards per mode (default 5)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tables-alone", action="store_true", help="also time one layer's stage call with and without the memo"
    )
    args = p.parse_args(argv)
    for flag in ("depth", "length", "dim", "heads", "repeats", "threads"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    print(
        f"# {' '.join(sys.argv)}\n# torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{args.threads} threads, float32, batch 1, vocab 256, eval, no grad",
        flush=True,
    )
    run(args)
    if args.tables_alone:
        tables_alone(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
