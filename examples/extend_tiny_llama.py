"""Train a tiny stock ``LlamaForCausalLM`` with HF's ``Trainer`` at a short length, then run
``posenc extend`` on the saved directory (issue 27, docs/extend.md)::

    python examples/extend_tiny_llama.py --out runs/extend-tiny

Data: posenc's embedded corpus (Python's documentation, bytes as tokens), its first 90 %
for training (``posenc extend`` evaluates on the last 10 %). One training row in
``--passkey-every`` is a passkey prompt of the Self-Extend / LongLoRA format
(:mod:`posenc.extend.passkey`, random key, random depth, random length up to the training
length), so that retrieval within the window is learned: the papers' models learned it in
pretraining, a 1M-parameter model trained for minutes on documentation would not.

The model is a stock ``LlamaForCausalLM`` (HF's own RoPE, nothing of posenc in it):
``posenc extend`` converts it when it reads it. Prints the tables and the wall times.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.trainer_utils import set_seed

from posenc.data import embedded_corpus
from posenc.extend import cli as extend_cli
from posenc.extend.passkey import Tokens, min_length, passkey_ids


def build(seq_len: int, dim: int, layers: int, heads: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=dim,
        intermediate_size=4 * dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=seq_len,  # what posenc extend reads as the training length
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config)


class Rows(torch.utils.data.Dataset):
    """Row ``i``: a corpus window of ``seq_len`` bytes, or (every ``passkey_every``-th) a passkey prompt."""

    def __init__(self, data: bytes, seq_len: int, passkey_every: int, n: int, seed: int) -> None:
        self.data, self.seq_len, self.every, self.n, self.seed = data, seq_len, passkey_every, n, seed
        self.tokens = Tokens()
        self.shortest = min_length(self.tokens)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        r = random.Random(self.seed * 1_000_003 + i)
        if self.every and i % self.every == 0 and self.shortest <= self.seq_len:  # (a prompt fits)
            key = "".join(r.choices("0123456789", k=5))
            length = r.randint(self.shortest, self.seq_len)
            ids, _ = passkey_ids(self.tokens, length, r.random(), key)
            ids = torch.cat([ids, torch.full((self.seq_len - length,), ord(" "))])  # padded with spaces
            labels = ids.clone()
            labels[length:] = -100
            return {"input_ids": ids, "labels": labels}
        s = r.randrange(0, len(self.data) - self.seq_len)
        ids = torch.tensor(list(self.data[s : s + self.seq_len]))
        return {"input_ids": ids, "labels": ids.clone()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/extend-tiny", help="folder: the model in model/, posenc extend in extend/")
    p.add_argument("--seq-len", type=int, default=256, help="training length, bytes (default 256)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--passkey-every", type=int, default=2, help="one training row in N is a passkey prompt (0: none)")
    p.add_argument("--lengths", default="1x,2x,4x,8x")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args, extend_args = p.parse_known_args(argv)
    set_seed(args.seed)
    torch.set_num_threads(args.threads)
    corpus = embedded_corpus()
    train = corpus[: len(corpus) - len(corpus) // 10]  # posenc extend's default text is the rest
    model = build(args.seq_len, args.dim, args.layers, args.heads)
    rows = Rows(train, args.seq_len, args.passkey_every, args.steps * args.batch_size, args.seed)
    targs = TrainingArguments(
        output_dir=f"{args.out}/trainer",
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=args.steps // 20,
        weight_decay=0.1,
        logging_steps=max(1, args.steps // 10),
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    t0 = time.perf_counter()
    Trainer(model=model, args=targs, train_dataset=rows).train()
    trained = time.perf_counter() - t0
    model.save_pretrained(f"{args.out}/model")
    print(f"trained {args.steps} steps at {args.seq_len} bytes in {trained:.0f} s; saved {args.out}/model")
    t0 = time.perf_counter()
    argv_ext = [f"{args.out}/model", "--lengths", args.lengths, "--out", f"{args.out}/extend", "--overwrite",
                *extend_args]  # fmt: skip
    parser = argparse.ArgumentParser(prog="posenc extend")
    extend_cli.add_arguments(parser)  # what `posenc extend ...` runs
    ns = parser.parse_args(argv_ext)
    ns.argv = ["extend", *argv_ext]
    print("$ posenc extend " + " ".join(argv_ext))
    rc = extend_cli.run(ns)
    print(f"posenc extend: {time.perf_counter() - t0:.0f} s (exit {rc}); training {trained:.0f} s")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
