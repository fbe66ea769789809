"""``posenc extend --budget``: the most informative settings whose estimate fits a time, and the
progress lines with the time left.

The estimate is the plan's (posenc.extend.plan: a timed warm-up scaled by the tokens to read).
When the settings asked for do not fit, they are cut in this order, each only as far as needed:

1. passkey trials per depth, down to 1;
2. RULER samples per task and length (``--task-samples``), down to 1;
3. windows per length, down to 2;
4. the sliding protocol's stride, widened (doubled, up to the window: then it is the
   non-overlapping protocol's cost);
5. windows per length, down to 1 (one window is both protocols, so there is no stride to widen:
   that is why the stride is widened before the last window goes).

No method, length or task is ever dropped; when even 1 trial, 1 sample and 1 window do not fit,
the run is refused before any scoring.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from .run import stride_for

__all__ = ["parse_budget", "fit", "describe_cuts", "Progress"]

_UNITS = {"s": 1, "m": 60, "h": 3600}
_FORM = "a positive number followed by s, m or h (e.g. 90s, 20m, 1h)"


def parse_budget(text: str) -> float:
    """``"90s"`` -> 90.0, ``"20m"`` -> 1200.0, ``"1.5h"`` -> 5400.0.

    Raises:
        ValueError: anything else, naming the value and the allowed form.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smh])\s*", str(text))
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--budget: {text!r} is not a duration; allowed: {_FORM}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def fit(settings: dict[str, Any], cost: Callable[[dict[str, Any]], float], budget_s: float) -> dict[str, Any]:
    """The settings to run within ``budget_s`` seconds, ``cost(settings)`` being the estimate.

    Returns ``{"settings", "estimate_s", "cuts", "fits"}``; ``fits`` is False when even the least
    (1 trial per depth, 1 sample per task, 1 window, the widest stride) is estimated over the budget.
    """
    s = {**settings, "stride_factor": settings.get("stride_factor", 1)}

    def ok(**change) -> bool:
        return cost({**s, **change}) <= budget_s

    def most(key: str, lo: int) -> None:  # the largest value in [lo, now] that fits (cost grows with it)
        hi = s[key]
        if hi <= lo or ok() or cost({**s, key: lo}) >= cost(s):  # fits, or cutting it saves nothing
            return
        if not ok(**{key: lo}):
            s[key] = lo
            return
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ok(**{key: mid}) else (lo, mid)
        s[key] = lo

    if settings["passkey_trials"]:
        most("passkey_trials", 1)
    if settings.get("tasks"):
        most("task_samples", 1)
    most("windows", 2)
    widest = max(settings["lengths"])
    while not ok() and s["windows"] > 1 and any(stride_for(s, n) < n for n in settings["lengths"]):
        s["stride_factor"] *= 2
        if s["stride_factor"] > widest:
            break
    most("windows", 1)
    est = cost(s)
    return {"settings": s, "estimate_s": est, "cuts": describe_cuts(settings, s), "fits": est <= budget_s}


def describe_cuts(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """``["passkey trials 5 -> 1", "windows 4 -> 2", "stride 16 -> 32 at L=32"]``: what changed."""
    out = []
    if after["passkey_trials"] != before["passkey_trials"]:
        out.append(f"passkey trials {before['passkey_trials']} -> {after['passkey_trials']} per depth")
    if after.get("task_samples") != before.get("task_samples"):
        out.append(f"RULER samples {before['task_samples']} -> {after['task_samples']} per task and length")
    if after["windows"] != before["windows"]:
        out.append(f"windows {before['windows']} -> {after['windows']} per length")
    if after.get("stride_factor", 1) != before.get("stride_factor", 1) and after["windows"] > 1:
        wide = [f"{stride_for(before, n)} -> {stride_for(after, n)} at L={n}" for n in before["lengths"]
                if stride_for(before, n) != stride_for(after, n)]  # fmt: skip
        out.append("stride " + ", ".join(wide))
    return out


class Progress:
    """One line per finished cell: ``[k/n] method @ length: 1.2 s, about 30 s left``.

    The time left is the plan's estimate of the cells still to run, rescaled by how the measured
    time of the cells done compares with their estimate (the warm-up's rate is only a start).
    """

    def __init__(self, plan: dict[str, Any], log: Callable[[str], None], clock=time.perf_counter):
        self.cost = {(c["method"], c["length"]): c.get("estimate_s", 0) for c in plan["cells"]}
        self.per = 1.0  # measured seconds per estimated second, until a cell is done
        self.log, self.clock = log, clock
        self.k, self.done_cost, self.spent = 0, 0, 0.0
        self.t0 = clock()

    def __call__(self, method: str, length: int) -> None:
        now = self.clock()
        took, self.t0 = now - self.t0, now
        self.k += 1
        self.spent += took
        self.done_cost += self.cost.get((method, length), 0)
        left_cost = sum(self.cost.values()) - self.done_cost
        rate = self.spent / self.done_cost if self.done_cost and self.spent > 0 else self.per
        left = left_cost * rate
        self.log(f"[{self.k}/{len(self.cost)}] {method} @ {length}: {took:.1f} s, about {_short(left)} left")


def _short(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"
