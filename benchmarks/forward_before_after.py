# A 12-layer TransformerLM forward (L=2048, dim 256, 4 heads, batch 1, eval, no grad, float32,
# 2 threads): run it with PYTHONPATH=<tree>/src for the code before and after a change, in
# turn, on a quiet machine; the argument labels the line (docs/bench.md, issue 25).
import statistics
import sys
import time

import torch

import posenc

torch.set_num_threads(2)
torch.manual_seed(0)
out = []
for enc in ("rope", "t5"):
    lm = posenc.TransformerLM(256, 256, 12, 4, encoding=enc, max_len=2048).eval()
    tok = torch.randint(0, 256, (1, 2048))
    with torch.no_grad():
        lm(tok)
        ts = []
        for _ in range(7):
            t = time.perf_counter()
            lm(tok)
            ts.append(time.perf_counter() - t)
    out.append(f"{enc} {statistics.median(ts) * 1000:.1f} ms (min {min(ts) * 1000:.1f}, max {max(ts) * 1000:.1f})")
print(sys.argv[1], " | ".join(out))
