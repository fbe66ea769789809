"""The papers' own claims about their own tasks, read from a run's numbers (issue 28).

* Kazemnejad et al. 2023 (``--task kaz-*``): by mean rank over their tasks past the
  training length, NoPE ≈ T5's bias > ALiBi > rotary ≈ absolute positions (APE).
* Golovneva et al. 2024 (``--task count``): CoPE counts far better than absolute or
  relative positions past the training length.
* Liu et al. 2023 (``--task flip-flop``): Transformers' sporadic errors grow on sparse
  strings (p(ignore) = 0.98) and on dense ones (0.1) against the training density (0.8).
* Press et al. 2022, Table 5 (text, evaluated to >= 8x the training length): ALiBi trained
  short keeps improving far past its training length.

Each reading returns ``{"source", "claim", "verdict", "evidence", "checks"}`` as
:func:`posenc.compare.reading.findings` does; ties (:func:`~posenc.compare.stats.tied`)
decide nothing. Called by :func:`~posenc.compare.reading.findings` with its
:class:`~posenc.compare.reading.Summary`.
"""

from __future__ import annotations

from typing import Any

from .stats import Interval, rank_with_ties, tied

__all__ = ["KAZEMNEJAD_TIERS", "paper_findings", "mean_ranks"]

# Kazemnejad et al. 2023, Fig. 3 (mean reciprocal rank over the tasks: NoPE 0.69, T5 0.55,
# ALiBi 0.50, RoPE 0.33, APE 0.22): NoPE and T5 best, ALiBi, then rotary and APE (posenc's
# absolute positions: learned and sinusoidal)
KAZEMNEJAD_TIERS = (("nope", "t5"), ("alibi",), ("rope", "learned", "sinusoidal"))
SOLVED = 0.9  # the task is learned at the training length (reading.SOLVED)
NOT_RUN = Interval(0.0, 0.0, 0.0, 1, "single")  # cannot run at a length: no answer, ranked as 0 %


def _verdict(checks: list[dict[str, Any]]) -> str:
    decided = [c["agrees"] for c in checks if c["agrees"] is not None]
    if not decided:
        return "undecided"
    return "agrees" if all(decided) else "disagrees" if not any(decided) else "partly"


def _learned(s, names) -> list[str]:
    """The healthy encodings of ``names`` with >= 90 % exact match at the training length."""
    out = []
    for e in names:
        c = s.cells.get(e, {}).get(s.train_len)
        if e in s.cells and e not in s.flagged and c is not None and c.mean >= SOLVED:
            out.append(e)
    return out


def mean_ranks(s, names: list[str], reciprocal: bool = False) -> dict[str, float]:
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


def _kazemnejad(s) -> dict[str, Any] | None:
    order = [e for tier in KAZEMNEJAD_TIERS for e in tier]
    names = _learned(s, order)
    if len(names) < 2:
        return None
    ranks = mean_ranks(s, names)
    tier = {e: i for i, t in enumerate(KAZEMNEJAD_TIERS) for e in t}
    checks = []
    for a in names:
        for b in names:
            if tier[a] < tier[b]:
                agrees = None if ranks[a] == ranks[b] else ranks[a] < ranks[b]
                checks.append({"pair": (a, b), "agrees": agrees, "values": (ranks[a], ranks[b])})
    if not checks:
        return None
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
    return {"source": "Kazemnejad et al. 2023, Fig. 3",
            "claim": "by mean rank past the training length: NoPE ≈ T5 > ALiBi > rotary ≈ APE",
            "verdict": _verdict(checks), "evidence": evidence, "checks": checks}  # fmt: skip


def _cope(s) -> dict[str, Any] | None:
    if "cope" not in _learned(s, ["cope"]) or not s.past:
        return None
    others = [e for e in s.cells if e != "cope" and e not in s.flagged]
    checks, parts = [], []
    for n in s.past:
        c = s.cells["cope"].get(n)
        if c is None:
            continue
        for e in others:
            o = s.cells[e].get(n) or NOT_RUN
            agrees = None if tied(c, o) else c.mean > o.mean
            checks.append({"pair": ("cope", e), "agrees": agrees, "values": (c.mean, o.mean), "length": n})
        best = max(others, key=lambda e: (s.cells[e].get(n) or NOT_RUN).mean, default=None)
        if best is not None:
            parts.append(f"n={n}: cope {100 * c.mean:.1f}% vs best other {best} "
                         f"{100 * (s.cells[best].get(n) or NOT_RUN).mean:.1f}%")  # fmt: skip
    if not checks:
        return None
    # "better than every other": a tie does not confirm it (partly), unlike an ordering's ties
    marks = [c["agrees"] for c in checks]
    verdict = ("agrees" if all(m is True for m in marks) else "partly" if any(m is True for m in marks)
               else "disagrees" if any(m is False for m in marks) else "undecided")  # fmt: skip
    return {"source": "Golovneva et al. 2024 (CoPE), counting",
            "claim": "past the training length CoPE counts better than every absolute or relative encoding",
            "verdict": verdict, "evidence": "; ".join(parts), "checks": checks}  # fmt: skip


def _flip_flop(s) -> dict[str, Any] | None:
    checks, parts = [], []
    n = s.train_len
    for e in [e for e in s.cells if e not in s.flagged]:
        d = s.depths.get(e, {}).get(n, {})
        if 0.8 not in d or d[0.8].mean < SOLVED:  # learned: >= 90 % at the training density
            continue
        for p in (0.98, 0.1):
            if p in d:
                agrees = None if tied(d[p], d[0.8]) else d[p].mean < d[0.8].mean
                checks.append({"pair": (e, p), "agrees": agrees, "values": (d[p].mean, d[0.8].mean)})
        parts.append(f"{e}: " + " / ".join(f"{100 * d[p].mean:.1f}%" for p in (0.8, 0.98, 0.1) if p in d))
    if not checks:
        return None
    return {"source": "Liu et al. 2023 (flip-flop)",
            "claim": "at the training length, exact match is lower on sparse (p(ignore) 0.98) and dense (0.1) "
                     "strings than at the training density (0.8)",
            "verdict": _verdict(checks), "evidence": f"at n={n}, p(ignore) 0.8 / 0.98 / 0.1: " + "; ".join(parts),
            "checks": checks}  # fmt: skip


def _press_table5(s) -> dict[str, Any] | None:
    """Press et al. 2022, Table 5: ALiBi trained at 64 keeps improving to 48x (28.46 at 64,
    24.70, 22.88, 22.09, 21.73, 21.53 at 3072): each longer length no worse than the last."""
    cells = s.cells.get("alibi", {})
    lens = [n for n in [s.train_len, *s.past] if cells.get(n) is not None]
    if "alibi" in s.flagged or s.train_len not in lens or max(lens) < 8 * s.train_len:
        return None
    checks = []
    for a, b in zip(lens, lens[1:]):
        agrees = None if tied(cells[a], cells[b]) else cells[b].mean < cells[a].mean
        checks.append({"pair": (a, b), "agrees": agrees, "values": (cells[a].mean, cells[b].mean)})
    evidence = ", ".join(f"{n / s.train_len:g}x {cells[n].mean:.3f}" for n in lens)
    first, last = cells[lens[0]], cells[lens[-1]]
    best = min(lens, key=lambda n: cells[n].mean)
    # the shape: still improving at the longest length (agrees); better than at 1x there but
    # past its lowest (partly); no better than at 1x (disagrees)
    verdict = (
        "disagrees" if tied(first, last) or last.mean >= first.mean else "agrees" if best == lens[-1] else "partly"
    )
    evidence += f" (lowest at {best / s.train_len:g}x; {lens[-1] / s.train_len:g}x is {last.mean / first.mean - 1:+.1%} from 1x)"
    return {"source": "Press et al. 2022, Table 5",
            "claim": "ALiBi trained short keeps improving far past its training length (their L=64 row: "
                     "28.46 -> 21.53 at 48x, every step lower)",
            "verdict": verdict, "evidence": f"alibi ppl at {evidence}", "checks": checks}  # fmt: skip


def paper_findings(s, task: str | None) -> list[dict[str, Any]]:
    """The readings of the claims ``task``'s own paper makes (none for other tasks); for
    text, Press et al.'s Table 5 when the run reaches 8x its training length."""
    if s.metric == "ppl":
        reading = _press_table5(s)
        return [reading] if reading else []
    if s.metric != "accuracy" or task is None:
        return []
    reading = _kazemnejad(s) if task.startswith("kaz-") else _cope(s) if task == "count" else None
    if task == "flip-flop":
        reading = _flip_flop(s)
    return [reading] if reading else []
