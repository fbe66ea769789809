"""The ``flex`` backend: FlexAttention with the encoding's ``score_mod`` and the mask's ``mask_mod``.

The ``score_mod`` is the bias stage's, composed with the encoding's soft-cap when it has one
(:func:`flex_score_mod`; a pure rotary encoding with a cap gets the cap alone).

Compiled on CUDA (the fused kernel, no ``L×L`` tensor); elsewhere the unfused reference
(forward only). Registered in :data:`posenc.BACKENDS` by :mod:`posenc.attend.backends`.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from ..base import Stage
from ..kernels.flash import propagate_nonfinite
from ..mask import AttentionMask
from .choice import FLEX_MIN_HEAD_DIM
from .sinks import append_sink_key, sink_mods

__all__ = ["flex", "flex_score_mod", "check_flex_heads", "FLEX_RECOMPILE_LIMIT"]


_compiled_flex = None

# Dynamo keeps at most ``recompile_limit`` (8) compiled entries per function, and FlexAttention is
# one function for every encoding's score_mod, every mask and (static shapes) every length: past
# 8 in one process it ran uncompiled, the unfused L x L path (seen in a CUDA benchmark's log).
# The compiled call raises the limit to this (never lowers one the user set).
FLEX_RECOMPILE_LIMIT = 256


def _flex_attention(device_type: str):
    """FlexAttention: compiled on CUDA (fused kernel; called under :func:`_recompile_limit`);
    the eager reference elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if device_type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        compiled = torch.compile(flex_attention, dynamic=False)

        def run(*args, **kwargs):
            if torch.compiler.is_compiling():  # inside the user's compiled model: its limits
                return compiled(*args, **kwargs)
            with _recompile_limit():
                return compiled(*args, **kwargs)

        _compiled_flex = run
    return _compiled_flex


def _recompile_limit():
    """Dynamo's per-function and accumulated recompile limits raised to at least
    :data:`FLEX_RECOMPILE_LIMIT` and 4x that, for the duration of the block."""
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # torch < 2.7
    limits = {name: max(getattr(cfg, name), FLEX_RECOMPILE_LIMIT)}
    if hasattr(cfg, "accumulated_recompile_limit"):
        limits["accumulated_recompile_limit"] = max(cfg.accumulated_recompile_limit, 4 * FLEX_RECOMPILE_LIMIT)
    return cfg.patch(**limits)


def check_flex_heads(device_type: str, head_dim: int, value_dim: int) -> None:
    """On CUDA, a ``ValueError`` for heads narrower than :data:`~posenc.attend.choice.FLEX_MIN_HEAD_DIM`
    channels (q/k ``head_dim`` or values ``value_dim``), which FlexAttention's compiled kernel
    refuses (inside inductor, with a lowering error); elsewhere (the unfused reference) nothing."""
    if device_type == "cuda" and min(head_dim, value_dim) < FLEX_MIN_HEAD_DIM:
        raise ValueError(
            f"backend 'flex' on CUDA needs heads of at least {FLEX_MIN_HEAD_DIM} channels (FlexAttention's compiled "
            f"kernel), got head_dim={head_dim} (values {value_dim}); use backend='auto', 'dense' or 'chunked'"
        )


def flex_score_mod(enc, q_pos: Tensor, k_pos: Tensor, ctx=None):
    """The ``score_mod`` of ``enc`` (``q_pos``/``k_pos`` ``(B, L)``): its bias's (None without a
    bias stage), composed with its soft-cap ``c·tanh(s/c)`` when ``enc.softcap`` is set."""
    mod = enc.score_mod(q_pos, k_pos, ctx=ctx) if enc.stages & Stage.BIAS else None
    cap = enc.softcap
    if cap is None:
        return mod

    def capped(score, b, h, q_idx, kv_idx):
        s = score if mod is None else mod(score, b, h, q_idx, kv_idx)
        return torch.tanh(s / cap) * cap

    return capped


def flex(
    enc, q, k, v, q_pos, k_pos, mask: AttentionMask, *, ctx=None, qk_proj=None, options=None, sinks=None, dropout=0.0
) -> Tensor:
    """FlexAttention with the encoding's ``score_mod`` and the mask's ``mask_mod``.

    Raises:
        ValueError: attention dropout (``dropout > 0``): FlexAttention has none (a ``score_mod``
            changes scores before the softmax; dropout acts on the probabilities after it);
            on CUDA, heads narrower than :data:`~posenc.attend.choice.FLEX_MIN_HEAD_DIM`
            channels, which its compiled kernel cannot run.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    if dropout:
        raise ValueError(
            f"backend 'flex' has no attention dropout (FlexAttention acts before the softmax), got dropout={dropout}; "
            "use backend='auto', 'dense' or 'chunked'"
        )

    check_flex_heads(q.device.type, q.shape[-1], v.shape[-1])
    (B, _, Lq, _), Lk = q.shape, k.shape[2]
    score_mod = flex_score_mod(enc, q_pos.expand(B, Lq), k_pos.expand(B, Lk), ctx)
    mask_mod = mask.mask_mod()
    if sinks is not None:  # key Lk: the sink key
        score_mod, mask_mod = sink_mods(score_mod, mask_mod, sinks, Lk)
        k, v = append_sink_key(k, v)
    batch, dev = B if mask.batched else None, q.device.type
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, batch, None, Lq, k.shape[2], device=dev)
    with warnings.catch_warnings():
        # off CUDA the unfused reference runs on purpose (FlexAttention has no CPU backward)
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        run = _flex_attention(q.device.type)
        key = (type(enc), q.dtype, q.shape[-1], v.shape[-1], q.device)
        out = _fitted_call(run, key, q, k, v, score_mod=score_mod, block_mask=block_mask, scale=enc.scale)
    return propagate_nonfinite(out, q, k, v, mask.checked_keys, mask.checked_queries)


# Kernel options tried, in order, when the compiled kernel does not fit the GPU's shared memory
# (inductor: "out of resource ... Reducing block sizes or `num_stages` may help"). Inkling's
# score_mod (a per-row table gathered at q - k) at 64-channel bfloat16 heads asked for 244 KiB on
# an H200 (227 KiB there); num_stages 2 and 1 compiled, forward and backward
# (benchmarks/flex_options_probe.py; benchmarks/RESULTS-cuda.md).
FLEX_SMALLER_OPTIONS = ({"num_stages": 2}, {"num_stages": 1})
_fitted: dict = {}  # (encoding class, dtype, q/k and value widths, device) -> the options that compiled


def _out_of_resource(err: Exception) -> bool:
    return "out of resource" in str(err)


def _fitted_call(run, key, q, k, v, **kwargs):
    """``run(q, k, v, **kwargs)``; when its compile runs out of shared memory, again with each of
    :data:`FLEX_SMALLER_OPTIONS` as ``kernel_options`` until one compiles (remembered per ``key``,
    with one warning naming it). Any other error, or the first refusal when none fits, is raised."""
    if (options := _fitted.get(key)) is not None:
        return run(q, k, v, kernel_options=options, **kwargs)
    refused = None
    for options in (None, *FLEX_SMALLER_OPTIONS):
        try:
            out = run(q, k, v, **kwargs) if options is None else run(q, k, v, kernel_options=options, **kwargs)
        except Exception as err:  # noqa: BLE001 (inductor's errors have no common public type)
            if not _out_of_resource(err):
                raise
            refused = refused or err
            continue
        if options is not None:
            _fitted[key] = options
            warnings.warn(
                f"FlexAttention's kernel for {key[0].__name__} ({key[1]}, {key[2]}-channel heads) did not fit the "
                f"GPU's shared memory with inductor's defaults; it runs with kernel_options={options}",
                stacklevel=4,
            )
        return out
    raise refused
