"""Kazemnejad et al. 2023, "The Impact of Positional Encoding on Length Generalization in
Transformers": their suite of ``--task kaz-*`` tasks, its budgets in the quick preset, and
the reading of their claim on one task's run.

The tasks are generated as their builders generate them (:mod:`posenc.data.kazemnejad`). At
their splits: the arithmetic tasks train on sizes up to 8 and test to 16 ("tr8_ts16"), copy
and reverse (and their 2x variants) up to 20, tested to 40 ("cmc_tr20_ts40",
"mc_tr20_ts40"). One evaluation column per size; T5's buckets reach 64 tokens (a size-8
sample is 19-92 tokens, a size-20 copy 43). :data:`BUDGETS` holds each task whose budget
differs from its split's common one.

Their claim (Fig. 3): by mean rank over the tasks past the training length, NoPE ≈ T5's bias
> ALiBi > rotary ≈ absolute positions (APE). :func:`findings` reads it on one task's run;
:mod:`.suite` over the runs of several tasks (``posenc study kazemnejad-suite``);
:mod:`.answer_errors` says where a model's answers go wrong (``posenc study answer-errors``).
"""

from __future__ import annotations

from typing import Any

from ...compare.config import register_task_defaults
from ...compare.reading import NOT_RUN, Check, Finding, Summary, learned_encodings, register_findings, verdict
from ...compare.results import rank_with_ties
from ...data import KAZEMNEJAD_TASKS

__all__ = ["BUDGETS", "TASKS", "TIERS", "TR20", "findings", "mean_ranks"]

# the tasks Kazemnejad et al. train up to size 20 and test to 40 (the rest: up to 8, to 16)
TR20 = ("kaz-copy", "kaz-copy-2x", "kaz-reverse", "kaz-reverse-2x")

# The common budgets, and below them each task's own: the convergence study behind every
# number is in docs/studies/kazemnejad2023.md (the probes themselves: this page in the git history).
_TR20 = {"train_len": 20, "eval_lens": [10, 20, 30, 40], "depth": 4, "steps": 8000}
_TR8 = {"train_len": 8, "eval_lens": [4, 8, 12, 16], "depth": 2, "steps": 6000}
BUDGETS: dict[str, dict[str, Any]] = {
    "kaz-sum": {"steps": 18000, "weight_decay": 0.1, "batch_size": 64},
    "kaz-parity": {"steps": 12000, "weight_decay": 0.1},
    "kaz-reverse": {"steps": 12000, "weight_decay": 0.1},
    "kaz-reverse-2x": {"steps": 12000, "weight_decay": 0.1, "batch_size": 64},
    "kaz-sort": {"steps": 8000},
    "kaz-addition": {"depth": 6, "steps": 18000, "weight_decay": 0.1},
}

# The quick preset's entries, one per task; a task's own budget is merged last, so it
# overrides any key of the common one.
TASKS: dict[str, dict[str, Any]] = {
    t: {
        **(_TR20 if t in TR20 else _TR8),
        "lr": 3e-3,
        "encodings": ["nope", "t5", "alibi", "rope", "learned"],  # their five (APE: learned)
        "encoding_options": {"t5": {"max_distance": 64}},
        **BUDGETS.get(t, {}),
    }
    for t in KAZEMNEJAD_TASKS
}

# Fig. 3 (mean reciprocal rank over the tasks: NoPE 0.69, T5 0.55, ALiBi 0.50, RoPE 0.33,
# APE 0.22): NoPE and T5 best, ALiBi, then rotary and APE (posenc's absolute positions:
# learned and sinusoidal)
TIERS = (("nope", "t5"), ("alibi",), ("rope", "learned", "sinusoidal"))


def mean_ranks(s: Summary, names: list[str], reciprocal: bool = False) -> dict[str, float]:
    """Mean over the lengths past training of each encoding's rank (1 = best; tied ones share
    the mean of the places they span; an encoding that cannot run at a length is 0 % there);
    ``reciprocal``: of ``1 / rank`` (the paper's mean reciprocal rank)."""
    total = {e: 0.0 for e in names}
    for n in s.past:
        cells = {e: s.cells[e].get(n) or NOT_RUN for e in names}
        place = 1
        for group in rank_with_ties(cells, higher_is_better=True):
            for e in group:
                rank = place + (len(group) - 1) / 2
                total[e] += 1 / rank if reciprocal else rank
            place += len(group)
    return {e: v / len(s.past) for e, v in total.items()}


def findings(s: Summary, task: str | None) -> list[Finding]:
    """The paper's ordering on one ``kaz-*`` task's run, by mean rank past the training length
    of the healthy encodings that learned the task (>= 90 % at the training length); none for
    other runs, or when fewer than two of the paper's encodings learned it."""
    if s.metric != "accuracy" or not (task or "").startswith("kaz-"):
        return []
    order = [e for tier in TIERS for e in tier]
    names = learned_encodings(s, order)
    if len(names) < 2:
        return []
    ranks = mean_ranks(s, names)
    tier = {e: i for i, t in enumerate(TIERS) for e in t}
    checks = []
    for a in names:
        for b in names:
            if tier[a] < tier[b]:
                agrees = None if ranks[a] == ranks[b] else ranks[a] < ranks[b]
                checks.append(Check((a, b), agrees, (ranks[a], ranks[b])))
    if not checks:
        return []
    na = sorted(e for e in names if any(s.cells[e].get(n) is None for n in s.past))
    left = sorted(set(order) & set(s.cells) - set(names))
    evidence = "mean rank past L={} (1 = best): {}".format(
        s.train_len, ", ".join(f"{e} {ranks[e]:.2f}" for e in sorted(names, key=ranks.get))
    )
    mrr = mean_ranks(s, names, reciprocal=True)
    evidence += "; mean reciprocal rank: " + ", ".join(f"{e} {mrr[e]:.2f}" for e in sorted(names, key=ranks.get))
    if na:
        evidence += f"; n/a past its length limit, ranked as 0 %: {', '.join(na)}"
    if left:
        evidence += f"; left out (failed, diverged or < 90 % at the training length): {', '.join(left)}"
    return [
        Finding(
            "Kazemnejad et al. 2023, Fig. 3",
            "by mean rank past the training length: NoPE ≈ T5 > ALiBi > rotary ≈ APE",
            verdict(checks),
            evidence,
            tuple(checks),
        )
    ]


register_task_defaults("quick", TASKS)
register_findings(findings)
