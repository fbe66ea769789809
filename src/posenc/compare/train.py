"""Training and evaluation of one model per encoding, with checkpoints and DDP.

Determinism is the design: the model of every encoding starts from the same seed
(shared weights get identical values), the batch of step ``s`` depends only on
``(seed, s)``, the learning rate is a function of ``s``, and a checkpoint holds the
weights, the optimizer state and the RNG state. So every encoding sees the same data
in the same order, and a run resumed from a checkpoint ends with the same numbers as
one that never stopped.

Under ``torchrun`` each of the ``W`` processes draws the same global batch and trains
on its ``1/W`` slice with :class:`~torch.nn.parallel.DistributedDataParallel`
(gloo on CPU, nccl on GPU); gradients are averaged, so the run matches one process with
the same global batch. Rank 0 evaluates and writes the files.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ..checkpoint import load_checkpoint, save_checkpoint
from ..data import (
    Batch,
    DataError,
    SyntheticTask,
    TextData,
    embedded_corpus,
    load_hf_dataset,
    read_text,
    step_generator,
)
from ..model import TransformerLM
from ..positions import randomized_positions
from .config import CompareConfig

__all__ = ["make_source", "train_encoding", "evaluate", "DistInfo", "setup_distributed", "resolve_device"]


# ------------------------------------------------------------------ setup
class DistInfo:
    """Rank and world size (1 process when not launched by torchrun)."""

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        self.rank, self.world = rank, world

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def setup_distributed(device: torch.device) -> DistInfo:
    """Join the process group when ``WORLD_SIZE > 1`` (torchrun); gloo on CPU, nccl on CUDA."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return DistInfo(dist.get_rank(), dist.get_world_size())


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(name)


def make_source(cfg: CompareConfig) -> TextData | SyntheticTask:
    """The data source the config names (embedded corpus by default)."""
    if cfg.task is not None:
        return SyntheticTask(cfg.task, seed=cfg.seed)
    if cfg.text is not None:
        data, name = read_text(cfg.text), f"--text {cfg.text!r}"
    elif cfg.dataset is not None:
        data = load_hf_dataset(cfg.dataset, cfg.dataset_config, cfg.dataset_split, cfg.dataset_field)
        name = f"--dataset {cfg.dataset!r}"
    else:
        data, name = embedded_corpus(), "the embedded corpus"
    try:
        source = TextData(data, val_fraction=cfg.val_fraction, seed=cfg.seed)
    except ValueError as e:
        raise DataError(f"{name}: {e}") from None
    longest = max(cfg.train_len, *cfg.eval_lens)
    if len(source.val) < longest + 1:
        raise DataError(
            f"{name}: its validation split ({len(source.val)} bytes, the last {cfg.val_fraction:.0%}) is shorter "
            f"than the longest evaluation length + 1 ({longest + 1}); give more text or shorter --eval-lens"
        )
    return source


def max_positions(cfg: CompareConfig, source) -> int:
    """``L_max`` of randomized positions, in tokens (default: the longest evaluation)."""
    n = cfg.max_pos if cfg.max_pos is not None else max(cfg.eval_lens)
    return source.seq_len(max(n, cfg.train_len))


def model_max_len(cfg: CompareConfig, source) -> int:
    """The ``max_len`` given to the encodings: the training length, or ``L_max`` if randomized."""
    return max_positions(cfg, source) if cfg.randomized_positions else source.seq_len(cfg.train_len)


def build_model(cfg: CompareConfig, source, encoding: str) -> TransformerLM:
    """The model of one encoding; shared weights get the same values for every encoding."""
    torch.manual_seed(cfg.seed)
    model = TransformerLM(
        source.vocab_size,
        cfg.dim,
        cfg.depth,
        cfg.heads,
        encoding=encoding,
        max_len=model_max_len(cfg, source),
        mlp_ratio=cfg.mlp_ratio,
        dropout=cfg.dropout,
        tie_embeddings=cfg.tie_embeddings,
        embed_std=cfg.embed_std,
        **cfg.encoding_options.get(encoding, {}),
    )
    # Re-draw every non-encoding weight from the same seed, so that the encodings'
    # own parameters (drawn first, in different numbers) do not shift them.
    torch.manual_seed(cfg.seed)
    model.reset_parameters()
    return model


def lr_at(cfg: CompareConfig, step: int) -> float:
    """Linear warmup, then cosine decay to ``lr * min_lr_ratio``; a function of the step only."""
    warmup = min(cfg.warmup, cfg.steps)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    t = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def masked_loss(logits: Tensor, targets: Tensor, mask: Tensor | None) -> Tensor:
    """Per-token cross-entropy ``(B, L)`` in float32; masked-out tokens are 0."""
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)
    return loss if mask is None else loss * mask


def _autocast(cfg: CompareConfig, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16")


def _save(path: Path, model: TransformerLM, **extra: Any) -> None:
    """Write atomically: a kill mid-write leaves the previous checkpoint intact."""
    tmp = path.with_suffix(".tmp")
    save_checkpoint(tmp, model, **extra)
    os.replace(tmp, path)


# ------------------------------------------------------------------ training
def train_encoding(
    cfg: CompareConfig,
    source,
    encoding: str,
    *,
    device: torch.device,
    ckpt_dir: Path | None,
    resume: bool = False,
    progress: bool = True,
    dinfo: DistInfo | None = None,
    position: tuple[int, int] = (1, 1),
    log=print,
) -> dict[str, Any]:
    """Train and evaluate one encoding; returns its ``runs`` entry of ``results.json``.

    With ``resume`` and a checkpoint in ``ckpt_dir``, continue from it (or return its
    stored result if that encoding had finished); a checkpoint written under another
    config, or unreadable, is a ``ValueError``. ``position``: ``(i, n)``, this encoding's
    place in the run, shown in the progress lines.
    """
    dinfo = dinfo or DistInfo()
    path = ckpt_dir / f"{encoding}.pt" if ckpt_dir is not None else None
    model = build_model(cfg, source, encoding).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    start, losses, train_seconds = 0, [], 0.0
    tag = f"[{position[0]}/{position[1]}] {encoding}"
    if resume and path is not None and path.exists():
        saved, extra = _load_for_resume(path, cfg)
        if extra.get("done"):
            return extra["result"]
        model.load_state_dict(saved.state_dict())
        opt.load_state_dict(extra["optimizer"])
        torch.set_rng_state(extra["rng_state"])
        start, losses, train_seconds = extra["step"], list(extra["losses"]), extra["train_seconds"]

    net = model
    if dinfo.enabled:
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    L = source.seq_len(cfg.train_len)
    L_max = max_positions(cfg, source)
    B, W = cfg.batch_size, dinfo.world
    if B % W:
        raise ValueError(f"batch_size={B} must be divisible by the number of processes ({W})")
    rows = slice(dinfo.rank * (B // W), (dinfo.rank + 1) * (B // W))

    def save(step: int, **more: Any) -> None:
        if path is not None and dinfo.main:
            _save(
                path, model, encoding=encoding, step=step, losses=losses, train_seconds=train_seconds,
                optimizer=opt.state_dict(), rng_state=torch.get_rng_state(), compare_config=cfg.to_dict(),
                fingerprint=cfg.fingerprint(), **more,
            )  # fmt: skip

    bar = _Progress(tag, cfg.steps, start, log) if progress and dinfo.main else None
    model.train()
    tokens_seen, t_window = 0, time.perf_counter()
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        batch = source.train_batch(step, B, cfg.train_len)
        tokens, targets = batch.tokens[rows].to(device), batch.targets[rows].to(device)
        mask = batch.mask[rows].to(device) if batch.mask is not None else None
        pos = None
        if cfg.randomized_positions:
            g = step_generator(cfg.seed + 7919, step)
            pos = randomized_positions(B, tokens.shape[1], L_max, generator=g)[rows].to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        with _autocast(cfg, device):
            logits = net(tokens, pos=pos)
        per_tok = masked_loss(logits, targets, mask)
        loss = per_tok.sum() / (mask.sum() if mask is not None else per_tok.numel())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        value = loss.detach()
        if dinfo.enabled:
            dist.all_reduce(value)
            value /= W
        losses.append(float(value))
        train_seconds += time.perf_counter() - t0
        tokens_seen += B * tokens.shape[1]
        if bar is not None and bar.due(step + 1):
            now = time.perf_counter()
            bar.update(step + 1, losses[-1], tokens_seen / (now - t_window))
            tokens_seen, t_window = 0, now
        if (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
            save(step + 1, done=False)
    if bar is not None:
        bar.close()

    result: dict[str, Any] = {}
    if dinfo.main:
        n_tokens = cfg.steps * B * L
        t0 = time.perf_counter()
        if progress:
            log(f"{tag}: evaluating at {', '.join(map(str, cfg.eval_lens_sorted))}")
        model.eval()
        evals = [evaluate(cfg, source, model, n, device=device) for n in cfg.eval_lens_sorted]
        result = {
            "encoding": encoding,
            "params": model.num_params(),
            "train_seconds": round(train_seconds, 3),
            "train_tokens_per_s": round(n_tokens / train_seconds, 1) if train_seconds > 0 else None,
            "eval_seconds": round(time.perf_counter() - t0, 3),
            "final_train_loss": losses[-1] if losses else None,
            "train_loss": losses,
            "eval": evals,
        }
        save(cfg.steps, done=True, result=result)
    if dinfo.enabled:
        dist.barrier()
    return result


def _load_for_resume(path: Path, cfg: CompareConfig):
    """The checkpoint at ``path``, refused (``ValueError``) if unreadable or from another config."""
    from .rundir import RunDirError, check_checkpoint

    try:
        saved, extra = load_checkpoint(path)
    except Exception as e:  # truncated, random bytes, not a posenc checkpoint: all one answer
        raise RunDirError(
            f"--resume: checkpoint {str(path)!r} is unreadable ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
            "delete it to retrain that encoding from scratch, or start the run over with --overwrite"
        ) from None
    check_checkpoint(path, extra, cfg)
    return saved, extra


class _Progress:
    """Training progress of one encoding: a tqdm bar on a terminal, plain lines otherwise
    (a log file gets one line per tenth of the steps, no carriage returns)."""

    def __init__(self, tag: str, total: int, start: int, log) -> None:
        import sys

        self.tag, self.total, self.log = tag, total, log
        self.every = max(1, total // 10)
        self.bar = None
        if sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=start, desc=tag, unit="step", dynamic_ncols=True, leave=True)
        self.last = start

    def due(self, step: int) -> bool:
        """Whether to report after ``step`` steps: every 10 on a terminal, every tenth of the run else."""
        return step == self.total or step % (10 if self.bar is not None else self.every) == 0

    def update(self, step: int, loss: float, tok_s: float) -> None:
        if self.bar is not None:
            self.bar.update(step - self.last)
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
        else:
            self.log(f"{self.tag}: step {step}/{self.total}  loss {loss:.3f}  {tok_s:,.0f} tok/s")
        self.last = step

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------ evaluation
def _not_applicable(model: TransformerLM, seq_len: int) -> str | None:
    for enc in model.encodings:
        if enc.position_limit is not None and seq_len > enc.position_limit:
            return f"{enc.name} supports positions < {enc.position_limit} (max_len={enc.max_len}); needs {seq_len}"
    return None


@torch.no_grad()
def evaluate(cfg: CompareConfig, source, model: TransformerLM, length: int, *, device: torch.device) -> dict[str, Any]:
    """One ``eval`` entry: loss/ppl/bpb (text) or accuracy (tasks) at ``length``, plus per-position loss.

    Positions are ``arange`` (also after randomized-position training). An encoding that
    cannot run at this length gives ``{"applicable": false, "reason": ...}`` with null metrics.
    """
    L = source.seq_len(length)
    reason = _not_applicable(model, L)
    text = source.kind == "text"
    if reason is not None:
        keys = ("loss", "ppl", "bpb") if text else ("loss", "accuracy", "token_accuracy")
        return {"length": length, "applicable": False, "reason": reason, **{k: None for k in keys}}
    if text:
        stride = None
        if cfg.sliding:
            stride = cfg.stride if cfg.stride is not None else max(1, length // 2)
            stride = min(stride, length)
        batches = source.eval_batches(length, cfg.eval_batch_size, cfg.eval_tokens, stride)
    else:
        batches = source.eval_batches(length, cfg.eval_batch_size, cfg.eval_samples)
    pos_loss = torch.zeros(L, dtype=torch.float64)
    pos_count = torch.zeros(L, dtype=torch.float64)
    solved = n_seq = correct_tok = 0
    for b in batches:
        tokens, targets = b.tokens.to(device), b.targets.to(device)
        mask = b.mask.to(device) if b.mask is not None else torch.ones_like(targets, dtype=torch.bool)
        with _autocast(cfg, device):
            logits = model(tokens)
        loss = masked_loss(logits, targets, mask)  # (b, L)
        pos_loss += loss.double().sum(0).cpu()
        pos_count += mask.double().sum(0).cpu()
        if not text:
            right = (logits.argmax(-1) == targets) | ~mask  # (b, L)
            solved += int(right.all(-1).sum())
            correct_tok += int(((logits.argmax(-1) == targets) & mask).sum())
            n_seq += tokens.shape[0]
    n_tok = float(pos_count.sum())
    mean = float(pos_loss.sum()) / n_tok
    edges = torch.linspace(0, L, min(cfg.position_buckets, L) + 1).round().long().tolist()
    buckets = []
    for a, e in zip(edges[:-1], edges[1:]):
        c = float(pos_count[a:e].sum())
        if c > 0:
            buckets.append({"start": a, "end": e, "loss": float(pos_loss[a:e].sum()) / c})
    entry: dict[str, Any] = {"length": length, "applicable": True, "loss": mean}
    if text:
        # byte-level: bits per byte is the loss in bits
        entry.update(ppl=math.exp(mean), bpb=mean / math.log(2))
    else:
        entry.update(accuracy=solved / n_seq, token_accuracy=correct_tok / n_tok)
    entry.update(tokens=int(n_tok), per_position=buckets)
    return entry


__all__ += ["build_model", "lr_at", "masked_loss", "model_max_len", "max_positions", "DataError", "Batch"]
