"""``--preset paper``: Press et al. 2022's WikiText-103 setup (fairseq ``transformer_lm_wiki103``).

What the preset holds, and what differs from Press et al. (docs/compare.md, "The paper preset"):

* the model: 16 blocks, D = 1024, 8 heads, FFN 4096, pre-norm without a final norm, adaptive
  input and adaptive softmax with cutoffs 20 000 / 60 000 (factor 4; the tail bands tied to
  the input bands), dropout 0.3, attention dropout 0.1 and activation dropout 0.1 (fairseq's
  ``attention_dropout``/``activation_dropout``); fairseq's adaptive-softmax dropout (0.2,
  inside the tail bands' projections) is not reproduced;
* the data: ``wiki.{train,valid,test}.tokens`` from ``--data-dir`` (:mod:`posenc.data.wikitext`);
* training: 512 tokens, 73 728 tokens per update whatever the number of processes
  (gradient accumulation: :func:`accumulation_steps`), 286 000 updates, gradient clipping 0.1,
  bf16 autocast (position tables stay float32). The optimizer is AdamW (posenc has no NAG):
  lr 1e-3 after 16 000 warmup steps (fairseq's warmup length), cosine to 0 without
  restarts — Press et al. used NAG at lr 1.0 with cosine restarts: our setting is an
  assumption, not theirs;
* evaluation: non-overlapping windows of L_valid = 512, 1012, 2512, 5512, 10512 tokens
  (Press et al.'s L + k columns for L = 512) over the validation set; ``--sliding --stride 1``
  is their sliding-window evaluation (each token scored with up to L - 1 tokens of context,
  one forward of L tokens per scored token: L times the cost of the non-overlapping one).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PAPER_DEFAULTS", "PAPER_PRESET", "accumulation_steps", "check_paper_fields"]

# The CompareConfig fields this module adds, with their defaults: a config written before
# they existed reads the same, and its fingerprint does not change while they keep them.
PAPER_DEFAULTS: dict[str, Any] = {
    "data_dir": None,
    "tokens_per_update": None,
    "micro_batch": None,
    "final_norm": True,
    "adaptive_cutoffs": None,
    "fsdp": False,
}

PAPER_PRESET: dict[str, Any] = dict(
    encodings=["sinusoidal", "rope", "t5", "alibi"],  # Press et al.'s Table 2 rows
    dim=1024, depth=16, heads=8, mlp_ratio=4.0, dropout=0.3, attn_dropout=0.1, activation_dropout=0.1,
    tie_embeddings=True,
    final_norm=False, adaptive_cutoffs=[20000, 60000],
    train_len=512, batch_size=144, tokens_per_update=73728, steps=286000,
    lr=1e-3, warmup=16000, min_lr_ratio=0.0, weight_decay=0.0, grad_clip=0.1,
    dtype="bfloat16", workers=1, checkpoint_every=1000, val_points=0,
    eval_lens=[512, 1012, 2512, 5512, 10512], eval_tokens=250000, eval_batch_size=4,
)  # fmt: skip


def check_paper_fields(cfg) -> None:
    """``ValueError`` naming a bad paper field (type, range, or a tokens-per-update mismatch)."""
    for name in ("tokens_per_update", "micro_batch"):
        v = getattr(cfg, name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 2**31 - 1):
            raise ValueError(f"{name} must be an int in [1, {2**31 - 1}] or unset, got {v!r}")
    if cfg.data_dir is not None and not (isinstance(cfg.data_dir, str) and cfg.data_dir.strip()):
        raise ValueError(f"data_dir must name a directory, got {cfg.data_dir!r}")
    for name in ("final_norm", "fsdp"):
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{name} must be true or false, got {getattr(cfg, name)!r}")
    if cfg.fsdp and cfg.val_points:
        raise ValueError(
            f"fsdp evaluates once, after training, from the gathered weights: val_points must be 0, got {cfg.val_points}"
        )
    c = cfg.adaptive_cutoffs
    if c is not None and not (
        isinstance(c, list) and c and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in c)
        and all(a < b for a, b in zip(c, c[1:]))
    ):  # fmt: skip
        raise ValueError(f"adaptive_cutoffs must be a non-empty list of strictly increasing ints >= 1, got {c!r}")
    if c is not None and cfg.data_dir is None and cfg.task is None and c[-1] >= 256:
        raise ValueError(
            f"adaptive_cutoffs {c} need a word-level vocabulary: give --data-dir DIR (WikiText-103's "
            "wiki.{train,valid,test}.tokens); the byte-level sources have 256 tokens"
        )
    if c is not None and cfg.task is not None:
        raise ValueError(f"adaptive_cutoffs is for a word-level corpus (--data-dir), not --task {cfg.task}")
    if cfg.data_dir is not None:
        other = [n for n in ("text", "dataset", "task") if getattr(cfg, n) is not None]
        if other:
            raise ValueError(f"data_dir is a data source: give it alone, not with {other}")
        if cfg.packed:
            raise ValueError("data_dir reads a word stream without documents: packed does not apply")
    t = cfg.tokens_per_update
    if t is not None and cfg.batch_size * cfg.train_len != t:
        fix = f"--batch-size {t // cfg.train_len}" if t % cfg.train_len == 0 else f"a multiple of {cfg.train_len}"
        raise ValueError(
            f"tokens_per_update must equal batch_size x train_len ({cfg.batch_size} x {cfg.train_len} = "
            f"{cfg.batch_size * cfg.train_len}), got {t}: give {fix}"
        )
    if cfg.micro_batch is not None and cfg.batch_size % cfg.micro_batch:
        raise ValueError(f"micro_batch must divide batch_size={cfg.batch_size}, got {cfg.micro_batch}")


def accumulation_steps(batch_size: int, world: int, micro_batch: int | None) -> int:
    """Micro-batches per optimizer step on each of ``world`` processes, so that one update
    holds ``batch_size`` sequences (``tokens_per_update / L``) whatever ``world`` is:
    ``batch_size / (world x micro_batch)``; ``micro_batch`` None: ``batch_size / world``, one each.

    Raises:
        ValueError: the global batch does not divide into ``world x micro_batch`` (one line
            naming the three numbers and a micro-batch that would).
    """
    if micro_batch is None:
        if batch_size % world:
            raise ValueError(f"batch_size={batch_size} sequences per update do not divide over {world} processes")
        return 1
    if batch_size % (world * micro_batch):
        fits = [m for m in range(1, batch_size // world + 1) if batch_size % (world * m) == 0]
        raise ValueError(
            f"--micro-batch {micro_batch}: {batch_size} sequences per update do not divide into {world} processes x "
            f"{micro_batch} sequences x whole accumulation steps; micro-batches that do: {fits or 'none'}"
        )
    return batch_size // (world * micro_batch)
