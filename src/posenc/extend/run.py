"""The cells of ``posenc extend``: one per (method, length), run in increasing length.

``results.json`` is rewritten (atomically) after every cell, so an interrupted run resumes
from the cells it has (``--resume``: the settings in ``config.json`` must be the same).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from ..functional import position_limit_reason
from .evaluate import PROTOCOLS, peak_rss_bytes, perplexity, truncated
from .methods import describe
from .model import Subject
from .passkey import DEPTHS, Tokens, passkey_accuracy

__all__ = ["parse_lengths", "resolve_lengths", "run_cells", "default_stride", "stride_for"]


def parse_lengths(text: str) -> list[tuple[str, float]]:
    """``"2x,4x,4096"`` -> ``[("x", 2.0), ("x", 4.0), ("tokens", 4096)]``.

    Raises:
        ValueError: an entry that is neither an int >= 8 nor a multiple ``Nx`` with N > 0.
    """
    out = []
    for part in (p.strip() for p in str(text).split(",")):
        try:
            if part.lower().endswith("x"):
                f = float(part[:-1])
                if not math.isfinite(f) or f <= 0:
                    raise ValueError
                out.append(("x", f))
            else:
                n = int(part)
                if n < 8:
                    raise ValueError
                out.append(("tokens", n))
        except ValueError:
            raise ValueError(
                f"--lengths: {part!r} is not a token count or a multiple of the training length "
                "(allowed: ints >= 8, or Nx with N > 0, comma-separated, e.g. 1x,2x,4x or 4096,8192)"
            ) from None
    if not out:
        raise ValueError("--lengths: no length given (e.g. 1x,2x,4x or 4096,8192)")
    return out


def resolve_lengths(spec: list[tuple[str, float]], train_len: int) -> list[int]:
    """Token counts, sorted, without repeats (a multiple rounds to the nearest token, at least 8)."""
    return sorted({max(8, int(round(v * train_len))) if k == "x" else int(v) for k, v in spec})


def default_stride(length: int) -> int:
    """The YaRN paper's stride, 256 tokens, but at most half the window."""
    return max(1, min(256, length // 2))


def stride_for(settings: dict[str, Any], length: int) -> int:
    """The sliding stride at ``length``: ``--stride`` (or min(256, L/2)), widened by ``--budget``'s
    factor (posenc.extend.budget), at most the window."""
    return min(length, (settings["stride"] or default_stride(length)) * settings.get("stride_factor", 1))


def run_cells(subject: Subject, settings: dict[str, Any], text: torch.Tensor, done: list[dict], save, *,
              device, log=print, progress=None, documents=None) -> list[dict]:  # fmt: skip
    """Every (method, length) cell of ``settings`` not in ``done``; ``save(cells)`` after each, then
    ``progress(method, length)`` (posenc.extend.budget.Progress: the time left). ``documents``: those
    of the truncated protocol (posenc.extend.documents), when ``settings["protocols"]`` has it."""
    protocols = settings.get("protocols", ("sliding", "windows"))
    done_cell = progress or (lambda m, n: None)
    cells = list(done)
    have = {(c["method"], c["length"]) for c in cells}
    lengths, longest = settings["lengths"], max(settings["lengths"])
    tokens, made = None, {}  # made: each (task, length)'s RULER samples, shared by the methods
    if settings["passkey_trials"]:
        try:
            tokens = Tokens(subject.tokenizer, subject.vocab_size)
        except ValueError as e:
            log(f"passkey: not run ({e})")
    for n in lengths:
        for m in settings["methods"]:
            if (m, n) in have:
                continue
            model, opts, why = subject.variant(m, longest)
            if model is not None and m != "sink-window":  # (sink-window's positions stay inside its cache)
                why = position_limit_reason(subject.encodings, n)  # a learned table ends where it was trained
                model = None if why else model
            cell: dict[str, Any] = {"method": m, "length": n, "options": opts, "setting": describe(m, opts)}
            if model is None:
                cells.append({**cell, "setting": "n/a", "applicable": False, "why": why})
                log(f"{m} @ {n}: not applicable ({why})")
                save(cells)
                done_cell(m, n)
                continue
            same = subject.same_as_none(m, opts, n) if m != "none" else None
            if same:  # (an identity setting: not scored again; the table shows "= none")
                cells.append({**cell, "applicable": False, "same_as_none": True, "why": same})
                log(f"{m} @ {n}: not run ({same})")
                save(cells)
                done_cell(m, n)
                continue
            sink = opts if m == "sink-window" else None
            if torch.cuda.is_available() and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            stride = stride_for(settings, n)
            ppl = perplexity(subject.kind, model, text, n, stride=stride, windows=settings["windows"],
                             chunk=settings["chunk"], sink=sink, sliding="sliding" in protocols)  # fmt: skip
            if "truncated" in protocols:
                ppl.update(
                    truncated(subject.kind, model, documents or [], length=n, chunk=settings["chunk"], sink=sink)
                )
            pk = None
            if tokens is not None:
                pk = passkey_accuracy(subject.kind, model, tokens, n, trials=settings["passkey_trials"],
                                      chunk=settings["chunk"], device=device, sink=sink, depths=DEPTHS)  # fmt: skip
            cell.update(applicable=True, **ppl, passkey=pk)
            cell.update(_tasks(subject, model, settings, n, sink, device, made, log))
            cell["rss_peak_bytes"] = peak_rss_bytes()
            if device.type == "cuda":
                cell["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device)
            cells.append(cell)
            shown = ", ".join(f"{'NaN/inf' if cell.get(k) is None else format(cell[k], '.3f')} ({label}"
                              + (f", stride {stride})" if p == "sliding" else ")")
                              for p, (k, label) in PROTOCOLS.items() if p in protocols)  # fmt: skip
            log(f"{m} @ {n}: ppl {shown}, {cell['ms_per_token']:.2f} ms/token")
            save(cells)
            done_cell(m, n)
            del model
    return cells


def _tasks(subject: Subject, model, settings: dict[str, Any], n: int, sink, device, made: dict, log) -> dict:
    """``{"ruler": ...}`` and ``{"lm_eval": ...}`` of one cell, for ``--tasks`` and ``--lm-eval``
    (greedy generation: a tokenizer in MODEL; not under sink-window's cache policy)."""
    out: dict[str, Any] = {}
    if not (settings.get("tasks") or settings.get("lm_eval")):
        return out
    if subject.tokenizer is None or subject.kind != "hf" or sink is not None:
        why = ("sink-window: generation under its cache policy is not implemented" if sink is not None
               else "no tokenizer in MODEL (RULER sizes prompts in the model's tokens)")  # fmt: skip
        log(f"tasks @ {n}: not run ({why})")
        return {"tasks_why": why}
    if settings.get("tasks"):
        from .ruler.score import ruler_cell

        out["ruler"] = ruler_cell(subject.kind, model, subject.tokenizer, settings["tasks"], n,
                                  settings["task_samples"], chunk=settings["chunk"], device=device, made=made)  # fmt: skip
    if settings.get("lm_eval"):
        from .lmeval import lm_eval_scores

        out["lm_eval"] = lm_eval_scores(model, subject.tokenizer, settings["lm_eval"], n,
                                        limit=settings.get("lm_eval_limit"), include=settings.get("lm_eval_include"))  # fmt: skip
    return out


def log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
