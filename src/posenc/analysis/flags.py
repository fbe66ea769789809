"""The flags of ``posenc analyze``: each value's type and range declared once, next to the
parser (:mod:`posenc.fields`: a bad one is one line naming the flag, exit 2), and
:func:`check_flags` for flags that are fine alone but do nothing together."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..cli_types import nonempty_path, spec_list
from ..fields import Int
from ..output import check_creatable

__all__ = ["MAX_LEN", "MAX_MAP", "SUBCOMMANDS", "TRAIN_STEPS", "add_arguments", "check_flags"]

TRAIN_STEPS = 600  # tiny models trained when no checkpoint is given
MAX_LEN = 256  # max_len of the random-weight models (--max-len)
MAX_MAP = 4096  # longest attention map (factor × training length): the map is stored in the JSON

SUBCOMMANDS = ("decompose", "invariance", "similarity", "decay", "padding-probe", "attention-maps")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="analysis", required=True, metavar="ANALYSIS")
    length = Int(2, 2048).parse  # L × L maps per head and layer: 2048 is already 16 MiB a map
    steps = Int(0, 1_000_000).parse
    layer = Int(-1024, 1023).parse  # negative: from the last
    train_len = Int(2, 1024).parse

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--out", type=nonempty_path, default=Path("analysis"), help="output folder (default: ./analysis)"
    )
    common.add_argument("--seed", type=Int(0, 2**63 - 1).parse, default=0)
    common.add_argument("--threads", type=Int(1, 1024).parse, default=None, help="torch CPU threads (default: torch's)")

    models = argparse.ArgumentParser(add_help=False)
    models.add_argument(
        "--encodings",
        nargs="+",
        type=spec_list,
        default=None,
        metavar="SPEC",
        help="encodings with random weights, separated by commas or spaces: name or name@{json options}; "
        '"all" = every registered one; an unknown name or one that cannot be built is an error',
    )
    models.add_argument(
        "--checkpoint",
        nargs="+",
        type=nonempty_path,
        default=[],
        metavar="PATH",
        help="trained models: posenc checkpoints (.pt) or run directories (<run>/checkpoints/*.pt)",
    )
    models.add_argument(
        "--train-steps",
        type=steps,
        default=None,
        help=f"also train a tiny LM per encoding for N steps (default: 0, no; 'all' and 'attention-maps': {TRAIN_STEPS})",
    )
    models.add_argument(
        "--train-dir",
        type=nonempty_path,
        default=None,
        help="where --train-steps keeps its checkpoints; one trained otherwise (other steps, ...) is refused",
    )
    models.add_argument(
        "--max-len",
        type=Int(1, 65536).parse,
        default=None,
        help=f"max_len of the random-weight models (default {MAX_LEN})",
    )

    def add(name, help_, parents):
        return sub.add_parser(name, help=help_, description=help_, parents=parents)

    p = add("decompose", "content/position terms of the attention logits and their variance shares", [common, models])
    p.add_argument("--length", type=length, default=64)
    p.add_argument("--layer", type=layer, default=0, help="which layer (negative: from the last)")

    p = add("invariance", "change of attention logits/probabilities when every position shifts by s", [common, models])
    p.add_argument("--length", type=length, default=32)
    p.add_argument("--shifts", type=Int(1, 1_000_000).parse, nargs="+", default=[1, 4, 16, 64, 128, 256, 1024])

    p = add("similarity", "position-position heatmaps and their share explained by i - j", [common, models])
    p.add_argument("--length", type=length, default=64)

    p = add("decay", "RoPE's long-range bound; bias and measured attention against distance", [common, models])
    p.add_argument("--length", type=length, default=256, help="sequence length of the measured attention")
    p.add_argument(
        "--max-distance", type=Int(1, 1_000_000).parse, default=2048, help="largest distance of the RoPE bound"
    )
    p.add_argument(
        "--head-dim",
        type=Int(2, 1024, even=True).parse,
        default=128,
        help="head dim of the random-weight models (Su: 128)",
    )

    p = add("padding-probe", "Islam et al. 2020 in 1-D: position from CNN features, zero vs circular", [common])
    p.add_argument("--length", type=length, default=64, help="at least --kernel // 2 (circular padding)")
    p.add_argument("--depth", type=Int(1, 64).parse, default=8)
    p.add_argument("--channels", type=Int(1, 1024).parse, default=32)
    p.add_argument("--kernel", type=Int(1, 255, odd=True).parse, default=9)
    p.add_argument("--task", choices=("token", "majority"), default="token")
    p.add_argument("--train-steps", type=steps, default=100, help="steps of the CNN on the position-free task")
    p.add_argument("--probe-steps", type=Int(1, 1_000_000).parse, default=200)

    p = add("attention-maps", "attention maps at the training length and at 4x it", [common, models])
    p.add_argument("--factor", type=Int(1, 64).parse, default=4, help=f"factor × training length at most {MAX_MAP}")
    p.add_argument("--layer", type=layer, default=-1, help="which layer (negative: from the last)")
    p.add_argument("--data", choices=("repeat", "random"), default="repeat")
    p.add_argument("--train-len", type=train_len, default=32, help="training length of --train-steps models")

    p = add("all", "run every analysis into --out (regenerates docs/figures)", [common, models])
    p.add_argument("--train-len", type=train_len, default=32, help="training length of --train-steps models")
    parser.set_defaults(_parser=parser)


def check_flags(args: argparse.Namespace) -> None:
    """Flags that are fine alone but not together: one sentence naming them (ValueError)."""
    if args.analysis == "padding-probe":
        return
    if args.analysis == "all" and args.encodings:
        raise ValueError("'all' uses each analysis' default encodings; run a single analysis for --encodings")
    if args.analysis in ("all", "attention-maps") and not args.checkpoint and args.train_steps is None:
        trains = TRAIN_STEPS  # these two train when given no checkpoint
    else:
        trains = args.train_steps or 0
    if args.train_dir is not None:
        if not trains:
            raise ValueError(f"--train-dir {str(args.train_dir)!r} keeps the models of --train-steps N; give N >= 1")
        check_creatable(args.train_dir, "--train-dir")
    if args.analysis == "attention-maps":
        if args.max_len is not None:
            raise ValueError("--max-len sets the random-weight models; attention-maps looks at trained ones only")
        if not args.checkpoint and not trains:
            raise ValueError("attention-maps looks at trained models: give --checkpoint PATH or --train-steps N >= 1")
