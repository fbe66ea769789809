"""One encoding of a comparison: its model, its batches, its training (on
:class:`posenc.train.Trainer`) with checkpoints, and its evaluation.

Determinism is the design: the model of every encoding starts from the same seed
(shared weights get identical values), the batch of step ``s`` depends only on
``(seed, s)``, the learning rate is a function of ``s``, and a checkpoint holds the
weights, the optimizer state and the RNG state. So every encoding sees the same data
in the same order, and a run resumed from a checkpoint ends with the same numbers as
one that never stopped.

Under ``torchrun`` each of the ``W`` processes draws the same global batch and trains
on its ``1/W`` slice with ``DistributedDataParallel`` (gloo on CPU, nccl on GPU);
gradients are averaged, so the run matches one process with the same global batch.
Rank 0 evaluates and writes the files.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import CheckpointError, load_checkpoint, run_checkpoint
from ..data import Batch, positions_for, step_generator
from ..model import TransformerLM
from ..output.rundir import RunDirError
from ..positions import randomized_positions
from ..train import Callback, Every, Progress, Runtime, Trainer, adamw, cosine_schedule, lm_loss, wsd_schedule
from ..train.fsdp import shard_model
from .config import CompareConfig
from .diagnostics import convergence, process_matmul_peak, training_flops_per_token
from .evaluate import EvalSettings, evaluate, model_axes
from .results import Evaluation, ModelRun, ValPoint

__all__ = [
    "accumulation_steps", "batches", "build_model", "checkpoint_path", "lr_schedule", "max_positions", "model_max_len",
    "train_encoding",
]  # fmt: skip


def max_positions(cfg: CompareConfig, source) -> int:
    """``L_max`` of randomized positions, in tokens (default: the longest evaluation)."""
    n = cfg.max_pos if cfg.max_pos is not None else max(cfg.eval_lens)
    return source.seq_len(max(n, cfg.train_len))


def model_max_len(cfg: CompareConfig, source) -> int:
    """The ``max_len`` given to the encodings: the training length, or ``L_max`` if randomized."""
    return max_positions(cfg, source) if cfg.randomized_positions else source.seq_len(cfg.train_len)


def build_model(cfg: CompareConfig, source, encoding: str, seed: int | None = None) -> TransformerLM:
    """The model of one encoding and seed (default: the first of ``cfg.seeds``); for a
    given seed, shared weights get the same values for every encoding."""
    seed = cfg.seeds[0] if seed is None else seed
    torch.manual_seed(seed)
    model = TransformerLM(
        source.vocab_size,
        cfg.dim,
        cfg.depth,
        cfg.heads,
        encoding=cfg.named_patterns().get(encoding, encoding),  # a name, preset or layer pattern
        max_len=model_max_len(cfg, source),
        mlp_ratio=cfg.mlp_ratio,
        dropout=cfg.dropout,
        attn_dropout=cfg.attn_dropout,
        activation_dropout=cfg.activation_dropout,
        tie_embeddings=cfg.tie_embeddings,
        embed_std=cfg.embed_std,
        final_norm=cfg.final_norm,
        adaptive_cutoffs=cfg.adaptive_cutoffs,
        kv_heads=cfg.kv_heads,
        qk_norm=cfg.qk_norm,
        qk_norm_position=cfg.qk_norm_position,
        score_scale=cfg.score_scale,
        softcap=cfg.softcap,
        **cfg.encoding_options.get(encoding, {}),
    )
    # Re-draw every non-encoding weight from the same seed, so that the encodings'
    # own parameters (drawn first, in different numbers) do not shift them.
    torch.manual_seed(seed)
    model.reset_parameters()
    return model


def batches(
    source, *, batch_size: int, length: int, max_pos: int | None, seed: int, axes: int = 1
) -> Callable[[int], Batch]:
    """``batch_at(step)``: the global training batch of ``step``, a function of ``(seed, step)``.

    ``max_pos``: draw sorted random positions from ``[0, max_pos)`` (Ruoss et al. 2023); None: ``arange``.
    ``axes``: coordinates per position the model reads (grid positions are converted for it).
    """

    def batch_at(step: int) -> Batch:
        b = source.train_batch(step, batch_size, length, seed=seed)
        b = b._replace(pos=positions_for(b.pos, axes))
        if max_pos is None:
            return b
        g = step_generator(seed + 7919, step)
        return b._replace(pos=randomized_positions(batch_size, b.tokens.shape[1], max_pos, generator=g))

    return batch_at


def checkpoint_path(ckpt_dir: Path, cfg: CompareConfig, encoding: str, seed: int) -> Path:
    """The checkpoint of ``encoding``, ``seed`` in a run of ``cfg`` (:func:`posenc.checkpoint.run_checkpoint`)."""
    return run_checkpoint(ckpt_dir, encoding, seed, seeds=len(cfg.seeds))


class _Validate(Callback):
    """The evaluation at the training length after each of ``steps`` (convergence diagnostics);
    the model goes back to training mode after each."""

    def __init__(
        self, model, source, length: int, settings: EvalSettings, device, steps: set[int], curve: list[ValPoint]
    ):
        self.model, self.source, self.length, self.settings, self.device = model, source, length, settings, device
        self.steps, self.curve = steps, curve

    def on_step(self, state) -> None:
        if state.step in self.steps:
            self.model.eval()
            e = evaluate(self.model, self.source, self.length, device=self.device, settings=self.settings)
            self.model.train()
            self.curve.append(_val_point(state.step, e))


def _val_point(step: int, e: Evaluation) -> ValPoint:
    """The validation point of ``e``: its perplexity (text) or exact match (tasks), kept when not a number."""
    return ValPoint(
        step, e.loss, e.ppl, e.accuracy, layout=("step", "loss", *(k for k in ("ppl", "accuracy") if e.has(k)))
    )


def lr_schedule(cfg: CompareConfig):
    """``lr_at(step)`` of the config's ``schedule``: cosine, or warmup-stable-decay with a linear
    (``wsd``) or ``1 - sqrt`` (``wsd-sqrt``) cooldown over the last ``decay_fraction`` of the steps."""
    if cfg.schedule == "cosine":
        return cosine_schedule(cfg.lr, cfg.steps, cfg.warmup, cfg.min_lr_ratio)
    shape = "sqrt" if cfg.schedule == "wsd-sqrt" else "linear"
    return wsd_schedule(cfg.lr, cfg.steps, cfg.warmup, cfg.decay_fraction, cfg.min_lr_ratio, shape=shape)


def val_steps(cfg: CompareConfig) -> set[int]:
    """The steps after which the training-length validation runs (the last one: the final evaluation)."""
    return {round(cfg.steps * k / cfg.val_points) for k in range(1, cfg.val_points)} - {0} if cfg.val_points else set()


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


def train_encoding(
    cfg: CompareConfig,
    source,
    encoding: str,
    *,
    seed: int | None = None,
    runtime: Runtime,
    ckpt_dir: Path | None,
    resume: bool = False,
    progress: bool = True,
    position: tuple[int, int] = (1, 1),
    log=print,
) -> ModelRun | None:
    """Train and evaluate one encoding with one seed (default: the first of ``cfg.seeds``);
    returns its :class:`~posenc.compare.results.ModelRun` (None on the processes other than rank 0).

    With ``resume`` and a checkpoint in ``ckpt_dir``, continue from it (or return its
    stored result if that model had finished); a checkpoint written under another
    config, or unreadable, is a :class:`~posenc.output.rundir.RunDirError`. ``position``:
    ``(i, n)``, this model's place in the run, shown in the progress lines.
    """
    rt = runtime
    seed = cfg.seeds[0] if seed is None else seed
    path = checkpoint_path(ckpt_dir, cfg, encoding, seed) if ckpt_dir is not None else None
    accumulate = accumulation_steps(
        cfg.batch_size, rt.world, cfg.micro_batch
    )  # before any work: a bad split is refused
    model = build_model(cfg, source, encoding, seed).to(rt.device)
    extra = None
    if resume and path is not None and path.exists():
        saved, extra = load_for_resume(path, cfg)
        if extra.get("done"):  # the checkpoint holds the result as results.json holds it
            return ModelRun.from_json(extra["result"])
        model.load_state_dict(saved.state_dict())  # full weights, before any sharding
    fsdp = cfg.fsdp and rt.distributed
    if fsdp:  # sharded parameters: the optimizer is built over them (posenc.train.fsdp)
        shard_model(model)
    fused = (
        {"fused": True} if rt.device.type in ("cpu", "cuda") and not fsdp else {}
    )  # one kernel per step (docs/compare.md, "Speed on a CPU, and MFU")
    trainer = Trainer(
        model, adamw(model, lr=cfg.lr, weight_decay=cfg.weight_decay, **fused), runtime=rt,
        loss=torch.compile(lm_loss) if cfg.compile else lm_loss,
        schedule=lr_schedule(cfg), grad_clip=cfg.grad_clip,
        autocast_dtype=torch.bfloat16 if cfg.dtype == "bfloat16" else None, accumulate=accumulate, fsdp=fsdp,
    )  # fmt: skip
    state, curve = None, []
    if extra is not None:
        state = trainer.load_state_dict(extra)
        curve = [ValPoint.from_json(p) for p in extra.get("val_curve", [])]
    tag = f"[{position[0]}/{position[1]}] {encoding}" + (f" seed {seed}" if len(cfg.seeds) > 1 else "")
    seq_len = source.seq_len(cfg.train_len)
    mark = {"encoding": encoding, "seed": seed, "compare_config": cfg.to_dict(), "fingerprint": cfg.fingerprint(),
            "train_len": seq_len}  # fmt: skip
    settings = EvalSettings.from_config(cfg)
    callbacks: list[Callback] = []
    if rt.main and cfg.val_points:  # before the checkpoint of the same step, which keeps the curve
        callbacks.append(_Validate(model, source, cfg.train_len, settings, rt.device, val_steps(cfg), curve))
    if path is not None:
        save = lambda s: trainer.save(path, s, done=False, val_curve=[p.to_json() for p in curve], **mark)  # noqa: E731
        callbacks.append(Every(cfg.checkpoint_every, save, until=cfg.steps))
    if progress and rt.main:
        callbacks.append(Progress(tag, cfg.steps, state.step if state else 0, log, terminal=progress_bar(progress)))
    max_pos = max_positions(cfg, source) if cfg.randomized_positions else None
    batch_at = batches(source, batch_size=cfg.batch_size, length=cfg.train_len, max_pos=max_pos, seed=seed,
                       axes=model_axes(model))  # fmt: skip
    state = trainer.fit(batch_at, cfg.steps, state=state, callbacks=callbacks)
    gathered = trainer.gather()  # FSDP: the full weights on rank 0 (every process takes part); else None

    result = None
    if rt.main:
        if gathered is not None:  # rank 0 evaluates a plain model holding the gathered weights
            with torch.random.fork_rng(devices=[]):
                model = build_model(cfg, source, encoding, seed).to(rt.device)
            model.load_state_dict(gathered[0])
        t0 = time.perf_counter()
        if progress:
            log(f"{tag}: evaluating at {', '.join(map(str, cfg.eval_lens_sorted))}")
        model.eval()
        evals = [evaluate(model, source, n, device=rt.device, settings=settings) for n in cfg.eval_lens_sorted]
        at_train = next((e for e in evals if e.length == cfg.train_len), None)
        if cfg.val_points and at_train is None:
            at_train = evaluate(model, source, cfg.train_len, device=rt.device, settings=settings)
        if cfg.val_points:
            curve.append(_val_point(cfg.steps, at_train))
        n_tokens = cfg.steps * cfg.batch_size * seq_len
        flops = training_flops_per_token(model, seq_len)
        result = ModelRun(
            encoding,
            seed,
            params=model.num_params(),
            train_seconds=round(state.seconds, 3),
            train_tokens_per_s=round(n_tokens / state.seconds, 1) if state.seconds > 0 else None,
            eval_seconds=round(time.perf_counter() - t0, 3),
            final_train_loss=state.losses[-1] if state.losses else None,
            flops_per_token=flops,
            train_flops=flops * n_tokens,
            threads=torch.get_num_threads(),
            matmul_peak_flops=process_matmul_peak(rt.device, cfg.dtype),
            convergence=convergence(state.losses, curve),
            val_curve=curve,
            train_loss=list(state.losses),
            evals=evals,
        )
        if path is not None:  # plain data: a checkpoint loads with weights_only
            trainer.save(path, state, gathered=gathered, done=True, result=result.to_json(),
                         val_curve=[p.to_json() for p in curve], **mark)  # fmt: skip
    rt.barrier()
    return result


def progress_bar(progress: bool | str) -> bool | None:
    """``progress`` True: a bar on a terminal, lines otherwise; ``"lines"``: always lines."""
    return False if progress == "lines" else None


def load_for_resume(path: Path, cfg: CompareConfig):
    """The checkpoint at ``path``, refused (:class:`RunDirError`) if unreadable or from another config."""
    try:  # weights_only: a checkpoint that would run code is refused unexecuted
        saved, extra = load_checkpoint(path)
    except (CheckpointError, OSError) as e:  # truncated, random bytes, a payload, gone: the message names path
        raise RunDirError(
            f"--resume: unreadable checkpoint: {e}; delete it to retrain that model from scratch, or start the run over "
            "with --overwrite"
        ) from None
    check_checkpoint(path, extra, cfg)
    return saved, extra


def check_checkpoint(path: Path, extra: dict[str, Any], cfg: CompareConfig) -> None:
    """Raise :class:`RunDirError` when the checkpoint at ``path`` was written under another config."""
    saved = extra.get("fingerprint")
    if saved == cfg.fingerprint():
        return
    old = extra.get("compare_config")
    fields = cfg.differing_fields(old) if isinstance(old, dict) else []
    diff = ", ".join(f"{f}: {old.get(f)!r} -> {getattr(cfg, f, None)!r}" for f in fields[:6]) if fields else ""
    raise RunDirError(
        f"--resume: checkpoint {str(path)!r} was written under another config"
        + (f" ({diff})" if diff else " (no fingerprint: written by an older posenc)")
        + "; a run folder belongs to one config: start it over with --overwrite, or use another --out"
    )
