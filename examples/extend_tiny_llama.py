"""Train a tiny stock ``LlamaForCausalLM`` with HF's ``Trainer`` at a short length, then run
``posenc extend`` on the saved directory (issue 27, docs/extend.md)::

    python examples/extend_tiny_llama.py --out runs/extend-tiny

Data: posenc's embedded corpus (Python's documentation, bytes as tokens), its first 90 %
for training (``posenc extend`` evaluates on the last 10 %). The papers evaluate passkey on
models that retrieve within their window (they learned it in pretraining; LongLoRA and
Landmark Attention fine-tune on it); a model this small must be taught, so the rows mix:

* every ``--passkey-every``-th row (default: half) a passkey prompt of the Self-Extend /
  LongLoRA format (:mod:`posenc.extend.passkey`) of the full training length, its key at a
  uniformly drawn depth; keys that ``posenc extend`` or the in-window check will ask are
  never drawn (``eval_keys``), so every evaluated prompt is new to the model;
* row ``i`` with ``i % --copy-every == 1`` (default: a quarter) a corpus window of half the
  length, then the same window again: copying what came before, the step retrieval needs
  (the induction heads of Olsson et al. 2022);
* the rest plain corpus windows.

Loss: the mean over every token of the batch, plus ``--answer-weight`` times the mean over
the passkey answers' tokens (:class:`MixedTrainer`). After training, ``--check`` fresh
prompts at the training length measure in-window retrieval before ``posenc extend`` reads
anything past it.

The model is a stock ``LlamaForCausalLM`` (HF's own RoPE, nothing of posenc in it):
``posenc extend`` converts it when it reads it. It is saved with a byte-level tokenizer
(:func:`byte_tokenizer`: token id = byte value, no merges, no special tokens), so that
``--tasks`` (RULER's tasks, sized in the model's tokens) runs on it; every other measurement
reads the same ids as bytes would be. Options the script does not know (``--windows``,
``--tasks``, ``--task-samples``, ...) go to ``posenc extend``. Prints the tables and the wall times.
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
from posenc.extend.passkey import DEPTHS, Tokens, min_length, passkey_ids


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


def byte_tokenizer():
    """A ``PreTrainedTokenizerFast`` whose token ids are the UTF-8 bytes (0-255): GPT-2's byte-level
    alphabet (each byte a printable character) as a BPE vocabulary with no merges, so every byte
    is one token, the id its value; no special tokens (greedy answers run to their budget)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}  # GPT-2's bytes_to_unicode
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) if b in printable else chr(256 + others.index(b)) for b in range(256)}
    t = Tokenizer(models.BPE(vocab={char[b]: b for b in range(256)}, merges=[]))
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=t)


def eval_keys(lengths: list[int], trials: int) -> set[str]:
    """The keys ``posenc extend`` draws for its passkey cells (:func:`posenc.extend.passkey.passkey_accuracy`)."""
    return {_key(random.Random(f"{n}/{d}/{t}")) for n in lengths for d in DEPTHS for t in range(trials)}


def _key(r: random.Random) -> str:
    return "".join(r.choices("0123456789", k=5))


class Rows(torch.utils.data.Dataset):
    """Row ``i``: a corpus window of ``seq_len`` bytes, or (every ``passkey_every``-th) a passkey
    prompt of ``seq_len`` bytes with its key at a uniformly drawn depth (``answer`` marks the
    answer's tokens); keys in ``held_out`` (the evaluation's) are drawn again."""

    def __init__(self, data: bytes, seq_len: int, passkey_every: int, n: int, seed: int,
                 held_out: set[str], copy_every: int = 0) -> None:  # fmt: skip
        self.data, self.seq_len, self.every, self.n, self.seed = data, seq_len, passkey_every, n, seed
        self.copy_every = copy_every
        self.tokens, self.held_out = Tokens(), held_out
        if passkey_every and min_length(self.tokens) > seq_len:
            raise ValueError(f"--seq-len {seq_len}: the passkey prompt needs >= {min_length(self.tokens)} bytes")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        r = random.Random(self.seed * 1_000_003 + i)
        if self.every and i % self.every == 0:
            key = _key(r)
            while key in self.held_out:
                key = _key(r)
            ids, answer = passkey_ids(self.tokens, self.seq_len, r.random(), key)
            is_answer = torch.zeros_like(ids, dtype=torch.bool)
            is_answer[answer] = True
            return {"input_ids": ids, "labels": ids.clone(), "answer": is_answer}
        s = r.randrange(0, len(self.data) - self.seq_len)
        if self.copy_every and i % self.copy_every == 1:  # a corpus window, then the same window again
            half = self.seq_len // 2
            ids = torch.tensor(list(self.data[s : s + half]) * 2 + list(self.data[s + half : s + self.seq_len - half]))
        else:
            ids = torch.tensor(list(self.data[s : s + self.seq_len]))
        return {"input_ids": ids, "labels": ids.clone(), "answer": torch.zeros_like(ids, dtype=torch.bool)}


class MixedTrainer(Trainer):
    """Loss = mean cross-entropy over every token of the batch (text rows and passkey prompts
    alike: the prompt's repeated filler and the key's second copy teach copying) +
    ``answer_weight`` x the mean over the passkey answers' tokens, a term of its own so that
    the 6 answer bytes of a row are not drowned by the batch's thousands."""

    answer_weight = 1.0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels, answer = inputs.pop("labels"), inputs.pop("answer")
        out = model(**inputs)
        ce = torch.nn.functional.cross_entropy(out.logits[:, :-1].transpose(1, 2).float(), labels[:, 1:],
                                               reduction="none")  # fmt: skip
        loss = ce.mean()
        if self.answer_weight and answer.any():
            loss = loss + self.answer_weight * ce[answer[:, 1:]].mean()
        return (loss, out) if return_outputs else loss


@torch.no_grad()
def in_window_check(model, seq_len: int, keys: list[str]) -> float:
    """Exact match on one prompt of ``seq_len`` bytes per key, key ``k`` at depth ``k / (n - 1)``
    (the caller keeps these keys out of training)."""
    model.eval()
    tokens, solved, n = Tokens(), 0, len(keys)
    for k, key in enumerate(keys):
        ids, answer = passkey_ids(tokens, seq_len, k / max(1, n - 1), key)
        pred = model(ids[None]).logits[0].argmax(-1)
        solved += all(int(pred[a - 1]) == int(ids[a]) for a in answer)
    return solved / n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/extend-tiny", help="folder: the model in model/, posenc extend in extend/")
    p.add_argument("--seq-len", type=int, default=384, help="training length, bytes (default 384)")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--passkey-every", type=int, default=2, help="one training row in N is a passkey prompt (0: none)")
    p.add_argument(
        "--copy-every",
        type=int,
        default=4,
        help="row i with i %% N == 1 is a corpus window repeated (its second half a copy; 0: none)",
    )
    p.add_argument("--answer-weight", type=float, default=1.0, help="weight of the passkey answer loss term")
    p.add_argument("--check", type=int, default=50, help="in-window passkey prompts checked after training (0: none)")
    p.add_argument("--lengths", default="1x,2x,4x,8x")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args, extend_args = p.parse_known_args(argv)
    trials = argparse.ArgumentParser(add_help=False)
    trials.add_argument("--passkey-trials", type=int, default=5)  # posenc extend's default
    n_trials = trials.parse_known_args(extend_args)[0].passkey_trials
    set_seed(args.seed)
    torch.set_num_threads(args.threads)
    corpus = embedded_corpus()
    train = corpus[: len(corpus) - len(corpus) // 10]  # posenc extend's default text is the rest
    lengths = [int(x[:-1]) * args.seq_len if x.endswith("x") else int(x) for x in args.lengths.split(",")]
    check = [_key(random.Random(f"check/{k}")) for k in range(args.check)]
    held_out = eval_keys(lengths, n_trials) | set(check)
    model = build(args.seq_len, args.dim, args.layers, args.heads)
    rows = Rows(
        train, args.seq_len, args.passkey_every, args.steps * args.batch_size, args.seed, held_out, args.copy_every
    )
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
        remove_unused_columns=False,
    )
    t0 = time.perf_counter()
    trainer = MixedTrainer(model=model, args=targs, train_dataset=rows)
    trainer.answer_weight = args.answer_weight
    trainer.train()
    trained = time.perf_counter() - t0
    model.save_pretrained(f"{args.out}/model")
    byte_tokenizer().save_pretrained(f"{args.out}/model")  # ids = bytes: what the model was trained on
    print(f"trained {args.steps} steps at {args.seq_len} bytes in {trained:.0f} s; saved {args.out}/model")
    if check:
        acc = in_window_check(model, args.seq_len, check)
        print(
            f"in-window passkey check: {acc:.0%} exact match on {len(check)} held-out prompts of {args.seq_len} bytes"
        )
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
