"""Evaluation of one trained model at one length: loss, perplexity and bits per byte (text)
or exact-match accuracy (tasks), and the loss by position."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..data import positions_for
from ..functional import position_limit_reason
from ..model import TransformerLM
from ..train import autocast, masked_loss
from .config import CompareConfig
from .results import Evaluation, PositionLoss, VariantScore

__all__ = ["EvalSettings", "batch_for", "evaluate", "model_axes", "not_applicable", "solved_rows"]


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
    # the attention scores of one layer, (B, H, L, L) float32, stay under this: long
    # evaluations (Press et al.'s 48x) run fewer sequences per batch instead of running out
    # of memory; each sequence's numbers do not depend on the batch it is in
    score_bytes: int = 1 << 30

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


def batch_for(model: TransformerLM, seq_len: int, settings: EvalSettings) -> int:
    """Sequences per evaluation batch at ``seq_len`` tokens: ``settings.batch_size``, fewer
    when one layer's ``(B, H, L, L)`` float32 scores would pass ``settings.score_bytes``."""
    per_seq = 4 * model.heads * seq_len * seq_len
    return max(1, min(settings.batch_size, settings.score_bytes // per_seq))


def not_applicable(model: TransformerLM, seq_len: int) -> str | None:
    """Why ``model`` cannot run ``seq_len`` tokens (an encoding that does not extrapolate), or None."""
    return position_limit_reason(model.encodings, seq_len)


def solved_rows(hit: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Exact match per sequence: ``(b,)`` True where every scored target (``mask``) is hit.

    ``hit`` is ``(b, L)``: the greedy prediction is the target. Unscored positions (the
    prompt, padding) do not count. ``evaluate``'s accuracy and
    :func:`posenc.studies.kazemnejad2023.answer_errors.exact_match_by_category` both use this rule.
    """
    return (hit | ~mask).all(-1)


@torch.no_grad()
def _score(model, batches, device: torch.device, L: int, dtype) -> dict[str, Any]:
    """Loss summed by position, and exact-match counts over the scored targets of ``batches``."""
    pos_loss = torch.zeros(L, dtype=torch.float64)
    pos_count = torch.zeros(L, dtype=torch.float64)
    solved = n_seq = correct_tok = 0
    axes = model_axes(model)
    for b in batches:
        tokens, targets = b.tokens.to(device), b.targets.to(device)
        mask = b.mask.to(device) if b.mask is not None else torch.ones_like(targets, dtype=torch.bool)
        with autocast(device, dtype):
            pos = positions_for(b.pos, axes)
            pos = None if pos is None else pos.to(device)
            if getattr(model, "adaptive", False):  # text only: exact -log p(target), no argmax
                loss = model(tokens, pos=pos, targets=targets) * mask
            else:
                logits = model(tokens, pos=pos)
        if not getattr(model, "adaptive", False):
            loss = masked_loss(logits, targets, mask)  # (b, L)
        pos_loss += loss.double().sum(0).cpu()
        pos_count += mask.double().sum(0).cpu()
        hit = torch.zeros_like(mask) if getattr(model, "adaptive", False) else logits.argmax(-1) == targets
        solved += int(solved_rows(hit, mask).sum())
        correct_tok += int((hit & mask).sum())
        n_seq += tokens.shape[0]
    return {"pos_loss": pos_loss, "pos_count": pos_count, "solved": solved, "seqs": n_seq, "correct": correct_tok}


@torch.no_grad()
def evaluate(model: TransformerLM, source, length: int, *, device: torch.device, settings: EvalSettings) -> Evaluation:
    """The :class:`~posenc.compare.results.Evaluation` at ``length``: loss/ppl/bpb (text) or
    accuracy (tasks), plus the per-position loss.

    A task scored per variant (a source with ``depths``: passkey's key depths, flip-flop's
    densities) is scored at each: ``depths`` holds one accuracy each, ``accuracy`` their mean.
    Positions are ``arange`` (also after randomized-position training), or the grid task's, as
    ``model`` reads them (:func:`posenc.data.positions_for`). An encoding that cannot run at
    this length gives ``applicable`` False with the ``reason`` and no metrics.
    """
    s = settings
    L = source.seq_len(length)
    reason = not_applicable(model, L)
    text = source.kind == "text"
    if reason is not None:
        metrics = ("loss", "ppl", "bpb") if text else ("loss", "accuracy", "token_accuracy")
        return Evaluation(length, False, reason, layout=("length", "applicable", "reason", *metrics))
    depths = getattr(source, "depths", None)
    s = dataclasses.replace(s, batch_size=batch_for(model, L, s))
    if text:
        stride = min(s.stride if s.stride is not None else max(1, length // 2), length) if s.sliding else None
        parts = [
            _score(model, source.eval_batches(length, s.batch_size, s.tokens, stride), device, L, s.autocast_dtype)
        ]
    elif depths:
        parts = [_score(model, source.eval_batches(length, s.batch_size, s.samples, d), device, L, s.autocast_dtype)
                 for d in depths]  # fmt: skip
    else:
        parts = [_score(model, source.eval_batches(length, s.batch_size, s.samples), device, L, s.autocast_dtype)]
    pos_loss, pos_count = sum(p["pos_loss"] for p in parts), sum(p["pos_count"] for p in parts)
    n_tok = float(pos_count.sum())
    mean = float(pos_loss.sum()) / n_tok
    edges = torch.linspace(0, L, min(s.buckets, L) + 1).round().long().tolist()
    buckets = []
    for a, e in zip(edges[:-1], edges[1:]):
        c = float(pos_count[a:e].sum())
        if c > 0:
            buckets.append(PositionLoss(a, e, float(pos_loss[a:e].sum()) / c))
    if text:
        # byte-level: bits per byte is the loss in bits
        # a diverged model's loss can pass 709.8 nats, where exp overflows: its perplexity is inf
        scores = {"ppl": math.inf if mean > 709 else math.exp(mean), "bpb": mean / math.log(2)}
    else:
        acc = [p["solved"] / p["seqs"] for p in parts]
        scores = {"accuracy": sum(acc) / len(acc), "token_accuracy": sum(p["correct"] for p in parts) / n_tok}
        if depths:
            scores["depths"] = [VariantScore(d, a) for d, a in zip(depths, acc)]
    layout = ("length", "applicable", "loss", *scores, "tokens", "per_position")
    return Evaluation(length, loss=mean, **scores, tokens=int(n_tok), per_position=buckets, layout=layout)
