"""Cost of packed documents: a TransformerLM training step with ``document_ids`` against the
same step without, on the same windows (compare's quick model: D=64, 2 layers, 4 heads,
B=32, L=64; embedded corpus, paragraphs as documents). Same process, steps alternate,
median of 10 after 3 warm-up steps, one thread::

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/packed_step.py
"""

import statistics
import time

import torch

import posenc
from posenc.data import load_source
from posenc.train import lm_loss

torch.set_num_threads(1)
src = load_source(packed=True, longest=512)
b = src.train_batch(0, 32, 64)
plain = b._replace(documents=None, mask=None)
for enc in ["rope", "alibi", "t5", "shaw"]:
    torch.manual_seed(0)
    lm = posenc.TransformerLM(256, 64, 2, 4, encoding=enc, max_len=64)
    opt = torch.optim.AdamW(lm.parameters(), 1e-3)
    t = {"plain": [], "packed": []}
    for step in range(13):
        for k, batch in (("plain", plain), ("packed", b)):
            t0 = time.perf_counter()
            lm_loss(lm, batch).backward()
            opt.step()
            opt.zero_grad()
            if step >= 3:
                t[k].append(time.perf_counter() - t0)
    p, q = statistics.median(t["plain"]), statistics.median(t["packed"])
    print(f"{enc}: plain {1000 * p:.1f} ms, packed {1000 * q:.1f} ms, ratio {q / p:.2f}")
print("documents per window (mean):", float((b.documents.max(1).values + 1).float().mean()))
