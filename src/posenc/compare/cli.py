"""Train a small model per encoding and compare quality and length extrapolation.

Examples::

    posenc compare                                   # quick preset, core seven, embedded corpus
    posenc compare --encodings all --preset standard --device cuda
    posenc compare --encodings rope,alibi --train-len 128 --eval-lens 128,512,2048
    posenc compare --task copy --train-len 16 --eval-lens 8,16,32,64
    posenc compare --task grid --train-len 8 --eval-lens 8,12,16 --encodings rope,mrope,sinusoidal \\
        --encoding-options sinusoidal.axes=2        # rope over flattened tokens; rope.axes=2: axial
    posenc compare --encodings rope --extend none,linear,ntk,dynamic,yarn,rerope,leaky-rerope,self-extend,dca
    posenc compare --encodings "rope,nope,irope,local=rope(window=16)*3,rope"   # NAME=PATTERN: local
    posenc compare --resume --out runs/2026-01-01T00-00-00-a1b2c3
    posenc compare --overwrite --out runs/x      # start a finished run over
    torchrun --nproc_per_node=2 -m posenc.cli compare --out runs/ddp
    posenc compare --shard 1/2 --out runs/a ; posenc compare --shard 2/2 --out runs/b
    posenc compare --merge runs/a runs/b --out runs/all   # a new folder (or --overwrite a merged one)
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..fields import Bool, declared
from ..output.rundir import RunDir, default_out, is_locked
from .config import CompareConfig, from_dict, preset_config, resolve_eval_lens
from .report import outputs_of

__all__ = ["add_arguments", "run"]

_HELP = {
    "encodings": "comma-separated encoding names or layer presets (irope, gemma3, ...), or 'all'; "
    "NAME=PATTERN names a layer pattern, up to the next ';' (\"rope,hybrid=rope*3,nope;alibi\"); NAME: letters, "
    "digits and . _ + - (it names the checkpoint file), not a registered encoding or preset it is not",
    "preset": "quick (the default command's budget), standard (a GPU-sized run) or paper (Press et al. 2022's "
    "WikiText-103 setup; needs --data-dir)",
    "text": "train on a UTF-8 text file instead of the embedded corpus",
    "dataset": "a Hugging Face dataset name (needs the optional 'datasets' package and the hub)",
    "dataset_config": "the dataset's configuration name",
    "dataset_split": "the dataset split to read",
    "dataset_field": "the dataset column holding the text",
    "task": "synthetic task: copy, reverse, sort, associative-recall (lengths count items), "
    "grid (2-D: the symbol above each cell; lengths are grid sides), or passkey (retrieval of a key from "
    "filler text; lengths count tokens), count (CoPE's counting; lengths count statements) or flip-flop "
    "(Liu et al. 2023; lengths count instructions, tested at p(ignore) 0.8, 0.98, 0.1), or Kazemnejad et "
    "al. 2023's kaz-copy, kaz-copy-2x, kaz-reverse, kaz-reverse-2x, kaz-addition, kaz-poly, kaz-sort, "
    "kaz-sort-multi, kaz-sum, kaz-parity, kaz-lego (lengths count their sizes); the preset then "
    "sets the task's lengths and budget",
    "val_fraction": "fraction of the corpus (its end) held out for validation",
    "dim": "model width D",
    "depth": "number of blocks",
    "heads": "attention heads",
    "mlp_ratio": "MLP hidden width over D",
    "dropout": "dropout of residual branches and the MLP",
    "attn_dropout": "dropout on the attention probabilities in training (fairseq's attention_dropout; the paper "
    "preset: 0.1); every backend but flex runs it",
    "activation_dropout": "dropout after the MLP's activation (fairseq's activation_dropout; the paper preset: 0.1)",
    "tie_embeddings": "share the token embedding with the output layer",
    "embed_std": "std of the token embeddings (1.0 matches unit-amplitude sinusoids)",
    "encoding_options": "per-encoding options, merged per key over the preset's: ENCODING.OPTION=VALUE,... "
    "(e.g. t5.max_distance=64,rope.base=500)",
    "train_len": "training sequence length (tokens; items for --task)",
    "steps": "optimizer steps per encoding",
    "batch_size": "sequences per step (the global batch under torchrun)",
    "lr": "peak learning rate (AdamW)",
    "warmup": "linear warmup steps",
    "min_lr_ratio": "the decay ends at lr * min_lr_ratio",
    "schedule": "learning-rate schedule after the warmup: cosine, or warmup-stable-decay (lr held, then a "
    "cooldown over the last --decay-fraction of the steps): wsd (linear cooldown) or wsd-sqrt (1 - sqrt, "
    "Hägele et al. 2024)",
    "decay_fraction": "wsd, wsd-sqrt: the cooldown's share of the steps, in (0, 1]",
    "weight_decay": "AdamW weight decay",
    "grad_clip": "clip the gradient norm to this (0: no clipping)",
    "seeds": "comma-separated seeds: one model per encoding and seed (weights and data order); "
    "tables show the mean and a 95%% interval (t with 3+ seeds, min-max with 2)",
    "compile": "torch.compile the training step (pays on GPUs; on a small CPU model the compile time does not)",
    "val_points": "validation points at the training length during training (convergence diagnostics; 0: none)",
    "workers": "CPU processes training models side by side, 1 thread each (0: one per core)",
    "device": "auto, cpu or cuda",
    "dtype": "float32 or bfloat16 (autocast)",
    "randomized_positions": "train with sorted random positions from [0, max-pos) (Ruoss et al. 2023)",
    "max_pos": "L_max of randomized positions (default: the longest eval length)",
    "packed": "train on packed documents: attention stops at document boundaries, positions restart "
    "per document, the first byte of a document is not scored (documents: paragraphs, ending at "
    "blank lines); evaluation windows stay contiguous",
    "eval_lens": "comma-separated evaluation lengths; Nx is N times the training length (1x,2x,...,48x: "
    "Press et al.'s Table 5)",
    "eval_tokens": "scored tokens per evaluation length (text)",
    "eval_samples": "problems per evaluation length (tasks)",
    "eval_batch_size": "sequences per evaluation batch",
    "sliding": "sliding-window evaluation (stride --stride) instead of non-overlapping windows",
    "stride": "sliding stride (default: half the window)",
    "position_buckets": "buckets of the per-position loss curve",
    "extend": "after training, evaluate the rotary models once per inference-time extension method: "
    "none,linear,ntk,dynamic,yarn,rerope,leaky-rerope,self-extend,dca (table extend.md, plot extend.png)",
    "checkpoint_every": "write a checkpoint every N steps (and after each encoding)",
    "shard": "i/n: run encodings i, i+n, ... of the list (join the shards with --merge)",
    "data_dir": "a local directory holding WikiText-103's wiki.{train,valid,test}.tokens (word level; "
    "never downloaded); the vocabulary is built from the train file as fairseq-preprocess does",
    "tokens_per_update": "tokens per optimizer update, the same under any number of processes; must equal "
    "batch-size x train-len (the paper preset: 73728)",
    "micro_batch": "sequences per process per forward; the update accumulates batch-size / (processes x "
    "micro-batch) of them (default: batch-size / processes, no accumulation)",
    "final_norm": "a LayerNorm after the last block (--no-final-norm: pre-norm without one, fairseq's wiki103 LM)",
    "fsdp": "under torchrun, shard weights, gradients and optimizer state over the processes "
    "(torch.distributed.fsdp.fully_shard, one unit per block) instead of replicating them (DDP); for models "
    "that do not fit one device; needs --val-points 0",
    "kv_heads": "key/value heads of every layer (grouped-query attention; 1: multi-query; must divide --heads); "
    "the KV cache stores them",
    "qk_norm": "per-head q/k normalisation with HF's conventions: rms (Qwen3), gemma-rms (Gemma 3), l2 (Llama 4)",
    "qk_norm_position": "before or after the q/k stage (Qwen3/Gemma 3: before RoPE; Llama 4: after)",
    "score_scale": "replaces the head_dim^-1/2 factor of the score scale (Gemma 3: query_pre_attn_scalar^-1/2)",
    "softcap": "tanh logit soft-capping c*tanh(s/c) of the scores (Gemma 2: 50); runs on chunked/eager/flex",
    "adaptive_cutoffs": "comma-separated band cutoffs of an adaptive input and adaptive softmax (word-level "
    "vocabularies; the paper preset: 20000,60000)",
}


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples' layout and shows every configuration field's default."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = getattr(action, "preset_default", argparse.SUPPRESS)
        if default is not argparse.SUPPRESS:
            shown = ",".join(map(str, default)) if isinstance(default, list) else default
            text += f" (default: {shown if shown not in (None, '', {}) else 'none'})"
        return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _Formatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    parser.add_argument("--out", help="output folder (default: runs/<timestamp>-<random>)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoints")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in a non-empty --out (removes only what a comparison wrote there: the files its "
        ".posenc-manifest.json lists)",
    )
    parser.add_argument("--config", help="start from a config.json instead of a preset")
    parser.add_argument("--merge", nargs="+", metavar="DIR", help="join the results of --shard runs into --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    g = parser.add_argument_group("configuration (every field of CompareConfig; defaults: the quick preset)")
    quick = preset_config("quick")
    # each field's flag reads its declaration (posenc.fields): the type here, the range in
    # CompareConfig.validate, which names the flag (where_given) as it names a --config file's field
    for name, decl in declared(CompareConfig).items():
        flag = "--" + name.replace("_", "-")
        if name == "preset":
            act = g.add_argument(flag, dest="cfg_preset", choices=decl.names(), help=_HELP["preset"])
        elif isinstance(decl, Bool):
            act = g.add_argument(flag, dest=f"cfg_{name}", action=argparse.BooleanOptionalAction, default=None,
                                 help=_HELP[name])  # fmt: skip
        else:
            act = g.add_argument(flag, dest=f"cfg_{name}", metavar=name.upper(), default=None, type=decl.reader(),
                                 help=_HELP[name])  # fmt: skip
        act.preset_default = getattr(quick, name)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        f.name: getattr(args, f"cfg_{f.name}")
        for f in fields(CompareConfig)
        if f.name != "preset" and getattr(args, f"cfg_{f.name}", None) is not None
    }


def build_config(args: argparse.Namespace) -> CompareConfig:
    """Preset (or --config file), then command-line overrides.

    Raises:
        ValueError: a bad field, named as it was given: ``--grad-clip`` for a flag,
            ``grad_clip in 'run/config.json'`` for a field of the config file.
    """
    over = _overrides(args)
    multiples = over.pop("eval_lens", None)
    try:
        cfg = _build(args, over)
        if multiples is not None:  # Nx needs the training length the preset / file / flags settled on
            over["eval_lens"] = multiples  # named --eval-lens if it is refused
            over["eval_lens"] = resolve_eval_lens(multiples, cfg.train_len)
            cfg = _build(args, over)
    except ValueError as e:
        raise ValueError(where_given(str(e), over, args.config)) from None
    idle = [f"--{k.replace('_', '-')}" for k in ("dataset_split", "dataset_field") if k in over and cfg.dataset is None]
    if idle:
        raise ValueError(
            f"{' and '.join(idle)} appl{'y' if len(idle) > 1 else 'ies'} to a --dataset only, and none is given"
        )
    return cfg


def _build(args: argparse.Namespace, over: dict[str, Any]) -> CompareConfig:
    """The config of the preset or --config file with ``over`` on top (``build_config``'s step)."""
    if args.config is not None and not args.config.strip():
        raise ValueError(f"--config must name a config.json file, got {args.config!r}")
    if args.config:
        try:
            d = read_config_file(args.config)
        except ValueError as e:
            raise ValueError(f"--config: {e}") from None
        if args.cfg_preset:
            d["preset"] = args.cfg_preset
        opts, theirs = over.get("encoding_options"), d.get("encoding_options", {})
        if opts and isinstance(theirs, dict) and all(isinstance(v, dict) for v in theirs.values()):
            merged = {k: dict(v) for k, v in theirs.items()}  # per key over the file's options
            for name, o in opts.items():
                merged.setdefault(name, {}).update(o)
            over["encoding_options"] = merged
        cfg = from_dict({**d, **over})
    else:
        cfg = preset_config(args.cfg_preset or "quick", **over)
    return cfg


def where_given(message: str, flags: dict[str, Any], config: str | None) -> str:
    """``message`` (``"grad_clip must be ..."``) with its leading field named as the user gave
    it: ``--grad-clip`` when it came from the command line, ``grad_clip in 'FILE'`` from a
    config file."""
    field, sep, rest = message.partition(" ")
    if sep and field in {f.name for f in fields(CompareConfig)}:
        if field in flags:
            return f"--{field.replace('_', '-')} {rest}"
        if config:
            return f"{field} in {config!r} {rest}"
    # led by a field the user did not give (dim must be divisible by heads): name the given flags it is about
    about = [f"--{f.replace('_', '-')}" for f in flags if re.search(rf"\b{f}\b", message)]
    return f"{' and '.join(about)}: {message}" if about else message


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A ``config.json`` as a dict; ``ValueError`` naming the path when missing or not JSON."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"config file {str(p)!r} not found" if not p.exists() else f"{str(p)!r} is not a file")
    try:
        d = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"config file {str(p)!r} is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"config file {str(p)!r} must hold a JSON object, got {type(d).__name__}")
    return d


def run(args: argparse.Namespace) -> int:
    from ..data import DataError
    from ..train import setup
    from .report import results_table
    from .runner import compare

    out = None
    try:
        if args.out is not None and (not args.out.strip() or "\x00" in args.out):
            raise ValueError(f"--out must name a folder, got {args.out!r}")
        if args.merge:
            return merge(args)
        if args.resume:
            if not args.out:
                raise ValueError("--resume needs --out DIR, the folder of the run to continue")
            over = _overrides(args)
            if over or args.cfg_preset or args.config:
                raise ValueError(
                    f"--resume takes the config from {args.out}/config.json; drop {sorted(over) or '--preset/--config'}"
                )
            path = Path(args.out) / "config.json"
            if not path.is_file():
                raise ValueError(f"--resume: {str(path)!r} not found (is {args.out!r} a run folder?)")
            try:
                cfg = from_dict(read_config_file(path))
            except ValueError as e:
                raise ValueError(
                    where_given(str(e), {}, str(path)) + "; this posenc does not accept that config (an older one may "
                    "have written it): start the run over with --overwrite, or use another --out"
                ) from None
        else:
            cfg = build_config(args)
        rt = setup(cfg.device)  # under torchrun every rank writes into rank 0's default folder
        out = args.out or rt.broadcast(default_out())
        results = compare(cfg, out, resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress,
                          runtime=rt, command=_command_line(getattr(args, "argv", None)))  # fmt: skip
    except (ValueError, DataError) as e:
        print(f"posenc compare: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full or read-only disk under a write that is not posenc's own
        if e.errno not in _DISK_ERRORS:
            raise
        print(f"posenc compare: error: cannot write {e.filename or out!r}: {e.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        where = f" --out {out}" if out else ""
        print(
            f"\nposenc compare: interrupted. Checkpoints are kept (every --checkpoint-every steps and after each "
            f"encoding); continue with: posenc compare --resume{where}",
            file=sys.stderr,
        )
        return 130
    if rt.main and results["runs"]:
        results_table(results).print()
        if results.get("extend"):
            from .extend import extend_table

            extend_table(results).print()
        print(f"wall time {results['wall_seconds']:.1f} s; results in {out}/")
    return 0


_DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


def merge(args: argparse.Namespace) -> int:
    """``--merge DIR ... --out OUT``: the shards' results joined into OUT, a run folder taken
    as ``compare`` takes one (locked; refused when not empty unless ``--overwrite``, which
    removes only what a comparison listed there)."""
    from .extend import extend_table, write_extend
    from .plots import run_subtitle
    from .report import merge_results, write_outputs

    flags = [f"--{k.replace('_', '-')}" for k in _overrides(args)]
    flags += [flag for flag, given in (("--preset", args.cfg_preset), ("--config", args.config),
                                       ("--resume", args.resume)) if given]  # fmt: skip
    if flags:
        raise ValueError(
            f"--merge joins finished runs as they were run; it takes no {', '.join(flags)}: drop "
            + ("it" if len(flags) == 1 else "them")
        )
    dirs = [Path(d) for d in args.merge]
    out = Path(args.out) if args.out is not None else Path(default_out() + "-merged")
    for d in dirs:
        if d.is_dir() and os.path.realpath(d) == os.path.realpath(out):
            raise ValueError(
                f"--merge: --out {str(out)!r} is one of the runs merged ({str(d)!r}): choose another --out"
            )
        if is_locked(d):
            raise ValueError(
                f"--merge: {str(d)!r} is in use by a running posenc compare: merge it when it has finished"
            )
    merged = merge_results(dirs)
    extend = merged.get("extend")
    writes = outputs_of({**merged["config"], "extend": merged["config"].get("extend") if extend else None})
    with RunDir(out, overwrite=args.overwrite, writes=writes) as run_dir:
        try:
            with run_dir.recording():
                table = write_outputs(out, merged)
                if extend:
                    write_extend(out, merged, run_subtitle(merged["config"]))
        except Exception:  # nothing to resume in a merge: leave the folder as it was
            run_dir.discard()
            raise
        run_dir.finish()
    table.print()
    if extend:
        extend_table(merged).print()
    print(f"merged {len(merged['runs'])} models from {len(dirs)} run folders into {out}")
    return 0


def _command_line(argv: list[str] | None) -> str:
    """The command as given (``posenc compare ...``), for report.md."""
    import shlex

    argv = list(sys.argv[1:] if argv is None else argv)
    if "compare" in argv:
        argv = argv[argv.index("compare") + 1 :]
    return "posenc compare" + "".join(" " + shlex.quote(a) for a in argv)
