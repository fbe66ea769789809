"""Profile one posenc attention layer, forward+backward, with torch.profiler.

Run:  PYTHONPATH=src python benchmarks/profile_layer.py ENCODING [--length 2048] [--threads 1]
          [--backend auto] [--dense-chunk 256] [--chunk-size 1024] [--rows 14]

Prints the wall time of one step after a warm-up and the operators by self CPU time;
this is how the misses in docs/bench.md were diagnosed.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import profile

import posenc


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("encoding")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", default="auto")
    p.add_argument("--dense-chunk", type=int, default=None)
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--rows", type=int, default=14)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    L = a.length
    attn = posenc.Attention(512, 8, a.encoding, causal=True, max_len=L, backend=a.backend, chunk_size=a.chunk_size)
    if a.dense_chunk:
        attn.dense_chunk = a.dense_chunk
    x, g = torch.randn(1, L, 512), torch.randn(1, L, 512)
    attn(x).backward(g)  # warm-up
    with profile() as prof:
        t0 = time.perf_counter()
        attn(x).backward(g)
        step = time.perf_counter() - t0
    print(f"{a.encoding} L={L} threads={a.threads}: one fwd+bwd step {step:.3f} s")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))


if __name__ == "__main__":
    main()
