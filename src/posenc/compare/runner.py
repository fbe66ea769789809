"""Run a whole comparison: every encoding in turn, then the output files."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..base import available, get_class
from .config import CompareConfig, parse_shard
from .report import write_outputs
from .train import DistInfo, make_source, resolve_device, setup_distributed, train_encoding

__all__ = ["compare", "resolve_encodings"]


def resolve_encodings(cfg: CompareConfig) -> list[str]:
    """The config's encodings (``all`` expands to every registered one), cut to its shard."""
    names = available() if cfg.encodings == ["all"] else list(dict.fromkeys(cfg.encodings))
    for n in names:
        get_class(n)  # ValueError listing the valid names
    if cfg.shard is not None:
        i, n = parse_shard(cfg.shard)
        names = names[i - 1 :: n]
    return names


def compare(
    cfg: CompareConfig,
    out: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    dinfo: DistInfo | None = None,
    log=print,
) -> dict[str, Any]:
    """Train and evaluate every encoding of ``cfg``; write the files to ``out``; return results.

    Raises:
        ValueError: bad config or encoding names.
        posenc.data.DataError: the data source cannot be loaded.
    """
    out = Path(out)
    device = resolve_device(cfg.device)
    dinfo = dinfo or setup_distributed(device)
    names = resolve_encodings(cfg)
    source = make_source(cfg)
    if dinfo.main:
        (out / "checkpoints").mkdir(parents=True, exist_ok=True)
        cfg.save(out / "config.json")
    if dinfo.enabled:
        dist.barrier()
    t0 = time.perf_counter()
    runs: list[dict[str, Any]] = []
    for name in names:
        run = train_encoding(
            cfg, source, name, device=device, ckpt_dir=out / "checkpoints", resume=resume,
            progress=progress, dinfo=dinfo,
        )  # fmt: skip
        runs.append(run)
        if dinfo.main:
            (out / "results.json").write_text(json.dumps({"config": cfg.to_dict(), "runs": runs}, indent=2) + "\n")
            last = run["eval"]
            log(f"{name}: " + ", ".join(_short(e) for e in last))
    results = {"config": cfg.to_dict(), "runs": runs, "wall_seconds": round(time.perf_counter() - t0, 2),
               "device": str(device), "processes": dinfo.world}  # fmt: skip
    if dinfo.main:
        write_outputs(out, results)
    return results


def _short(e: dict[str, Any]) -> str:
    if not e.get("applicable", True):
        return f"{e['length']}: n/a"
    if e.get("ppl") is not None:
        return f"{e['length']}: ppl {e['ppl']:.2f}"
    return f"{e['length']}: acc {100 * e['accuracy']:.1f}%"
