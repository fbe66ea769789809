"""Peak memory of one fwd+bwd step of a posenc attention layer at long L (CPU, profiler).

Run:  PYTHONPATH=src python benchmarks/peak_memory_long.py 16384 alibi,shaw,t5

One profiled step per encoding (B = 1, H = 8, Dh = 64, causal, 1 thread); the peak is
measured as in `posenc bench` (torch.profiler memory events, live bytes above the start).
"""

from __future__ import annotations

import sys
import time

import torch

import posenc
from posenc.bench.measure import peak_memory


def main() -> None:
    torch.set_num_threads(1)
    L = int(sys.argv[1])
    names = sys.argv[2].split(",")
    x, g = torch.randn(1, L, 512), torch.randn(1, L, 512)
    for name in names:
        attn = posenc.Attention(512, 8, name, causal=True, max_len=L)

        def run(attn=attn):
            attn(x).backward(g)

        t0 = time.perf_counter()
        b = peak_memory(run, device=torch.device("cpu"))
        print(
            f"{name} L={L} peak {b / 2**20:.0f} MiB (one profiled fwd+bwd {time.perf_counter() - t0:.0f} s)", flush=True
        )


if __name__ == "__main__":
    main()
