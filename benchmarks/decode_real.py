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
path, label = sys.argv[1], sys.argv[2]
stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
ours = posenc.hf.convert(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
prompt = torch.randint(0, stock.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))


def per_token_ms(model) -> float:
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(12):
            start = time.perf_counter()
            out = model(nxt, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - start)
            cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return statistics.median(times[2:]) * 1000


rounds = {"stock": [], "posenc": []}
for _ in range(3):  # interleaved
    rounds["stock"].append(per_token_ms(stock))
    rounds["posenc"].append(per_token_ms(ours))
s, p = statistics.median(rounds["stock"]), statistics.median(rounds["posenc"])
print(label, f"stock {s:.1f} ms/token, posenc {p:.1f} ms/token, posenc/stock {p / s:.2f}")
