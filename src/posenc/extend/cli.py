"""``posenc extend MODEL``: how far a trained checkpoint goes past its training length, per training-free method.

For each method of ``--methods`` at each length of ``--lengths``: perplexity on ``--text``
under the protocols of ``--protocol`` (sliding window, the YaRN paper's; non-overlapping
windows; truncated per document, the YaRN repository's), passkey retrieval by length and
depth, time per token and memory, and what each method ran with (posenc.extend.record).
Writes ``config.json``, ``results.json``, ``results.csv``, ``table.md``, ``ppl.png``,
``passkey.png`` and ``report.md`` to ``--out``, with the guarantees of ``posenc compare``'s
run folders (resumable, atomic writes, removes only what a run listed in its manifest).
``--save DIR --method M --length L`` writes the model under one method as an HF checkpoint
instead (posenc.extend.save). See docs/extend.md.

Examples::

    posenc extend ./my-llama --lengths 1x,2x,4x,8x --out runs/extend-llama
    posenc extend ./my-llama --methods none,yarn,self-extend --lengths 4096,16384 --device cuda --dtype bfloat16
    posenc extend runs/quick --encoding rope --lengths 1x,4x          # a compare run directory
    posenc extend ./my-llama --out runs/extend-llama --resume          # continue an interrupted run
    posenc extend ./my-llama --save out/llama-yarn-4x --method yarn --length 4x   # an HF checkpoint
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from ..fields import SEED, Choice, Float, Int, ListOf, Str

__all__ = ["add_arguments", "run"]

_DTYPES = ("float32", "bfloat16", "float16")
MAX_LENGTH = 1 << 24  # tokens: a longer --lengths entry is refused before any text is read
MAX_TRIALS = 10_000  # --passkey-trials
MAX_WINDOWS = 10_000  # --windows
# The ranges of the flags (posenc.fields; extend's flags have no config field of their own).
# --lengths: the list rule here; each item (N >= 8 tokens or Nx) by posenc.extend.run.parse_lengths.
LENGTHS = ListOf(Str(what="length"), note="each N >= 8 tokens, or Nx: N times the training length")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .evaluate import PROTOCOLS
    from .methods import METHODS

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "examples:" + __doc__.split("Examples::", 1)[1]
    parser.add_argument("model", metavar="MODEL", help="a local HF checkpoint directory, or a compare run directory")
    parser.add_argument("--methods", type=ListOf(Choice(METHODS, what="method"), dedupe=True).parse,
                        default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)} (default: all)")  # fmt: skip
    parser.add_argument("--lengths", type=LENGTHS.parse, default="1x,2x,4x",
                        help="tokens, or multiples of the training length: 1x,2x,4x (default) or 4096,8192")  # fmt: skip
    parser.add_argument("--text", help="UTF-8 text file for perplexity (default: the held-out tenth of posenc's "
                        "embedded corpus, Python's documentation)")  # fmt: skip
    parser.add_argument("--windows", type=Int(1, MAX_WINDOWS).parse, default=4,
                        help="windows of each length the perplexity covers, and documents of the truncated "
                             "protocol (default 4)")  # fmt: skip
    parser.add_argument("--protocol", type=ListOf(Choice(tuple(PROTOCOLS), what="protocol"), dedupe=True).parse,
                        default="sliding,windows", help="perplexity protocols, a column each: sliding (YaRN paper), "
                        "windows (non-overlapping), truncated (the first L tokens of each document, YaRN's "
                        "eval/perplexity.py) (default sliding,windows)")  # fmt: skip
    parser.add_argument("--stride", type=Int(1, MAX_LENGTH).parse,
                        help="sliding-window stride in tokens (default: min(256, L/2))")  # fmt: skip
    parser.add_argument("--chunk", type=Int(1, MAX_LENGTH).parse, default=512,
                        help="tokens per prefill forward call (default 512)")  # fmt: skip
    parser.add_argument("--passkey-trials", type=Int(0, MAX_TRIALS).parse, default=5,
                        help="trials per length and depth; 0: no passkey")  # fmt: skip
    parser.add_argument("--tasks", type=ListOf(Str(what="task"), dedupe=True).parse,
                        help="RULER tasks generated here, as lm-eval names them: niah_single_1, niah_multikey_2, "
                             "niah_multikey_3, niah_multivalue_noise, niah_multiquery_noise, ruler_vt, ruler_cwe, "
                             "ruler_fwe (greedy answers; needs a tokenizer in MODEL)")  # fmt: skip
    parser.add_argument("--task-samples", type=Int(1, MAX_TRIALS).parse, default=20,
                        help="samples per RULER task and length (default 20)")  # fmt: skip
    parser.add_argument("--lm-eval", metavar="TASKS", type=ListOf(Str(what="task"), dedupe=True).parse,
                        help="lm-eval tasks run through its HF backend on each extended model (pip install "
                             "posenc[lmeval])")  # fmt: skip
    parser.add_argument("--lm-eval-limit", type=Int(1, MAX_TRIALS).parse, help="samples per lm-eval task (default all)")
    parser.add_argument("--lm-eval-include", metavar="DIR", help="a folder of lm-eval task yaml files")
    parser.add_argument("--budget", metavar="DURATION",
                        help="time for the run (90s, 20m, 1h): cuts passkey trials, then RULER samples, then windows, "
                             "then widens the stride until the estimate fits; refused before scoring if even the "
                             "least does not")  # fmt: skip
    parser.add_argument("--within", type=Float(0, 1000, lo_open=True, hi_open=True).parse, default=10.0,
                        help="the reading's tolerance: perplexity within this %% of the in-window value (default 10)")  # fmt: skip
    parser.add_argument("--train-len", type=Int(8, MAX_LENGTH).parse,
                        help="the model's training length in tokens (default: its config)")  # fmt: skip
    parser.add_argument("--encoding", help="compare run directory: the encoding whose checkpoint to extend")
    parser.add_argument("--seed", type=SEED.parse, help="compare run directory: the seed of that checkpoint")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N")
    parser.add_argument("--dtype", default="float32", choices=_DTYPES, help="weights and activations (default float32)")
    parser.add_argument("--out", help="output folder (default: runs/<timestamp>-<random>)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out")
    parser.add_argument("--overwrite", action="store_true", help="start over in --out (removes only what a run listed)")
    parser.add_argument("--save", metavar="DIR", help="write the model under --method set for --length as an HF "
                        "checkpoint (stock rope_parameters where HF has the method, else posenc's remote code); "
                        "no evaluation")  # fmt: skip
    parser.add_argument("--method", help="with --save: the one method to save")
    parser.add_argument("--length", help="with --save: the length it is set for (N tokens or Nx)")


# a resumed run must be the same run: the settings, and these fingerprints of what they name
_CHANGED = {"model_fingerprint": "the model's config, weights or tokenizer changed",
            "text_fingerprint": "the text's tokens changed"}  # fmt: skip


def _settings(args, subject, lengths, device, text_fingerprint: str) -> dict[str, Any]:
    from .passkey import Tokens
    from .record import run_record

    tokens = subject.tokenizer is not None and Tokens(subject.tokenizer).name or "bytes (UTF-8, ids 0-255)"
    return {"model": str(Path(args.model).resolve()), "methods": args.methods, "lengths": lengths,
            "train_len": subject.train_len,
            "text": "embedded corpus (held-out last 10 %)" if args.text is None else args.text,
            "tokens_source": tokens, "protocols": args.protocol, "windows": args.windows, "stride": args.stride,
            "chunk": args.chunk,
            "passkey_trials": args.passkey_trials, "encoding": args.encoding, "seed": args.seed,
            "device": str(device), "dtype": args.dtype, "model_fingerprint": subject.fingerprint,
            "text_fingerprint": text_fingerprint,
            **({"budget": args.budget} if args.budget is not None else {}), **_task_settings(args),
            "ran_with": run_record(subject, args.methods, max(lengths), dtype=args.dtype,
                                   device=str(device))}  # fmt: skip


def _task_settings(args) -> dict[str, Any]:
    """``--tasks`` and ``--lm-eval`` (in the settings only when asked: older run folders resume)."""
    out: dict[str, Any] = {}
    if getattr(args, "tasks", None):
        out.update(tasks=args.tasks, task_samples=args.task_samples)
    if getattr(args, "lm_eval", None):
        out.update(lm_eval=args.lm_eval, lm_eval_limit=args.lm_eval_limit, lm_eval_include=args.lm_eval_include)
    return out


def _check_tasks_early(args) -> None:
    """Unknown RULER tasks, a missing lm-eval or --lm-eval-include: refused before the model loads."""
    if getattr(args, "tasks", None):
        from .ruler import check_tasks

        check_tasks(args.tasks)
    include = getattr(args, "lm_eval_include", None)
    if include is not None and not (include.strip() and Path(include).is_dir()):
        raise ValueError(f"--lm-eval-include {include!r} is not a folder; allowed: a folder of lm-eval task yaml files")
    if include is not None and not args.lm_eval:
        raise ValueError(f"--lm-eval-include {include!r} without --lm-eval; allowed: with --lm-eval TASKS")
    if getattr(args, "lm_eval", None):
        from .lmeval import check_lm_eval

        check_lm_eval(args.lm_eval, include)


def _text(args, subject, need: int):
    """The first ``need`` tokens of the text (fewer if it has fewer) and their fingerprint.

    ``--text`` is read only as far as ``need`` tokens take (a prefix, grown until it holds
    them): a file of gigabytes costs what the run uses, never the whole file.
    """
    import hashlib

    import torch

    from ..data import embedded_corpus, read_text
    from .passkey import Tokens

    try:
        tok = Tokens(subject.tokenizer, subject.vocab_size)
    except ValueError as e:
        raise ValueError(f"perplexity: {e}; save a tokenizer in MODEL") from None
    if args.text is None:
        data = embedded_corpus()
        ids = tok.of_bytes(data[len(data) - len(data) // 10 :])
    else:
        size = need if subject.tokenizer is None else 8 * need  # bytes: one a token, or a guess, grown below
        while True:
            data = read_text(args.text, max_bytes=size)
            ids = tok.of_bytes(data)
            if len(ids) >= need or len(data) < size:  # enough, or the whole file
                break
            size *= 4
    ids = ids[:need]
    digest = hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest()[:16]
    return ids, digest


def _check_text_early(args, spec) -> None:
    """``--text`` (or the embedded corpus) is refused before the model loads when it cannot
    hold the longest length: a token is at least one byte (a tokenizer may add one prefix
    token), so its bytes bound its tokens. The exact count is checked again once tokenized."""
    from ..data import embedded_corpus, read_text
    from .model import peek
    from .run import resolve_lengths

    train_len, tokenizer = peek(args.model)
    train_len = args.train_len or train_len
    if train_len is None and any(k == "x" for k, _ in spec):
        return  # the load decides the training length (or refuses the model)
    longest = max(resolve_lengths(spec, train_len or 8))
    if args.text is None:
        data = embedded_corpus()
        size = len(data) // 10
    else:
        read_text(args.text, max_bytes=1)  # exists, a regular file, readable (DataError otherwise)
        size = Path(args.text).stat().st_size
    if size + tokenizer < longest:
        what = f"{size} bytes (at most {size + tokenizer} tokens)" if tokenizer else f"{size} tokens"
        raise ValueError(f"--text: {what}, fewer than the longest length {longest}; allowed: a text of at least "
                         f"{longest} tokens; give a longer --text or shorter --lengths")  # fmt: skip


def _plan(subject, settings, text, done: list[dict], log, chosen: dict | None = None):
    """What the run will score (the cells not in ``done``) and the time it should take, logged
    before any scoring (posenc.extend.plan); with ``--budget``, the settings cut to fit it
    (posenc.extend.budget; ``chosen``: a resumed run's earlier choice, kept).

    Returns ``(plan, settings to run, budget record or None)``.
    """
    from .budget import fit, parse_budget
    from .passkey import Tokens
    from .plan import decode_warm_up, describe_plan, estimate, plan, task_prompts, warm_up

    try:
        tokens = Tokens(subject.tokenizer, subject.vocab_size) if settings["passkey_trials"] else None
    except ValueError:
        tokens = None
    have = {(c["method"], c["length"]) for c in done}
    warm = warm_up(subject, text, settings["chunk"])
    ruler, unfit = task_prompts(subject, settings)  # (one sample per task and length; {} without --tasks)
    if ruler:
        warm = {**warm, **decode_warm_up(subject, text, settings["chunk"])}
    record = None
    if settings.get("budget") is not None:
        limit = parse_budget(settings["budget"])
        if chosen is None:

            def cost(s):
                return estimate(plan(subject, s, len(text), tokens, have, ruler), warm)["estimate_s"]

            got = fit(settings, cost, limit)
            if not got["fits"]:
                least = "1 passkey trial per depth, " + ("1 RULER sample per task, " if ruler else "")
                raise ValueError(f"--budget {settings['budget']}: even the least ({least}1 window per length, every "
                                 f"method and length) is estimated at {got['estimate_s']:.3g} s; allowed: a longer "
                                 "--budget, or fewer --methods or --lengths")  # fmt: skip
            keys = ("passkey_trials", "windows", "stride_factor", *(("task_samples",) if ruler else ()))
            chosen = {k: got["settings"][k] for k in keys}
            record = {"budget": settings["budget"], "budget_s": limit, "chosen": chosen, "cuts": got["cuts"]}
        else:
            record = {"budget": settings["budget"], "budget_s": limit, **chosen}
            chosen = chosen["chosen"]
        settings = {**settings, **chosen}
    p = estimate(plan(subject, settings, len(text), tokens, have, ruler), warm)
    for line in [*unfit, *describe_plan(p)]:
        log(line)
    for cut in (record or {}).get("cuts", []):
        log(f"budget: {cut} to fit --budget {record['budget']}")
    return p, settings, record


def _resumed(out: Path, settings: dict[str, Any]) -> tuple[list[dict], dict | None]:
    """The cells of the run in ``out``, which must have been written with ``settings``, and the
    settings its ``--budget`` chose (kept: a resumed run scores its cells the same way)."""
    old = json.loads((out / "config.json").read_text())
    old.pop("versions", None)  # (recorded, not compared: a resumed run may run under a newer posenc)
    if old != json.loads(json.dumps(settings)):
        diff = [k for k in settings if old.get(k) != json.loads(json.dumps(settings[k]))]
        why = "; ".join(f"{k}: {_CHANGED[k]}" for k in diff if k in _CHANGED)
        raise ValueError(f"--resume: {out / 'config.json'} was written with other settings ({', '.join(diff)}"
                         f"{'; ' + why if why else ''}); rerun with the same ones, or start over with --overwrite")  # fmt: skip
    if (out / "results.json").is_file():
        old = json.loads((out / "results.json").read_text())
        return old.get("cells", []), old.get("budget")
    return [], None


def _check_out(out: Path, model: str) -> None:
    """``--out`` is neither ``MODEL``, inside it, nor around it (an overwrite would remove the model)."""
    a, b = os.path.realpath(out), os.path.realpath(model)
    if os.path.commonpath([a, b]) in (a, b):
        where = "is" if a == b else ("is inside" if os.path.commonpath([a, b]) == b else "contains")
        raise ValueError(f"--out {str(out)!r} {where} MODEL {model!r}; write the run elsewhere")


def run(args: argparse.Namespace) -> int:
    if any(getattr(args, k, None) is not None for k in ("save", "method", "length")):
        from .save import run_save

        return run_save(args)  # (posenc.extend.save: no evaluation)
    import torch

    from ..data import DataError
    from ..output import write_json
    from ..output.rundir import RunDir, default_out
    from .budget import Progress, parse_budget
    from .documents import run_documents
    from .model import load_subject
    from .record import versions
    from .report import FILES, protocol_keys, write_outputs
    from .run import log_stderr, parse_lengths, resolve_lengths, run_cells

    try:
        spec = parse_lengths(",".join(args.lengths))  # (each flag's range: checked as it was parsed)
        if args.out is not None and (not args.out.strip() or "\x00" in args.out):
            raise ValueError(f"--out must name a folder, got {args.out!r}")
        out = Path(args.out or default_out())
        _check_out(out, args.model)
        try:
            device = torch.device(args.device)
        except RuntimeError:
            raise ValueError(f"--device: {args.device!r} is not a device (cpu, cuda, cuda:N)") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: no CUDA device here")
        if args.budget is not None:
            parse_budget(args.budget)  # (refused before the model loads)
        _check_text_early(args, spec)
        _check_tasks_early(args)
        subject = load_subject(args.model, encoding=args.encoding, seed=args.seed, train_len=args.train_len,
                               device=device, dtype=getattr(torch, args.dtype))  # fmt: skip
        lengths = resolve_lengths(spec, subject.train_len)
        if max(lengths) > MAX_LENGTH:
            raise ValueError(f"--lengths: {max(lengths)} tokens; allowed: up to {MAX_LENGTH} tokens")
        if args.stride is not None and args.stride > min(lengths):
            raise ValueError(f"--stride {args.stride} is longer than the shortest length ({min(lengths)} tokens); "
                             f"allowed: 1..{min(lengths)}")  # fmt: skip
        text, text_fp = _text(args, subject, args.windows * max(lengths))
        settings = _settings(args, subject, lengths, device, text_fp)
        text, documents = text.to(device), None
        if "truncated" in args.protocol:  # (posenc.extend.documents: what a document is)
            documents, settings["documents"] = run_documents(args.text, subject, longest=max(lengths),
                                                             count=args.windows)  # fmt: skip
            if not documents:
                raise ValueError(f"--protocol truncated: no document of the text has {max(lengths)} tokens (the "
                                 "longest length); allowed: a text with such documents (see docs/extend.md) or "
                                 "shorter --lengths")  # fmt: skip
            documents = [d.to(device) for d in documents]
        if len(text) < max(lengths):
            raise ValueError(f"--text: {len(text)} tokens, fewer than the longest length {max(lengths)}; allowed: a "
                             f"text of at least {max(lengths)} tokens; give a longer --text or shorter --lengths")  # fmt: skip
        # everything is checked before the folder is claimed: a refused run never touches an --overwrite folder
        with RunDir(out, resume=args.resume, overwrite=args.overwrite, writes=FILES, tool="posenc extend") as rd:
            done, chosen = _resumed(out, settings) if args.resume else ([], None)
            if not args.resume:
                write_json(out / "config.json", {**settings, "versions": versions()})
            base = {}

            def save(cells):
                write_json(out / "results.json", {**base, "cells": cells})

            try:
                plan, settings, budget = _plan(subject, settings, text, done, log_stderr, chosen)
                base = {"tool": "posenc extend", "model": subject.label, "train_len": subject.train_len,
                        "versions": versions(), "settings": settings, "protocols": protocol_keys(settings),
                        "plan": plan, **({"budget": budget} if budget else {})}  # fmt: skip
                cells = run_cells(subject, settings, text, done, save, device=device, log=log_stderr,
                                  progress=Progress(plan, log_stderr), documents=documents)  # fmt: skip
            except BaseException:  # nothing worth resuming yet: leave the folder as it was
                if not args.resume and not (out / "results.json").exists():
                    rd.discard()
                raise
            results = {**base, "cells": cells}
            save(cells)
            command = "posenc " + " ".join(
                shlex.quote(a) for a in getattr(args, "argv", None) or ["extend", args.model]
            )
            with rd.recording():
                tabs = write_outputs(out, results, within=args.within, command=command)
            rd.finish()
    except (ValueError, DataError) as e:
        print(f"posenc extend: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    for t in tabs:
        t.print()
    wrote = [f for f in FILES if f != "config.json" and (out / f).is_file()]
    print(f"wrote {out}/: {', '.join(wrote)}")
    return 0
