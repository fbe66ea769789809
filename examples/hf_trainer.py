"""Train a tiny Llama with any posenc encoding, using the Hugging Face ``Trainer``.

Data: the corpus embedded in every CPython (``posenc.data.embedded_documents``: Python's
documentation, one document per topic), bytes as tokens. Runs on a CPU in about a minute::

    python examples/hf_trainer.py --encoding alibi
    python examples/hf_trainer.py --encoding rope,rope,rope,nope --packed     # per layer; packed documents

``--packed`` trains on whole documents packed into one row by HF's
``DataCollatorWithFlattening`` (positions restart at every document; posenc's attention
stops at the boundaries); without it, on fixed windows of the corpus. The held-out loss
is printed before and after training, and the model is saved with ``save_pretrained``
(``--out``), from where ``AutoModelForCausalLM.from_pretrained`` loads it back.
"""

from __future__ import annotations

import argparse
import random

import torch
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.trainer_utils import set_seed

import posenc.hf
from posenc.data import embedded_documents


def build_model(encoding: str, *, seq_len: int, layers: int = 2, dim: int = 64, heads: int = 4):
    """A tiny byte-level Llama (256 tokens) converted to ``encoding`` (a name or a comma list, one per layer)."""
    names = encoding.split(",")
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=dim,
        intermediate_size=2 * dim,
        num_hidden_layers=layers if len(names) == 1 else len(names),
        num_attention_heads=heads,
        max_position_embeddings=seq_len,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return posenc.hf.convert(LlamaForCausalLM(config), encoding=names[0] if len(names) == 1 else names)


def chunks(seq_len: int) -> list[list[int]]:
    """Every document cut into pieces of at most ``seq_len`` bytes (the last piece of a
    document may be shorter; pieces under 8 bytes are dropped)."""
    out = []
    for doc in embedded_documents():
        out += [list(doc[i : i + seq_len]) for i in range(0, len(doc), seq_len) if len(doc) - i >= 8]
    return out


def datasets(seq_len: int, packed: bool, n_eval: int = 32, seed: int = 0):
    """(train, eval) lists of ``{"input_ids", "labels"}``; fixed windows keep only full pieces."""
    items = [c for c in chunks(seq_len) if packed or len(c) == seq_len]
    random.Random(seed).shuffle(items)
    rows = [{"input_ids": c, "labels": c} for c in items]
    return rows[n_eval:], rows[:n_eval]


def _collate_windows(rows):
    ids = torch.tensor([r["input_ids"] for r in rows])
    return {"input_ids": ids, "labels": ids.clone()}


def main(argv: list[str] | None = None) -> dict:
    """Train; returns ``{"eval_before", "eval_after", "log_history", "model"}``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--encoding", default="alibi", help="a posenc encoding, or a comma list with one per layer")
    p.add_argument("--packed", action="store_true", help="pack whole documents with DataCollatorWithFlattening")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300, about a minute on a CPU)")
    p.add_argument("--seq-len", type=int, default=128, help="window / longest document piece, bytes")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--out", default="hf-trainer-out", help="output folder (the trained model is saved here)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    set_seed(args.seed)
    torch.set_num_threads(1)
    model = build_model(args.encoding, seq_len=args.seq_len)
    train, held_out = datasets(args.seq_len, args.packed, seed=args.seed)
    collator = DataCollatorWithFlattening() if args.packed else _collate_windows
    targs = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=args.steps // 10,
        logging_steps=max(1, args.steps // 10),
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=train, eval_dataset=held_out, data_collator=collator)
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    trainer.save_model(args.out)
    print(f"{args.encoding}{' packed' if args.packed else ''}: held-out loss {before:.3f} -> {after:.3f} (nats/byte)")
    return {"eval_before": before, "eval_after": after, "log_history": trainer.state.log_history, "model": model}


if __name__ == "__main__":
    main()
