"""Cost of sliding-window attention against full causal attention, one posenc layer forward.

B=1, H=4, Dh=32 (D=128), L=2048, float32, CPU, one thread. Same process: every repetition
runs full attention and each window once, in turn; median of 5 after one warm-up. The
blocked backends (``dense`` for a scalar bias, ``chunked`` for everything) read only the
key blocks a window lets a query block see; ``sdpa`` takes the window as a dense boolean
mask and does not skip. Prints the time of each window as a ratio to full attention::

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/window_cost.py
"""

import statistics
import time

import torch

import posenc

torch.set_num_threads(1)
L, D, H = 2048, 128, 4
WINDOWS = [None, 512, 128, 32]
CASES = [("alibi", "dense"), ("t5", "chunked"), ("rope", "chunked"), ("rope", "sdpa")]
x = torch.randn(1, L, D, generator=torch.Generator().manual_seed(0))
print(f"L={L}, D={D}, H={H}; time(window W) / time(full causal), median of 5")
for enc, backend in CASES:
    torch.manual_seed(0)
    layers = {w: posenc.Attention(D, H, enc, max_len=L, backend=backend, window=w) for w in WINDOWS}
    for w in WINDOWS[1:]:
        layers[w].load_state_dict(layers[None].state_dict())
    t = {w: [] for w in WINDOWS}
    with torch.no_grad():
        for rep in range(6):
            for w in WINDOWS:
                t0 = time.perf_counter()
                layers[w](x)
                if rep:
                    t[w].append(time.perf_counter() - t0)
    full = statistics.median(t[None])
    cells = ", ".join(f"W={w}: {statistics.median(t[w]) / full:.2f}" for w in WINDOWS[1:])
    print(f"{enc:6s} {backend:8s} full {1000 * full:7.1f} ms | {cells}")
