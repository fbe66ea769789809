"""Where a trained task model goes wrong inside its answer, index by index.

Exact match says a model failed at a length; this says how. For each answer token
(teacher-forced, as ``evaluate`` scores them: the prefix is the gold one) the model's
greedy prediction falls in one of four classes:

* ``right``: the gold token;
* ``stop``: ``</s>`` before the answer is over (the model ends its answer early, the
  "EOS decision" of Newman et al. 2020);
* ``prompt``: a wrong token that is in the sample's prompt (copying from the wrong place);
* ``other``: a token that is in neither (not read from the input at all).

``scripts/answer_errors.py RUN ENCODING N`` prints it for one model of a finished
``posenc compare --task kaz-*`` run (docs/compare.md, "The Kazemnejad runs").
"""

from __future__ import annotations

from typing import Any

import torch

from ..data.kazemnejad import EOS, PAD

__all__ = ["CLASSES", "answer_classes", "answer_errors"]

CLASSES = ("right", "stop", "prompt", "other")


def answer_classes(
    pred: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
) -> list[list[str]]:
    """Per sample, the class (:data:`CLASSES`) of each answer token's prediction, in answer order.

    Args:
        pred: ``(b, L)`` predicted next tokens (argmax of the logits).
        tokens: ``(b, L)`` the input (prompt, separator, answer; padded with ``PAD``).
        targets: ``(b, L)`` the next tokens.
        mask: ``(b, L)`` True where a target is scored (the answer and its ``</s>``).
    """
    out = []
    for p, t, g, m in zip(pred.tolist(), tokens.tolist(), targets.tolist(), mask.tolist()):
        idx = [i for i, on in enumerate(m) if on]
        prompt = set(t[: idx[0] + 1]) - {PAD} if idx else set()  # everything before the first answer token
        row = []
        for i in idx:
            if p[i] == g[i]:
                row.append("right")
            elif p[i] == EOS:
                row.append("stop")
            else:
                row.append("prompt" if p[i] in prompt else "other")
        out.append(row)
    return out


@torch.no_grad()
def answer_errors(model, source, n: int, samples: int = 64, batch_size: int = 64) -> dict[str, Any]:
    """Counts of each class at each answer index for ``samples`` test samples of size ``n``:
    ``{"n", "samples", "counts": [{class: count} per answer index]}`` (the last index of the
    longest answer is its ``</s>``; shorter answers count only at the indices they have).

    Raises:
        ValueError: the model's logits are NaN or infinite (a failed model: its argmax says nothing).
    """
    model.eval()
    counts: list[dict[str, int]] = []
    seen = 0
    for b in source.eval_batches(n, batch_size, samples):
        logits = model(b.tokens)
        if not torch.isfinite(logits).all():
            raise ValueError(f"the model's logits are NaN or infinite at n={n}: a failed model, nothing to classify")
        for row in answer_classes(logits.argmax(-1), b.tokens, b.targets, b.mask):
            for j, c in enumerate(row):
                if j == len(counts):
                    counts.append(dict.fromkeys(CLASSES, 0))
                counts[j][c] += 1
        seen += b.tokens.shape[0]
    return {"n": n, "samples": seen, "counts": counts}
