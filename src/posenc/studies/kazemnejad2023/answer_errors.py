"""Where a trained task model goes wrong inside its answer, index by index.

Exact match says a model failed at a length; this says how. For each answer token
(teacher-forced, as ``evaluate`` scores them: the prefix is the gold one) the model's
greedy prediction falls in one of four classes:

* ``right``: the gold token;
* ``stop``: ``</s>`` before the answer is over (the model ends its answer early, the
  "EOS decision" of Newman et al. 2020);
* ``prompt``: a wrong token that is in the sample's prompt (copying from the wrong place);
* ``other``: a token that is in neither (not read from the input at all).

:func:`exact_match_by_category` splits exact match by the original builder's ``cat`` of
each sample instead: for ``kaz-lego`` the query's index in the chain (how many clauses its
value depends on), for ``kaz-addition`` the operands' digit counts.

``posenc study answer-errors RUN ENCODING N [--by-category]`` prints either for one model of
a finished ``posenc compare --task kaz-*`` run (docs/studies/kazemnejad2023.md).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from ...compare.evaluate import solved_rows
from ...data.kazemnejad import EOS, PAD

__all__ = ["CLASSES", "answer_classes", "answer_errors", "exact_match_by_category"]

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


def _logits(model, b, n: int) -> torch.Tensor:
    logits = model(b.tokens)
    if not torch.isfinite(logits).all():
        raise ValueError(f"the model's logits are NaN or infinite at n={n}: a failed model, nothing to classify")
    return logits


@torch.no_grad()
def answer_errors(model, source, n: int, samples: int = 64, batch_size: int = 64) -> dict[str, Any]:
    """Counts of each class at each answer index for ``samples`` test samples of size ``n``:
    ``{"n", "samples", "counts": [{class: count} per answer index], "other_tokens": [{token id:
    count} per answer index]}`` (the last index of the longest answer is its ``</s>``; shorter
    answers count only at the indices they have; ``other_tokens`` says which tokens the
    ``other`` predictions were).

    Raises:
        ValueError: the model's logits are NaN or infinite (a failed model: its argmax says nothing).
    """
    model.eval()
    counts: list[dict[str, int]] = []
    others: list[Counter] = []
    seen = 0
    for b in source.eval_batches(n, batch_size, samples):
        pred = _logits(model, b, n).argmax(-1)
        for p, m, row in zip(pred, b.mask, answer_classes(pred, b.tokens, b.targets, b.mask)):
            answer = p[m].tolist()  # the predictions at the answer's positions, in the order of ``row``
            for j, c in enumerate(row):
                if j == len(counts):
                    counts.append(dict.fromkeys(CLASSES, 0))
                    others.append(Counter())
                counts[j][c] += 1
                if c == "other":
                    others[j][answer[j]] += 1
        seen += b.tokens.shape[0]
    return {"n": n, "samples": seen, "counts": counts, "other_tokens": [dict(o) for o in others]}


def category_label(task: str, cat) -> str:
    """A builder's ``cat`` in words: ``kaz-lego``'s ``(n, q)`` is the query's 1-based place in
    the chain; ``kaz-addition``'s ``"a-by-b"`` the digit counts; anything else as it is."""
    if task == "kaz-lego":
        return f"query: variable {cat[1] + 1} of {cat[0]}"
    if task == "kaz-addition":
        return "digits: {} + {}".format(*cat.split("-by-"))
    return str(cat)


@torch.no_grad()
def exact_match_by_category(model, source, n: int, samples: int = 64, batch_size: int = 64) -> dict[str, Any]:
    """Exact match of the test samples of size ``n`` (``evaluate``'s samples and rule: every
    answer token's teacher-forced greedy prediction right), split by the record's ``cat``:
    ``{"n", "samples", "categories": {label: {"solved", "samples"}}}`` in the categories' order
    (query place; digit counts).

    Args:
        source: a :class:`posenc.data.kazemnejad.KazemnejadTask` (its ``eval_records``).

    Raises:
        ValueError: the model's logits are NaN or infinite.
    """
    model.eval()
    records = source.eval_records(n, samples)
    cats: dict[Any, dict[str, int]] = {}
    for s in range(0, samples, batch_size):
        part = records[s : s + batch_size]
        b = source.batch(part, source.seq_len(n))
        solved = solved_rows(_logits(model, b, n).argmax(-1) == b.targets, b.mask).tolist()
        for r, ok in zip(part, solved):
            c = cats.setdefault(r["cat"], {"solved": 0, "samples": 0})
            c["solved"] += int(ok)
            c["samples"] += 1

    def order(cat):  # addition's "a-by-b" by its numbers, not as text
        return tuple(map(int, cat.split("-by-"))) if isinstance(cat, str) and "-by-" in cat else cat

    labels = {category_label(source.name, c): cats[c] for c in sorted(cats, key=order)}
    return {"n": n, "samples": len(records), "categories": labels}
