"""Run a whole comparison: setup (device, processes, encodings, data), every model (one per
encoding and seed) in turn or on worker processes side by side, then the output files.

Worker processes: the models of a comparison do not talk to each other, so on a CPU with ``C``
cores, ``C`` one-thread processes each training its own encoding do more work per second than
one process spreading each small model's matmuls over ``C`` threads (whose per-op overhead and
synchronisation dominate at this size; see docs/compare.md for the measurement).
:func:`run_jobs` runs ``fn(job)`` for every job in worker processes started with ``spawn`` (no
fork of a process that holds torch's thread pools), each limited to ``threads`` intra-op
threads, and hands every result to ``on_done`` as soon as it arrives; with ``workers == 1``
everything runs here, in order. A failing job cancels the ones not started and re-raises in the
caller; Ctrl-C stops the workers. Workers die with the process that started them, even when it
is killed with SIGKILL (the OOM killer's signal, which runs no cleanup): on Linux the kernel sends
each worker SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``), and everywhere a watchdog
thread in each worker exits it once its parent is gone (:mod:`posenc.train.lifeline`). A worker
that outlived its run would go on writing checkpoints into a folder whose lock it does not hold.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from .._version import __version__
from ..data import load_source
from ..output import write_json
from ..output.rundir import RunDir
from ..registry import available
from ..train import Runtime, setup
from ..train.lifeline import die_with
from .config import CompareConfig, from_dict, parse_shard
from .plots import run_subtitle
from .report import outputs_of, write_outputs
from .results import Evaluation, ModelRun, RunResults
from .train import accumulation_steps, checkpoint_path, train_encoding

VOCAB_FILE = "vocab.json"  # a data_dir run's vocabulary (JSON), in the run folder

__all__ = ["compare", "make_source", "resolve_encodings", "check_extend", "environment", "run_jobs", "cpu_cores",
           "plan_workers"]  # fmt: skip

J = TypeVar("J")
R = TypeVar("R")


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
    from ..attend.backends import select_backend
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


def _run_job(job: dict[str, Any]) -> ModelRun | None:
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
) -> RunResults:
    """Train and evaluate every encoding of ``cfg`` once per seed; write the files to
    ``out``; return the results (on the processes other than rank 0, without their runs).

    On a CPU with one process (no torchrun), the models train side by side on
    ``cfg.workers`` worker processes of one thread each (0: one per core; see the module
    docstring); results do not depend on which worker ran them.

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
    runs: list[ModelRun | None] = [None] * len(jobs)

    def done(i: int, run: ModelRun | None) -> None:
        runs[i] = run
        if rt.main:
            partial = RunResults(cfg.to_dict(), cfg.fingerprint(), [r for r in runs if r is not None])
            write_json(out / "results.json", partial.to_json())
            who = run.encoding + (f" seed {run.seed}" if len(cfg.seeds) > 1 else "")
            log(f"[{len(partial.runs)}/{len(jobs)}] {who}: " + ", ".join(_short(e) for e in run.evals))

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
    results = RunResults(cfg.to_dict(), cfg.fingerprint(), [r for r in runs if r is not None],
                         wall_seconds=round(time.perf_counter() - t0, 2), device=str(rt.device), processes=rt.world,
                         layout=("config", "fingerprint", "runs", "wall_seconds", "device", "processes"))  # fmt: skip
    if rt.main:
        results.command = command
        results.environment = environment(rt, cfg, results.runs, workers=workers, threads=threads)
        results.include("command", "environment")
        if cfg.extend:  # the trained rotary models once per extension method (posenc.compare.extend)
            from .extend import run_extend, write_extend

            results.extend = run_extend(cfg, source, out / "checkpoints", results.runs, device=rt.device, log=log)
            results.include("extend")
        with run_dir.recording():
            write_outputs(out, results)
            if results.extend:
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


def environment(rt: Runtime, cfg: CompareConfig, runs: list[ModelRun], *, workers: int, threads: int) -> dict[str, Any]:
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
    peaks = [r.matmul_peak_flops for r in runs if r.matmul_peak_flops]
    if peaks:  # each process measured its own, at the thread count it trained with
        env["matmul_peak_flops"] = statistics.median(peaks)
    return env


def _short(e: Evaluation) -> str:
    if not e.applicable:
        return f"{e.length}: n/a"
    if e.has("ppl"):  # no number: NaN, or inf (a finite loss whose perplexity overflows)
        return f"{e.length}: ppl " + (f"{e.ppl:.2f}" if e.ppl is not None else "inf" if e.loss is not None else "NaN")
    return f"{e.length}: acc {100 * e.accuracy:.1f}%"


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def plan_workers(workers: int, jobs: int, cores: int | None = None) -> tuple[int, int]:
    """``(processes, threads per process)`` for ``jobs`` jobs: ``workers`` 0 means one per core
    (at most one per job); the cores are shared out so that processes × threads <= cores."""
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise ValueError(f"workers must be an int >= 0 (0: one per CPU core), got {workers!r}")
    cores = cores or cpu_cores()
    n = max(1, min(workers or cores, jobs))
    return n, max(1, cores // n)


def _init_worker(threads: int, parent: int) -> None:
    import signal

    import torch

    die_with(parent)
    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops the workers


def _call(item):
    fn, i, job = item
    return i, fn(job)


def run_jobs(
    jobs: Sequence[J],
    fn: Callable[[J], R],
    *,
    workers: int,
    threads: int,
    on_done: Callable[[int, R], Any] | None = None,
) -> list[R]:
    """``[fn(job) for job in jobs]``, on ``workers`` processes of ``threads`` threads each.

    ``fn`` and the jobs must be picklable (a module-level function and plain data). Jobs
    start in the given order, each on the next free worker; ``on_done(index, result)``
    runs here, in the order results arrive.
    """
    out: list[Any] = [None] * len(jobs)
    if workers <= 1 or len(jobs) <= 1:
        for i, job in enumerate(jobs):
            out[i] = fn(job)
            if on_done is not None:
                on_done(i, out[i])
        return out
    import multiprocessing as mp

    # leaving the block terminates the workers: after an error, a Ctrl-C, or the last result
    with mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(threads, os.getpid())) as pool:
        for i, result in pool.imap_unordered(_call, [(fn, i, job) for i, job in enumerate(jobs)], chunksize=1):
            out[i] = result  # a worker's exception is re-raised by the iterator, here
            if on_done is not None:
                on_done(i, result)
    return out
