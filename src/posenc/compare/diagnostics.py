"""Is a model trained, and how well was the machine used? Convergence and MFU.

* :func:`convergence` — from a run's training-loss history and a few validation losses
  at the training length: is the model still clearly improving when training stops?
* :func:`run_health` — did the run train at all: ``failed`` (a NaN/inf loss), ``diverged``
  (its training loss rose, or it ended above chance), or ``ok``.
* :func:`training_flops_per_token` — the model's training FLOPs per token (forward and
  backward), counted from its layers.
* :func:`matmul_peak_flops` — the machine's matmul rate, measured in this process.
* :func:`mfu` — model FLOPs utilisation of a whole comparison, from its results.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from .results import Evaluation, ModelRun, RunResults, ValPoint

__all__ = [
    "convergence",
    "run_convergence",
    "training_flops_per_token",
    "matmul_peak_flops",
    "process_matmul_peak",
    "mfu",
    "still_improving",
    "run_health",
    "training_trouble",
    "finite",
    "vocab_size",
    "chance_loss",
    "CONVERGED_DROP",
    "DIVERGED_RISE",
]

# A model counts as still improving when its validation loss fell by more than this fraction
# over the last 20 % of training (docs/compare.md, "Converged within the budget").
CONVERGED_DROP = 0.02
# A model has diverged when its training loss ended (the mean over the last 10 % of the
# steps) more than this fraction above its first step's loss: training made it worse.
DIVERGED_RISE = 0.05
SOLVED_ACCURACY = 0.9  # a task is solved from 90 % exact match (reading.SOLVED)
RISE_TAIL = 0.1


def _tail_slope(losses: Sequence[float], tail: float) -> float | None:
    """Least-squares slope of ``losses`` over their last ``tail``, as the relative change
    a straight line predicts across that stretch (negative: still falling)."""
    n = len(losses)
    k = max(5, int(round(n * tail)))
    if n < 10 or k > n:
        return None
    ys = [finite(v) for v in losses[-k:]]
    if any(y is None for y in ys):  # NaN (None in results.json): no line through it
        return None
    xs = range(n - k, n)
    mx, my = (n - k + n - 1) / 2, sum(ys) / k
    sxx = sum((x - mx) ** 2 for x in xs)
    if my == 0:  # losses are >= 0: every one is 0 (a task solved exactly), a flat line
        return 0.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope * (k - 1) / my


def convergence(
    train_loss: Sequence[float | None],
    val_points: Sequence[ValPoint],
    *,
    tail: float = 0.2,
    threshold: float = CONVERGED_DROP,
) -> dict[str, Any]:
    """Whether a model was still clearly improving when training stopped.

    Two measurements over the last ``tail`` of training:

    * ``val_drop``: the relative drop of the validation loss at the training length from
      the last validation point at or before the tail's start to the last one;
    * ``train_slope``: the least-squares line through the training losses of the tail,
      as the relative change it predicts across the tail (negative: still falling).

    On a task whose validation points carry exact-match ``accuracy``, its gain over the
    tail (``val_accuracy_gain``, in points of 1) decides instead: a task solved early has a
    validation loss near 0 whose relative change is noise (passkey at 1 600 steps: 100 %
    exact match from step 960 while the loss fell from 8e-4 to 2e-5). The gain counts at
    most the room left (``1 - accuracy`` at the end): a model that ends within ``threshold``
    of 100 % has reached its quality, whatever it gained on the way. Otherwise the
    validation drop decides when there are two validation points: the training loss
    keeps falling on data the model has seen after the held-out loss has flattened (the
    quick preset at 1 600 steps: validation loss -0.3 to +0.7 % over the last 20 %, the
    training loss's line -1.5 to -3.1 %), so its slope is recorded but only decides
    without validation points.

    Args:
        train_loss: one training loss per step.
        val_points: the validation points (loss None: skipped).
        threshold: ``converged`` is False when the deciding drop exceeds it.

    Returns:
        ``{"train_slope", "val_drop", "val_from_step", "tail", "threshold", "decided_by",
        "converged", "diverged"}`` (and ``"val_accuracy_gain"`` on tasks); ``converged`` (and
        ``decided_by``) None when there is too little history to tell. ``diverged``: why the
        training loss shows a failed or diverged run (:func:`training_trouble`), or None;
        such a run is not converged (``decided_by`` ``"diverged"``).
    """
    if not 0 < tail < 1 or not 0 < threshold < 1:
        raise ValueError(f"need 0 < tail < 1 and 0 < threshold < 1, got tail={tail!r}, threshold={threshold!r}")
    out: dict[str, Any] = {"tail": tail, "threshold": threshold, "val_drop": None, "val_from_step": None}
    out["train_slope"] = _tail_slope(train_loss, tail)
    pts = sorted((p for p in val_points if p.loss is not None), key=lambda p: p.step)
    if len(pts) >= 2:
        end = pts[-1]
        cut = end.step * (1 - tail)
        ref = ([p for p in pts[:-1] if p.step <= cut + 1e-9] or pts[:1])[-1]
        # a validation loss of 0 (a task solved exactly) can only stay there: no drop
        out["val_drop"] = (ref.loss - end.loss) / ref.loss if ref.loss else 0.0
        out["val_from_step"] = ref.step
        if ref.accuracy is not None and end.accuracy is not None:
            out["val_accuracy_gain"] = end.accuracy - ref.accuracy
    gain = out.get("val_accuracy_gain")
    # a task: exact match decides (the loss of a solved task is ~0, its ratio noise), unless
    # the task is not solved and its loss still falls: exact match stuck near 0 % while the
    # loss falls 12 % is a model still learning (kaz-copy, rope seed 1, at 3 000 steps)
    unsolved = gain is not None and pts[-1].accuracy < SOLVED_ACCURACY
    if gain is not None and not (unsolved and gain <= threshold and (out["val_drop"] or 0) > threshold):
        # exact match cannot rise past 100 %: a model that ends within the threshold of it has
        # no more than the threshold left to gain, however fast it rose (kaz-copy, nope seed 0
        # at 8 000 steps: 95 % -> 100 % over the tail, then nothing left to learn at its length)
        out["decided_by"], drop = "val_accuracy_gain", min(gain, 1.0 - pts[-1].accuracy)
    elif out["val_drop"] is not None:
        out["decided_by"], drop = "val_drop", out["val_drop"]
    elif out["train_slope"] is not None:
        out["decided_by"], drop = "train_slope", -out["train_slope"]
    else:
        out["decided_by"], drop = None, None
    out["converged"] = None if drop is None else drop <= threshold
    out["diverged"] = training_trouble(train_loss)
    if out["diverged"] is not None:  # a loss that rose or went NaN is not converged, whatever its slope
        out["decided_by"], out["converged"] = "diverged", False
    return out


def run_convergence(run: ModelRun) -> dict[str, Any]:
    """:func:`convergence` of one model of a comparison under this version's rule.

    The check runs when a model finishes, and results.json keeps what it said then; a rule
    changed since (d58583e: exact-match gain counts at most the room left to 100 %) would
    leave stored runs with statuses the current code would not give. So the status is
    recomputed from the stored histories (``train_loss`` and ``val_curve``), at the stored
    ``tail`` and ``threshold``; an entry without them keeps its stored dict ({} if none).
    Every reading of a status (the reading, the report, the Kazemnejad suite) goes through here.
    """
    stored = run.convergence
    losses, curve = run.train_loss, run.val_curve
    if not losses or curve is None:
        return stored
    return convergence(losses, curve, tail=stored.get("tail", 0.2), threshold=stored.get("threshold", CONVERGED_DROP))


def finite(v: Any) -> float | None:
    """``v`` as a float when it is a finite number; None for None, NaN and ±inf."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def training_trouble(train_loss: Sequence[float | None]) -> str | None:
    """Why a training-loss history shows a failed or diverged run, or None.

    ``"training loss NaN from step 7"`` when a loss is not finite (NaN, ±inf, or None as
    results.json stores them); ``"training loss rose 114% (5.52 at step 1 -> 11.82 over the
    last 10% of the steps)"`` when the mean over the last :data:`RISE_TAIL` of the steps (at
    least one) is more than :data:`DIVERGED_RISE` above the first step's loss.
    """
    losses = list(train_loss or [])
    for i, v in enumerate(losses):
        if finite(v) is None:
            return f"training loss NaN from step {i + 1}"
    if len(losses) < 2:
        return None
    k = max(1, math.ceil(RISE_TAIL * len(losses)))
    first, end = float(losses[0]), sum(losses[-k:]) / k
    if first > 0 and end > first * (1 + DIVERGED_RISE):
        return (f"training loss rose {end / first - 1:.0%} ({first:.2f} at step 1 -> {end:.2f} over the last "
                f"{RISE_TAIL:.0%} of the steps)")  # fmt: skip
    return None


def vocab_size(config: dict[str, Any]) -> int | None:
    """Tokens the data of a comparison's ``config`` uses: 256 bytes for text and passkey, the
    task's own vocabulary otherwise (None: a task this version does not know, or a
    ``data_dir`` corpus)."""
    task = config.get("task")
    if config.get("data_dir"):  # a word-level corpus: its vocabulary is in the run folder, not the config
        return None
    if not task or task == "passkey":
        return 256
    from ..data import DataError, load_source

    try:  # every task the data package knows (synthetic, grid, the papers' count and flip-flop)
        return load_source(task=task).vocab_size
    except (ValueError, DataError):
        return None


def chance_loss(config: dict[str, Any]) -> float | None:
    """The loss of a uniform guess over the vocabulary, ``ln(vocab)``: a trained model
    below it has learned something; one above it is worse than guessing."""
    v = vocab_size(config)
    return None if v is None else math.log(v)


def _eval_loss(e: Evaluation) -> float | None:
    loss = finite(e.loss)
    if loss is None and not e.has("loss") and (finite(e.ppl) or 0) > 0:
        loss = math.log(e.ppl)  # results without the loss (text): ln(ppl)
    return loss


def run_health(run: ModelRun, config: dict[str, Any]) -> dict[str, str | None]:
    """Did this run (one model of a comparison of ``config``) train? ``{"state", "why"}``:

    * ``"failed"``: a loss is NaN or ±inf (stored as null): in training, or at an evaluation
      length the model can run;
    * ``"diverged"``: the training loss rose (:func:`training_trouble`), or the final loss at
      the training length is above chance (:func:`chance_loss`, ``ln(vocab)``: worse than a
      uniform guess; without an evaluation at the training length, the mean training loss
      of the last 10 % of the steps);
    * ``"ok"`` otherwise (``why`` None).

    A failed or diverged run is never ranked, read or called converged.
    """
    unit = "n" if config.get("task") and config.get("task") != "passkey" else "L"
    evals = [e for e in run.evals if e.applicable]
    bad_eval = [e.length for e in evals if (e.has("loss") or e.has("ppl")) and _eval_loss(e) is None
                and finite(e.ppl) is None]  # fmt: skip
    trouble = training_trouble(run.train_loss)
    if bad_eval or (trouble or "").startswith("training loss NaN"):
        parts = [trouble] if trouble else []
        if bad_eval:
            parts.append(f"loss NaN at {unit}=" + ", ".join(map(str, bad_eval)))
        return {"state": "failed", "why": "; ".join(parts)}
    if trouble:
        return {"state": "diverged", "why": trouble}
    chance = chance_loss(config)
    if chance is not None:
        at_train = next((e for e in evals if e.length == config.get("train_len")), None)
        loss = _eval_loss(at_train) if at_train is not None else None
        where = f"at {unit}={config.get('train_len')}"
        if loss is None:
            tail = [float(v) for v in run.train_loss]
            k = max(1, math.ceil(RISE_TAIL * len(tail)))
            loss, where = (sum(tail[-k:]) / k if tail else None), "in training (last 10% of the steps)"
        if loss is not None and loss > chance:
            return {"state": "diverged", "why": f"loss {loss:.2f} {where} above chance ln({vocab_size(config)}) = "
                                                f"{chance:.2f}"}  # fmt: skip
    return {"state": "ok", "why": None}


def still_improving(convs: Sequence[dict[str, Any]]) -> str | None:
    """``"validation loss fell 3.1% over the last 20%"`` (tasks: ``"exact match rose 12.0
    points ..."``) for the worst of ``convs`` (the
    ``convergence`` entries of one encoding's runs) that did not converge; None if all did
    (or cannot tell)."""
    worst = None
    for c in convs:
        if c.get("converged") is not False or c.get("decided_by") == "diverged":
            continue
        by = c.get("decided_by", "val_drop")
        tail = f"over the last {c.get('tail', 0.2):.0%}"
        if by == "val_accuracy_gain":
            drop, text = c["val_accuracy_gain"], f"exact match rose {100 * c['val_accuracy_gain']:.1f} points {tail}"
        elif by == "val_drop" and c.get("val_drop") is not None:
            drop, text = c["val_drop"], f"validation loss fell {c['val_drop']:.1%} {tail}"
        else:
            drop = -(c.get("train_slope") or 0.0)
            text = f"training loss fell {drop:.1%} {tail}"
        if worst is None or drop > worst[0]:
            worst = (drop, text)
    return None if worst is None else worst[1]


def training_flops_per_token(model, seq_len: int) -> float:
    """Training FLOPs per token of ``model`` at ``seq_len`` tokens (forward + backward).

    Counted the way Kaplan et al. (2020, Table 1) and PaLM (Chowdhery et al. 2022, App. B)
    count them:

    * ``6 N`` for the ``N`` weights of the linear layers (2 FLOPs per multiply-add in the
      forward pass, twice that in the backward for the input and the weight gradients);
      token embeddings are a lookup and norms, biases and activations are negligible;
    * attention's scores ``Q Kᵀ`` and weighted sum ``A V``: ``2·Dₐ`` FLOPs each per
      (query, key) pair, ``Dₐ = heads × head_dim``, times 3 for training. A causal query
      ``i`` sees ``i + 1`` keys, ``(L + 1) / 2`` on average, so ``6·Dₐ·(L + 1)`` per token and
      layer (``12·Dₐ·L`` without the mask). The masked half is not useful work: the kernels
      that run here skip it, and counting it would flatter MFU.

    The position encodings' own layers and arithmetic are not counted (their modules are
    skipped), so every encoding of a comparison gets the same useful work per token and
    MFU compares their speed on equal terms.
    """
    from torch import nn

    from ..base import PositionEncoding
    from ..layer.attention import Attention

    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    own = {id(m) for e in model.modules() if isinstance(e, PositionEncoding) for m in e.modules()}
    weights, attn = 0, 0.0
    for m in model.modules():
        if id(m) in own:
            continue
        if isinstance(m, nn.Linear):
            weights += m.weight.numel()
        elif isinstance(m, Attention):
            d = m.heads * m.head_dim
            attn += 6 * d * (seq_len + 1) if m.causal else 12 * d * seq_len
    return 6.0 * weights + attn


def matmul_peak_flops(*, dtype=None, size: int = 1024, seconds: float = 1.0, device=None) -> float:
    """The matmul rate this process gets now (FLOP/s): the best of repeated ``size × size``
    products in ``dtype`` (float32 by default) on ``device`` (CPU: the threads torch uses)."""
    import torch

    dtype = dtype or torch.float32
    device = torch.device(device or "cpu")
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.mm(a, b)  # warm up
    sync()
    best, t_end, rounds = 0.0, time.perf_counter() + seconds, 0
    while rounds < 3 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = max(best, 2 * size**3 / (time.perf_counter() - t0))
        rounds += 1
    return best


_PEAKS: dict[tuple[str, str, int], float] = {}


def process_matmul_peak(device, dtype: str = "float32") -> float:
    """:func:`matmul_peak_flops` of this process on ``device`` in ``dtype`` (``"float32"`` or
    ``"bfloat16"``) at its current thread count, measured once per process and remembered."""
    import torch

    key = (str(device), dtype, torch.get_num_threads())
    if key not in _PEAKS:
        _PEAKS[key] = matmul_peak_flops(dtype=getattr(torch, dtype), device=device)
    return _PEAKS[key]


def mfu(results: RunResults) -> dict[str, Any] | None:
    """Model FLOPs utilisation of a comparison: the training FLOPs of every run over their
    training seconds, divided by the matmul peak of the processes that trained them
    (``results.environment["matmul_peak_flops"]``, measured in those processes at the
    same thread count; with several worker processes this is each worker's share of the
    machine, so the ratio is the machine's utilisation while they all train).

    Returns ``{"flops_per_s", "peak_flops_per_s", "mfu", "per_encoding": {enc: mfu}}``, or
    None when the runs or the environment lack the numbers.
    """
    peak = (results.environment or {}).get("matmul_peak_flops")
    runs = [r for r in results.runs if r.train_flops and r.train_seconds]
    if not peak or not runs:
        return None
    per: dict[str, list[float]] = {}
    for r in runs:
        per.setdefault(r.encoding, []).append(r.train_flops / r.train_seconds)
    total = sum(r.train_flops for r in runs) / sum(r.train_seconds for r in runs)
    return {
        "flops_per_s": total,
        "peak_flops_per_s": peak,
        "mfu": total / peak,
        "per_encoding": {e: sum(v) / len(v) / peak for e, v in per.items()},
    }
