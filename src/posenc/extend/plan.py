"""What ``posenc extend`` will score, counted before any scoring, and a time estimate.

Per (method, length) cell: the windows of each perplexity protocol (the documents of the
truncated one), the tokens every forward call reads (sliding windows overlap: a token is read
by up to ``L / stride`` of them), and the passkey prompts. The estimate times one short
forward of the model as trained (after an untimed one, so lazy set-up is not counted) and
fits a cost per token and a cost per token of context to two warm-up forwards (``n`` and
``4n`` tokens), so a length past the warm-up pays the attention its context costs: a forward
over ``L`` tokens takes ``a·L + b·L²/2`` seconds; ReRoPE and Self-Extend compute two score
maps, DCA three, which cost about one on CPU (the ``maps`` backend: each over its own keys)
and twice or three times the attention elsewhere (:func:`score_maps`).

RULER's tasks (``--tasks``) are counted the same way: one sample of each task at each length is
made before the run (a task that does not fit a length is not counted, and the plan says why),
and each of the cell's samples costs the prefill of that prompt plus its generation budget in
decode steps (every step to the budget: an end-of-sequence token stops earlier, so this is an
upper bound). A decode step is timed in the warm-up (one token a call after a short prefill,
:func:`decode_warm_up`) and pays ``b`` per token of context, like the prefill.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from .evaluate import token_scores
from .methods import applies, method_options
from .passkey import DEPTHS, passkey_ids

__all__ = ["context_share", "plan", "sliding_tokens", "describe_plan", "task_prompts", "decode_warm_up"]

_SCORE_MAPS = {"rerope": 2, "leaky-rerope": 2, "self-extend": 2, "dca": 3}  # q·k maps per layer (else 1)


def score_maps(method: str, device_type: str) -> int:
    """The attention a forward of ``method`` costs, in plain maps: on CPU ``auto`` runs the ``maps``
    backend, each map over only its own keys (about one map in all: docs/bench.md, "Two-map
    extension methods"); elsewhere ``chunked`` scores every map over every key."""
    return 1 if device_type == "cpu" else _SCORE_MAPS.get(method, 1)


def sliding_tokens(span: int, length: int, stride: int) -> tuple[int, int]:
    """``(windows, tokens read)`` of the sliding pass over ``span`` tokens (evaluate.perplexity's loop)."""
    if span <= length:
        return 1, span
    k = math.ceil((span - length) / stride) + 1
    return k, (k - 1) * length + span - (k - 1) * stride


def _device_type(subject) -> str:
    p = next(iter(subject.model.parameters()), None)
    return "cpu" if p is None else p.device.type


def _applies(subject, method: str, longest: int) -> bool:
    if method in ("none", "sink-window"):
        return True
    if not any(applies(method, s["encoding"]) for s in subject.specs):
        return False
    try:
        method_options(method, train_tokens=subject.train_len, longest_tokens=longest, **subject.rope)
    except ValueError:
        return False
    return True


def task_prompts(subject, settings: dict[str, Any]) -> tuple[dict[int, list[tuple[str, int, int]]], list[str]]:
    """``({length: [(task, prompt tokens, generation budget), ...]}, lines)``: one sample of each
    ``--tasks`` task at each length, made as the run makes them, and a line for each task that
    does not fit a length. ``({}, [])`` when the run generates nothing (no tasks, no tokenizer,
    not an HF model: what :func:`posenc.extend.run._tasks` requires)."""
    if not settings.get("tasks") or subject.tokenizer is None or subject.kind != "hf":
        return {}, []
    from .ruler import TASKS, samples
    from .ruler.score import prompt_of

    out: dict[int, list[tuple[str, int, int]]] = {}
    lines = []
    for n in settings["lengths"]:
        out[n] = []
        for task in settings["tasks"]:
            try:
                one = samples(task, subject.tokenizer, n, 1)[0]
            except ValueError as e:
                lines.append(f"plan: {task} @ {n}: not run ({e})")
                continue
            prompt = len(subject.tokenizer(prompt_of(one, TASKS[task].target_delimiter)).input_ids)
            out[n].append((task, prompt, TASKS[task].max_gen_toks))
    return out, lines


def plan(subject, settings: dict[str, Any], text_len: int, tokens, done: set,
         ruler: dict[int, list[tuple[str, int, int]]] | None = None) -> dict[str, Any]:  # fmt: skip
    """The cells still to run, each with its windows, tokens read, passkey prompts and (``ruler``:
    :func:`task_prompts`) RULER samples: ``tasks`` is ``[[prompt tokens, budget, samples], ...]``."""
    from .run import stride_for

    lengths, longest, cells = settings["lengths"], max(settings["lengths"]), []
    for n in lengths:
        for m in settings["methods"]:
            if (m, n) in done:
                continue
            cell: dict[str, Any] = {"method": m, "length": n}
            same = None
            if _applies(subject, m, longest) and m not in ("none", "sink-window"):
                opts = method_options(m, train_tokens=subject.train_len, longest_tokens=longest, **subject.rope)
                same = subject.same_as_none(m, opts, n)
            if not _applies(subject, m, longest) or same:
                cells.append({**cell, "runs": False, "why": same or "not applicable"})
                continue
            n_win = max(1, min(settings["windows"], text_len // n))
            stride = stride_for(settings, n)
            protocols = settings.get("protocols", ("sliding", "windows"))
            docs = (settings.get("documents") or {}).get("count", 0) if "truncated" in protocols else 0
            if n_win == 1 or "sliding" not in protocols or (stride == n and m != "sink-window"):
                slide = (0, 0)  # the windows are both protocols (scored once), or no sliding pass
            elif m == "sink-window":
                slide = (1, n_win * n)
            else:
                slide = sliding_tokens(n_win * n, n, stride)
            prompts = 0
            if tokens is not None and settings["passkey_trials"] and passkey_ids(tokens, n, 0.0, "00000"):
                prompts = settings["passkey_trials"] * len(DEPTHS)
            read = slide[1] + n_win * n + docs * n + prompts * n
            tasks = [] if m == "sink-window" else [[p, g, settings["task_samples"]] for _, p, g in
                                                   (ruler or {}).get(n, [])]  # fmt: skip
            cells.append({**cell, "runs": True, "windows": n_win, "sliding_windows": slide[0], "stride": stride,
                          "sliding": "sliding" in protocols, "documents": docs, "passkey_prompts": prompts,
                          "tokens_read": read, "tasks": tasks, "task_tokens": sum(k * (p + g) for p, g, k in tasks),
                          "maps": score_maps(m, _device_type(subject))})  # fmt: skip
    return {"cells": cells, "tokens_read": sum(c.get("tokens_read", 0) for c in cells),
            "task_tokens": sum(c.get("task_tokens", 0) for c in cells)}  # fmt: skip


@torch.no_grad()
def warm_up(subject, text: torch.Tensor, chunk: int) -> dict[str, float]:
    """Seconds of a short forward of the model as trained, and of one four times as long (both
    within the training length and the text), after an untimed one (lazy set-up): what
    :func:`estimate` fits its cost per token and per token of context to."""
    n = max(2, min(chunk, 512, subject.train_len, len(text)))
    token_scores(subject.kind, subject.model, text[: min(8, n)], chunk=chunk)  # untimed: lazy set-up
    out = {"context_share": context_share(subject)}
    for key, size in (("", n), ("long_", min(4 * n, subject.train_len, len(text)))):
        if key and size <= n:
            break
        t0 = time.perf_counter()
        token_scores(subject.kind, subject.model, text[:size], chunk=chunk)
        out |= {f"{key}tokens": size, f"{key}seconds": time.perf_counter() - t0}
    return out


@torch.no_grad()
def decode_warm_up(subject, text: torch.Tensor, chunk: int, steps: int = 16) -> dict[str, float]:
    """Seconds of one greedy decode step (a token a call on the model's cache, as RULER's answers
    are generated): a greedy run of ``1 + steps`` tokens after a short prefill, less one of 1
    token after the same prefill, over ``steps`` (after an untimed one)."""
    from .ruler.score import greedy

    ids = text[: max(1, min(64, subject.train_len - steps - 1, len(text)))]
    greedy(subject.kind, subject.model, ids[:8], 2, chunk=chunk)  # untimed: lazy set-up
    t0 = time.perf_counter()
    greedy(subject.kind, subject.model, ids, 1, chunk=chunk)
    t1 = time.perf_counter()
    greedy(subject.kind, subject.model, ids, 1 + steps, chunk=chunk)
    t2 = time.perf_counter()
    return {"decode_steps": steps, "step_seconds": max(0.0, (t2 - t1) - (t1 - t0)) / steps}


def context_share(subject) -> float:
    """The attention's FLOPs per token of context over the weights' FLOPs per token: ``4·Σ H·Dh``
    over the layers (``q·k`` and ``p·v``, a multiply and an add each) over ``2·P`` (every parameter
    once, a multiply and an add; the embedding counts as the output projection it is tied to, or
    over-counts, which lowers the share): the least the context can cost at the weights' rate."""
    params = sum(p.numel() for p in subject.model.parameters())
    heads = sum(e.heads * e.head_dim for e in subject.encodings)
    return 4 * heads / (2 * params) if params else 0.0


def rates(warm: dict[str, float]) -> tuple[float, float]:
    """``(a, b)`` of a forward over ``n`` tokens taking ``a·n + b·n²/2`` seconds: ``a`` what a token
    costs (the weights), ``b`` what each token of context adds to it (attention), from the two
    warm-up forwards (``b = 0`` with one, or when the longer one is not slower per token).

    ``b`` is at least ``a`` times ``warm["context_share"]`` (:func:`context_share`: the attention's
    FLOPs at the weights' rate), with ``a`` set so the short forward still takes what it took: a
    warm-up on a busy machine, where the longer forward happened to run faster per token, fits no
    context term and would price a long window at the short one's rate."""
    n1, t1 = warm["tokens"], warm["seconds"]
    n2, t2 = warm.get("long_tokens"), warm.get("long_seconds")
    b = 0.0
    if n2 and n2 > n1:
        b = max(0.0, 2 * (t2 - t1 * n2 / n1) / (n2 * n2 - n1 * n2))
    a = max(t1 / n1 - b * n1 / 2, 0.0)
    share = warm.get("context_share", 0.0)
    if b < a * share:  # (a·n1 + b·n1²/2 = t1 with b = a·share)
        a = t1 / n1 / (1 + share * n1 / 2)
        b = a * share
    return a, b


def estimate(p: dict[str, Any], warm: dict[str, float]) -> dict[str, Any]:
    """The plan with each cell's ``estimate_s`` and their sum: every token read lies in a forward of
    the cell's length (sliding and non-overlapping windows, documents, passkey prompts), whose
    attention is ``maps`` plain maps (:func:`score_maps`); a RULER sample is the
    prefill of its ``p`` prompt tokens and ``g - 1`` decode steps (the first answer token comes
    from the prefill) at ``warm["step_seconds"]`` each plus the attention over their context."""
    a, b = rates(warm)
    step = warm.get("step_seconds", 0.0)
    cells = []
    for c in p["cells"]:
        if c.get("runs"):
            n, read = c["length"], c["tokens_read"]
            maps = c.get("maps", 1)
            gen = sum(k * (a * q + maps * b * q * q / 2 + (g - 1) * step + maps * b * (g - 1) * (q + g / 2))
                      for q, g, k in c.get("tasks", []))  # fmt: skip
            c = {**c, "estimate_s": read / n * (a * n + maps * b * n * n / 2) + gen, "tasks_estimate_s": gen}
        cells.append(c)
    return {
        **p,
        "cells": cells,
        "warmup": warm,
        "rates": (a, b),
        "estimate_s": sum(c.get("estimate_s", 0) for c in cells),
    }


def describe_plan(p: dict[str, Any]) -> list[str]:
    """The lines ``extend`` prints before it starts."""
    out = []
    for c in p["cells"]:
        head = f"{c['method']} @ {c['length']}"
        if not c["runs"]:
            out.append(f"plan: {head}: not run ({c['why']})")
            continue
        slide = (f"{c['windows']} non-overlapping (no sliding pass)" if not c.get("sliding", True) else
                 "the same windows for both protocols" if not c["sliding_windows"] else
                 f"{c['sliding_windows']} sliding (stride {c['stride']}) + {c['windows']} non-overlapping")  # fmt: skip
        if c.get("documents"):
            slide += f" + {c['documents']} document(s) truncated"
        tasks = ""
        if c.get("tasks"):
            k = sum(t[2] for t in c["tasks"])
            tasks = f"; {k} RULER samples ({c['task_tokens']} tokens, prompts and generation budgets)"
        out.append(f"plan: {head}: {c['windows']} window(s) of {c['length']} tokens, {slide}; "
                   f"{c['passkey_prompts']} passkey prompts; {c['tokens_read']} tokens read{tasks}")  # fmt: skip
    w, (a, b) = p["warmup"], p["rates"]
    timed = f"{w['tokens']} tokens in {w['seconds']:.2f} s"
    if "long_tokens" in w:
        timed += f", {w['long_tokens']} in {w['long_seconds']:.2f} s"
    gen = ""
    if p.get("task_tokens"):
        gen = (f", {p['task_tokens']} RULER tokens (prompts and generation budgets; "
               f"decode step {1000 * w.get('step_seconds', 0.0):.2f} ms + the context's attention)")  # fmt: skip
    share = w.get("context_share", 0.0)
    floor = (
        " (the attention's FLOPs at the weights' rate: the warm-up timed less)"
        if share and b <= a * share * (1 + 1e-9)
        else ""
    )
    out.append(f"plan: {p['tokens_read']} tokens read in all{gen}; warm-up {timed}: {1000 * a:.3f} ms per token "
               f"+ {1e6 * b:.3f} µs per token of context{floor}; estimate {_duration(p['estimate_s'])}")  # fmt: skip
    return out


def _duration(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"
