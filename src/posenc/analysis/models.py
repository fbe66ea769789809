"""The models an analysis looks into: freshly initialised (``random``), loaded from a
checkpoint saved by ``posenc compare``, or tiny LMs trained here (:func:`train_tiny`, on
:class:`posenc.train.Trainer`)."""

from __future__ import annotations

import contextlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ..data import Batch
from ..data.lengths import sequence_length
from ..model import TransformerLM
from ..train import Trainer
from .specs import Spec

__all__ = ["Subject", "build_subjects", "checkpoint_paths", "load_subjects", "random_model", "run_fingerprint",
           "synthetic_batch", "tiny_checkpoints", "tiny_config", "train_len_of", "train_tiny"]  # fmt: skip

TASK = "repeated random blocks"  # what train_tiny trains on (synthetic_batch)


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


def build_subjects(specs: list[Spec], notes: list[str], *, max_len: int, seed: int, strict=(), **kw) -> list[Subject]:
    """Random-weight models for ``specs``; one that fails to build is skipped with a note,
    or, when its label is in ``strict`` (named by the user), a ``ValueError``."""
    out = []
    for spec in specs:
        try:
            model = random_model(spec, max_len=max_len, seed=seed, **kw)
        except (ValueError, TypeError) as e:
            if spec.label in strict:
                raise ValueError(f"--encodings {spec.label!r}: cannot build it ({e})") from None
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
        raise ValueError(
            f"--checkpoint {str(p)!r}: no checkpoints in it (looked for {p}/checkpoints/*.pt and {p}/*.pt)"
        )
    raise ValueError(f"--checkpoint {str(p)!r} does not exist")


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
        return sequence_length(cfg["task"], n) if cfg.get("task") else n
    if model.max_len:
        return model.max_len
    raise ValueError("the checkpoint records no training length (train_len) and the model has no max_len")


def run_fingerprint(folder: Path) -> str | None:
    """The config fingerprint a ``posenc compare`` run folder records, or None for a folder
    that is not one: ``results.json``'s ``fingerprint``, else that of its ``config.json``.

    Raises:
        ValueError: ``config.json`` is there but is not a readable compare config.
    """
    from ..compare.config import from_dict

    results = folder / "results.json"
    if results.is_file():  # only its fingerprint is read: a results.json of any posenc version has it
        with contextlib.suppress(OSError, ValueError, UnicodeDecodeError):  # unreadable: config.json decides
            saved = json.loads(results.read_text())
            if isinstance(saved, dict) and isinstance(saved.get("fingerprint"), str):
                return saved["fingerprint"]
    config = folder / "config.json"
    if not config.is_file():
        return None

    try:
        d = json.loads(config.read_text())
        if not isinstance(d, dict):
            raise ValueError(f"a JSON object expected, got {type(d).__name__}")
        return from_dict(d).fingerprint()
    except (OSError, ValueError, TypeError, UnicodeDecodeError) as e:
        reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise ValueError(f"--checkpoint: {str(config)!r} is not a readable posenc compare config ({reason})") from None


def _run_folder(arg: Path, p: Path) -> Path | None:
    """The run folder a checkpoint belongs to: ``<run>`` for ``<run>/checkpoints/x.pt`` (given
    as the file, ``<run>/checkpoints`` or ``<run>``), else the ``--checkpoint`` folder."""
    if p.parent.name == "checkpoints":
        return p.parent.parent
    return arg if arg.is_dir() else None


def _check_fingerprint(p: Path, extra: dict, folder: Path, expected: str) -> None:
    saved = extra.get("fingerprint")
    if saved == expected:
        return
    what = "records no config fingerprint" if saved is None else f"was trained under config {saved}"
    raise ValueError(
        f"--checkpoint {str(p)!r} {what}, but its run folder {str(folder)!r} is a run of config {expected} "
        "(its results.json / config.json): it is not a model of that run; rerun the comparison, or pass "
        "the checkpoint of the right run"
    )


def load_subjects(paths: list[str], notes: list[str]) -> list[Subject]:
    """Models from checkpoint files or run directories.

    A checkpoint of a ``posenc compare`` run folder (one that holds ``results.json`` or
    ``config.json``) must record that run's config fingerprint: a checkpoint of another
    config beside them (an earlier run's, left by a killed worker) is refused.

    Raises:
        ValueError: a path that does not exist, holds no checkpoint, or one that cannot be
            read or belongs to another config than its run folder.
    """
    out = []
    fingerprints: dict[Path, str | None] = {}
    for arg in paths:
        for p in checkpoint_paths(arg):
            try:  # weights_only: a file that would run code is refused unexecuted (CheckpointError)
                model, extra = load_checkpoint(p)
            except CheckpointError as e:  # truncated, random bytes, another format, a payload: it names p
                raise ValueError(f"--checkpoint: {e}") from None
            folder = _run_folder(Path(arg), p)
            if folder is not None:
                if folder not in fingerprints:
                    fingerprints[folder] = run_fingerprint(folder)
                if fingerprints[folder] is not None:
                    _check_fingerprint(p, extra, folder, fingerprints[folder])
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
    compare`` checkpoints use too), ``steps``, ``task``, the final ``loss``, and
    ``train_config`` (:func:`tiny_config`: everything that decides the model).
    """
    config = tiny_config(spec, steps=steps, length=length, batch=batch, dim=dim, depth=depth, heads=heads,
                         vocab_size=vocab_size, seed=seed, lr=lr)  # fmt: skip
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
    extra = {"train_len": length, "steps": steps, "task": TASK, "loss": loss, "train_config": config}
    return model.eval(), extra


def tiny_config(spec: Spec, **kw) -> dict:
    """What decides a :func:`train_tiny` model: the encoding and its options, every argument
    (``kw`` over the defaults) and the task, in a JSON-comparable form."""
    params = inspect.signature(train_tiny).parameters
    unknown = sorted(set(kw) - set(params) | ({"spec"} & set(kw)))
    if unknown:
        raise TypeError(f"unknown train_tiny argument(s) {unknown}")
    args = {k: p.default for k, p in params.items() if k != "spec"} | kw
    return json.loads(json.dumps({"encoding": spec.name, "options": spec.options, **args, "task": TASK}))


def _check_cached(path: Path, want: dict, train_dir: Path) -> None:
    """Refuse a cached checkpoint that was not trained as ``want`` asks (one sentence)."""
    try:
        _, extra = load_checkpoint(path)
    except CheckpointError as e:  # truncated, random bytes, another format, a payload: it names path
        raise ValueError(f"--train-dir {str(train_dir)!r}: {e}") from None
    have = extra.get("train_config")
    have = json.loads(json.dumps(have)) if isinstance(have, dict) else None
    if have == want:
        return
    if have is None:
        why = "records no training config (not written by this version of posenc analyze --train-steps)"
    else:
        diff = [k for k in sorted(set(want) | set(have)) if want.get(k) != have.get(k)]
        why = "was trained with " + ", ".join(f"{k}={have.get(k)!r} (asked: {want.get(k)!r})" for k in diff[:6])
    raise ValueError(
        f"--train-dir {str(train_dir)!r}: {str(path)!r} {why}; use another --train-dir, or remove that file to retrain"
    )


def _save_atomic(path: Path, model: TransformerLM, extra: dict) -> None:
    """Save a checkpoint through a fresh temporary file in the same folder: the whole file or none."""
    from ..output import OutputError
    from ..output.files import atomic_write

    try:
        with atomic_write(path, "wb") as f:
            save_checkpoint(f, model, **extra)
    except RuntimeError as e:  # torch's writer reports a full disk as a RuntimeError
        raise OutputError(0, str(e).splitlines()[0][:160], str(path)) from None


def tiny_checkpoints(
    specs: list[Spec], out_dir: Path, notes: list[str], *, steps: int, length: int, strict=()
) -> list[str]:
    """Train (or reuse) ``<out_dir>/checkpoints/<name>.pt`` for each spec; return the paths.

    A checkpoint already there is reused only if it was trained exactly as asked
    (:func:`tiny_config`: steps, length and everything else that decides the model).
    A spec that cannot be trained is skipped with a note, or, when its label is in
    ``strict`` (named by the user), a ``ValueError``.

    Raises:
        ValueError: ``out_dir`` is not a folder, or a checkpoint there was trained
            otherwise (another ``steps``, ``length``, ...).
        OutputError: a checkpoint cannot be written.
    """
    out_dir = Path(out_dir)
    ckdir = out_dir / "checkpoints"
    try:
        ckdir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ValueError(f"--train-dir {str(out_dir)!r}: {str(ckdir)!r} exists and is not a folder") from None
    except OSError as e:
        raise ValueError(f"--train-dir {str(out_dir)!r} cannot be used: {e.strerror or e}") from None
    paths = []
    for spec in specs:
        path = ckdir / f"{spec.slug}.pt"
        want = tiny_config(spec, steps=steps, length=length)
        if path.exists() or path.is_symlink():
            _check_cached(path, want, out_dir)
        else:
            try:
                model, extra = train_tiny(spec, steps=steps, length=length)
            except (ValueError, TypeError) as e:
                if spec.label in strict:
                    raise ValueError(f"--encodings {spec.label!r}: cannot train it ({e})") from None
                notes.append(f"skipped training {spec.label!r}: {e}")
                continue
            _save_atomic(path, model, extra)
        paths.append(str(path))
    return paths
