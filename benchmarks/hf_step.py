"""Time per training step of a converted tiny Llama against stock HF, same process, CPU.

    PYTHONPATH=src python benchmarks/hf_step.py --encodings rope alibi t5 nope --steps 20

Each model takes AdamW steps (forward, backward, update) on the same random batch; the
models take turns step by step, so a noisy neighbour slows them alike. Reported: the median
step time and its ratio to stock ``LlamaForCausalLM`` (``attn_implementation="sdpa"``).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import posenc.hf


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--encodings", nargs="+", default=["rope", "alibi", "t5", "nope"])
    p.add_argument("--steps", type=int, default=20, help="timed steps per model (after 3 warm-up steps)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=args.dim,
        intermediate_size=2 * args.dim,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        max_position_embeddings=args.length,
    )
    stock = LlamaForCausalLM(config)
    models = {"stock HF (sdpa)": stock}
    for name in args.encodings:
        models[f"posenc {name}"] = posenc.hf.convert(copy.deepcopy(stock), encoding=name)
    ids = torch.randint(0, 256, (args.batch, args.length))
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    for step in range(args.steps + 3):
        for k, m in models.items():
            t0 = time.perf_counter()
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opts[k].step()
            opts[k].zero_grad(set_to_none=True)
            if step >= 3:
                times[k].append(time.perf_counter() - t0)
    base = statistics.median(times["stock HF (sdpa)"])
    rows = {k: {"median_s": statistics.median(v), "ratio": statistics.median(v) / base} for k, v in times.items()}
    print(
        f"B={args.batch} L={args.length} D={args.dim} layers={args.layers} threads={args.threads}, {args.steps} steps"
    )
    print("| model | median step (ms) | vs stock |\n|---|---|---|")
    for k, r in rows.items():
        print(f"| {k} | {1000 * r['median_s']:.1f} | {r['ratio']:.2f}× |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
