"""``posenc extend --lm-eval TASKS``: lm-eval's Hugging Face backend on the live extended model.

For each method at each length, :func:`lm_eval_scores` wraps the converted-and-extended model
and its tokenizer in lm-eval's ``HFLM`` (``lm_eval.models.huggingface``) with ``max_length``
set to the evaluated length ``L``: lm-eval reads no length from the saved config (which would
be the training length, and silently truncate), and its own rule counts the generation budget
(a context is left-truncated to ``L - max_gen_toks`` tokens, with lm-eval's warning; RULER's
tasks are sized to fit). RULER tasks (lm-eval's ``ruler`` group) are generated at ``L`` with
the model's tokenizer (``metadata``: ``max_seq_lengths=[L]``, ``tokenizer=`` its folder).

The same call from Python::

    from posenc.extend.lmeval import lm_eval_scores
    scores = lm_eval_scores(model, tokenizer, ["ruler_vt"], 8192, limit=20)
    # {"ruler_vt": {"8192,none": 41.0, ...}}

lm-eval is an optional dependency (``pip install posenc[lmeval]``); nothing here downloads,
but a task whose dataset is on the Hub needs it in the local cache (``HF_DATASETS_OFFLINE=1``).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["lm_eval_scores", "check_lm_eval"]


def check_lm_eval(tasks: list[str] | None = None, include: str | None = None) -> None:
    """One line when lm-eval is not installed, or does not know one of ``tasks`` (a task, group or
    tag name, or a yaml file; ``include``: a folder of more), before any model is loaded."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ValueError(
            "--lm-eval: lm-eval is not installed; install it with `pip install posenc[lmeval]` (lm-eval >= 0.4.9)"
        ) from None
    if not tasks:
        return
    from pathlib import Path

    from lm_eval.tasks import TaskManager

    known = set(TaskManager(include_path=include).all_tasks)
    bad = [t for t in tasks if t not in known and not Path(t).is_file()]
    if bad:
        raise ValueError(f"--lm-eval: {', '.join(map(repr, bad))} is not a task lm-eval knows; allowed: a name "
                         "`lm_eval ls tasks` lists, a task yaml file, or one under --lm-eval-include")  # fmt: skip


def lm_eval_scores(model, tokenizer, tasks: list[str], length: int, *, limit: int | None = None,
                   include: str | None = None, batch_size: int = 1) -> dict[str, dict[str, Any]]:  # fmt: skip
    """lm-eval's scores of ``tasks`` on ``model`` at context length ``length``.

    Args:
        model: an HF causal LM (posenc-converted or stock), already on its device.
        tokenizer: its tokenizer.
        tasks: lm-eval task names (or those of yaml files under ``include``).
        length: the context length, lm-eval's ``max_length``.
        limit: samples per task (lm-eval's ``limit``); None: all.
        include: a folder of task yaml files (lm-eval's ``include_path``).

    Returns:
        ``{task: {"metric,filter": value}}``, the numbers of lm-eval's ``results`` (stderr
        that lm-eval does not compute is left out).
    """
    check_lm_eval()
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", max_length=length, batch_size=batch_size)
    meta = {"max_seq_lengths": [length]}
    name = getattr(tokenizer, "name_or_path", "")
    if name:
        meta["tokenizer"] = name  # (RULER's generators read it; a folder extend already checked)
    manager = TaskManager(include_path=include, metadata=meta)  # (simple_evaluate passes metadata only to its own)
    out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), limit=limit, task_manager=manager, log_samples=False,
                                  bootstrap_iters=0)  # fmt: skip
    scores: dict[str, dict[str, Any]] = {}
    for task, res in (out or {}).get("results", {}).items():
        keep = {}
        for k, v in res.items():
            if k == "alias" or not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            if "_stderr" in k and (not math.isfinite(v)):
                continue
            if k.split(",")[0].isdigit() and k.split(",")[0] != str(length):
                continue  # RULER's per-length metrics: -1 ("no sample of this length") at every other length
            keep[k] = float(v)
        scores[task] = keep
    return scores


def _metrics(at: dict) -> list[tuple[str, str]]:
    """Every ``(task, metric)`` the cells hold, stderr left out, in first-seen order."""
    return list(dict.fromkeys((t, k) for c in at.values() for t, r in (c.get("lm_eval") or {}).items()
                              for k in r if "_stderr" not in k))  # fmt: skip


def lm_eval_table(methods: list[str], lengths: list[int], at: dict, train: int):
    """lm-eval's numbers: one row per method, task and metric (``metric,filter`` as lm-eval names it)."""
    from ..output import Column, Table

    keys = _metrics(at)
    if not keys:
        return None
    rows = []
    for m in methods:
        for t, k in keys:
            row = [m, t, k]
            for n in lengths:
                v = ((at.get((m, n), {}).get("lm_eval") or {}).get(t) or {}).get(k)
                row.append("" if v is None else f"{v:.4g}")
            rows.append(row)
    heads = [f"L={n}" + (" (train)" if n == train else "") for n in lengths]
    return Table([Column("method", code=True), Column("task", code=True), Column("metric"),
                  *(Column(h, "right") for h in heads)], rows,
                 title="lm-eval (HF backend on the extended model, max_length = L)")  # fmt: skip


def lm_eval_reading(methods: list[str], lengths: list[int], at: dict) -> list[str]:
    """Per task and metric: which method scores highest at the longest length lm-eval ran."""
    out = []
    for t, k in _metrics(at):
        ran = [n for n in lengths if any(((at.get((m, n), {}).get("lm_eval") or {}).get(t) or {}).get(k) is not None
                                         for m in methods)]  # fmt: skip
        if not ran:
            continue
        n = ran[-1]
        vals = sorted(((at[(m, n)]["lm_eval"][t][k], m) for m in methods
                       if ((at.get((m, n), {}).get("lm_eval") or {}).get(t) or {}).get(k) is not None), reverse=True)  # fmt: skip
        out.append(f"lm-eval `{t}` ({k}) at L={n}: " + ", ".join(f"`{m}` {v:.4g}" for v, m in vals) + ".")
    return out


def lm_eval_rows(cells: list[dict]) -> list[dict]:
    """``results.csv`` rows: one per (method, length, task, metric)."""
    return [{"method": c["method"], "length": c["length"], "setting": f"lm-eval {t} {k}", "lm_eval": v}
            for c in cells for t, r in (c.get("lm_eval") or {}).items() for k, v in r.items()]  # fmt: skip
