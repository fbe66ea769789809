"""Train a small model per encoding and compare quality and length extrapolation.

Examples::

    posenc compare                                   # quick preset, core seven, embedded corpus
    posenc compare --encodings all --preset standard --device cuda
    posenc compare --encodings rope,alibi --train-len 128 --eval-lens 128,512,2048
    posenc compare --task copy --train-len 16 --eval-lens 8,16,32,64
    posenc compare --task grid --train-len 8 --eval-lens 8,12,16 --encodings rope,mrope,sinusoidal \\
        --encoding-options sinusoidal.axes=2        # rope over flattened tokens; rope.axes=2: axial
    posenc compare --encodings rope --extend none,linear,ntk,dynamic,yarn,rerope,leaky-rerope,self-extend
    posenc compare --encodings "rope,nope,irope,local=rope(window=16)*3,rope"
    posenc compare --resume --out runs/2026-01-01T00-00-00-a1b2c3
    posenc compare --overwrite --out runs/x      # start a finished run over
    torchrun --nproc_per_node=2 -m posenc.cli compare --out runs/ddp
    posenc compare --shard 1/2 --out runs/a ; posenc compare --shard 2/2 --out runs/b
    posenc compare --merge runs/a runs/b --out runs/all
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from .config import PRESETS, CompareConfig, from_dict, preset_config
from .rundir import default_out

__all__ = ["add_arguments", "run"]

_HELP = {
    "encodings": "comma-separated encoding names or layer presets (irope, gemma3, ...), or 'all'; "
    "NAME=PATTERN names a layer pattern, up to the next ';' (\"rope,irope=rope*3,nope;alibi\")",
    "preset": "quick (the default command's budget) or standard (a GPU-sized run)",
    "text": "train on a UTF-8 text file instead of the embedded corpus",
    "dataset": "a Hugging Face dataset name (needs the optional 'datasets' package and the hub)",
    "dataset_config": "the dataset's configuration name",
    "dataset_split": "the dataset split to read",
    "dataset_field": "the dataset column holding the text",
    "task": "synthetic task: copy, reverse, sort, associative-recall (lengths count items), "
    "grid (2-D: the symbol above each cell; lengths are grid sides), or passkey (retrieval of a key from "
    "filler text; lengths count tokens); the preset then sets the task's lengths and budget",
    "val_fraction": "fraction of the corpus (its end) held out for validation",
    "dim": "model width D",
    "depth": "number of blocks",
    "heads": "attention heads",
    "mlp_ratio": "MLP hidden width over D",
    "dropout": "dropout of residual branches and the MLP",
    "tie_embeddings": "share the token embedding with the output layer",
    "embed_std": "std of the token embeddings (1.0 matches unit-amplitude sinusoids)",
    "encoding_options": "per-encoding options, merged per key over the preset's: ENCODING.OPTION=VALUE,... "
    "(e.g. t5.max_distance=64,rope.base=500)",
    "train_len": "training sequence length (tokens; items for --task)",
    "steps": "optimizer steps per encoding",
    "batch_size": "sequences per step (the global batch under torchrun)",
    "lr": "peak learning rate (AdamW)",
    "warmup": "linear warmup steps",
    "min_lr_ratio": "cosine decay ends at lr * min_lr_ratio",
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
    "eval_lens": "comma-separated evaluation lengths",
    "eval_tokens": "scored tokens per evaluation length (text)",
    "eval_samples": "problems per evaluation length (tasks)",
    "eval_batch_size": "sequences per evaluation batch",
    "sliding": "sliding-window evaluation (stride --stride) instead of non-overlapping windows",
    "stride": "sliding stride (default: half the window)",
    "position_buckets": "buckets of the per-position loss curve",
    "extend": "after training, evaluate the rotary models once per inference-time extension method: "
    "none,linear,ntk,dynamic,yarn,rerope,leaky-rerope,self-extend (table extend.md, plot extend.png)",
    "checkpoint_every": "write a checkpoint every N steps (and after each encoding)",
    "shard": "i/n: run encodings i, i+n, ... of the list (join the shards with --merge)",
}


def parse_encoding_options(s: str) -> dict[str, dict[str, Any]]:
    """``"t5.max_distance=64,rope.base=500"`` -> ``{"t5": {"max_distance": 64}, "rope": {"base": 500}}``."""
    out: dict[str, dict[str, Any]] = {}
    for item in filter(None, (x.strip() for x in s.split(","))):
        key, sep, raw = item.partition("=")
        name, dot, opt = key.partition(".")
        if not (sep and dot and name and opt):
            raise argparse.ArgumentTypeError(f"expected ENCODING.OPTION=VALUE, got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw  # a bare string
        out.setdefault(name, {})[opt] = value
    return out


def split_encodings(s: str) -> list[str]:
    """``"rope,irope=rope*3,nope;alibi"`` -> ``["rope", "irope=rope*3,nope", "alibi"]``: a
    ``NAME=PATTERN`` entry runs to the next ``;`` (or the end), other entries end at ``,``."""
    out, rest = [], s
    while rest.strip():
        head, _, tail = rest.partition(";")
        names = head.split(",")
        for i, item in enumerate(names):
            if "=" in item.split("(")[0]:  # NAME=PATTERN: the rest of this ';' part
                out.append(",".join(names[i:]).strip())
                break
            if item.strip():
                out.append(item.strip())
        rest = tail
    return out


def _parser_for(type_str: str):
    """An argparse ``type`` for a dataclass field annotation (a string: postponed annotations)."""
    t = type_str.replace(" | None", "")
    if t.startswith("dict["):
        return parse_encoding_options
    if t == "list[int]":
        return lambda s: [int(x) for x in s.split(",") if x]
    if t == "list[str]":
        return lambda s: [x.strip() for x in s.split(",") if x.strip()]
    return {"int": int, "float": float, "str": str}[t]


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
        "--overwrite", action="store_true", help="start over in a non-empty --out (removes its outputs and checkpoints)"
    )
    parser.add_argument("--config", help="start from a config.json instead of a preset")
    parser.add_argument("--merge", nargs="+", metavar="DIR", help="join the results of --shard runs into --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    g = parser.add_argument_group("configuration (every field of CompareConfig; defaults: the quick preset)")
    quick = preset_config("quick")
    for f in fields(CompareConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "preset":
            act = g.add_argument(flag, dest="cfg_preset", choices=sorted(PRESETS), help=_HELP["preset"])
        elif f.type == "bool":
            act = g.add_argument(flag, dest=f"cfg_{f.name}", action=argparse.BooleanOptionalAction, default=None,
                                 help=_HELP[f.name])  # fmt: skip
        else:
            act = g.add_argument(
                flag, dest=f"cfg_{f.name}", metavar=f.name.upper(), default=None,
                type=split_encodings if f.name == "encodings" else _parser_for(f.type),
                help=_HELP[f.name],
            )  # fmt: skip
        act.preset_default = getattr(quick, f.name)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        f.name: getattr(args, f"cfg_{f.name}")
        for f in fields(CompareConfig)
        if f.name != "preset" and getattr(args, f"cfg_{f.name}", None) is not None
    }


def build_config(args: argparse.Namespace) -> CompareConfig:
    """Preset (or --config file), then command-line overrides."""
    over = _overrides(args)
    if args.config:
        d = read_config_file(args.config)
        if args.cfg_preset:
            d["preset"] = args.cfg_preset
        opts = over.pop("encoding_options", None)
        if opts:  # per key over the file's options, as over a preset's
            merged = {k: dict(v) for k, v in d.get("encoding_options", {}).items()}
            for name, o in opts.items():
                merged.setdefault(name, {}).update(o)
            over["encoding_options"] = merged
        return from_dict({**d, **over})
    return preset_config(args.cfg_preset or "quick", **over)


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
    from .report import merge_results, results_table, write_outputs
    from .runner import compare

    out = None
    try:
        if args.merge:
            out = Path(args.out or default_out() + "-merged")
            write_outputs(out, merge_results([Path(d) for d in args.merge])).print()
            print(f"merged {len(args.merge)} runs into {out}")
            return 0
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
            cfg = from_dict(read_config_file(path))
        else:
            cfg = build_config(args)
        rt = setup(cfg.device)  # under torchrun every rank writes into rank 0's default folder
        out = args.out or rt.broadcast(default_out())
        results = compare(cfg, out, resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress,
                          runtime=rt, command=_command_line(getattr(args, "argv", None)))  # fmt: skip
    except (ValueError, DataError) as e:
        print(f"posenc compare: error: {e}", file=sys.stderr)
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


def _command_line(argv: list[str] | None) -> str:
    """The command as given (``posenc compare ...``), for report.md."""
    import shlex

    argv = list(sys.argv[1:] if argv is None else argv)
    if "compare" in argv:
        argv = argv[argv.index("compare") + 1 :]
    return "posenc compare" + "".join(" " + shlex.quote(a) for a in argv)
