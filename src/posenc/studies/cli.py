"""Commands of the paper studies over finished ``posenc compare`` runs; they write nothing.

Examples::

    posenc study kazemnejad-suite runs/kaz-copy runs/kaz-reverse ...
    posenc study answer-errors runs/kaz-copy nope 30 [--seed 0] [--samples K] [--by-category]

``kazemnejad-suite``: Kazemnejad et al. 2023's ordering over their whole suite, from the run
folders of ``--task kaz-*`` runs (one per task; merge a task's shards with ``--merge``
first): the markdown table (mean rank per task and over the suite, mean reciprocal rank) and
the reading (:mod:`posenc.studies.kazemnejad2023.suite`), from each folder's ``results.json``.

``answer-errors``: where one model of a finished ``--task kaz-*`` run goes wrong in its answers
at size N, answer index by answer index (:mod:`posenc.studies.kazemnejad2023.answer_errors`).
It reads the model's checkpoint from RUN/checkpoints (``weights_only``: nothing in it runs)
and prints one row per answer index: the share of samples whose prediction is right, ``</s>``
(the answer stops early), a wrong token from the prompt, or a token from neither, and the
most common of those last tokens with its share. With ``--by-category``, one row per category
of the original builder instead (kaz-lego: the query's place in the chain; kaz-addition: the
digit counts) with its exact match.

A bad argument, a folder without what is needed or a run of another task is one line on
stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json

from ..checkpoint import CheckpointError, load_checkpoint
from ..cli_types import fail, nonempty_path
from ..compare.config import CompareConfig, from_dict
from ..compare.evaluate import not_applicable
from ..compare.reading import summarize
from ..compare.results import load_results
from ..compare.train import checkpoint_path
from ..data import load_source
from ..data.kazemnejad import VOCAB
from ..fields import SEED, Int, declared
from .kazemnejad2023.answer_errors import CLASSES, answer_errors, exact_match_by_category
from .kazemnejad2023.suite import suite_finding, suite_ranks, suite_table_md

__all__ = ["add_arguments", "run", "share"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "examples:" + __doc__.split("Examples::", 1)[1].split("\n\n``kazemnejad-suite``")[0]
    sub = parser.add_subparsers(dest="study", required=True, metavar="COMMAND")
    suite = sub.add_parser(
        "kazemnejad-suite",
        help="Kazemnejad et al. 2023's ordering over the suite, from kaz-* run folders",
        description="Kazemnejad et al. 2023's ordering over their suite: the mean rank of each encoding per task "
        "and over the tasks, from finished `posenc compare --task kaz-*` run folders (one per task).",
    )
    suite.add_argument("runs", nargs="+", type=nonempty_path, metavar="RUN", help="a finished run folder")
    suite.set_defaults(study_command=kazemnejad_suite)
    errors = sub.add_parser(
        "answer-errors",
        help="where one model of a kaz-* run goes wrong in its answers, index by index",
        description="Where one model of a finished `posenc compare --task kaz-*` run goes wrong in its answers "
        "at size N, answer index by answer index (right, </s> too early, a prompt token, another token).",
    )
    errors.add_argument("run", type=nonempty_path, metavar="RUN", help="a finished run folder")
    errors.add_argument("encoding", metavar="ENCODING", help="a model of the run")
    errors.add_argument(
        "n", type=Int().parse, metavar="N", help="the problem size (the task's range: checked with the run)"
    )
    errors.add_argument("--seed", type=SEED.parse, default=0, help="the model's seed (default: 0)")
    samples = declared(CompareConfig)["eval_samples"]  # the range of the run's own --eval-samples
    errors.add_argument("--samples", type=samples.parse, help="test samples (default: the run's --eval-samples)")
    errors.add_argument("--by-category", action="store_true", help="exact match per category of the original builder")
    errors.set_defaults(study_command=answer_errors_command)


def run(args: argparse.Namespace) -> int:
    return args.study_command(args)


def kazemnejad_suite(args: argparse.Namespace) -> int:
    prog = "posenc study kazemnejad-suite"
    summaries = []
    for d in args.runs:
        try:  # one summary per run, as compare's report reads it
            summaries.append(summarize(load_results(d / "results.json")))
        except ValueError as e:
            return fail(prog, str(e))
    try:
        suite = suite_ranks(summaries)
    except ValueError as e:
        return fail(prog, str(e))
    print(suite_table_md(suite))
    f = suite_finding(suite)
    print(
        f"Reading: **{f.verdict}** ({f.evidence})"
        if f
        else "Reading: none (fewer than two of the paper's encodings ranked)"
    )
    return 0


def answer_errors_command(a: argparse.Namespace) -> int:
    prog = "posenc study answer-errors"
    try:
        cfg = from_dict(json.loads((a.run / "config.json").read_text()))
    except (OSError, ValueError, TypeError) as e:
        return fail(prog, f"{str(a.run / 'config.json')!r} cannot be read as a compare run's config ({e})")
    if not (cfg.task or "").startswith("kaz-"):
        return fail(prog, f"the run is of task {cfg.task!r}; this reads runs of --task kaz-*")
    if a.encoding not in cfg.encodings or a.seed not in cfg.seeds:
        return fail(prog, f"encoding {a.encoding!r} seed {a.seed} is not in the run (encodings "
                          f"{', '.join(cfg.encodings)}; seeds {', '.join(map(str, cfg.seeds))})")  # fmt: skip
    source = load_source(task=cfg.task)
    samples = cfg.eval_samples if a.samples is None else a.samples
    top = source.max_size if source.max_size is not None else float("inf")
    if not source.min_size <= a.n <= top:
        sizes = f"in [{source.min_size}, {source.max_size}]" if source.max_size is not None else f">= {source.min_size}"
        return fail(prog, f"n must be {sizes} for {cfg.task}, got n={a.n}")
    path = checkpoint_path(a.run / "checkpoints", cfg, a.encoding, a.seed)
    try:  # weights_only; the model is rebuilt from the checkpoint's own config
        model, extra = load_checkpoint(path)
    except (CheckpointError, OSError) as e:
        return fail(prog, f"{str(path)!r} cannot be read as a checkpoint ({e})")
    if not extra.get("done"):
        return fail(prog, f"{str(path)!r} is a model still in training (step {extra.get('step')})")
    why = not_applicable(model, source.seq_len(a.n))
    if why is not None:
        return fail(prog, f"{a.encoding} cannot run at n={a.n}: {why}")
    try:
        r = (exact_match_by_category if a.by_category else answer_errors)(model, source, a.n, samples)
    except ValueError as e:
        return fail(prog, f"{a.encoding} seed {a.seed}: {e}")
    if a.by_category:
        print(f"{cfg.task}, {a.encoding} seed {a.seed}, n = {a.n}, {r['samples']} samples: exact match by "
              "category (teacher-forced greedy predictions)")  # fmt: skip
        print("| category | samples | exact match |")
        print("|---|---:|---:|")
        for label, c in r["categories"].items():
            print(f"| {label} | {c['samples']} | {c['solved'] / c['samples']:.1%} |")
        return 0
    print(f"{cfg.task}, {a.encoding} seed {a.seed}, n = {a.n}, {r['samples']} samples (teacher-forced greedy "
          "predictions; the last index is the answer's </s>)")  # fmt: skip
    print("| answer index | " + " | ".join(CLASSES) + " | most common other |")
    print("|---:|" + "---:|" * len(CLASSES) + "---|")
    for j, (c, o) in enumerate(zip(r["counts"], r["other_tokens"])):
        total = sum(c.values())
        if o:  # the most frequent; a tie goes to the lower token id
            tok, times = max(o.items(), key=lambda kv: (kv[1], -kv[0]))
            common = f"`{VOCAB[tok]}` ({share(times / total)})"
        else:
            common = "-"
        print(f"| {j + 1} | " + " | ".join(share(c[k] / total) for k in CLASSES) + f" | {common} |")
    return 0


def share(x: float) -> str:
    """A share as a whole percentage that never rounds a nonzero share to 0 % or a partial one to 100 %."""
    text = f"{x:.0%}"
    if x > 0 and text == "0%":
        return "<1%"
    if x < 1 and text == "100%":
        return ">99%"
    return text
