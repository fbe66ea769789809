"""PyTorch's CPU flash-attention kernel, called with its log-sum-exp.

``F.scaled_dot_product_attention`` hides the row log-sum-exp that the fused kernel
computes; these wrappers call the kernel itself so that several calls over different
key ranges can be merged exactly (:func:`merge_into`) and differentiated with the
merged output (FlashAttention-2's split-KV backward: each part's backward needs only the
*global* output and log-sum-exp, because ``P_ij = exp(s_ij - lse_i)`` and
``D_i = Σ_d dO_id·O_id`` are row quantities of the whole softmax).

Shapes: ``q`` ``(B, H, Lq, Dh)``, ``k, v`` ``(B, H, Lk, Dh)`` (one head size for all
three: the kernel requires it), ``lse`` ``(B, H, Lq)`` float32. ``causal`` is the
kernel's top-left alignment: row ``t`` of the call sees keys ``0..t`` of the call.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
from torch import Tensor

__all__ = [
    "flash_forward",
    "flash_backward",
    "flush_denormals",
    "known_finite",
    "merge_into",
    "needs_upcast",
    "propagate_nonfinite",
    "safe_lse",
]

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@functools.cache
def _bf16_flash_works() -> bool:
    """Whether this CPU's flash kernel runs bfloat16 over 64+ keys, forward and backward.

    torch 2.13's CPU kernel packs bfloat16 with an AVX-512 instruction and raises
    ``RuntimeError: pack_vnni2 is only supported when avx512 is supported`` on CPUs
    without AVX-512 (or under ``ATEN_CPU_CAPABILITY=avx2``/``default``), from 64 keys on;
    ``F.scaled_dot_product_attention`` fails the same way. float16 is not affected.
    """
    x = torch.zeros(1, 1, 128, 8, dtype=torch.bfloat16)
    try:
        out, lse = _FWD(x, x, x, 0.0, True, scale=1.0)
        _BWD(out, x, x, x, out, lse, 0.0, True, scale=1.0)
        return True
    except RuntimeError:
        return False


def needs_upcast(t: Tensor) -> bool:
    """True for a CPU bfloat16 tensor on a CPU whose fused kernel cannot run bfloat16
    (:func:`_bf16_flash_works`): the callers then run the kernel in float32 and cast back."""
    return t.dtype == torch.bfloat16 and t.device.type == "cpu" and not _bf16_flash_works()


def _f32(t: Tensor | None) -> Tensor | None:
    return t.float() if t is not None and t.is_floating_point() else t


def flash_forward(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float, causal: bool, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Fused attention of one call: ``(out (B, H, Lq, Dh), lse (B, H, Lq) float32)``.

    ``mask``: additive, the dtype of ``q``, broadcastable to ``(B, H, Lq, Lk)``. A row whose
    keys are all masked comes back as ``out = 0, lse = 0``: callers fix its ``lse``.
    """
    if needs_upcast(q):
        out, lse = _FWD(q.float(), k.float(), v.float(), 0.0, causal, attn_mask=_f32(mask), scale=scale)
        return out.to(q.dtype), lse
    return _FWD(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)


def flash_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    scale: float,
    causal: bool,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of one call, given the output and log-sum-exp of the whole softmax."""
    if needs_upcast(q):
        args = (grad_out.float(), q.float(), k.float(), v.float(), out.float(), lse)
        dq, dk, dv = _BWD(*args, 0.0, causal, attn_mask=_f32(mask), scale=scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    return _BWD(grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


def _flushing() -> bool:
    """Whether this thread already flushes denormal floats (then a denormal product is 0)."""
    return float(torch.tensor(torch.finfo(torch.float32).tiny) * 0.5) == 0.0


@contextlib.contextmanager
def flush_denormals():
    """Flush denormal floats to zero on this thread for the duration (state restored after).

    A softmax weight ``exp(s - lse)`` of ``2^-149 .. 2^-126`` is a denormal; x86 handles
    each in microcode, ~100x slower than a normal float. Biases that grow with distance
    (ALiBi, a long key range) make a large share of the weights denormal, and the fused
    kernel's backward slows down several times for values that are 0 to float32 precision
    of the output. ``torch.set_flush_denormal`` sets the calling thread only: with several
    OpenMP threads, the others keep the slow path.
    """
    if _flushing():
        yield
        return
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def safe_lse(lse: Tensor) -> Tensor:
    """``lse`` with ``-inf`` (a row that sees no key) replaced by 0, so ``exp(s - lse) = 0``."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def merge_into(
    out: Tensor, lse: Tensor, rows: slice, part_out: Tensor, part_lse: Tensor, heads: slice = slice(None)
) -> None:
    """Merge one partial softmax over a key subset into the running ``(out, lse)`` of ``rows``.

    ``out`` ``(B, H, Lq, Dh)`` float32 and ``lse`` ``(B, H, Lq)`` float32 are updated in
    place (only the ``heads`` given); ``part_out`` is the part's normalised output,
    ``part_lse`` its log-sum-exp (``-inf`` for rows the part gives nothing).
    """
    old = lse[:, heads, rows]
    new = torch.logaddexp(old, part_lse)
    ref = safe_lse(new)
    keep = torch.exp(old - ref).unsqueeze(-1)
    add = torch.exp(part_lse - ref).unsqueeze(-1)
    o = out[:, heads, rows]
    o.mul_(keep).add_(part_out.float() * add)
    lse[:, heads, rows] = new


def known_finite(*tensors: Tensor) -> bool:
    """True when every element of ``tensors`` is finite, read on the host where that costs no
    device sync (CPU tensors, outside ``torch.compile``): one float32 sum each, so an overflow
    reads as not finite, and so does every tensor off the CPU (False: check per head)."""
    if not all(t.is_cpu for t in tensors) or torch.compiler.is_compiling():
        return False
    total = 0.0
    for t in tensors:
        if t.numel():
            t = t.detach() if t.requires_grad else t
            total += float(t.sum() if t.dtype == torch.float32 else t.sum(dtype=torch.float32))
    return math.isfinite(total)


def propagate_nonfinite(
    out: Tensor, q: Tensor, k: Tensor, v: Tensor, checked: int = 0, queries_checked: bool = False
) -> Tensor:
    """``out`` ``(B, H, Lq, Dh)`` with NaN in every (batch row, head) whose ``q``, ``k`` or ``v`` holds a
    NaN or an infinity (``k``/``v`` may have ``H/g`` heads: grouped, query head ``h`` reads key
    head ``h // g``), unchanged elsewhere (bit for bit: ``x + 0``): every backend's rule
    for non-finite input (:mod:`posenc.attend.backends`).

    The kernels alone would not agree: this flash kernel treats a query row whose scores are
    all NaN like a row that sees no key and returns zeros where ``eager`` returns NaN, and
    which rows a NaN key or value reaches depends on each kernel's masking and block
    skipping. The cost: three reductions over ``q``, ``k``, ``v`` and one add, no host sync; on
    CPU, where reading the sums back costs no sync, a call whose input is all finite returns
    ``out`` itself after the three sums (:func:`known_finite`).
    ``checked``: key rows a cache checked when it wrote them (``AttentionMask.checked_keys``),
    left out of the reductions (a decoding step then reads only its new keys);
    ``queries_checked``: that check read ``q`` too (``AttentionMask.checked_queries``): with every
    key checked, nothing is left to read.
    """
    every = checked >= k.shape[2]  # (a decoding step whose keys the cache checked: the query alone)
    if every and queries_checked:
        return out
    if checked and not every:
        k, v = k[:, :, checked:], v[:, :, checked:]
    if known_finite(q) if every else known_finite(q, k, v):  # (CPU: one sum per tensor, nothing added)
        return out
    if every:
        with torch.no_grad():
            flag = q.sum((-2, -1), keepdim=True, dtype=torch.float32).mul_(0.0)
        return out + flag.to(out.dtype)
    with torch.no_grad():  # a constant: 0 or NaN per (b, h), summed in float32 (no overflow to inf)
        flag = q.sum((-2, -1), keepdim=True, dtype=torch.float32)
        for t in (k, v):  # grouped k/v (fewer heads): each key head stands for its group of query heads
            s = t.sum((-2, -1), keepdim=True, dtype=torch.float32)
            flag += s if s.shape[1] in (1, flag.shape[1]) else s.repeat_interleave(flag.shape[1] // s.shape[1], 1)
        flag.mul_(0.0)  # (B, H, 1, 1): NaN where a sum met a NaN or an infinity
    return out + flag.to(out.dtype)
