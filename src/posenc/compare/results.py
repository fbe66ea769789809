"""A comparison's results, typed: the records of ``results.json`` and the statistics over seeds.

Records, read and written here only (:meth:`Record.from_json`, :meth:`Record.to_json`):
:class:`RunResults` (the run: config dict, fingerprint, runs, ``--extend`` rows, environment),
:class:`ModelRun` (one encoding and seed: size, speed, the training curve, the diagnostics as
:mod:`posenc.compare.diagnostics` writes them, one :class:`Evaluation` per length), and per
length the loss by position (:class:`PositionLoss`) and the task variants (:class:`VariantScore`:
passkey's depths, flip-flop's densities). A record keeps the keys it was read with, in order,
and the keys this version does not know, so a ``results.json`` is written back byte for byte;
numbers are held as the file holds them (NaN and ±inf as None).

Statistics, pure functions of floats: :func:`interval` (95 % over seeds: t for ``n >= 3``,
min–max for two, none for one), :func:`wilson` (one accuracy on ``n`` samples), :func:`tied`,
:func:`rank_with_ties` and :func:`untied_within` (ties chain: a ~ b and b ~ c put a, b and c
in one rank when a and c do not overlap).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

__all__ = ["Evaluation", "ExtendRow", "Interval", "ModelRun", "PositionLoss", "Record", "RunResults", "SINGLE_REL_TOL",
           "ValPoint", "VariantScore", "interval", "load_results", "rank_with_ties", "t_quantile", "tied",
           "untied_within", "wilson"]  # fmt: skip

_META = ("layout", "extra")


def _finite(v: Any) -> Any:
    """``v`` with NaN and ±inf as None (in lists and dicts too), as ``results.json`` holds them."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, (list, dict)):
        return {k: _finite(x) for k, x in v.items()} if isinstance(v, dict) else [_finite(x) for x in v]
    return v


def _encode(v: Any) -> Any:
    return v.to_json() if isinstance(v, Record) else [_encode(x) for x in v] if isinstance(v, (list, tuple)) else v


@dataclass
class Record:
    """A JSON object as a dataclass: a field per key (``JSON``: fields whose key is spelled
    otherwise; ``NESTED``: the record type of fields that hold records or lists of them).
    ``layout``: the keys, in order (empty: every field, less the ``OPTIONAL`` ones that are None);
    ``extra``: keys this version does not know, as read."""

    JSON: ClassVar[dict[str, str]] = {}
    NESTED: ClassVar[dict[str, type[Record]]] = {}
    OPTIONAL: ClassVar[tuple[str, ...]] = ()

    layout: tuple[str, ...] = field(default=(), kw_only=True, repr=False, compare=False)
    extra: dict[str, Any] = field(default_factory=dict, kw_only=True, repr=False)

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name not in _META and f.name not in self.NESTED:
                setattr(self, f.name, _finite(getattr(self, f.name)))

    @classmethod
    def _keys(cls) -> dict[str, str]:
        return {cls.JSON.get(f.name, f.name): f.name for f in fields(cls) if f.name not in _META}

    def _layout(self) -> tuple[str, ...]:
        keys = self._keys().items()
        return self.layout or tuple(k for k, n in keys if n not in self.OPTIONAL or getattr(self, n) is not None)

    def has(self, key: str) -> bool:
        """Whether the object has ``key`` (a record read from a file: whether the file had it)."""
        return key in self._layout()

    def include(self, *names: str) -> None:
        """Add the fields ``names`` to a set ``layout``, after its keys."""
        if self.layout:
            self.layout = tuple(dict.fromkeys((*self.layout, *(self.JSON.get(n, n) for n in names))))

    def to_json(self) -> dict[str, Any]:
        """The JSON object (dicts, lists and numbers), its keys in ``layout`` order."""
        keys = self._keys()
        return {k: self.extra[k] if k in self.extra else _encode(getattr(self, keys[k])) for k in self._layout()}

    @classmethod
    def from_json(cls, d: Any):
        """The record of the JSON object ``d``.

        Raises:
            ValueError: ``d`` is not an object, or lacks a key the record needs.
        """
        if not isinstance(d, dict):
            raise ValueError(f"{cls.__name__}: a JSON object expected, got {type(d).__name__}")
        keys, values, extra = cls._keys(), {}, {}
        for k, v in d.items():
            if k not in keys:
                extra[k] = v
            elif (nested := cls.NESTED.get(keys[k])) is not None and v is not None:
                values[keys[k]] = [nested.from_json(x) for x in v] if isinstance(v, list) else nested.from_json(v)
            else:
                values[keys[k]] = v
        try:
            return cls(**values, layout=tuple(d), extra=extra)
        except TypeError as e:  # a key the record needs is missing
            raise ValueError(f"{cls.__name__}: {str(e).split('__init__() ')[-1]}") from None


@dataclass
class PositionLoss(Record):
    """The mean loss over positions ``[start, end)`` (tokens) of a sequence at one length."""

    start: int
    end: int
    loss: float | None


@dataclass
class VariantScore(Record):
    """Exact match at one task variant: passkey's key depth, flip-flop's p(ignore) (``depth``)."""

    depth: float
    accuracy: float | None


@dataclass
class Evaluation(Record):
    """One model at one evaluation length. Text: ``loss``, ``ppl``, ``bpb``; tasks: ``loss``,
    ``accuracy`` (exact match), ``token_accuracy``, and ``depths`` for a task scored per
    variant (``accuracy``: their mean). ``applicable`` False: the encoding cannot run there
    (``reason``), every metric None."""

    NESTED = {"per_position": PositionLoss, "depths": VariantScore}

    length: int
    applicable: bool = True
    reason: str | None = None
    loss: float | None = None
    ppl: float | None = None
    bpb: float | None = None
    accuracy: float | None = None
    token_accuracy: float | None = None
    depths: list[VariantScore] | None = None
    tokens: int | None = None
    per_position: list[PositionLoss] = field(default_factory=list)

    def value(self, metric: str) -> float | None:
        """``ppl`` or ``accuracy`` (None: not applicable, not finite, or not measured)."""
        return getattr(self, metric)


@dataclass
class ValPoint(Record):
    """The validation at the training length after ``step`` (convergence diagnostics)."""

    OPTIONAL = ("ppl", "accuracy")

    step: int
    loss: float | None
    ppl: float | None = None
    accuracy: float | None = None


@dataclass
class ModelRun(Record):
    """One trained model (encoding and seed). ``convergence``: :func:`~posenc.compare.diagnostics.convergence`'s
    dict as the model finished (read through :func:`~posenc.compare.diagnostics.run_convergence`);
    ``health``: :func:`~posenc.compare.diagnostics.run_health`'s, set when the outputs are written."""

    JSON = {"evals": "eval"}
    NESTED = {"val_curve": ValPoint, "evals": Evaluation}
    OPTIONAL = ("health",)

    encoding: str
    seed: int = 0
    params: int | None = None
    train_seconds: float | None = None
    train_tokens_per_s: float | None = None
    eval_seconds: float | None = None
    final_train_loss: float | None = None
    flops_per_token: float | None = None
    train_flops: float | None = None
    threads: int | None = None
    matmul_peak_flops: float | None = None
    convergence: dict[str, Any] = field(default_factory=dict)
    val_curve: list[ValPoint] | None = None
    train_loss: list[float | None] = field(default_factory=list)
    evals: list[Evaluation] = field(default_factory=list)
    health: dict[str, str | None] | None = None

    def at(self, length: int) -> Evaluation | None:
        return next((e for e in self.evals if e.length == length), None)


@dataclass
class ExtendRow(Record):
    """One trained model under one ``--extend`` method (``options``: the encoding options it set)."""

    JSON = {"evals": "eval"}
    NESTED = {"evals": Evaluation}

    encoding: str
    seed: int
    method: str
    options: dict[str, Any]
    setting: str
    evals: list[Evaluation] = field(default_factory=list)


@dataclass
class RunResults(Record):
    """A whole comparison: ``results.json``. ``config``: :meth:`CompareConfig.to_dict`'s dict;
    ``notes``: the ``"summary"`` object (the table's notes as numbers), set when the outputs
    are written. Read as a mapping (``results["runs"]``) it is that JSON object, for code
    written against the dict :func:`~posenc.compare.compare` returned before it was typed."""

    JSON = {"notes": "summary"}
    NESTED = {"runs": ModelRun, "extend": ExtendRow}
    OPTIONAL = ("fingerprint", "wall_seconds", "device", "processes", "command", "environment", "extend", "notes")

    config: dict[str, Any]
    fingerprint: str | None = None
    runs: list[ModelRun] = field(default_factory=list)
    wall_seconds: float | None = None
    device: str | None = None
    processes: int | None = None
    command: str | None = None
    environment: dict[str, Any] | None = None
    extend: list[ExtendRow] | None = None
    notes: dict[str, Any] | None = None

    @property
    def task(self) -> str | None:
        return self.config.get("task")

    @property
    def metric(self) -> str:  # passkey included
        return "accuracy" if self.task else "ppl"

    def __getitem__(self, key: str) -> Any:
        return self.to_json()[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.to_json().get(key, default)


def load_results(path: str | Path) -> RunResults:
    """The :class:`RunResults` of a ``results.json`` (``path``: the file, or the run folder holding it).

    Raises:
        ValueError: one line naming the file: missing, not JSON, or not a comparison's results.
    """
    p = Path(path)
    p = p / "results.json" if p.is_dir() else p
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"{str(p)!r} not found (is {str(p.parent)!r} a finished run?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        what = "cannot be read" if isinstance(e, OSError) else "is not valid JSON"
        raise ValueError(f"{str(p)!r} {what} ({str(e).splitlines()[0][:200]})") from None
    try:
        return RunResults.from_json(d)
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{str(p)!r} is not a comparison's results ({str(e).splitlines()[0][:200]})") from None


# ------------------------------------------------------------------ statistics over seeds
# One seed gives no interval. Differences below this relative size are then called ties:
# Press et al.'s four encodings sit within 2 % of each other at the training length, and a
# second seed of the old quick preset moved single perplexities by 1-5 %.
SINGLE_REL_TOL = 0.02


@functools.lru_cache(maxsize=64)
def t_quantile(p: float, df: int) -> float:
    """Quantile ``p`` of Student's t with ``df`` degrees of freedom (``0.5 < p < 1``): closed forms
    for ``df`` 1 and 2, else the CDF (Simpson's rule, 2000 panels) inverted by bisection (within
    1e-9 of the tables, with no SciPy)."""
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
    """Mean of ``n`` values and a 95 % interval ``[lo, hi]``. ``kind``: ``"t95"`` (Student's t,
    ``n >= 3``), ``"range"`` (min–max, ``n == 2``), ``"wilson"`` (one accuracy on ``n`` samples),
    ``"single"`` (one value: no interval, ``lo == hi == mean``)."""

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


def interval(values: Sequence[float | None]) -> Interval:
    """Mean and 95 % interval of per-seed values: t (n >= 3), min–max (2), none (1); ValueError
    without a finite value."""
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
    """Whether ``a`` and ``b`` cannot be told apart: with intervals on both sides, when they
    overlap; otherwise (a single value has no interval) when the means differ by at most
    ``rel_tol`` of the smaller magnitude."""
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
