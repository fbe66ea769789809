"""Greedy answers to RULER's samples and RULER's score of them, on the model ``extend`` runs.

The prompt is lm-eval's without a chat template: the sample's ``input``, the task's target
delimiter where neither side has whitespace at the join, then the ``gen_prefix`` (lm-eval
``build_qa_turn``). The answer is greedy decoding of up to the task's ``max_gen_toks`` tokens,
stopped at the tokenizer's end-of-sequence token, prefilled in chunks of ``chunk`` tokens into
the model's cache (as every other ``extend`` measurement), then one token a call. It is
decoded and cleaned as lm-eval's ``postprocess_pred`` (control characters to newlines,
stripped) and scored by ``string_match_all``: the share of the references found in it,
case-insensitive. A task's score at a length is the mean over its samples, in percent.
"""

from __future__ import annotations

import re

import torch

from . import TASKS, samples

__all__ = ["prompt_of", "postprocess", "string_match_all", "greedy", "task_score", "ruler_cell"]


def prompt_of(sample: dict, delimiter: str = " ") -> str:
    """lm-eval's context for a sample (no chat template)."""
    q, prefix = sample["input"], sample["gen_prefix"]
    joined = q and not (q[-1].isspace() or prefix[0].isspace())
    return q + (delimiter if joined else "") + prefix


def postprocess(text: str) -> str:
    return re.sub(r"[\x00-\x1f]", "\n", text.strip()).strip()


def string_match_all(pred: str, refs: list[str]) -> float:
    """RULER's metric for one sample: the share of ``refs`` found in ``pred`` (case-insensitive)."""
    return sum(r.lower() in pred.lower() for r in refs) / len(refs)


@torch.no_grad()
def greedy(kind: str, model, ids: torch.Tensor, max_new: int, *, chunk: int, eos: int | None = None) -> list[int]:
    """Greedy continuation of ``ids`` ``(n,)``: up to ``max_new`` tokens, stopped after ``eos``
    (not included). ``kind``: ``"hf"`` (an HF model, its ``DynamicCache``) or ``"run"`` (posenc's
    ``TransformerLM`` and its cache)."""
    n = ids.shape[-1]
    if kind == "hf":
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)

        def step(x):
            return model(input_ids=x[None], cache=cache, use_cache=True).logits[0, -1]
    else:
        p = next(model.parameters())
        cache = model.init_cache(1, n + max_new, dtype=p.dtype, device=p.device)

        def step(x):
            return model(x[None], cache=cache)[0, -1]

    for s in range(0, n, chunk):
        logits = step(ids[s : s + chunk])
    out: list[int] = []
    while len(out) < max_new:
        t = int(logits.argmax())
        if eos is not None and t == eos:
            break
        out.append(t)
        if len(out) < max_new:
            logits = step(torch.tensor([t], device=ids.device))
    return out


def task_score(kind: str, model, tokenizer, task: str, length: int, n: int, *, chunk: int, device,
               made: list[dict] | None = None) -> dict:  # fmt: skip
    """``{"score": percent, "samples": k, "max_gen_toks": m}``: ``task`` at ``length``, ``n`` samples
    (``made``: samples generated before, e.g. shared by the methods of one length)."""
    spec = TASKS[task]
    made = made if made is not None else samples(task, tokenizer, length, n)
    eos = tokenizer.eos_token_id
    total = 0.0
    for s in made:
        ids = torch.tensor(tokenizer(prompt_of(s, spec.target_delimiter)).input_ids, device=device)
        out = greedy(kind, model, ids, spec.max_gen_toks, chunk=chunk, eos=eos)
        total += string_match_all(postprocess(tokenizer.decode(out, skip_special_tokens=True)), s["outputs"])
    return {"score": 100 * total / len(made), "samples": len(made), "max_gen_toks": spec.max_gen_toks}


def ruler_cell(kind: str, model, tokenizer, tasks: list[str], length: int, n: int, *, chunk: int, device,
               made: dict) -> dict[str, dict]:  # fmt: skip
    """``{task: {"score", "samples", "max_gen_toks"} or {"score": None, "why"}}`` at ``length``;
    ``made`` keeps each ``(task, length)``'s samples for the next method (the same prompts for all)."""
    out = {}
    for task in tasks:
        key = (task, length)
        if key not in made:
            try:
                made[key] = samples(task, tokenizer, length, n)
            except ValueError as e:
                made[key] = str(e)
        if isinstance(made[key], str):
            out[task] = {"score": None, "why": made[key]}
            continue
        out[task] = task_score(kind, model, tokenizer, task, length, n, chunk=chunk, device=device, made=made[key])
    return out
