"""Forward+backward cost of the absolute/unconventional encodings relative to sinusoidal.

One small TransformerLM per encoding (vocab 256, D = 128, depth 2, H = 4, batch 1),
timed fwd+bwd at each length; the encodings are interleaved within every repeat so
that load on a shared machine hits them alike; the report is the median over repeats
and its ratio to ``sinusoidal`` measured in the same run. ``complex-model`` is the
paper's complex-valued LM (:class:`posenc.encodings.complex_model.ComplexTransformerLM`, 64
complex features = 128 real).

    PYTHONPATH=src python benchmarks/bench_absolute.py --lengths 512 4096 --repeats 5 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import posenc
from posenc.encodings.complex_model import ComplexTransformerLM

NAMES = ["sinusoidal", "hierarchical", "multiplicative", "floater", "recurrent", "conv", "complex-order"]


def make(name: str, L: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "complex-model":
        return ComplexTransformerLM(256, 64, 2, 4)
    max_len = int(L**0.5) if name == "hierarchical" and L > 512 else L  # hierarchical: n² >= L
    return posenc.TransformerLM(256, 128, 2, 4, encoding=name, max_len=max_len)


def step(model: torch.nn.Module, tokens: torch.Tensor) -> float:
    t0 = time.perf_counter()
    model(tokens).float().square().mean().backward()
    dt = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--repeats", type=int, nargs="+", default=[5, 3], help="one per length")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--names", nargs="+", default=NAMES + ["complex-model"])
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    for L, reps in zip(args.lengths, args.repeats):
        tokens = torch.randint(0, 256, (1, L))
        models = {n: make(n, L) for n in args.names}
        for m in models.values():
            step(m, tokens)  # warm-up
        times = {n: [] for n in models}
        for _ in range(reps):
            for n, m in models.items():
                times[n].append(step(m, tokens))
        base = statistics.median(times["sinusoidal"])
        for n, ts in times.items():
            med = statistics.median(ts)
            results[f"{n}@{L}"] = dict(name=n, L=L, median_s=med, ratio=med / base, times_s=ts)
            print(f"L={L:5d}  {n:15s} median {med * 1e3:9.1f} ms  x{med / base:6.2f}  ({reps} repeats)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
