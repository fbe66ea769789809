"""StreamingLLM on posenc: perplexity while decoding far past the training length, with
attention sinks (``SinkWindow(sinks=4, window=60)``) and without (``SinkWindow(sinks=0,
window=64)``: the last 64 tokens only; for RoPE this equals a rolling sliding-window cache).

The model is compare's quick RoPE model (D=64, 2 layers, 4 heads, byte-level, embedded
corpus, 400 steps at length 64), trained here with ``posenc.compare`` (or loaded from
``--ckpt``). With ``--bos`` the same model is trained on windows that start with a fixed
BOS byte (0) instead, as LLM pre-training sequences do, and the streams start with it too. Both caches attend to 64 tokens, so no position exceeds the training range.
Validation windows of 8 x 64 tokens are decoded token by token; the script prints the
perplexity of each 64-token segment of the stream, and of a full (uncached) forward::

    PYTHONPATH=src OMP_NUM_THREADS=1 python examples/streaming_sinks.py [--ckpt rope.pt] [--windows 24]
"""

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import posenc
from posenc.compare import compare, preset_config
from posenc.data import load_source
from posenc.train import Trainer, adamw, cosine_schedule, setup

p = argparse.ArgumentParser()
p.add_argument("--ckpt", default=None)
p.add_argument("--windows", type=int, default=24, help="validation streams of 8 x 64 tokens")
p.add_argument("--bos", action="store_true", help="train (and stream) with a BOS byte first")
p.add_argument("--steps", type=int, default=400)
args = p.parse_args()
torch.set_num_threads(1)
W, SEG = 64, 8
src = load_source(longest=W * SEG)


def with_bos(t):
    return torch.cat((torch.zeros_like(t[:, :1]), t), 1)


if args.bos:  # compare's quick model and optimiser, on BOS-first windows
    cfg = preset_config("quick", encodings=["rope"], steps=args.steps)
    torch.manual_seed(0)
    lm = posenc.TransformerLM(256, cfg.dim, cfg.depth, cfg.heads, "rope", max_len=W, embed_std=cfg.embed_std,
                              tie_embeddings=cfg.tie_embeddings)  # fmt: skip

    def batch_at(step):
        b = src.train_batch(step, cfg.batch_size, W - 1)
        return b._replace(tokens=with_bos(b.tokens), targets=torch.cat((b.tokens[:, :1], b.targets), 1))

    trainer = Trainer(lm, adamw(lm, lr=cfg.lr, weight_decay=cfg.weight_decay), runtime=setup("cpu"),
                      schedule=cosine_schedule(cfg.lr, steps=args.steps, warmup=cfg.warmup), grad_clip=cfg.grad_clip)  # fmt: skip
    trainer.fit(batch_at, args.steps)
else:
    if args.ckpt is None:
        out = Path(tempfile.mkdtemp()) / "run"
        compare(preset_config("quick", encodings=["rope"]), out=out)
        args.ckpt = out / "checkpoints" / "rope.pt"
    try:  # weights_only: a checkpoint that would run code is refused, unexecuted
        lm, _ = posenc.load_checkpoint(args.ckpt)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(print(f"streaming_sinks.py: error: --ckpt: {e}", file=sys.stderr) or 2)
lm.eval()
windows, _ = src.eval_windows(W * SEG, max_tokens=W * SEG * args.windows)
tokens, targets = windows[:, :-1], windows[:, 1:]
if args.bos:
    tokens, targets = with_bos(tokens)[:, :-1], torch.cat((tokens[:, :1], targets), 1)[:, :-1]
B, L = tokens.shape


def nll_of(logits):
    return F.cross_entropy(logits.transpose(1, 2), targets[:, : logits.shape[1]], reduction="none")  # (B, L)


def decode(policy):
    cache = lm.init_cache(B, L, policy=policy)
    with torch.no_grad():
        return nll_of(torch.cat([lm(tokens[:, t : t + 1], cache=cache) for t in range(L)], 1))


rows = {
    "sinks 4 + window 60": decode(posenc.SinkWindow(sinks=4, window=60)),
    "window 64, no sinks": decode(posenc.SinkWindow(sinks=0, window=64)),
}
with torch.no_grad():
    rows["full forward (no cache)"] = nll_of(lm(tokens))
print(f"{B} streams of {L} tokens; perplexity per {W}-token segment (segment k = tokens [{W}k, {W}(k+1)))")
print("policy".ljust(26) + "".join(f"{f'seg {k}':>9s}" for k in range(SEG)))
for name, nll in rows.items():
    ppl = [math.exp(float(nll[:, k * W : (k + 1) * W].mean())) for k in range(SEG)]
    print(name.ljust(26) + "".join(f"{x:9.2f}" for x in ppl))
