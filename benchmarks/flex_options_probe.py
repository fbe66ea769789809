"""Which FlexAttention ``kernel_options`` compile for an encoding on CUDA (one GPU session's probe).

Inkling's ``score_mod`` (a per-row table gathered at ``q - k``) failed to compile on an H200 at
16 heads of 64 channels in bfloat16: "out of resource: triton_tem_fused_flex_attention_0
Required: 249856 Hardware limit: 232448" (shared memory). This runs one posenc ``flex`` call per
(encoding, options), forward, then forward + backward, and prints what compiled and its time:

    python benchmarks/flex_options_probe.py --encodings inkling,inkling-temperature --length 512
"""

from __future__ import annotations

import sys
import time

import torch

import posenc
import posenc.attend.flex as flex_mod
from posenc import registry
from posenc.cli_types import OneLineParser
from posenc.fields import Choice, Int, ListOf

VARIANTS = [None, {"num_stages": 1}, {"num_stages": 2}, {"BLOCK_M": 64, "BLOCK_N": 64}, {"BLOCK_M": 64, "BLOCK_N": 32}]
_BASE = flex_mod._flex_attention  # posenc's own, before the probe replaces it


def with_options(options):
    """posenc's compiled flex call with ``kernel_options`` added."""
    base = _BASE("cuda")

    def run(*args, **kwargs):
        return base(*args, kernel_options=options, **kwargs) if options else base(*args, **kwargs)

    return lambda device_type: run


def one(name: str, L: int, dtype, options, backward: bool) -> str:
    torch.manual_seed(0)
    attn = posenc.Attention(16 * 64, 16, name, head_dim=64, max_len=2 * L, backend="flex").to("cuda", dtype)
    x = torch.randn(1, L, 16 * 64, device="cuda", dtype=dtype, requires_grad=backward)
    flex_mod._flex_attention = with_options(options)
    try:
        t = time.perf_counter()
        out = attn(x)
        if backward:
            out.float().sum().backward()
        torch.cuda.synchronize()
        first = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(5):
            out = attn(x)
            if backward:
                out.float().sum().backward()
        torch.cuda.synchronize()
        return f"ok: first {first:6.2f} s, then {1e3 * (time.perf_counter() - t) / 5:7.3f} ms"
    except Exception as e:  # noqa: BLE001 (the probe reports every failure as one line)
        lines = [s for s in str(e).splitlines() if s.strip()]
        return (
            "FAILED: "
            + type(e).__name__
            + ": "
            + next((s for s in lines if "resource" in s), lines[0] if lines else "")[:160]
        )


def main(argv=None) -> int:
    ap = OneLineParser(prog="flex_options_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--encodings", type=ListOf(Choice(registry.available, what="encoding")).parse, default="inkling")
    ap.add_argument("--length", type=Int(16, 1 << 16).parse, default=512)
    ap.add_argument("--variants", type=Int(1, len(VARIANTS)).parse, default=len(VARIANTS), help="the first N options")
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    for name in args.encodings:
        for dtype in (torch.bfloat16, torch.float32):
            for options in VARIANTS[: args.variants]:
                for backward in (False, True):
                    verdict = one(name, args.length, dtype, options, backward)
                    step = "fwd+bwd" if backward else "fwd    "
                    print(f"{name:20s} {str(dtype)[6:]:9s} {step} {options}: {verdict}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
