"""Measure and draw the properties papers argue about: decompose, invariance, similarity, decay, padding-probe, attention-maps.

Each subcommand prints a short table and writes ``<out>/<name>.json`` and
``<out>/<name>.png``; ``posenc analyze all --out DIR`` runs every one of them (this is
how ``docs/figures`` is made). Encodings are given as ``name`` or ``name@{json options}``
(``rope@{"base": 500000}``), separated by commas or spaces as ``compare --encodings``
takes them; an unknown name is an error (exit 2) listing the registered ones. Trained models come from ``--checkpoint`` (a ``.pt`` saved by ``posenc compare`` or
a run directory holding ``checkpoints/*.pt``) or from ``--train-steps N``, which trains a
tiny LM per encoding on repeated random blocks.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

import torch

from ..output import OutputFolder, Table, write_json
from .flags import MAX_LEN, MAX_MAP, SUBCOMMANDS, TRAIN_STEPS, add_arguments, check_flags

__all__ = ["COMMANDS", "DEFAULTS", "SUBCOMMANDS", "add_arguments", "run"]
from .models import Subject, build_subjects, load_subjects, tiny_checkpoints
from .specs import Spec, resolve, split_specs

# Each analysis' encodings when --encodings is not given ("all": every registered one).
DEFAULTS = {
    "decompose": "learned sinusoidal hierarchical multiplicative floater recurrent complex-order conv rope xpos t5 "
    "alibi kerple fire cope tupe shaw xl deberta nope all".split(),
    "invariance": ["all"],
    "similarity": "sinusoidal learned hierarchical multiplicative floater recurrent complex-order conv rope xpos t5 "
    "alibi kerple fire shaw xl deberta tupe".split(),
    "decay": [
        "rope",
        'rope@{"base": 500000}',
        'rope@{"rope_scaling": {"rope_type": "linear", "factor": 4.0}}',
        'rope@{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}',
        *"xpos alibi t5 kerple fire nope".split(),
    ],
    "attention-maps": "nope learned sinusoidal rope xpos alibi t5 kerple fire shaw xl".split(),
}


# ============================================================================ subjects
def _subjects(args, name: str, notes: list[str], *, random=True, **build_kw) -> list[Subject]:
    try:
        specs, more = resolve(args.encodings or DEFAULTS[name])
        strict = _named(args)
    except ValueError as e:  # an unknown name, options that are not a JSON object
        raise ValueError(f"--encodings: {e}") from None
    notes.extend(more)
    max_len = args.max_len or MAX_LEN
    if random:
        subjects = build_subjects(specs, notes, max_len=max_len, seed=args.seed, strict=strict, **build_kw)
    else:  # the named ones must build before any training starts
        build_subjects([s for s in specs if s.label in strict], [], max_len=max_len, seed=args.seed, strict=strict)
        subjects = []
    subjects += load_subjects(_checkpoints(args, specs, notes, strict), notes)
    if not subjects:
        why = f" ({notes[-1]})" if notes else ""
        raise ValueError(f"nothing to analyse: no model could be built, loaded or trained{why}")
    return subjects


def _named(args) -> set[str]:
    """Labels of the encodings the user named in --encodings (not through "all" or a default):
    one that cannot be built is an error, not a note."""
    return {Spec.parse(t).label for t in split_specs(args.encodings or []) if t != "all"}


def _checkpoints(args, specs: list[Spec], notes: list[str], strict=()) -> list[str]:
    paths = [str(p) for p in args.checkpoint]
    if args.train_steps:
        if args.train_dir is None:
            args.train_dir = Path(tempfile.mkdtemp(prefix="posenc-analyze-"))
        paths += tiny_checkpoints(
            specs, args.train_dir, notes, steps=args.train_steps, length=getattr(args, "train_len", 32), strict=strict
        )
    return paths


def _check_layer(subjects: list[Subject], layer: int) -> None:
    for sub in subjects:
        depth = sub.model.depth
        if not -depth <= layer < depth:
            raise ValueError(f"--layer {layer}: {sub.label} has {depth} layers (allowed {-depth}..{depth - 1})")


def _report(args, name: str, results, notes: list[str], plot, table: Table) -> int:
    """Print the summary ``table`` and the notes; write ``<name>.json`` and ``<name>.png``."""
    table.notes = notes
    table.print()
    command = "posenc analyze " + " ".join(shlex.quote(a) for a in getattr(args, "_argv", []) or [name])
    data = {"analysis": name, "command": command, "notes": notes, "results": results}
    write_json(args.out / f"{name}.json", data, digits=7)  # float32 values: 7 significant digits
    if results:
        plot(results, args.out / f"{name}.png", subtitle=_subtitle(args, name, results))
    print(f"wrote {args.out / name}.json" + (f" and {args.out / name}.png" if results else " (nothing to plot)"))
    return 0


def _subtitle(args, name: str, results: list[dict]) -> str:
    """The run in one line: the analysis, its seed, and which models (random, trained)."""
    parts = [f"posenc analyze {name}", f"seed {args.seed}"]
    sources = [r.get("source") for r in results if "source" in r]
    n_random = sum(s == "random" for s in sources)
    if n_random:
        parts.append(f"{n_random} random-weight models")
    if len(sources) > n_random:
        parts.append(f"{len(sources) - n_random} trained checkpoints")
    for flag in ("length", "layer"):
        if getattr(args, flag, None) is not None:
            parts.append(f"--{flag} {getattr(args, flag)}")
    return ", ".join(parts)


def _tag(s: str) -> str:
    return "random" if s == "random" else "trained"


# ============================================================================ commands
def cmd_decompose(args) -> int:
    from .decompose import TERM_ORDER, plot_decompose, run_decompose

    notes: list[str] = []
    subjects = _subjects(args, "decompose", notes)
    _check_layer(subjects, args.layer)
    res = run_decompose(subjects, length=args.length, layer=args.layer, seed=args.seed)
    cols = [t for t in TERM_ORDER if any(t in r["shares"] for r in res)]
    rows = [[r["label"], _tag(r["source"]), *[r["shares"].get(t, "") for t in cols]] for r in res]
    table = Table(["model", "", *cols], rows, title=f"decompose: variance share of each term (layer {args.layer})")
    return _report(args, "decompose", res, notes, plot_decompose, table)


def cmd_invariance(args) -> int:
    from .invariance import plot_invariance, run_invariance

    notes: list[str] = []
    res = run_invariance(_subjects(args, "invariance", notes), shifts=args.shifts, length=args.length, seed=args.seed)
    shifts = sorted({row["shift"] for r in res for row in r["shifts"]})
    rows = []
    for r in res:
        by = {row["shift"]: row["logits"] for row in r["shifts"]}
        rows.append([r["label"], _tag(r["source"]), "yes" if r["relative"] else "no", *[by.get(s, "") for s in shifts]])
        for a in range(r["axes"] if r["axes"] > 1 else 0):  # positions with axes: each axis shifted alone
            by = {row["shift"]: row["per_axis"][a]["logits"] for row in r["shifts"]}
            rows.append([f"  axis {a}", "", "", *[by.get(s, "") for s in shifts]])
    cols = ["model", "", "relative", *[f"s={s}" for s in shifts]]
    table = Table(cols, rows, title="invariance: relative change of attention logits (max over layers)")
    return _report(args, "invariance", res, notes, plot_invariance, table)


def cmd_similarity(args) -> int:
    from .similarity import plot_similarity, run_similarity

    notes: list[str] = []
    res = run_similarity(_subjects(args, "similarity", notes), length=args.length)
    cols = ["model", "", "vectors", "p·p share", "p·p offdiag", "logits share", "logits offdiag"]
    rows = [
        [
            r["label"],
            _tag(r["source"]),
            r["vectors"],
            *[_share(r.get(k)) for k in ("gram_share", "gram_share_offdiag", "logits_share", "logits_share_offdiag")],
        ]
        for r in res
    ]
    table = Table(cols, rows, title="similarity: variance explained by the mean along each diagonal")
    return _report(args, "similarity", res, notes, plot_similarity, table)


def _share(v) -> str:
    return "n/a" if v is None else f"{v:.4f}"


def cmd_decay(args) -> int:
    from .decay import plot_decay, run_decay, summarize

    notes: list[str] = []
    heads = 2
    subjects = _subjects(args, "decay", notes, dim=heads * args.head_dim, heads=heads)
    res = run_decay(subjects, notes, length=args.length, max_distance=args.max_distance, seed=args.seed)
    summaries = [summarize(r) for r in res]
    keys = list(dict.fromkeys(k for s in summaries for k in s))
    rows = [[r["label"], _tag(r["source"]), *[s.get(k, "") for k in keys]] for r, s in zip(res, summaries, strict=True)]
    return _report(args, "decay", res, notes, plot_decay, Table(["model", "", *keys], rows, title="decay"))


def cmd_padding(args) -> int:
    from .padding import plot_padding, run_padding

    if args.length < args.kernel // 2:
        raise ValueError(
            f"--length {args.length}: padding-probe needs at least --kernel // 2 = {args.kernel // 2} positions "
            f"(circular padding of kernel {args.kernel} wraps at most once)"
        )
    res = run_padding(
        seed=args.seed,
        length=args.length,
        depth=args.depth,
        channels=args.channels,
        kernel=args.kernel,
        task=args.task,
        train_steps=args.train_steps,
        probe_steps=args.probe_steps,
    )
    rows = [[r["padding"], r["accuracy"], r["chance"], r["mean_abs_error"], r["task_loss"]] for r in res]
    cols = ["padding", "accuracy", "chance", "mean |error|", "CNN task loss"]
    table = Table(cols, rows, title="padding-probe: linear probe of absolute position from 1-D CNN features")
    return _report(args, "padding-probe", res, [], plot_padding, table)


def cmd_attention_maps(args) -> int:
    from .attention_maps import plot_attention_maps, run_attention_maps

    notes: list[str] = []
    if not args.checkpoint and args.train_steps is None:
        args.train_steps = TRAIN_STEPS
        notes.append(f"no --checkpoint: trained tiny models for {TRAIN_STEPS} steps (--train-steps)")
    subjects = _subjects(args, "attention-maps", notes, random=False)
    _check_layer(subjects, args.layer)
    for sub in subjects:
        if args.factor * sub.train_len > MAX_MAP:
            raise ValueError(
                f"--factor {args.factor}: {sub.label} would be mapped at {args.factor} × {sub.train_len} = "
                f"{args.factor * sub.train_len} positions (at most {MAX_MAP}: the maps are stored in the JSON)"
            )
    res = run_attention_maps(subjects, notes, factor=args.factor, layer=args.layer, data=args.data, seed=args.seed)
    rows = []
    for r in res:
        cells = []
        for mp in r["maps"]:
            cells += ["n/a", "n/a"] if "error" in mp else [mp["entropy"], mp["mean_distance"]]
        rows.append([r["label"], *cells])
    cols = ["model", "entropy@T", "distance@T", f"entropy@{args.factor}T", f"distance@{args.factor}T"]
    title = f"attention-maps: layer {args.layer}, normalised entropy and mean distance"
    return _report(args, "attention-maps", res, notes, plot_attention_maps, Table(cols, rows, title=title))


def cmd_all(args) -> int:
    """Every analysis with its defaults; the tiny trained models are shared."""
    if args.train_steps is None:
        args.train_steps = TRAIN_STEPS
    if args.train_steps > 0 and not args.checkpoint:
        notes: list[str] = []
        specs, _ = resolve(DEFAULTS["attention-maps"])
        args.train_dir = args.train_dir or Path(tempfile.mkdtemp(prefix="posenc-analyze-"))
        args.checkpoint = tiny_checkpoints(specs, args.train_dir, notes, steps=args.train_steps, length=args.train_len)
        for n in notes:
            print(f"note: {n}")
    parser = args._parser
    ckpt = ["--checkpoint", *map(str, args.checkpoint)] if args.checkpoint else []
    base = ["--out", str(args.out), "--seed", str(args.seed)]
    if args.threads:
        base += ["--threads", str(args.threads)]
    random = ["--max-len", str(args.max_len)] if args.max_len else []
    runs = [
        ["decompose", *base, *random, *ckpt],
        ["invariance", *base, *random, *ckpt],
        ["similarity", *base, *random, *ckpt],
        ["decay", *base, *random],
        ["padding-probe", *base],
    ]
    if ckpt:
        runs.append(["attention-maps", *base, *ckpt])
    else:
        print("note: --train-steps 0 and no --checkpoint: no trained models, so no attention-maps")
    for argv in runs:
        print(f"\n$ posenc analyze {' '.join(shlex.quote(a) for a in argv)}")
        sub_args = parser.parse_args(argv)
        sub_args._argv = argv
        rc = _dispatch(sub_args)
        if rc:
            return rc
    return 0


COMMANDS = {
    "decompose": cmd_decompose,
    "invariance": cmd_invariance,
    "similarity": cmd_similarity,
    "decay": cmd_decay,
    "padding-probe": cmd_padding,
    "attention-maps": cmd_attention_maps,
    "all": cmd_all,
}


def run(args: argparse.Namespace) -> int:
    """Check the flags that go together, take ``--out`` (exclusively, checked writable),
    then run the analysis. Bad input, an unusable or busy folder and a file that cannot be
    written are one line on stderr and exit status 2."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if not hasattr(args, "_argv"):
        args._argv = _argv_after("analyze")
    try:
        check_flags(args)
        with OutputFolder(args.out, tool=f"posenc analyze {args.analysis}"):
            return _dispatch(args)
    except ValueError as e:
        print(f"posenc analyze {args.analysis}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    """One analysis, in an ``--out`` this process holds."""
    check_flags(args)
    return COMMANDS[args.analysis](args)


def _argv_after(word: str) -> list[str]:
    argv = sys.argv[1:]
    return argv[argv.index(word) + 1 :] if word in argv else argv
