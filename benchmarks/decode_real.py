# Per-token decode after a 512-token prompt on a local HF checkpoint (SmolLM2-135M: scripts/smollm2.py),
# stock HF against posenc.hf.convert of the same weights, in one process, 1 thread, median of 3 rounds x 10 steps:
#   PYTHONPATH=<tree>/src python benchmarks/decode_real.py CHECKPOINT_DIR LABEL  (issue 64)
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM

import posenc.hf

torch.set_num_threads(1)
path = sys.argv[1]
stock = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
ours = posenc.hf.convert(AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval())
tok = torch.randint(0, 49152, (1, 512), generator=torch.Generator().manual_seed(0))


def per_token(m):
    with torch.no_grad():
        out = m(tok, use_cache=True)
        pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        ts = []
        for _ in range(12):
            t = time.perf_counter()
            out = m(nxt, past_key_values=pkv, use_cache=True)
            ts.append(time.perf_counter() - t)
            pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return statistics.median(ts[2:]) * 1000


res = {"stock": [], "posenc": []}
for r in range(3):
    res["stock"].append(per_token(stock))
    res["posenc"].append(per_token(ours))
s, p = statistics.median(res["stock"]), statistics.median(res["posenc"])
print(sys.argv[2], f"stock {s:.1f} ms/token, posenc {p:.1f} ms/token, ratio {p / s:.2f}", res)
