"""Run a whole comparison: setup (device, processes, encodings, data), every model (one per
encoding and seed) in turn or on worker processes side by side, then the output files."""

from __future__ import annotations

import contextlib
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from .._version import __version__
from ..data import load_source
from ..output import write_json
from ..output.rundir import RunDir
from ..registry import available
from ..train import Runtime, setup
from .config import CompareConfig, from_dict, parse_shard
from .pool import plan_workers, run_jobs
from .report import outputs_of, run_subtitle, write_outputs
from .train import accumulation_steps, checkpoint_path, train_encoding

VOCAB_FILE = "vocab.json"  # a data_dir run's vocabulary (JSON), in the run folder

__all__ = ["compare", "make_source", "resolve_encodings", "check_extend", "environment"]


def resolve_encodings(cfg: CompareConfig) -> list[str]:
    """The config's model names (``all`` expands to every registered encoding; a
    ``NAME=PATTERN`` entry gives ``NAME``; presets stay as they are), cut to its shard."""
    names = available() if cfg.encodings == ["all"] else list(dict.fromkeys(cfg.encoding_names()))
    # every name resolves and builds: checked when the config was made (checks.check_encodings)
    if cfg.shard is not None:
        i, n = parse_shard(cfg.shard)
        names = names[i - 1 :: n]
    return names


def make_source(cfg: CompareConfig, out: Path | None = None):
    """The data source the config names (embedded corpus by default). Its batches take
    the seed of each model; evaluation data is the same for every seed. A ``data_dir``
    corpus reads its vocabulary from ``out/vocab.json`` when a run wrote one there."""
    if cfg.data_dir is not None:
        from ..data.wikitext import load_wikitext

        vocab = None if out is None else Path(out) / VOCAB_FILE
        return load_wikitext(cfg.data_dir, vocab_file=vocab, seed=0, longest=max(cfg.train_len, *cfg.eval_lens))
    return load_source(
        task=cfg.task, text=cfg.text, dataset=cfg.dataset, dataset_config=cfg.dataset_config,
        dataset_split=cfg.dataset_split, dataset_field=cfg.dataset_field, val_fraction=cfg.val_fraction,
        seed=0, longest=max(cfg.train_len, *cfg.eval_lens), packed=cfg.packed,
    )  # fmt: skip


def _slow_first(cfg: CompareConfig, names: list[str]) -> list[str]:
    """Encodings ordered for worker processes: the ones on slower attention backends first
    (chunked, then the bias backends, then SDPA; within one, more position parameters
    first: their gradients cost time), so that no long job starts last (the longest-first
    rule for jobs on parallel workers)."""
    from ..backends import select_backend
    from ..registry import build

    rank = {"chunked": 0, "eager": 0, "sdpa": 2}  # any other (dense, flex, blockwise ...): 1

    def cost(name: str) -> tuple[int, int]:
        try:
            enc = build(name, heads=cfg.heads, head_dim=cfg.dim // cfg.heads, max_len=cfg.train_len,
                        **cfg.encoding_options.get(name, {}))  # fmt: skip
        except (TypeError, ValueError):  # an encoding that needs other options: no opinion, keep its place
            return (2, 0)
        return rank.get(select_backend(enc, "cpu", cfg.train_len, cfg.train_len, causal=True), 1), -sum(
            p.numel() for p in enc.parameters()
        )

    return sorted(names, key=cost)


def _run_job(job: dict[str, Any]) -> dict[str, Any]:
    """One model on a worker process (module level, so that it pickles)."""
    cfg = from_dict(job["config"])
    return train_encoding(
        cfg, make_source(cfg), job["encoding"], seed=job["seed"], runtime=Runtime(torch.device("cpu")),
        ckpt_dir=Path(job["ckpt_dir"]), resume=job["resume"], progress=job["progress"], position=job["position"],
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
    command: str | None = None,
) -> dict[str, Any]:
    """Train and evaluate every encoding of ``cfg`` once per seed; write the files to
    ``out``; return the results.

    On a CPU with one process (no torchrun), the models train side by side on
    ``cfg.workers`` worker processes of one thread each (0: one per core; see
    :mod:`posenc.compare.pool`); results do not depend on which worker ran them.

    The folder belongs to this run (see :mod:`posenc.output.rundir`): a non-empty one is
    refused unless ``resume`` (continue it; its checkpoints must carry ``cfg``'s
    fingerprint) or ``overwrite`` (start it over: only what the folder's manifest lists is
    removed), and a second process is kept out by a lock for as long as this one runs. A
    run that fails before writing any checkpoint removes what it wrote. ``command``: the
    command line, for ``report.md``.

    Raises:
        ValueError: bad config or encoding names, ``fsdp`` outside ``torchrun``, an unusable
            or busy run folder, a checkpoint from another config or unreadable.
        posenc.data.DataError: the data source cannot be loaded.
    """
    out = Path(out)
    rt = runtime or setup(cfg.device)
    if cfg.fsdp and not rt.distributed:  # it would train unsharded, as if the flag were not given
        raise ValueError(
            "--fsdp shards the model over torchrun's processes, and this is one process (no WORLD_SIZE > 1): "
            "run it under torchrun --nproc_per_node=N (N >= 2) -m posenc.cli compare ..., or drop --fsdp"
        )
    names = resolve_encodings(cfg)
    check_extend(cfg)
    accumulation_steps(cfg.batch_size, rt.world, cfg.micro_batch)  # tokens per update split over these processes
    source = make_source(cfg, out if resume else None)
    jobs = [(name, seed) for name in names for seed in cfg.seeds]
    ckpts = [checkpoint_path(out / "checkpoints", cfg, name, seed) for name, seed in jobs]
    # every path this run may write, listed in the folder's manifest before it is written
    writes = [
        *outputs_of(cfg),
        "checkpoints",
        *(f"checkpoints/{c.name}" for c in ckpts),
    ]
    with contextlib.ExitStack() as stack:
        run_dir = (
            stack.enter_context(RunDir(out, resume=resume, overwrite=overwrite, writes=writes)) if rt.main else None
        )
        try:
            results = _run(cfg, out, jobs, source, rt, resume=resume, progress=progress, log=log, run_dir=run_dir,
                           command=command)  # fmt: skip
        except Exception:
            # nothing worth resuming (no checkpoint): leave the folder as it was, so that the
            # corrected rerun is not refused for the config.json of a run that never trained
            if run_dir is not None and not resume and not any(c.exists() for c in ckpts):
                run_dir.discard()
            raise
    return results


def _run(cfg: CompareConfig, out: Path, jobs, source, rt: Runtime, *, resume, progress, log, run_dir, command):
    """The body of :func:`compare`, in the folder ``run_dir`` holds (rank 0; None on the others)."""
    names = list(dict.fromkeys(name for name, _ in jobs))
    if rt.distributed or rt.device.type != "cpu":
        workers, threads = 1, torch.get_num_threads()
    else:
        workers, threads = plan_workers(cfg.workers, len(jobs))
        if workers == 1:
            threads = torch.get_num_threads()
    if rt.main:
        (out / "checkpoints").mkdir(parents=True, exist_ok=True)
        cfg.save(out / "config.json")
        if cfg.data_dir is not None and not (out / VOCAB_FILE).exists():  # the ids a resumed run must read
            from ..data.wikitext import save_vocab

            save_vocab(out / VOCAB_FILE, source.symbols, source.train_bytes)
    rt.barrier()
    t0 = time.perf_counter()
    runs: list[dict[str, Any] | None] = [None] * len(jobs)

    def done(i: int, run: dict[str, Any]) -> None:
        runs[i] = run
        if rt.main:
            partial = [r for r in runs if r is not None]
            write_json(out / "results.json", {"config": cfg.to_dict(), "fingerprint": cfg.fingerprint(),
                                              "runs": partial})  # fmt: skip
            who = run["encoding"] + (f" seed {run['seed']}" if len(cfg.seeds) > 1 else "")
            log(f"[{len(partial)}/{len(jobs)}] {who}: " + ", ".join(_short(e) for e in run["eval"]))

    if workers > 1:
        order = {n: k for k, n in enumerate(_slow_first(cfg, names))}
        todo = sorted(range(len(jobs)), key=lambda i: (order[jobs[i][0]], i))
        payload = [{"config": cfg.to_dict(), "encoding": jobs[i][0], "seed": jobs[i][1],
                    "ckpt_dir": str(out / "checkpoints"), "resume": resume,
                    "progress": "lines" if progress else False, "position": (k + 1, len(jobs))}
                   for k, i in enumerate(todo)]  # fmt: skip
        log(f"training {len(jobs)} models on {workers} worker processes of {threads} thread(s) each")
        run_jobs(payload, _run_job, workers=workers, threads=threads, on_done=lambda k, r: done(todo[k], r))
    else:
        for i, (name, seed) in enumerate(jobs):
            run = train_encoding(
                cfg, source, name, seed=seed, runtime=rt, ckpt_dir=out / "checkpoints", resume=resume,
                progress=progress, position=(i + 1, len(jobs)), log=log,
            )  # fmt: skip
            done(i, run)
    results = {"config": cfg.to_dict(), "fingerprint": cfg.fingerprint(), "runs": runs,
               "wall_seconds": round(time.perf_counter() - t0, 2), "device": str(rt.device),
               "processes": rt.world}  # fmt: skip
    if rt.main:
        results["command"] = command
        results["environment"] = environment(rt, cfg, runs, workers=workers, threads=threads)
        if cfg.extend:  # the trained rotary models once per extension method (posenc.compare.extend)
            from .extend import run_extend, write_extend

            results["extend"] = run_extend(cfg, source, out / "checkpoints", runs, device=rt.device, log=log)
        with run_dir.recording():
            write_outputs(out, results)
            if results.get("extend"):
                write_extend(out, results, run_subtitle(cfg.to_dict()))
        run_dir.finish()
    return results


def check_extend(cfg: CompareConfig) -> None:
    """``--extend`` needs at least one compared model that a method applies to (a registered
    rotary encoding): refused before any training otherwise, not an empty table after it."""
    if not cfg.extend:
        return
    from ..extend.methods import applies

    names = available() if cfg.encodings == ["all"] else cfg.encoding_names()  # every shard's
    if not any(applies(m, n) for n in names for m in cfg.extend):
        raise ValueError(
            f"--extend {','.join(cfg.extend)} applies to registered rotary encodings (rope; xpos for none and "
            f"ntk), and none is compared ({', '.join(names)}); a layer pattern or preset, named or not, is not "
            "extended even when its layers are rotary: add rope to --encodings, or drop --extend"
        )


def environment(rt: Runtime, cfg: CompareConfig, runs, *, workers: int, threads: int) -> dict[str, Any]:
    """Where the numbers come from: versions, device, processes and threads, dtype, and the
    matmul peak of the training processes (MFU's denominator)."""
    env: dict[str, Any] = {
        "posenc": __version__, "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "device": str(rt.device), "dtype": cfg.dtype,
        "worker_processes": workers, "threads_per_process": threads, "torchrun_processes": rt.world,
    }  # fmt: skip
    if rt.device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(rt.device)
    else:
        env["cpu"] = platform.processor() or platform.machine()
        env["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    peaks = [r["matmul_peak_flops"] for r in runs if r and r.get("matmul_peak_flops")]
    if peaks:  # each process measured its own, at the thread count it trained with
        env["matmul_peak_flops"] = statistics.median(peaks)
    return env


def _short(e: dict[str, Any]) -> str:
    if not e.get("applicable", True):
        return f"{e['length']}: n/a"
    if e.get("ppl") is not None:
        return f"{e['length']}: ppl {e['ppl']:.2f}"
    return f"{e['length']}: acc {100 * e['accuracy']:.1f}%"
