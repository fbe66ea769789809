"""Evaluation of one trained model at one length: loss, perplexity and bits per byte (text)
or exact-match accuracy (tasks), and the loss by position."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..data import positions_for
from ..model import TransformerLM
from ..train import autocast, masked_loss
from .config import CompareConfig

__all__ = ["EvalSettings", "evaluate", "model_axes", "not_applicable"]


@dataclass(frozen=True)
class EvalSettings:
    """How much to evaluate and how (the evaluation fields of :class:`CompareConfig`)."""

    batch_size: int = 16
    tokens: int = 16384  # scored tokens per length (text)
    samples: int = 256  # problems per length (tasks)
    sliding: bool = False  # sliding windows instead of non-overlapping ones
    stride: int | None = None  # sliding stride; None: half the window
    buckets: int = 16  # buckets of the per-position loss
    autocast_dtype: torch.dtype | None = None

    @classmethod
    def from_config(cls, cfg: CompareConfig) -> EvalSettings:
        return cls(
            batch_size=cfg.eval_batch_size, tokens=cfg.eval_tokens, samples=cfg.eval_samples, sliding=cfg.sliding,
            stride=cfg.stride, buckets=cfg.position_buckets,
            autocast_dtype=torch.bfloat16 if cfg.dtype == "bfloat16" else None,
        )  # fmt: skip


def model_axes(model: TransformerLM) -> int:
    """Coordinates per position ``model``'s encodings read (1 for a sequence)."""
    return max((enc.axes for enc in model.encodings), default=1)


def not_applicable(model: TransformerLM, seq_len: int) -> str | None:
    """Why ``model`` cannot run ``seq_len`` tokens (an encoding that does not extrapolate), or None."""
    for enc in model.encodings:
        if enc.position_limit is not None and seq_len > enc.position_limit:
            return f"{enc.name} supports positions < {enc.position_limit} (max_len={enc.max_len}); needs {seq_len}"
    return None


@torch.no_grad()
def evaluate(
    model: TransformerLM, source, length: int, *, device: torch.device, settings: EvalSettings
) -> dict[str, Any]:
    """One ``eval`` entry: loss/ppl/bpb (text) or accuracy (tasks) at ``length``, plus per-position loss.

    Positions are ``arange`` (also after randomized-position training), or the grid
    task's, as ``model`` reads them (:func:`posenc.data.positions_for`). An encoding that
    cannot run at this length gives ``{"applicable": false, "reason": ...}`` with null metrics.
    """
    s = settings
    L = source.seq_len(length)
    reason = not_applicable(model, L)
    text = source.kind == "text"
    if reason is not None:
        keys = ("loss", "ppl", "bpb") if text else ("loss", "accuracy", "token_accuracy")
        return {"length": length, "applicable": False, "reason": reason, **{k: None for k in keys}}
    if text:
        stride = min(s.stride if s.stride is not None else max(1, length // 2), length) if s.sliding else None
        batches = source.eval_batches(length, s.batch_size, s.tokens, stride)
    else:
        batches = source.eval_batches(length, s.batch_size, s.samples)
    pos_loss = torch.zeros(L, dtype=torch.float64)
    pos_count = torch.zeros(L, dtype=torch.float64)
    solved = n_seq = correct_tok = 0
    axes = model_axes(model)
    for b in batches:
        tokens, targets = b.tokens.to(device), b.targets.to(device)
        mask = b.mask.to(device) if b.mask is not None else torch.ones_like(targets, dtype=torch.bool)
        with autocast(device, s.autocast_dtype):
            pos = positions_for(b.pos, axes)
            logits = model(tokens, pos=None if pos is None else pos.to(device))
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
    edges = torch.linspace(0, L, min(s.buckets, L) + 1).round().long().tolist()
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
