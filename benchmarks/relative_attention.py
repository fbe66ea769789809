"""Forward+backward time and peak memory of one attention layer: the relative family vs SDPA and HF.

One layer, B=1, H=8, Dh=64 (D=512), bidirectional, float32, for each L: plain SDPA with no
position (``nope``), posenc ``shaw``, ``xl``, ``t5``, ``deberta``, ``tupe`` (backend
``auto``), and the HF references ``T5Attention`` and DeBERTa-v2 ``DisentangledSelfAttention``
(v3 settings: 256 log buckets, ``share_att_key``, c2p|p2c) with posenc ``deberta`` built the
same way.

Time: median over ``--repeats`` of one ``out.sum().backward()`` after a warm-up, the
layers interleaved round-robin so contention hits them alike. Memory: each (layer, L) in a
fresh subprocess: peak resident set sampled every 0.5 ms during one forward+backward minus
the resident set before it (CPU; large tensors are mmapped so it follows live tensors), or
``torch.cuda.max_memory_allocated`` minus the allocation before it (CUDA). Both are
reported as ratios to SDPA from the same run.

    PYTHONPATH=src python benchmarks/relative_attention.py --lengths 1024 4096 --repeats 3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time

import torch

import posenc

H, DH = 8, 64
D = H * DH
ENCODINGS = ["shaw", "xl", "t5", "deberta", "tupe"]
HF = ["hf-t5", "hf-deberta-v2"]
DEBERTA = dict(position_buckets=256, max_relative_positions=512, share_att_key=True, pos_att_type="c2p|p2c")


CHUNK = {"chunk_size": 1024}


def build(name: str, L: int, device: str):
    """A callable running one forward pass on a fresh input, and its module."""
    if name == "hf-t5":
        from transformers import T5Config
        from transformers.models.t5.modeling_t5 import T5Attention

        cfg = T5Config(d_model=D, d_kv=DH, num_heads=H, dropout_rate=0.0, is_decoder=False)
        cfg._attn_implementation = "eager"
        mod = T5Attention(cfg, has_relative_attention_bias=True, layer_idx=0).to(device)
        return (lambda x: mod(x)[0]), mod
    if name == "hf-deberta-v2":
        from transformers import DebertaV2Config
        from transformers.models.deberta_v2 import modeling_deberta_v2 as v2

        cfg = DebertaV2Config(
            hidden_size=D,
            num_attention_heads=H,
            relative_attention=True,
            norm_rel_ebd="layer_norm",
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **DEBERTA,
        )
        mod = v2.DisentangledSelfAttention(cfg).to(device)
        table = torch.nn.Embedding(2 * 256, D).to(device)
        norm = torch.nn.LayerNorm(D, eps=1e-7).to(device)
        mod.extra = torch.nn.ModuleList([table, norm])
        rel_pos = v2.build_relative_position(torch.empty(L, 1), torch.empty(L, 1), 256, 512).to(device)
        mask = torch.ones(1, 1, L, L, dtype=torch.bool, device=device)
        return (lambda x: mod(x, mask, relative_pos=rel_pos, rel_embeddings=norm(table.weight))[0]), mod
    enc = "nope" if name == "sdpa" else name
    opts = dict(DEBERTA, qkv_bias=True) if name == "deberta" else {}
    if name == "t5":
        opts["scale_logits"] = False
    mod = posenc.Attention(D, H, enc, causal=False, max_len=L, chunk_size=CHUNK["chunk_size"], **opts).to(device)
    return mod, mod


def step(fn, x) -> None:
    fn(x).sum().backward()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_all(names, L, repeats, device) -> dict[str, float]:
    layers = {n: build(n, L, device)[0] for n in names}
    x = torch.randn(1, L, D, device=device, requires_grad=True)
    for fn in layers.values():  # warm-up
        step(fn, x)
    times = {n: [] for n in names}
    for _ in range(repeats):
        for n, fn in layers.items():
            sync(device)
            t = time.perf_counter()
            step(fn, x)
            sync(device)
            times[n].append(time.perf_counter() - t)
    return {n: statistics.median(v) for n, v in times.items()}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_one(name: str, L: int, device: str) -> int:
    """Extra bytes at the peak of one forward+backward (run in a fresh process)."""
    fn, _ = build(name, L, device)
    x = torch.randn(1, L, D, device=device, requires_grad=True)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step(fn, x)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    # CPU: sample the resident set from a thread while the step runs (torch ops release the
    # GIL); with MALLOC_MMAP_THRESHOLD_ set by the parent, big tensors are mmapped and their
    # pages leave the resident set when freed, so the samples follow live tensors.
    before = _rss_bytes()
    peak, done = [before], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.0005)

    th = threading.Thread(target=sample)
    th.start()
    step(fn, x)
    done.set()
    th.join()
    return max(peak[0], _rss_bytes()) - before


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", nargs="+", default=None, help="subset of layers")
    ap.add_argument("--chunk-size", type=int, default=1024, help="query chunk of posenc's relative backend")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--_peak", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    CHUNK["chunk_size"] = args.chunk_size
    if args._peak:
        print(peak_one(args._peak[0], int(args._peak[1]), args.device))
        return 0
    names = args.only or ["sdpa", *ENCODINGS, *HF]
    if "sdpa" not in names:
        names = ["sdpa", *names]
    results = []
    for L in args.lengths:
        t = time_all(names, L, args.repeats, args.device)
        mem = {}
        for n in names:
            cmd = [sys.executable, __file__, "--_peak", n, str(L), "--device", args.device]
            cmd += ["--chunk-size", str(args.chunk_size)]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
            mem[n] = int(out.split()[-1])
        for n in names:
            results.append(
                dict(
                    layer=n,
                    L=L,
                    time_s=t[n],
                    time_vs_sdpa=t[n] / t["sdpa"],
                    peak_mib=mem[n] / 2**20,
                    mem_vs_sdpa=mem[n] / max(mem["sdpa"], 1),
                )
            )
        ref = {"t5": "hf-t5", "deberta": "hf-deberta-v2"}
        print(f"\nL={L}  device={args.device}  threads={torch.get_num_threads()}  (median of {args.repeats})")
        print(
            f"{'layer':15s} {'fwd+bwd s':>10s} {'x SDPA':>7s} {'peak MiB':>9s} {'x SDPA':>7s} {'x faster than HF':>17s}"
        )
        for r in results[-len(names) :]:
            hf = ref.get(r["layer"])
            vs = f"{t[hf] / t[r['layer']]:.2f}" if hf in t else ""
            print(
                f"{r['layer']:15s} {r['time_s']:10.3f} {r['time_vs_sdpa']:7.2f} {r['peak_mib']:9.1f} "
                f"{r['mem_vs_sdpa']:7.1f} {vs:>17s}"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
