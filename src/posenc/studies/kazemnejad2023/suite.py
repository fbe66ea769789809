"""Kazemnejad et al. 2023's claim over their suite, from the finished runs of several tasks.

Their Fig. 3 ranks the encodings on each task past the training length and reports the
mean reciprocal rank over the tasks (NoPE 0.69, T5 0.55, ALiBi 0.50, RoPE 0.33, APE 0.22).
One ``--task kaz-*`` run speaks for one task (:func:`posenc.studies.kazemnejad2023.findings`); this
module joins the summaries of runs of different tasks:

* a task counts when at least one healthy encoding learned it (>= 90 % exact match at the
  training length), two or more healthy encodings ran it, and they do not all tie at every
  length past the training length; otherwise it is listed as skipped, with why (a task no
  encoding learned ranks nothing but noise; one where all tie, e.g. all at 0 %, ranks nothing);
* on a counted task every healthy encoding is ranked at every length past the training
  length (1 = best; encodings whose intervals overlap share the mean of the places they
  span; one that cannot run at a length is 0 % there), as the per-task reading does, but
  without leaving out the encodings that did not learn the task: the paper ranks every model;
* an encoding's suite rank is the mean over every (task, length) cell it was ranked in,
  and its mean reciprocal rank the mean of ``1 / rank`` over the same cells;
* encodings still improving when training stopped (the convergence check) are named per
  counted task in the reading's evidence: their ranks are those of unfinished models.

``posenc study kazemnejad-suite RUN ...`` prints the table and the reading
(docs/studies/kazemnejad2023.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ...compare.reading import NOT_RUN, SOLVED, Check, Finding, Summary, verdict
from ...compare.results import rank_with_ties
from . import TIERS

__all__ = ["Suite", "TaskRanks", "suite_ranks", "suite_finding", "suite_table_md"]


@dataclass
class TaskRanks:
    """One task's ranks: per healthy encoding, its rank at each length past the training length
    (``ranks``; empty when the task is ``skipped``, with why); ``left_out``: the failed or
    diverged encodings, with why; ``unconverged``: the encodings still improving."""

    task: str
    train_len: int
    past: list[int]
    learned: list[str]
    left_out: dict[str, str]
    unconverged: list[str]
    ranks: dict[str, list[float]] = field(default_factory=dict)
    skipped: str | None = None


@dataclass
class Suite:
    """The suite's ranks: ``tasks`` (one :class:`TaskRanks` each), and per encoding its mean
    rank (``rank``), mean reciprocal rank (``mrr``) and the (task, length) cells it was ranked in."""

    tasks: list[TaskRanks]
    rank: dict[str, float]
    mrr: dict[str, float]
    cells: dict[str, int]


def _task_ranks(s: Summary) -> TaskRanks:
    """One task's ranks, from its run's summary."""
    names = [e for e in s.encodings if e not in s.flagged]
    learned = [e for e in names if (c := s.cells[e].get(s.train_len)) is not None and c.mean >= SOLVED]
    out = TaskRanks(s.task or "", s.train_len, list(s.past), learned, {e: s.why.get(e, s.flagged[e]) for e in s.flagged},
                    [e for e in names if s.converged.get(e) is False])  # fmt: skip
    if not s.past:
        out.skipped = f"no evaluation length past n={s.train_len}"
    elif not learned:
        out.skipped = f"no encoding reached {SOLVED:.0%} exact match at n={s.train_len}"
    elif len(names) < 2:
        out.skipped = "fewer than two healthy encodings"
    if out.skipped:
        return out
    ranks: dict[str, list[float]] = {e: [] for e in names}
    for n in s.past:
        place = 1
        for group in rank_with_ties({e: s.cells[e].get(n) or NOT_RUN for e in names}, higher_is_better=True):
            for e in group:
                ranks[e].append(place + (len(group) - 1) / 2)
            place += len(group)
    if all(len(set(col)) == 1 for col in zip(*ranks.values())):
        out.skipped = f"every encoding ties at every length past n={s.train_len}"
        return out
    out.ranks = ranks
    return out


def suite_ranks(summaries: Sequence[Summary]) -> Suite:
    """The suite's ranks from the summaries of ``kaz-*`` runs (:func:`posenc.compare.reading.summarize`),
    one per task.

    Raises:
        ValueError: a run is not of a ``kaz-*`` task, or two runs are of the same task.
    """
    tasks = [s.task or "" for s in summaries]
    bad = [t for t in tasks if not t.startswith("kaz-")]
    if bad:
        raise ValueError(f"the suite joins runs of Kazemnejad et al.'s tasks (--task kaz-*), got task {bad[0]!r}")
    dup = sorted({t for t in tasks if tasks.count(t) > 1})
    if dup:
        raise ValueError(f"one run per task: {dup[0]!r} is given {tasks.count(dup[0])} times (merge its shards first)")
    per = [_task_ranks(s) for s in summaries]
    cells: dict[str, list[float]] = {}
    for t in per:
        for e, rs in t.ranks.items():
            cells.setdefault(e, []).extend(rs)
    return Suite(
        per,
        {e: sum(v) / len(v) for e, v in cells.items()},
        {e: sum(1 / r for r in v) / len(v) for e, v in cells.items()},
        {e: len(v) for e, v in cells.items()},
    )


def suite_finding(suite: Suite) -> Finding | None:
    """The paper's ordering checked on the suite's mean ranks, as a finding
    (``agrees``/``partly``/``disagrees``/``undecided``); None when fewer than two of the
    paper's encodings were ranked."""
    tier = {e: i for i, t in enumerate(TIERS) for e in t}
    rank = suite.rank
    names = sorted((e for e in rank if e in tier), key=rank.get)
    checks = []
    for a in names:
        for b in names:
            if tier[a] < tier[b]:
                agrees = None if abs(rank[a] - rank[b]) < 1e-9 else rank[a] < rank[b]
                checks.append(Check((a, b), agrees, (rank[a], rank[b])))
    if not checks:
        return None
    counted = [t.task for t in suite.tasks if not t.skipped]
    evidence = (f"mean rank over {len(counted)} task(s) ({', '.join(counted) or 'none'}), past the training "
                "length (1 = best): " + ", ".join(f"{e} {rank[e]:.2f}" for e in names)
                + "; mean reciprocal rank: " + ", ".join(f"{e} {suite.mrr[e]:.2f}" for e in names))  # fmt: skip
    still = [f"{t.task}: {', '.join(t.unconverged)}" for t in suite.tasks if not t.skipped and t.unconverged]
    if still:
        evidence += "; still improving when training stopped (ranked unfinished): " + "; ".join(still)
    skipped = [f"{t.task} ({t.skipped})" for t in suite.tasks if t.skipped]
    if skipped:
        evidence += "; not counted: " + "; ".join(skipped)
    return Finding(
        "Kazemnejad et al. 2023, Fig. 3 (over the suite)",
        "by mean rank over the tasks past the training length: NoPE ≈ T5 > ALiBi > rotary ≈ APE",
        verdict(checks),
        evidence,
        tuple(checks),
    )


def suite_table_md(suite: Suite) -> str:
    """A markdown table: one row per encoding, its mean rank on each counted task, then over
    the suite (rank and reciprocal rank); the skipped tasks below it."""
    counted = [t for t in suite.tasks if not t.skipped]
    encs = sorted(suite.rank, key=suite.rank.get)
    head = ["encoding", *(f"`{t.task}`" for t in counted), "suite rank", "suite MRR"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for e in encs:
        row = [f"`{e}`"]
        for t in counted:
            rs = t.ranks.get(e)
            row.append(f"{sum(rs) / len(rs):.2f}" if rs else "—")
        row += [f"{suite.rank[e]:.2f}", f"{suite.mrr[e]:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    for t in suite.tasks:
        if t.skipped:
            lines.append(f"\n`{t.task}` not counted: {t.skipped}.")
        for e, why in t.left_out.items():
            lines.append(f"\n`{t.task}`: `{e}` left out ({why}).")
    return "\n".join(lines) + "\n"
