"""The models an analysis looks into: freshly initialised (``random``), loaded from a
checkpoint saved by ``posenc compare``, or tiny LMs trained here (:func:`train_tiny`, on
:class:`posenc.train.Trainer`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..checkpoint import load_checkpoint, save_checkpoint
from ..data import Batch, SyntheticTask
from ..model import TransformerLM
from ..train import Trainer
from .specs import Spec

__all__ = ["Subject", "build_subjects", "checkpoint_paths", "load_subjects", "random_model", "synthetic_batch",
           "tiny_checkpoints", "train_len_of", "train_tiny"]  # fmt: skip


@dataclass
class Subject:
    """A model to analyse and where it came from (``"random"`` or a checkpoint path)."""

    label: str
    model: TransformerLM
    source: str
    train_len: int

    @property
    def name(self) -> str:
        return self.model.encoding_name


def random_model(
    spec: Spec, *, dim=64, depth=2, heads=4, max_len=256, vocab_size=256, seed=0, causal=True
) -> TransformerLM:
    """A freshly initialised model (GPT-2 init; the encoding initialises itself)."""
    torch.manual_seed(seed)
    model = TransformerLM(vocab_size, dim, depth, heads, spec.name, max_len, causal=causal, **spec.options)
    return model.eval()


def build_subjects(specs: list[Spec], notes: list[str], *, max_len: int, seed: int, **kw) -> list[Subject]:
    """Random-weight models for ``specs``; one that fails to build is skipped with a note."""
    out = []
    for spec in specs:
        try:
            model = random_model(spec, max_len=max_len, seed=seed, **kw)
        except (ValueError, TypeError) as e:
            notes.append(f"skipped {spec.label!r}: cannot build it ({e})")
            continue
        out.append(Subject(spec.label, model, "random", max_len))
    return out


def checkpoint_paths(path: str | Path) -> list[Path]:
    """A checkpoint file, or every ``*.pt`` of a run directory (``<run>/checkpoints/*.pt``)."""
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        found = sorted((p / "checkpoints").glob("*.pt")) or sorted(p.glob("*.pt"))
        if found:
            return found
        raise ValueError(f"no checkpoints in {p} (looked for {p}/checkpoints/*.pt and {p}/*.pt)")
    raise ValueError(f"checkpoint path {p} does not exist")


def train_len_of(model: TransformerLM, extra: dict) -> int:
    """The training length in tokens that a posenc checkpoint records.

    ``train_len`` (written by ``posenc compare`` and :func:`train_tiny`); in a ``compare``
    checkpoint older than that key, its ``compare_config`` (items of a ``--task`` turned
    into tokens); else the model's ``max_len``.
    """
    if isinstance(extra.get("train_len"), int):
        return extra["train_len"]
    cfg = extra.get("compare_config")
    if isinstance(cfg, dict) and isinstance(cfg.get("train_len"), int):
        n = cfg["train_len"]
        return SyntheticTask(cfg["task"]).seq_len(n) if cfg.get("task") else n
    if model.max_len:
        return model.max_len
    raise ValueError("the checkpoint records no training length (train_len) and the model has no max_len")


def load_subjects(paths: list[str], notes: list[str]) -> list[Subject]:
    """Models from checkpoint files or run directories.

    Raises:
        ValueError: a path that does not exist, holds no checkpoint, or one that cannot be read.
    """
    out = []
    for arg in paths:
        for p in checkpoint_paths(arg):
            try:
                model, extra = load_checkpoint(p)
            except Exception as e:  # truncated, random bytes, another format: one clear error
                reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
                raise ValueError(f"--checkpoint {str(p)!r} is not a readable posenc checkpoint ({reason})") from None
            label = p.stem if p.stem.startswith(model.encoding_name) else model.encoding_name
            out.append(Subject(f"{label} (trained)", model.eval(), str(p), train_len_of(model, extra)))
    return out


def synthetic_batch(batch: int, length: int, vocab_size: int, generator: torch.Generator) -> Tensor:
    """Repeated random blocks: each row is a random block of 4..12 tokens, repeated.

    Predicting the next token needs looking back one period, a content-and-position
    lookup, so a few hundred steps give attention with visible positional structure.
    """
    rows = []
    for _ in range(batch):
        period = int(torch.randint(4, 13, (1,), generator=generator))
        block = torch.randint(0, vocab_size, (period,), generator=generator)
        rows.append(block.repeat(length // period + 1)[:length])
    return torch.stack(rows)


def train_tiny(
    spec: Spec, *, steps=600, length=32, batch=32, dim=64, depth=2, heads=4, vocab_size=16, seed=0, lr=3e-3
) -> tuple[TransformerLM, dict]:
    """Train a small causal LM on :func:`synthetic_batch` data; returns ``(model, extra)``.

    Constant learning rate, AdamW without weight decay. ``extra`` holds what
    :func:`save_checkpoint` stores next to the weights: ``train_len`` (the key ``posenc
    compare`` checkpoints use too), ``steps``, ``task`` and the final ``loss``.
    """
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    # untied unit-variance token embeddings, as `posenc compare` trains: with GPT-2's 0.02
    # the unit-amplitude sinusoids drown the tokens and the sinusoidal model never learns
    model = TransformerLM(
        vocab_size, dim, depth, heads, spec.name, length, tie_embeddings=False, embed_std=1.0, **spec.options
    )
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def batch_at(step: int) -> Batch:  # the step-th draw of g: called in order, from step 0
        tokens = synthetic_batch(batch, length + 1, vocab_size, g)
        return Batch(tokens[:, :-1], tokens[:, 1:], None)

    state = Trainer(model, opt).fit(batch_at, steps)
    loss = state.losses[-1] if state.losses else float("nan")
    extra = {"train_len": length, "steps": steps, "task": "repeated random blocks", "loss": loss}
    return model.eval(), extra


def tiny_checkpoints(specs: list[Spec], out_dir: Path, notes: list[str], *, steps: int, length: int) -> list[str]:
    """Train (or reuse) ``<out_dir>/checkpoints/<name>.pt`` for each spec; return the paths."""
    ckdir = Path(out_dir) / "checkpoints"
    ckdir.mkdir(parents=True, exist_ok=True)
    paths = []
    for spec in specs:
        path = ckdir / f"{spec.slug}.pt"
        if not path.exists():
            try:
                model, extra = train_tiny(spec, steps=steps, length=length)
            except (ValueError, TypeError) as e:
                notes.append(f"skipped training {spec.label!r}: {e}")
                continue
            save_checkpoint(path, model, **extra)
        paths.append(str(path))
    return paths
