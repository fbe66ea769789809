"""Forward+backward time of the rotary and bias encodings, as ratios to plain causal SDPA.

The attention core only (no projections): ``q, k, v`` ``(B, H, L, Dh)`` with gradients,
the encoding's stages and the backend the library runs, then ``backward`` of a random
projection of the output (gradients also reach the encoding's parameters). Configurations
are timed round-robin, ``--repeats`` rounds, median per configuration, so a contended
machine slows them alike; ratios are against ``sdpa`` (no position) of the same run.

    PYTHONPATH=src python benchmarks/rotary_bias_fwd_bwd.py --length 2048 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import posenc


def make_cases(L: int, H: int, Dh: int):
    """name -> (encoding or None, backend)."""
    cases = {"sdpa (no position)": (None, "sdpa")}
    for name, opts in (("rope", {}), ("xpos", {})):
        cases[name] = (dict(name=name, **opts), "sdpa")
    for name, opts in (
        ("alibi", {}),
        ("kerple", {"kernel": "log"}),
        ("kerple-power", {"kernel": "power"}),
        ("fire", {}),
    ):
        for backend in ("dense", "chunked"):
            cases[f"{name} [{backend}]"] = (dict(name=name.split("-")[0], **opts), backend)
    return cases


def build_runner(spec, backend: str, L: int, H: int, Dh: int):
    if spec is None:

        def run(q, k, v, pos):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return run, []
    spec = dict(spec)
    name = spec.pop("name")
    attn = posenc.Attention(H * Dh, H, name, causal=True, max_len=L, backend=backend, **spec)
    enc = attn.encoding
    attend = posenc.BACKENDS[attn.resolve_backend(backend, "cpu")]
    mask = posenc.AttentionMask(causal=True)

    def run(q, k, v, pos):
        q, k = enc.rotate(q, k, pos, pos)
        return attend(enc, q, k, v, pos, pos, mask, options=attn.block_options)

    return run, [p for p in enc.parameters() if p.requires_grad]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--only", nargs="*", help="substrings of case names to keep (baseline always kept)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, H, L, Dh = args.batch, args.heads, args.length, args.head_dim
    pos = torch.arange(L).unsqueeze(0)
    q0, k0, v0 = torch.randn(3, B, H, L, Dh).unbind(0)
    grad_out = torch.randn(B, H, L, Dh)
    cases = make_cases(L, H, Dh)
    if args.only:
        cases = {n: c for n, c in cases.items() if n.startswith("sdpa") or any(s in n for s in args.only)}
    runners = {n: build_runner(spec, be, L, H, Dh) for n, (spec, be) in cases.items()}

    def once(run, params):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        t0 = time.perf_counter()
        out = run(q, k, v, pos)
        out.backward(grad_out)
        return time.perf_counter() - t0

    for run, params in runners.values():  # warm-up
        once(run, params)
    times = {n: [] for n in runners}
    for _ in range(args.repeats):
        for n, (run, params) in runners.items():
            times[n].append(once(run, params))
    base = statistics.median(times["sdpa (no position)"])
    print(f"B={B} H={H} L={L} Dh={Dh} threads={args.threads} repeats={args.repeats} torch={torch.__version__}")
    print(f"{'case':28s} {'median ms':>10s} {'ratio':>7s}")
    for n, ts in times.items():
        m = statistics.median(ts)
        print(f"{n:28s} {1000 * m:10.1f} {m / base:7.2f}")


if __name__ == "__main__":
    main()
