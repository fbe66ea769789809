"""The training loop: :class:`Trainer` (one optimizer step, and ``fit`` over steps), the
language-model loss, the learning-rate schedule and the hooks the loop calls."""

from __future__ import annotations

import contextlib
import errno
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checkpoint import save_checkpoint
from ..output.files import OutputError, atomic_write
from .runtime import Runtime, map_tensors

LossFn = Callable[[nn.Module, Any], Tensor]


# ------------------------------------------------------------------ losses and schedules
def masked_loss(logits: Tensor, targets: Tensor, mask: Tensor | None) -> Tensor:
    """Per-token cross-entropy ``(B, L)`` in float32 from logits ``(B, L, V)``; masked-out tokens are 0."""
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)
    return loss if mask is None else loss * mask


def lm_loss(net: nn.Module, batch) -> Tensor:
    """Mean next-token loss of a causal LM over the scored tokens of ``batch``.

    ``batch``: a :class:`posenc.data.Batch` (``tokens``, ``targets`` ``(B, L)``, ``mask``
    ``(B, L)`` or None for all, ``pos`` ``(B, L)`` or None for ``arange``). ``net(tokens)``
    returns logits ``(B, L, V)``; it gets ``pos=`` only when the batch has positions, so any
    LM with that call works (x-transformers' in the benchmarks).
    """
    pos, documents = getattr(batch, "pos", None), getattr(batch, "documents", None)
    kw = {} if pos is None else {"pos": pos}
    if documents is not None:
        kw["document_ids"] = documents
    if getattr(getattr(net, "module", net), "adaptive", False):  # an adaptive softmax: its exact loss per token
        per_tok = net(batch.tokens, targets=batch.targets, **kw)
        per_tok = per_tok if batch.mask is None else per_tok * batch.mask
    else:
        per_tok = masked_loss(net(batch.tokens, **kw), batch.targets, batch.mask)
    return per_tok.sum() / (batch.mask.sum() if batch.mask is not None else per_tok.numel())


def cosine_schedule(lr: float, steps: int, warmup: int = 0, min_lr_ratio: float = 0.1) -> Callable[[int], float]:
    """Linear warmup over ``min(warmup, steps)`` steps, then cosine decay to ``lr * min_lr_ratio``.

    Returns ``lr_at(step)``, a function of the step only (so a resumed run gets the same rates).
    """
    warmup = min(warmup, steps)
    return _warmup_then(lr, warmup, min_lr_ratio,
                        lambda step: 0.5 * (1 + math.cos(math.pi * ((step - warmup) / max(1, steps - warmup)))))  # fmt: skip


def _warmup_then(lr: float, warmup: int, min_lr_ratio: float, left: Callable[[int], float]) -> Callable[[int], float]:
    """``lr_at(step)``: linear warmup over ``warmup`` steps, then ``lr * (min_lr_ratio + (1 -
    min_lr_ratio) * left(step))``; ``left`` (1 down to 0) is each schedule's own shape."""

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        return lr * (min_lr_ratio + (1 - min_lr_ratio) * left(step))

    return lr_at


def wsd_schedule(
    lr: float,
    steps: int,
    warmup: int = 0,
    decay_fraction: float = 0.2,
    min_lr_ratio: float = 0.0,
    shape: str = "linear",
) -> Callable[[int], float]:
    """Warmup-stable-decay: linear warmup over ``min(warmup, steps)`` steps, ``lr`` until the last
    ``decay_fraction`` of the steps, then a cooldown to ``lr * min_lr_ratio``.

    The cooldown is linear (MiniCPM, Hu et al. 2024) or ``shape="sqrt"``, ``1 - sqrt(t)``
    (Hägele et al. 2024, who found it the better of the two); ``t`` runs from 0 at its first
    step towards 1 at ``steps``, as :func:`cosine_schedule`'s does after the warmup. The
    cooldown starts no earlier than the warmup ends. Returns ``lr_at(step)``.
    """
    if shape not in ("linear", "sqrt"):
        raise ValueError(f"shape must be 'linear' or 'sqrt', got {shape!r}")
    if not 0.0 < decay_fraction <= 1.0:
        raise ValueError(f"decay_fraction must be in (0, 1], got {decay_fraction!r}")
    warmup = min(warmup, steps)
    start = max(warmup, steps - round(decay_fraction * steps))

    def left(step: int) -> float:
        if step < start:
            return 1.0
        t = min(1.0, (step - start) / max(1, steps - start))
        return 1 - (math.sqrt(t) if shape == "sqrt" else t)

    return _warmup_then(lr, warmup, min_lr_ratio, left)


def adamw(model: nn.Module, *, lr: float, weight_decay: float = 0.01, betas=(0.9, 0.95), **kw) -> torch.optim.AdamW:
    """AdamW over every parameter of ``model`` (``kw``: e.g. ``fused=True`` or ``foreach=True``)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay, **kw)


def autocast(device: torch.device, dtype: torch.dtype | None):
    """``torch.autocast`` to ``dtype`` on ``device``; a no-op context for None (float32)."""
    return torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


# ------------------------------------------------------------------ state and hooks
@dataclass
class TrainState:
    """What the loop has done: with the weights and the optimizer state, what a checkpoint holds."""

    step: int = 0  # optimizer steps done
    losses: list[float] = field(default_factory=list)  # loss of every step, mean over processes
    seconds: float = 0.0  # time in steps (batch, forward, backward, update), hooks excluded
    tokens: int = 0  # input tokens of the global batches since this process started or resumed


class Callback:
    """Hooks of :meth:`Trainer.fit`: after every step and once at the end (both do nothing here)."""

    def on_step(self, state: TrainState) -> None:
        pass

    def on_end(self, state: TrainState) -> None:
        pass


class Every(Callback):
    """``fn(state)`` after every ``n`` steps, before step ``until`` (None: to the end)."""

    def __init__(self, n: int, fn: Callable[[TrainState], None], *, until: int | None = None) -> None:
        if n < 1:
            raise ValueError(f"Every(n) needs n >= 1, got {n}")
        self.n, self.fn, self.until = n, fn, until

    def on_step(self, state: TrainState) -> None:
        if state.step % self.n == 0 and (self.until is None or state.step < self.until):
            self.fn(state)


# ------------------------------------------------------------------ the trainer
class Trainer:
    """Optimizer steps of ``model`` on batches, on one process or many (DDP).

    Args:
        model: the module trained (wrapped in ``DistributedDataParallel`` when the
            runtime has several processes; :attr:`model` stays the bare module).
        optimizer: built by the caller over ``model``'s parameters (:func:`adamw`).
        runtime: device and processes (:func:`~posenc.train.setup`); default one CPU process.
        loss: ``loss(net, batch) -> scalar``; default :func:`lm_loss`.
        schedule: ``lr_at(step)`` set on every parameter group before each step; None keeps
            the optimizer's rate.
        grad_clip: clip the global gradient norm to this; 0 = no clipping.
        autocast_dtype: None (float32) or ``torch.bfloat16`` (autocast around the loss).
        accumulate: micro-batches per optimizer step: this process's rows are cut into
            ``accumulate`` equal parts, each run forward and backward with its loss divided by
            ``accumulate`` (DDP synchronises the gradients on the last one only); the step's
            gradient is that of the mean of the parts' mean losses.
        fsdp: the model was sharded with :func:`posenc.train.fsdp.shard_model` (and the
            optimizer built after): no DDP wrapper; checkpoints gather the full weights and
            optimizer state on every process (:meth:`save` is then a collective).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        runtime: Runtime | None = None,
        loss: LossFn = lm_loss,
        schedule: Callable[[int], float] | None = None,
        grad_clip: float = 0.0,
        autocast_dtype: torch.dtype | None = None,
        accumulate: int = 1,
        fsdp: bool = False,
    ) -> None:
        if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
            raise ValueError(f"accumulate must be an int >= 1, got {accumulate!r}")
        self.accumulate = accumulate
        self.model, self.optimizer = model, optimizer
        self.runtime = runtime or Runtime()
        self.loss_fn, self.schedule, self.grad_clip = loss, schedule, grad_clip
        self.autocast_dtype = autocast_dtype
        self.net = model
        self.fsdp = fsdp and self.runtime.distributed
        if self.runtime.distributed and not self.fsdp:
            dev = self.runtime.device
            self.net = nn.parallel.DistributedDataParallel(
                model, device_ids=[dev.index] if dev.type == "cuda" else None
            )

    def step(self, batch, step: int | None = None) -> Tensor:
        """One optimizer step on ``batch`` (already this process's rows on the device).

        Returns the detached loss of this process (no host sync).
        """
        if self.schedule is not None and step is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = self.schedule(step)
        self.optimizer.zero_grad(set_to_none=True)
        k, total = self.accumulate, None
        for j, part in enumerate(micro_batches(batch, k)):
            last = j == k - 1
            if self.fsdp:  # FSDP2: reduce-scatter the gradients after the last micro-batch only
                self.model.set_requires_gradient_sync(last)
            ddp = self.runtime.distributed and not self.fsdp
            sync = self.net.no_sync() if ddp and not last else contextlib.nullcontext()
            with sync:
                with autocast(self.runtime.device, self.autocast_dtype):
                    loss = self.loss_fn(self.net, part)
                (loss / k if k > 1 else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        loss = total / k if k > 1 else total
        if self.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        return loss

    def fit(
        self,
        batch_at: Callable[[int], Any],
        steps: int,
        *,
        state: TrainState | None = None,
        callbacks: Iterable[Callback] = (),
    ) -> TrainState:
        """Train from ``state.step`` (0 for a new ``state``) up to ``steps``.

        ``batch_at(step)``: the global batch of ``step`` (every process draws the same one and
        keeps its rows); a function of the step, so a resumed run sees the same data.
        """
        state = state or TrainState()
        callbacks = list(callbacks)
        self.model.train()
        for step in range(state.step, steps):
            t0 = time.perf_counter()
            batch = batch_at(step)
            state.tokens += _numel(batch)
            value = self.runtime.mean(self.step(self.runtime.shard(batch), step))
            state.losses.append(float(value))
            state.step = step + 1
            state.seconds += time.perf_counter() - t0
            for cb in callbacks:
                cb.on_step(state)
        for cb in callbacks:
            cb.on_end(state)
        return state

    # ------------------------------------------------------------------ checkpoints
    def gather(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """Under FSDP, the full weights and optimizer state (a collective: every process calls
        it; rank 0 receives them); None otherwise."""
        if not self.fsdp:
            return None
        from .fsdp import gather

        return gather(self.model, self.optimizer)

    def state_dict(self, state: TrainState, gathered=None) -> dict[str, Any]:
        """The checkpoint entries besides the weights: step, losses, time, optimizer, RNG
        (``gathered``: :meth:`gather`'s output, whose optimizer state it takes)."""
        d = {
            "step": state.step,
            "losses": list(state.losses),
            "train_seconds": state.seconds,
            "optimizer": gathered[1] if gathered is not None else self.optimizer.state_dict(),
            "rng_state": torch.get_rng_state(),
        }
        if self.runtime.device.type == "cuda":
            d["cuda_rng_state"] = torch.cuda.get_rng_state(self.runtime.device)
        return d

    def load_state_dict(self, d: dict[str, Any]) -> TrainState:
        """Restore the optimizer and RNG from :meth:`state_dict` output; returns the state to resume."""
        if self.fsdp:
            from .fsdp import load_optimizer

            load_optimizer(self.model, self.optimizer, d["optimizer"])
        else:
            self.optimizer.load_state_dict(d["optimizer"])
        torch.set_rng_state(d["rng_state"])
        if "cuda_rng_state" in d and self.runtime.device.type == "cuda":
            torch.cuda.set_rng_state(d["cuda_rng_state"], self.runtime.device)
        return TrainState(step=d["step"], losses=list(d["losses"]), seconds=d["train_seconds"])

    def save(self, path: str | Path, state: TrainState, *, gathered=None, **extra: Any) -> None:
        """Write ``model`` + :meth:`state_dict` + ``extra`` to ``path`` atomically (rank 0 only).

        A kill mid-write leaves the previous file intact. Under FSDP every process calls it
        (it gathers the full state first), unless ``gathered`` (:meth:`gather`) is given.

        Raises:
            CheckpointWriteError: the file cannot be written (a full disk, a read-only or
                vanished folder); the temporary file is removed, the previous one kept.
        """
        if self.fsdp and gathered is None:
            gathered = self.gather()
        if not self.runtime.main:
            return
        path = Path(path)
        model = self.model
        if gathered is not None:
            from .fsdp import FullModel

            model = FullModel(self.model.config, gathered[0])
        try:  # a fresh hidden temporary (O_EXCL: never through a link planted in the folder), then a rename
            with atomic_write(path, "wb") as f:
                save_checkpoint(f, model, **self.state_dict(state, gathered), **extra)
        except OutputError as e:
            raise CheckpointWriteError.of(path, e) from None
        except RuntimeError as e:  # torch's zip writer: the bytes did not reach the disk
            if not any(m in str(e) for m in _WRITE_FAILURES):
                raise
            raise CheckpointWriteError.of(path, e) from None


# what torch's zip writer says when the bytes do not reach the disk (it raises RuntimeError)
_WRITE_FAILURES = ("unexpected pos", "file write failed", "PytorchStreamWriter failed", "Parent directory")


class CheckpointWriteError(OSError, ValueError):
    """A checkpoint could not be written: one sentence naming the path and why. An
    ``OSError`` (``errno``, ``filename``) and a ``ValueError`` (the tools' one-line path)."""

    def __str__(self) -> str:
        return f"cannot write checkpoint {str(self.filename)!r}: {self.strerror}"

    @classmethod
    def of(cls, path: Path, e: BaseException) -> CheckpointWriteError:
        code = e.errno if isinstance(e, OSError) and e.errno else errno.ENOSPC
        try:
            st = os.statvfs(path.parent)
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = None
        if code in (errno.EROFS, errno.EACCES, errno.EPERM):
            why = "the folder is not writable (read-only or permission denied)"
        elif code in (errno.ENOSPC, errno.EDQUOT) and (free is None or free < 64 << 20):
            why = "the disk is full" + (f" ({free >> 20} MiB free)" if free is not None else "")
        else:
            why = "the disk is full or the folder is not writable"
        detail = " ".join(str(getattr(e, "strerror", None) or e).split())[:120]
        return cls(code, f"{why}: free space or choose another --out ({detail})", str(path))


def micro_batches(batch, k: int) -> list:
    """``batch`` (a tensor or a tuple of tensors, rows first) cut into ``k`` equal parts of rows.

    Raises:
        ValueError: the rows do not divide by ``k``.
    """
    if k == 1:
        return [batch]
    t = batch if isinstance(batch, Tensor) else next(x for x in batch if isinstance(x, Tensor))
    rows = t.shape[0]
    if rows % k:
        raise ValueError(f"{rows} rows per process do not divide into {k} micro-batches (accumulation steps)")
    n = rows // k
    return [map_tensors(batch, lambda x, j=j: x[j * n : (j + 1) * n]) for j in range(k)]


def _numel(batch) -> int:
    t = batch if isinstance(batch, Tensor) else getattr(batch, "tokens", batch[0])
    return t.numel()
