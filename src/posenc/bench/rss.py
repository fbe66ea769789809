"""Peak resident memory of one layer step, each case in a fresh process.

What "fits in 24 GiB" means is the process's resident set, not the bytes of the tensors
alive at once (the profiler method of :mod:`.measure`): the C allocator keeps freed
memory, and blocks that grow with the key count can fragment its heap (CoPE's blocked
backward once peaked at 9 GiB resident for ~1 GiB of live tensors at L = 8192), and the
profiler itself cannot record FLOATER's ODE solve (its event list outgrows the machine).
:func:`peak_rss` therefore runs the case in a child process (``python -m
posenc.bench.rss``, the spec as JSON on stdin) and reads the child's peak resident set
(``ru_maxrss``) after one forward+backward, with the C allocator set as in the parent
(``posenc.tune_allocator``, ``spec["allocator"]``). CPU only.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import torch

from ..allocator import allocator_settings, tune_allocator
from .layers import baseline_case, posenc_case, resolved_backend
from .measure import layer_step

__all__ = ["peak_rss"]


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss(spec: dict, timeout: float | None = None) -> dict:
    """``{"peak_bytes", "before_bytes", "backend", "allocator"}`` of one fwd+bwd of the case ``spec``
    (the keys :func:`_child` reads) in a fresh process; raises RuntimeError when it fails
    (a process killed for memory included)."""
    proc = subprocess.run(
        [sys.executable, "-m", "posenc.bench.rss"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        why = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        tail = proc.stderr.strip().splitlines()[-1:] or [""]
        raise RuntimeError(f"child {why}: {tail[0][:200]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _child(spec: dict) -> dict:
    torch.set_num_threads(spec.get("threads", 1))
    alloc = spec.get("allocator")
    if alloc:  # the parent's posenc.tune_allocator settings, so that both measure one setup
        tune_allocator(alloc["mmap_threshold"], alloc["trim_threshold"])
    device, dtype = torch.device("cpu"), getattr(torch, spec["dtype"])
    kw = dict(heads=spec["heads"], head_dim=spec["head_dim"], causal=spec["causal"], device=device, dtype=dtype)
    if spec["encoding"] == "none":
        case = baseline_case(**kw)
    else:
        case = posenc_case(
            spec["encoding"],
            max_len=spec["max_len"],
            backend=spec["backend"],
            chunk_size=spec["chunk_size"],
            **spec.get("options", {}),
            **kw,
        )
    L, D = spec["L"], spec["heads"] * spec["head_dim"]
    g = torch.Generator(device="cpu").manual_seed(spec["seed"] + L)
    x = torch.randn(spec["batch"], L, D, generator=g).to(dtype=dtype)
    grad = torch.randn(spec["batch"], L, D, generator=g).to(dtype=dtype)
    torch.manual_seed(spec["seed"])
    module, fn = case.make(L)
    backend = resolved_backend(case, module, device, L)
    before = _current_rss()
    layer_step(module, fn, x, grad, "fwd+bwd")()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"peak_bytes": peak, "before_bytes": before, "backend": backend, "allocator": allocator_settings()}


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.stdin.read()))))
