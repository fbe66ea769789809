"""posenc's ``yarn`` beside llama.cpp's own YaRN on SmolLM2-135M (issue 64 part 5): the last
``N`` tokens of the embedded corpus, YaRN ×2 over the trained 8 192 (llama.cpp:
``rope_scaling_type`` YARN, ``rope_freq_scale`` 0.5, ``yarn_orig_ctx`` 8192, its other YaRN
settings at their defaults, which are HF's), one forward each; prints the perplexities, their
relative difference, top-1 agreement and the mean per-token |Δ log p|, over all positions and
before / past the trained length. The helpers are ``tests/test_real_llamacpp.py``'s (its 4 096
case is a test); needs ``pip install -e ".[llama]"`` and the checkpoint (scripts/smollm2.py)::

    python scripts/llamacpp_yarn.py 16384

Exit 2 with one line for a length that is not an integer in 2..(tokens of the corpus's last fifth).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main(argv: list[str]) -> int:
    n = int(argv[0]) if len(argv) == 1 and argv[0].isdigit() else -1
    if n < 2:
        print(f"length must be one integer of at least 2 (tokens), got {argv}")
        return 2
    import llama_cpp
    import torch
    from scripts import smollm2
    from tests.test_real_llamacpp import YARN, agreement, llama_logits, logits, stock
    from transformers import AutoTokenizer

    import posenc.hf as ph
    from posenc.data import embedded_corpus

    ckpt = smollm2.checkpoint_dir()
    data = embedded_corpus()
    ids = AutoTokenizer.from_pretrained(ckpt)(data[len(data) - len(data) // 5 :].decode("utf-8", "ignore"))["input_ids"]
    if n > len(ids):
        print(f"length must be at most {len(ids)} (tokens of the corpus's last fifth), got {n}")
        return 2
    ids = ids[-n:]
    t = time.perf_counter()
    ours = logits(
        ph.convert(stock(ckpt, rope_parameters=dict(YARN), max_position_embeddings=2 * 8192)), torch.tensor([ids])
    )[0]
    t_ours, t = time.perf_counter() - t, time.perf_counter()
    yarn = dict(rope_scaling_type=llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN, rope_freq_scale=0.5, yarn_orig_ctx=8192)
    theirs = llama_logits(smollm2.gguf_file(), ids, **yarn)
    print(f"{n} tokens: posenc yarn {t_ours:.0f} s, llama.cpp {time.perf_counter() - t:.0f} s")
    for lo, hi in ((1, n), (1, 8192), (8192, n)) if n > 8192 else ((1, n),):
        if hi > lo:
            a = agreement(ours[lo - 1 : hi], theirs[lo - 1 : hi], ids[lo - 1 : hi])
            print(f"positions {lo}-{hi - 1}: posenc {a['ppl_ref']:.3f}, llama.cpp {a['ppl']:.3f} ({100 * a['rel']:+.2f} %), "
                  f"top-1 {100 * a['top1']:.1f} %, mean |Δ log p| {a['dnll']:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
