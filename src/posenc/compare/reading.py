"""The reading of a comparison, computed from its numbers.

:func:`summarize` turns a run's :class:`~posenc.compare.results.RunResults` (one
:class:`~posenc.compare.results.ModelRun` per encoding and seed) into its :class:`Summary`:
intervals per encoding and length, health and convergence. A run is summarised once, in
:func:`posenc.compare.report.write_outputs` (the one call; the console's copy of the table,
printed after :func:`~posenc.compare.compare` returns, is the exception: see
:func:`~posenc.compare.report.results_table`), and that summary is handed to the table, the
figures, ``report.md`` and the reading here: :func:`findings` checks every published result
the run can speak to (the paper studies' own through :func:`register_findings`) and says
whether this run agrees, with the numbers that decide it (a :class:`Finding`);
:func:`caveats` says what the run cannot support. Nothing here is prose about a
particular run: change the numbers and the reading changes
(``tests/test_compare_reading.py`` flips them).

Failed and diverged runs (:func:`~posenc.compare.diagnostics.run_health`: a NaN loss, a
training loss that rose, a loss above chance) are named and left out: an encoding with
such a run is never ranked, read against a finding, counted in the spread or called
converged; its intervals use its healthy seeds (none: its diverged seeds' numbers, shown
only to say how far off they are).

Ties: two measurements that :func:`~posenc.compare.results.tied` cannot tell apart decide
nothing. With several seeds that is overlapping 95 % intervals; with one seed, a
perplexity within 2 % (no interval exists) or accuracies whose Wilson intervals over the
evaluation samples overlap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .diagnostics import finite, run_convergence, run_health, still_improving
from .results import Interval, ModelRun, RunResults, interval, rank_with_ties, tied, untied_within, wilson

__all__ = ["NOT_RUN", "SOLVED", "STUDY_FINDINGS", "Check", "Finding", "Summary", "caveats", "findings", "flagged_text",
           "learned_encodings", "register_findings", "summarize", "train_spread", "verdict"]  # fmt: skip

# Press et al. 2022, Table 2 (WikiText-103, trained at 512): past the training length
# sinusoidal degrades most (20.05 -> 43.54 at ~2x), then rotary (20.07 -> 21.37), then T5
# (19.65 -> 18.79), and ALiBi least (19.73 -> 18.73), flat out to 20x (18.32).
PRESS_ORDER = ("sinusoidal", "rope", "t5", "alibi")
FLAT = 1.05  # "flat": the longest length's perplexity within 5 % of the training length's
# Haviv et al. 2022 (125M, the Pile): NoPos 22.15 against learned 22.04 and sinusoidal 21.49.
COMPETITIVE = 1.05
# Kazemnejad et al. 2023 (decoder-only, synthetic tasks, past the training length): NoPE
# generalises best, then T5's bias, ALiBi, rotary, and absolute positions (APE) worst.
KAZEMNEJAD_ORDER = ("nope", "t5", "alibi", "rope", "sinusoidal", "learned")
SPREAD_LIMIT = 1.15  # non-nope encodings at the training length, max/min (issue 17)
SOLVED = 0.9  # a task is learned at the training length from 90 % exact match
NOT_RUN = Interval(0.0, 0.0, 0.0, 1, "single")  # cannot run at a length: no answer, ranked as 0 %


@dataclass
class Summary:
    """A run's numbers summarised (:func:`summarize`): per encoding and length, the interval of
    the metric over seeds (None: cannot run there, or no finite value); for text also the
    interval of ``ppl(L) / ppl(train_len)`` (``ratios``). ``health``: ``"ok"``, ``"diverged"`` or
    ``"failed"`` (the worst of the encoding's seeds), ``why``: what went wrong (``"diverged:
    training loss rose ..."``, per seed when there are several: ``"seed 1 failed: ..."``).
    ``run_health`` and ``run_convergence``: the diagnostics of each of ``results.runs``, in order."""

    results: RunResults = field(repr=False)
    metric: str
    train_len: int
    lengths: list[int]
    encodings: list[str]
    cells: dict[str, dict[int, Interval | None]] = field(default_factory=dict)
    ratios: dict[str, dict[int, Interval | None]] = field(default_factory=dict)
    depths: dict[str, dict[int, dict[float, Interval]]] = field(default_factory=dict)
    seeds: dict[str, list[int]] = field(default_factory=dict)
    converged: dict[str, bool | None] = field(default_factory=dict)
    health: dict[str, str] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)
    run_health: list[dict[str, str | None]] = field(default_factory=list)
    run_convergence: list[dict[str, Any]] = field(default_factory=list)

    @property
    def task(self) -> str | None:
        return self.results.task

    def runs_of(self, encoding: str) -> list[ModelRun]:
        """The runs (seeds) of ``encoding``, in the results' order."""
        return [r for r in self.results.runs if r.encoding == encoding]

    def convergence_of(self, encoding: str) -> list[dict[str, Any]]:
        """:func:`~posenc.compare.diagnostics.run_convergence` of each run of ``encoding``."""
        return [c for r, c in zip(self.results.runs, self.run_convergence) if r.encoding == encoding]

    @property
    def flagged(self) -> dict[str, str]:
        """The encodings with a failed or diverged run: ``{encoding: "failed" | "diverged"}``."""
        return {e: h for e, h in self.health.items() if h != "ok"}

    @property
    def higher_is_better(self) -> bool:
        return self.metric == "accuracy"

    @property
    def past(self) -> list[int]:
        """The evaluation lengths past the training length."""
        return [n for n in self.lengths if n > self.train_len]

    def at(self, length: int) -> dict[str, Interval]:
        """The healthy encodings that ran at ``length``, with their intervals (failed and
        diverged ones are left out: they are never ranked or read)."""
        return {e: c[length] for e, c in self.cells.items() if c.get(length) is not None and e not in self.flagged}

    def ranking(self, length: int) -> list[list[str]]:
        """Encodings best first at ``length``; tied ones share a rank."""
        return rank_with_ties(self.at(length), higher_is_better=self.higher_is_better)

    def untied(self, length: int, ranks: list[list[str]]) -> list[tuple[str, str]]:
        """The pairs ``(better, worse)`` inside the ranks of :meth:`ranking` at ``length``
        that are not tied themselves (ties chain)."""
        cells = self.at(length)
        return [p for group in ranks for p in untied_within(cells, group, higher_is_better=self.higher_is_better)]


def _accuracy_interval(values: list[float], samples: int) -> Interval:
    """Seeds' interval; for one seed, the Wilson interval over its evaluation samples."""
    return interval(values) if len(values) > 1 else wilson(values[0], samples)


def summarize(results: RunResults) -> Summary:
    """The :class:`Summary` of ``results`` (see the module docstring)."""
    cfg, runs, metric = results.config, results.runs, results.metric
    health, conv = [run_health(r, cfg) for r in runs], [run_convergence(r) for r in runs]
    lengths = sorted({e.length for r in runs for e in r.evals})
    encodings = list(dict.fromkeys(r.encoding for r in runs))
    s = Summary(results, metric, cfg["train_len"], lengths, encodings, run_health=health, run_convergence=conv)
    samples = int(cfg.get("eval_samples") or 1)
    several = len({r.seed for r in runs}) > 1
    for enc in encodings:
        mine = [i for i, r in enumerate(runs) if r.encoding == enc]
        s.seeds[enc] = [runs[i].seed for i in mine]
        states = {health[i]["state"] for i in mine}
        s.health[enc] = "failed" if "failed" in states else "diverged" if "diverged" in states else "ok"
        if s.health[enc] != "ok":
            s.why[enc] = "; ".join((f"seed {runs[i].seed} " if several else "") + f"{health[i]['state']}: "
                                   f"{health[i]['why']}" for i in mine if health[i]["state"] != "ok")  # fmt: skip
        # intervals over the healthy seeds; with none, the diverged ones (failed: no numbers)
        mine = [i for i in mine if health[i]["state"] == "ok"] or [i for i in mine if health[i]["state"] == "diverged"]
        flags = [conv[i].get("converged") for i in mine]
        s.converged[enc] = (
            None if s.health[enc] != "ok" or all(f is None for f in flags) else not any(f is False for f in flags)
        )
        by_len = [{e.length: e for e in runs[i].evals if e.applicable} for i in mine]
        s.cells[enc], s.ratios[enc], s.depths[enc] = {}, {}, {}
        for n in lengths:
            vals = [finite(b[n].value(metric)) for b in by_len if n in b]
            vals = [v for v in vals if v is not None]
            if not vals:
                s.cells[enc][n] = None
            elif metric == "accuracy":
                entries = [b[n] for b in by_len if n in b]
                per_depth: dict[float, list[float]] = {d.depth: [] for e in entries for d in e.depths or []}
                for e in entries:
                    for d in e.depths or []:
                        if finite(d.accuracy) is not None:
                            per_depth[d.depth].append(d.accuracy)
                s.cells[enc][n] = _accuracy_interval(vals, samples * max(1, len(per_depth)))
                s.depths[enc][n] = {d: _accuracy_interval(v, samples) for d, v in per_depth.items() if v}
            else:
                s.cells[enc][n] = interval(vals)
            if metric == "ppl":
                base = s.train_len
                pairs = [(finite(b[n].ppl), finite(b[base].ppl)) for b in by_len if n in b and base in b]
                r = [a / b for a, b in pairs if a is not None and b]
                s.ratios[enc][n] = interval(r) if r else None
    return s


@dataclass(frozen=True)
class Check:
    """One comparison a finding rests on: is ``pair``'s first value above (or below) the second's
    as published (``agrees``; None: tied)? ``length``: where, when the finding spans lengths."""

    pair: tuple[Any, Any]
    agrees: bool | None
    values: tuple[float, float]
    length: int | None = None


@dataclass(frozen=True)
class Finding:
    """A published result read on this run: ``verdict`` ``"agrees"``, ``"disagrees"``, ``"partly"``
    (some comparisons agree, some are reversed) or ``"undecided"`` (every comparison tied)."""

    source: str
    claim: str
    verdict: str
    evidence: str
    checks: tuple[Check, ...] = ()


def _fmt(v: float, metric: str) -> str:
    return f"{100 * v:.1f}%" if metric == "accuracy" else f"{v:.2f}"


def _chain(cells: dict[str, Interval], order: tuple[str, ...], *, first_larger: bool, length: int) -> list[Check]:
    """Adjacent pairs of ``order`` present in ``cells``: does each pair's first value exceed
    (``first_larger``) or fall below the second's? ``agrees`` None: tied."""
    names = [e for e in order if e in cells]
    out = []
    for a, b in zip(names, names[1:]):
        ia, ib = cells[a], cells[b]
        agrees = None if tied(ia, ib) else (ia.mean > ib.mean) == first_larger
        out.append(Check((a, b), agrees, (ia.mean, ib.mean), length))
    return out


def verdict(checks: Sequence[Check]) -> str:
    """``agrees`` when every decided check agrees, ``disagrees`` when none does, ``partly``
    between, ``undecided`` when every check is tied (``agrees`` None)."""
    decided = [c.agrees for c in checks if c.agrees is not None]
    if not decided:
        return "undecided"
    return "agrees" if all(decided) else "disagrees" if not any(decided) else "partly"


def _pair_text(c: Check, fmt) -> str:
    (a, b), (va, vb) = c.pair, c.values
    mark = {True: "as published", False: "reversed", None: "tied"}[c.agrees]
    return f"{a} {fmt(va)} vs {b} {fmt(vb)} ({mark})"


def _ordering(s: Summary, table, order, *, first_larger: bool, fmt, unit: str = "L") -> tuple[str, str, tuple] | None:
    """The ordering ``order`` checked at every length past training; ``unit``: how the lengths
    are named (``L`` tokens, ``n`` a task's problem size)."""
    checks, parts = [], []
    for n in s.past:
        cells = {e: t[n] for e, t in table.items() if t.get(n) is not None}
        pairs = _chain(cells, order, first_larger=first_larger, length=n)
        if pairs:
            checks += pairs
            parts.append(f"{unit}={n}: " + "; ".join(_pair_text(p, fmt) for p in pairs))
    return (verdict(checks), " | ".join(parts), tuple(checks)) if checks else None


def findings(s: Summary) -> list[Finding]:
    """Each published finding the run of ``s`` can speak to, the paper studies' included."""
    out: list[Finding] = []
    task = s.task
    healthy = {e: c for e, c in s.cells.items() if e not in s.flagged}  # failed/diverged: never read
    if s.metric == "ppl" and s.past:
        ratios = {e: c for e, c in s.ratios.items() if e not in s.flagged}
        o = _ordering(s, ratios, PRESS_ORDER, first_larger=True, fmt=lambda v: f"x{v:.2f}")
        if o:
            out.append(Finding("Press et al. 2022, Table 2",
                               "past the training length perplexity grows most for sinusoidal, then rotary, then "
                               "T5, and least for ALiBi (compared: ppl(L) / ppl(train length))",
                               o[0], o[1] + _left_out(s, PRESS_ORDER), o[2]))  # fmt: skip
        far = max(s.past)
        ratio = ratios.get("alibi", {}).get(far)
        if ratio is not None:
            out.append(Finding("Press et al. 2022, Table 2",
                               f"ALiBi stays flat past the training length (here: within {FLAT - 1:.0%} "
                               f"at {far / s.train_len:g}x)",
                               "agrees" if ratio.mean <= FLAT else "disagrees",
                               f"alibi {s.cells['alibi'][s.train_len].mean:.2f} at L={s.train_len} -> "
                               f"{s.cells['alibi'][far].mean:.2f} at L={far} (x{ratio.mean:.3f})"))  # fmt: skip
    if s.metric == "ppl" and s.train_len in s.lengths:
        here = s.at(s.train_len)
        refs = {e: here[e] for e in ("learned", "sinusoidal") if e in here}
        if "nope" in here and refs:
            best = min(refs, key=lambda e: refs[e].mean)
            ratio = here["nope"].mean / refs[best].mean
            out.append(Finding("Haviv et al. 2022",
                               "a causal LM without positions is competitive with absolute positions at the "
                               f"training length (NoPos 22.15 vs learned 22.04 and sinusoidal 21.49 at 125M; "
                               f"here: within {COMPETITIVE - 1:.0%})",
                               "agrees" if ratio <= COMPETITIVE else "disagrees",
                               f"at L={s.train_len}: nope {here['nope'].mean:.2f} vs {best} "
                               f"{refs[best].mean:.2f} (x{ratio:.3f})"))  # fmt: skip
    if s.metric == "accuracy" and task != "passkey" and s.past:
        learned = {e for e, c in healthy.items() if c.get(s.train_len) is not None and c[s.train_len].mean >= SOLVED}
        table = {e: c for e, c in healthy.items() if e in learned}
        o = _ordering(s, table, KAZEMNEJAD_ORDER, first_larger=True, fmt=lambda v: _fmt(v, "accuracy"), unit="n")
        skipped = sorted(set(healthy) & set(KAZEMNEJAD_ORDER) - learned)
        note = f" (left out, not learned at the training length: {', '.join(skipped)})" if skipped else ""
        note += _left_out(s, KAZEMNEJAD_ORDER)
        if o:
            out.append(Finding("Kazemnejad et al. 2023",
                               "past the training length NoPE generalises best, then T5's bias, ALiBi, rotary, "
                               "and absolute positions worst (compared: exact-match accuracy)",
                               o[0], o[1] + note, o[2]))  # fmt: skip
        elif skipped or _left_out(s, KAZEMNEJAD_ORDER):
            ours = sorted(learned & set(KAZEMNEJAD_ORDER))
            why = "fewer than two of its encodings learned the task at the training length"
            if len(ours) >= 2:  # learned, but no length past training where two of them have an answer
                na = [e for e in ours if all(table[e].get(n) is None for n in s.past)]
                why = (f"of the encodings that learned the task at the training length ({', '.join(ours)}), fewer "
                       "than two have an answer at any one length past it"
                       + (f" (n/a past the training length: {', '.join(na)})" if na else ""))  # fmt: skip
            out.append(Finding("Kazemnejad et al. 2023", "the ordering of length generalisation on synthetic tasks",
                               "undecided", why + note))  # fmt: skip
    for study in STUDY_FINDINGS:  # the claims of the task's own paper (posenc.studies)
        out += study(s, task)
    return out


# The readings of each paper study's own claims (posenc.studies registers them):
# ``study(summary, task) -> [finding, ...]``, empty for a run the study cannot speak to.
STUDY_FINDINGS: list[Callable[[Summary, str | None], list[Finding]]] = []


def register_findings(study: Callable[[Summary, str | None], list[Finding]]) -> None:
    """Add ``study(summary, task) -> [finding, ...]`` to what :func:`findings` reads."""
    if study not in STUDY_FINDINGS:
        STUDY_FINDINGS.append(study)


def learned_encodings(s: Summary, names) -> list[str]:
    """The healthy encodings of ``names`` with >= 90 % exact match at the training length."""
    out = []
    for e in names:
        c = s.cells.get(e, {}).get(s.train_len)
        if e in s.cells and e not in s.flagged and c is not None and c.mean >= SOLVED:
            out.append(e)
    return out


def _left_out(s: Summary, order: tuple[str, ...]) -> str:
    """`` (left out, diverged: rope; failed: alibi)`` for the flagged encodings of ``order``."""
    parts = [f"{state}: {', '.join(e for e in order if s.flagged.get(e) == state)}" for state in ("failed", "diverged")
             if any(s.flagged.get(e) == state for e in order)]  # fmt: skip
    return f" (left out, {'; '.join(parts)})" if parts else ""


def flagged_text(s: Summary) -> str | None:
    """``"rope (failed: training loss NaN from step 3), alibi (diverged: ...)"``, or None if every run trained."""
    if not s.flagged:
        return None
    return ", ".join(f"{e} ({s.why[e]})" for e in s.flagged)


def train_spread(s: Summary) -> tuple[float, tuple[str, float], tuple[str, float]] | None:
    """Max/min of the non-nope encodings' perplexity at the training length (None if < 2)."""
    if s.metric != "ppl":
        return None
    cells = {e: i.mean for e, i in s.at(s.train_len).items() if e != "nope"}
    if len(cells) < 2:
        return None
    lo = min(cells.items(), key=lambda kv: kv[1])
    hi = max(cells.items(), key=lambda kv: kv[1])
    return hi[1] / lo[1], lo, hi


def passkey_reach(s: Summary) -> dict[str, int | None]:
    """Per encoding, the longest evaluated length up to which every depth is retrieved with
    >= 90 % exact match (None: not even at the shortest)."""
    out = {}
    for enc, by_len in s.depths.items():
        if enc in s.flagged:
            continue
        reach = None
        for n in s.lengths:
            d = by_len.get(n)
            if not d or min(i.mean for i in d.values()) < SOLVED:
                break
            reach = n
        out[enc] = reach
    return out


def caveats(s: Summary) -> list[str]:
    """What the run of ``s`` cannot support, one sentence each (empty when nothing is amiss)."""
    out = []
    bad = flagged_text(s)
    if bad:
        ext = ", --extend" if s.results.config.get("extend") else ""
        out.append(f"failed or diverged: {bad}; left out of the rankings, the reading, the spread{ext} and the "
                   "intervals (an encoding's interval uses its healthy seeds; with none, a diverged model's numbers "
                   "are shown but are not a trained model's; a lower --lr or --grad-clip may help)")  # fmt: skip
    still = [e for e, c in s.converged.items() if c is False]
    if still:
        details = [f"{enc} ({still_improving(s.convergence_of(enc))})" for enc in still]
        out.append(f"not converged: train longer — {', '.join(details)}; models still improving are compared "
                   "before they reached their quality")  # fmt: skip
    if all(len(v) == 1 for v in s.seeds.values()):
        out.append("one seed: no intervals over seeds; differences of a few percent may be seed noise "
                   "(--seeds 0,1,2 gives 95 % intervals)")  # fmt: skip
    if s.metric == "accuracy":
        weak = [e for e, c in s.cells.items()
                if e not in s.flagged and c.get(s.train_len) is not None and c[s.train_len].mean < SOLVED]  # fmt: skip
        if weak:
            vals = ", ".join(f"{e} {_fmt(s.cells[e][s.train_len].mean, 'accuracy')}" for e in weak)
            out.append(f"not learned at the training length (< {SOLVED:.0%} exact match): {vals}; nothing about "
                       "length generalisation can be read from these")  # fmt: skip
    spread = train_spread(s)
    if spread is not None and spread[0] > SPREAD_LIMIT:
        out.append(f"at the training length the encodings other than nope differ by max/min {spread[0]:.2f} > "
                   f"{SPREAD_LIMIT} ({spread[2][0]} {spread[2][1]:.2f} vs {spread[1][0]} {spread[1][1]:.2f}): "
                   "numbers past it mix quality with extrapolation")  # fmt: skip
    return out
