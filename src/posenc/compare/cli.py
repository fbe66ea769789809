"""Train a small model per encoding and compare quality and length extrapolation.

Examples::

    posenc compare                                   # quick preset, core seven, embedded corpus
    posenc compare --encodings all --preset standard --device cuda
    posenc compare --encodings rope,alibi --train-len 128 --eval-lens 128,512,2048
    posenc compare --task copy --train-len 16 --eval-lens 8,16,32,64
    posenc compare --resume --out runs/2026-01-01T00-00-00
    torchrun --nproc_per_node=2 -m posenc.cli compare --out runs/ddp
    posenc compare --shard 1/2 --out runs/a ; posenc compare --shard 2/2 --out runs/b
    posenc compare --merge runs/a runs/b --out runs/all
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from .config import PRESETS, CompareConfig, from_dict, preset_config

__all__ = ["add_arguments", "run"]

_HELP = {
    "encodings": "comma-separated encoding names, or 'all' (default: the core seven)",
    "text": "train on a UTF-8 text file instead of the embedded corpus",
    "dataset": "a Hugging Face dataset name (needs the optional 'datasets' package and the hub)",
    "task": "synthetic task: copy, reverse, sort, associative-recall (lengths count items)",
    "train_len": "training sequence length",
    "eval_lens": "comma-separated evaluation lengths",
    "randomized_positions": "train with sorted random positions from [0, max-pos) (Ruoss et al. 2023)",
    "max_pos": "L_max of randomized positions (default: the longest eval length)",
    "sliding": "sliding-window evaluation (stride --stride) instead of non-overlapping windows",
    "eval_tokens": "scored tokens per evaluation length",
    "checkpoint_every": "write a checkpoint every N steps (and after each encoding)",
    "device": "auto, cpu or cuda",
    "encoding_options": "per-encoding options: ENCODING.OPTION=VALUE,... (e.g. t5.max_distance=64,rope.base=500)",
    "embed_std": "std of the token embeddings (1.0 matches unit-amplitude sinusoids)",
    "dtype": "float32 or bfloat16 (autocast)",
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    parser.add_argument("--out", help="output folder (default: runs/<timestamp>)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoints")
    parser.add_argument("--config", help="start from a config.json instead of a preset")
    parser.add_argument("--merge", nargs="+", metavar="DIR", help="join the results of --shard runs into --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    g = parser.add_argument_group("configuration (every field of CompareConfig; defaults from --preset)")
    for f in fields(CompareConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "preset":
            g.add_argument(flag, dest="cfg_preset", choices=sorted(PRESETS), help="quick (default) or standard")
        elif f.type == "bool":
            g.add_argument(flag, dest=f"cfg_{f.name}", action=argparse.BooleanOptionalAction, default=None,
                           help=_HELP.get(f.name))  # fmt: skip
        else:
            g.add_argument(
                flag, dest=f"cfg_{f.name}", metavar=f.name.upper(), type=_parser_for(f.type), default=None,
                help=_HELP.get(f.name),
            )  # fmt: skip


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
        d = json.loads(Path(args.config).read_text())
        if args.cfg_preset:
            d["preset"] = args.cfg_preset
        return from_dict({**d, **over})
    return preset_config(args.cfg_preset or "quick", **over)


def _print_table(table: str) -> None:
    from rich.console import Console
    from rich.markdown import Markdown

    Console(width=200 if not sys.stdout.isatty() else None).print(Markdown(table))


def run(args: argparse.Namespace) -> int:
    from ..data import DataError
    from .report import merge_results, write_outputs
    from .runner import compare

    try:
        if args.merge:
            out = Path(args.out or f"runs/{time.strftime('%Y-%m-%dT%H-%M-%S')}-merged")
            table = write_outputs(out, merge_results([Path(d) for d in args.merge]))
            _print_table(table)
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
                raise ValueError(f"--resume: {str(path)!r} not found")
            cfg = from_dict(json.loads(path.read_text()))
        else:
            cfg = build_config(args)
        out = args.out or _default_out()
        results = compare(cfg, out, resume=args.resume, progress=not args.no_progress)
    except (ValueError, DataError) as e:
        print(f"posenc compare: error: {e}", file=sys.stderr)
        return 2
    if results["runs"] and Path(out, "table.md").is_file():
        _print_table(Path(out, "table.md").read_text())
        print(f"wall time {results['wall_seconds']:.1f} s; results in {out}/")
    return 0


def _default_out() -> str:
    """``runs/<timestamp>``; under torchrun every rank gets rank 0's."""
    out = f"runs/{time.strftime('%Y-%m-%dT%H-%M-%S')}"
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist

        from .train import resolve_device, setup_distributed

        setup_distributed(resolve_device("auto"))
        box = [out]
        dist.broadcast_object_list(box, src=0)
        out = box[0]
    return out
