"""Run a whole comparison: setup (device, processes, encodings, data), every encoding in
turn, then the output files."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from ..base import available, get_class
from ..data import load_source
from ..output import write_json
from ..patterns import is_pattern, layers
from ..train import Runtime, setup
from .config import CompareConfig, parse_shard
from .report import run_subtitle, write_outputs
from .rundir import RunDir
from .train import train_encoding

__all__ = ["compare", "make_source", "resolve_encodings"]


def resolve_encodings(cfg: CompareConfig) -> list[str]:
    """The config's model names (``all`` expands to every registered encoding; a
    ``NAME=PATTERN`` entry gives ``NAME``; presets stay as they are), cut to its shard."""
    names = available() if cfg.encodings == ["all"] else list(dict.fromkeys(cfg.encoding_names()))
    patterns = cfg.named_patterns()
    for n in names:
        if n in patterns or is_pattern(n):
            layers(patterns.get(n, n), cfg.depth)  # ValueError: a bad pattern, or longer than the depth
        else:
            get_class(n)  # ValueError listing the valid names
    if cfg.shard is not None:
        i, n = parse_shard(cfg.shard)
        names = names[i - 1 :: n]
    return names


def make_source(cfg: CompareConfig):
    """The data source the config names (embedded corpus by default)."""
    return load_source(
        task=cfg.task, text=cfg.text, dataset=cfg.dataset, dataset_config=cfg.dataset_config,
        dataset_split=cfg.dataset_split, dataset_field=cfg.dataset_field, val_fraction=cfg.val_fraction,
        seed=cfg.seed, longest=max(cfg.train_len, *cfg.eval_lens), packed=cfg.packed,
    )  # fmt: skip


def compare(
    cfg: CompareConfig,
    out: str | Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    runtime: Runtime | None = None,
    log=print,
) -> dict[str, Any]:
    """Train and evaluate every encoding of ``cfg``; write the files to ``out``; return results.

    The folder belongs to this run (see :mod:`posenc.compare.rundir`): a non-empty one is
    refused unless ``resume`` (continue it; its checkpoints must carry ``cfg``'s
    fingerprint) or ``overwrite`` (start it over), and a second process is kept out by a
    lock for as long as this one runs.

    Raises:
        ValueError: bad config or encoding names, an unusable or busy run folder, a
            checkpoint from another config or unreadable.
        posenc.data.DataError: the data source cannot be loaded.
    """
    out = Path(out)
    rt = runtime or setup(cfg.device)
    names = resolve_encodings(cfg)
    source = make_source(cfg)
    with contextlib.ExitStack() as stack:
        if rt.main:
            stack.enter_context(RunDir(out, resume=resume, overwrite=overwrite))
            (out / "checkpoints").mkdir(parents=True, exist_ok=True)
            cfg.save(out / "config.json")
        rt.barrier()
        t0 = time.perf_counter()
        runs: list[dict[str, Any]] = []
        for index, name in enumerate(names, 1):
            run = train_encoding(
                cfg, source, name, runtime=rt, ckpt_dir=out / "checkpoints", resume=resume, progress=progress,
                position=(index, len(names)), log=log,
            )  # fmt: skip
            runs.append(run)
            if rt.main:
                write_json(
                    out / "results.json", {"config": cfg.to_dict(), "fingerprint": cfg.fingerprint(), "runs": runs}
                )
                log(f"[{index}/{len(names)}] {name}: " + ", ".join(_short(e) for e in run["eval"]))
        results = {"config": cfg.to_dict(), "fingerprint": cfg.fingerprint(), "runs": runs,
                   "wall_seconds": round(time.perf_counter() - t0, 2), "device": str(rt.device),
                   "processes": rt.world}  # fmt: skip
        if rt.main:
            if cfg.extend:  # the trained rotary models once per extension method (posenc.compare.extend)
                from .extend import run_extend, write_extend

                results["extend"] = run_extend(cfg, source, out / "checkpoints", runs, device=rt.device, log=log)
            write_outputs(out, results)
            if results.get("extend"):
                write_extend(out, results, run_subtitle(cfg.to_dict()))
    return results


def _short(e: dict[str, Any]) -> str:
    if not e.get("applicable", True):
        return f"{e['length']}: n/a"
    if e.get("ppl") is not None:
        return f"{e['length']}: ppl {e['ppl']:.2f}"
    return f"{e['length']}: acc {100 * e['accuracy']:.1f}%"
