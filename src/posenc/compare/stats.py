"""Numbers about numbers: intervals over seeds, ties, and rankings with ties.

Pure functions of lists of floats, so the report's reading can be tested by feeding it
numbers.

* :func:`interval` — mean and a 95 % interval over seeds: Student's t with ``n - 1``
  degrees of freedom for ``n >= 3`` seeds, the min–max range for two, none for one.
* :func:`wilson` — the 95 % Wilson score interval of one accuracy measured on ``n``
  samples: with a single seed, the evaluation sample is the only noise we can measure.
* :func:`tied` — whether two measurements cannot be told apart: their intervals overlap,
  or, for single values without an interval, they differ by less than ``rel_tol``.
* :func:`rank_with_ties` — an ordering where tied neighbours share a rank;
  :func:`untied_within` — the pairs of such a rank that are not tied themselves (ties
  chain: a ~ b and b ~ c put a, b and c in one rank when a and c do not overlap).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

__all__ = ["Interval", "interval", "wilson", "t_quantile", "tied", "rank_with_ties", "untied_within", "SINGLE_REL_TOL"]

# One seed gives no interval. Differences below this relative size are then called ties:
# Press et al.'s four encodings sit within 2 % of each other at the training length, and a
# second seed of the old quick preset moved single perplexities by 1-5 %.
SINGLE_REL_TOL = 0.02


@functools.lru_cache(maxsize=64)
def t_quantile(p: float, df: int) -> float:
    """Quantile ``p`` of Student's t with ``df`` degrees of freedom (``0.5 < p < 1``).

    Closed forms for ``df`` 1 and 2; otherwise the CDF (the density integrated by
    Simpson's rule, 2000 panels) inverted by bisection: within 1e-9 of the tables,
    with no SciPy.
    """
    if not 0.5 < p < 1 or not isinstance(df, int) or df < 1:
        raise ValueError(f"need 0.5 < p < 1 and an int df >= 1, got p={p!r}, df={df!r}")
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        a = 2 * p - 1
        return a * math.sqrt(2 / (1 - a * a))
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def density(x: float) -> float:
        return math.exp(log_c - (df + 1) / 2 * math.log1p(x * x / df))

    def mass(t: float, n: int = 2000) -> float:  # P(0 < T < t), Simpson's rule on [0, t]
        h = t / n
        s = density(0.0) + density(t) + sum((4 if i % 2 else 2) * density(i * h) for i in range(1, n))
        return s * h / 3

    lo, hi = 0.0, 1.0
    while mass(hi) < p - 0.5:
        lo, hi = hi, 2 * hi
    for _ in range(45):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mass(mid) < p - 0.5 else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Interval:
    """Mean of ``n`` values and a 95 % interval ``[lo, hi]``.

    ``kind``: ``"t95"`` (Student's t, ``n >= 3``), ``"range"`` (min–max, ``n == 2``),
    ``"wilson"`` (one accuracy on ``n`` samples), ``"single"`` (one value: no interval,
    ``lo == hi == mean``).
    """

    mean: float
    lo: float
    hi: float
    n: int
    kind: str

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2

    @property
    def has_width(self) -> bool:
        return self.kind != "single"

    def overlaps(self, other: Interval) -> bool:
        return self.lo <= other.hi and other.lo <= self.hi

    def to_dict(self) -> dict:
        return asdict(self)


def interval(values: Sequence[float]) -> Interval:
    """Mean and 95 % interval of per-seed values: t (n >= 3), min–max (2), none (1).

    Raises:
        ValueError: no finite value.
    """
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not vals:
        raise ValueError(f"interval needs at least one finite value, got {list(values)!r}")
    n = len(vals)
    mean = sum(vals) / n
    if n == 1:
        return Interval(mean, mean, mean, 1, "single")
    if n == 2:
        return Interval(mean, min(vals), max(vals), 2, "range")
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
    h = t_quantile(0.975, n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - h, mean + h, n, "t95")


def wilson(p: float, n: int, z: float = 1.959964) -> Interval:
    """The 95 % Wilson score interval of a proportion ``p`` measured on ``n`` samples."""
    if not 0 <= p <= 1 or not isinstance(n, int) or n < 1:
        raise ValueError(f"need 0 <= p <= 1 and an int n >= 1, got p={p!r}, n={n!r}")
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return Interval(p, max(0.0, c - h), min(1.0, c + h), n, "wilson")


def tied(a: Interval, b: Interval, rel_tol: float = SINGLE_REL_TOL) -> bool:
    """Whether ``a`` and ``b`` cannot be told apart.

    With intervals on both sides, when they overlap; otherwise (a single value has no
    interval) when the means differ by at most ``rel_tol`` of the smaller magnitude.
    """
    if a.has_width and b.has_width:
        return a.overlaps(b)
    return abs(a.mean - b.mean) <= rel_tol * min(abs(a.mean), abs(b.mean))


def rank_with_ties(
    items: dict[str, Interval], *, higher_is_better: bool = False, rel_tol: float = SINGLE_REL_TOL
) -> list[list[str]]:
    """Names best first, grouped into ranks: a name joins the rank before it when it is
    :func:`tied` with any member of that rank (a difference this run cannot resolve). A rank
    is a chain of ties, so two of its members may themselves differ (:func:`untied_within`)."""
    order = sorted(items, key=lambda k: items[k].mean, reverse=higher_is_better)
    groups: list[list[str]] = []
    for name in order:
        if groups and any(tied(items[name], items[m], rel_tol) for m in groups[-1]):
            groups[-1].append(name)
        else:
            groups.append([name])
    return groups


def untied_within(
    items: dict[str, Interval], group: Sequence[str], *, higher_is_better: bool = False, rel_tol: float = SINGLE_REL_TOL
) -> list[tuple[str, str]]:
    """The pairs ``(better, worse)`` of one :func:`rank_with_ties` rank that are not
    :func:`tied` with each other: the ends of a chain of ties that this run does tell
    apart (kaz-parity at n = 12, two seeds: 73.6 % (60.5-86.7) and 32.8 % (27.0-38.7) share
    a rank through 51.4 % (33.2-69.5), which overlaps both). In ``group``'s order."""
    out = []
    for i, a in enumerate(group):
        for b in group[i + 1 :]:
            if not tied(items[a], items[b], rel_tol):
                better = items[a].mean > items[b].mean if higher_is_better else items[a].mean < items[b].mean
                out.append((a, b) if better else (b, a))
    return out
