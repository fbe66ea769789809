"""Where one model of a finished ``posenc compare --task kaz-*`` run goes wrong in its
answers at size N, answer index by answer index (``posenc.compare.answer_errors``).

    python scripts/answer_errors.py runs/kaz-copy nope 30 [--seed 0] [--samples K] [--by-category]

Reads the model's checkpoint from RUN/checkpoints (``weights_only``: nothing in it runs) and
prints one row per answer index: the share of samples whose prediction is right, ``</s>``
(the answer stops early), a wrong token from the prompt, or a token from neither, and the
most common of those last tokens with its share. With
``--by-category``, one row per category of the original builder instead (kaz-lego: the
query's place in the chain; kaz-addition: the digit counts) with its exact match. Writes
nothing. A bad argument or a missing checkpoint is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from posenc.checkpoint import CheckpointError, load_checkpoint
from posenc.compare import from_dict
from posenc.compare.answer_errors import CLASSES, answer_errors, exact_match_by_category
from posenc.compare.evaluate import not_applicable
from posenc.compare.train import checkpoint_path
from posenc.data import load_source
from posenc.data.kazemnejad import VOCAB


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="answer_errors.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("encoding")
    ap.add_argument("n", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--samples", type=int, help="test samples (default: the run's --eval-samples)")
    ap.add_argument("--by-category", action="store_true", help="exact match per category of the original builder")
    a = ap.parse_args(argv)
    try:
        cfg = from_dict(json.loads((a.run / "config.json").read_text()))
    except (OSError, ValueError, TypeError) as e:
        print(f"answer_errors: {str(a.run / 'config.json')!r} cannot be read as a compare run's config ({e})",
              file=sys.stderr)  # fmt: skip
        return 2
    if not (cfg.task or "").startswith("kaz-"):
        print(f"answer_errors: the run is of task {cfg.task!r}; this reads runs of --task kaz-*", file=sys.stderr)
        return 2
    if a.encoding not in cfg.encodings or a.seed not in cfg.seeds:
        print(f"answer_errors: encoding {a.encoding!r} seed {a.seed} is not in the run (encodings "
              f"{', '.join(cfg.encodings)}; seeds {', '.join(map(str, cfg.seeds))})", file=sys.stderr)  # fmt: skip
        return 2
    source = load_source(task=cfg.task)
    a.samples = cfg.eval_samples if a.samples is None else a.samples
    top = source.max_size if source.max_size is not None else float("inf")
    if not source.min_size <= a.n <= top or a.samples < 1:
        sizes = f"in [{source.min_size}, {source.max_size}]" if source.max_size is not None else f">= {source.min_size}"
        print(f"answer_errors: n must be {sizes} for {cfg.task} and --samples >= 1, got n={a.n}, "
              f"--samples={a.samples}", file=sys.stderr)  # fmt: skip
        return 2
    path = checkpoint_path(a.run / "checkpoints", cfg, a.encoding, a.seed)
    try:  # weights_only; the model is rebuilt from the checkpoint's own config
        model, extra = load_checkpoint(path)
    except (CheckpointError, OSError) as e:
        print(f"answer_errors: {str(path)!r} cannot be read as a checkpoint ({e})", file=sys.stderr)
        return 2
    if not extra.get("done"):
        print(f"answer_errors: {str(path)!r} is a model still in training (step {extra.get('step')})", file=sys.stderr)
        return 2
    why = not_applicable(model, source.seq_len(a.n))
    if why is not None:
        print(f"answer_errors: {a.encoding} cannot run at n={a.n}: {why}", file=sys.stderr)
        return 2
    try:
        r = (exact_match_by_category if a.by_category else answer_errors)(model, source, a.n, a.samples)
    except ValueError as e:
        print(f"answer_errors: {a.encoding} seed {a.seed}: {e}", file=sys.stderr)
        return 2
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
