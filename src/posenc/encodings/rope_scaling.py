"""RoPE's context-extension scalings: HF's ``rope_scaling`` dict, step for step.

``rope_parameters(scaling, dim=, base=, max_len=, seq_len=)`` returns ``(inv_freq,
attention_factor)`` exactly as ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``
(``linear``, ``dynamic``, ``yarn`` (Peng et al. 2023), ``longrope``, ``llama3``): the same
float32 ``inv_freq`` and the same attention factor. :func:`check_scaling` validates and
normalises the dict. Used by :class:`posenc.encodings.rotary.RoPE`; checked against HF
in ``tests/test_rope_scaling.py``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import functional as PF

__all__ = ["ROPE_TYPES", "rope_parameters", "check_scaling"]

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# keys each type reads from the dict (besides rope_type / rope_theta / partial_rotary_factor)
_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor", "original_max_position_embeddings"},
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
    "longrope": {"factor", "original_max_position_embeddings", "attention_factor", "long_factor", "short_factor"},
    "llama3": {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"},
}
_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "longrope": ("long_factor", "short_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}


def rope_parameters(
    scaling: dict, *, dim: int, base: float, max_len: int | None, seq_len: int | None = None
) -> tuple[Tensor, float]:
    """``(inv_freq (Dr/2,) float32, attention_factor)`` for a validated ``rope_scaling`` dict.

    The arithmetic is HF's ``ROPE_INIT_FUNCTIONS[rope_type](config, seq_len=seq_len)``
    step for step, so the results are bit-identical. ``max_len`` plays the role of
    ``config.max_position_embeddings``; ``original_max_position_embeddings`` defaults
    to it. ``seq_len`` matters only for ``dynamic`` and ``longrope``.
    """
    kind = scaling["rope_type"]
    orig = scaling.get("original_max_position_embeddings") or max_len
    if kind == "default":
        return PF.sinusoidal_inv_freq(dim, base), 1.0
    if kind == "linear":
        inv_freq = PF.sinusoidal_inv_freq(dim, base)
        inv_freq /= scaling["factor"]
        return inv_freq, 1.0
    if kind == "dynamic":
        factor = scaling["factor"]
        s = orig if seq_len is None else max(seq_len, orig)
        base = base * ((factor * s / orig) - (factor - 1)) ** (dim / (dim - 2))
        return PF.sinusoidal_inv_freq(dim, base), 1.0
    if kind == "yarn":
        return _yarn(scaling, dim, base, orig)
    if kind == "longrope":
        factor = scaling.get("factor")
        if factor is None:
            factor = max_len / orig
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        ext = scaling["long_factor"] if seq_len and seq_len > orig else scaling["short_factor"]
        ext = torch.tensor(ext, dtype=torch.float32)
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (ext * base**shape), attention_factor
    if kind == "llama3":
        inv_freq = PF.sinusoidal_inv_freq(dim, base)
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        low_freq_wavelen, high_freq_wavelen = orig / lo, orig / hi
        wavelen = 2 * math.pi / inv_freq
        inv = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)  # low frequencies: / factor
        smooth = (orig / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv / factor + smooth * inv
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv), 1.0
    raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {kind!r}")


def _yarn(scaling: dict, dim: int, base: float, orig: int) -> tuple[Tensor, float]:
    """YaRN (Peng et al. 2023): NTK-by-parts ramp between interpolated and original frequencies."""
    factor = scaling["factor"]

    def get_mscale(scale, mscale=1):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations):  # the dimension whose wavelength makes `rotations` turns in orig
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 where the original frequency is kept (high frequencies)
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def check_scaling(scaling: dict | None, dim: int, max_len: int | None) -> dict:
    """Validate ``rope_scaling`` and return a normalised copy with ``rope_type`` set."""
    if scaling is None:
        return {"rope_type": "default"}
    if not isinstance(scaling, dict):
        raise TypeError(f"rope_scaling must be a dict (HF form) or None, got {type(scaling).__name__}")
    s = dict(scaling)
    kind = s.pop("rope_type", None) or s.pop("type", None) or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling rope_type must be one of {ROPE_TYPES}, got {kind!r}")
    s.pop("rope_theta", None), s.pop("partial_rotary_factor", None)  # handled by the caller
    unknown = sorted(set(s) - _KEYS[kind])
    if unknown:
        raise ValueError(f"unknown rope_scaling key(s) {unknown} for rope_type {kind!r}; valid: {sorted(_KEYS[kind])}")
    missing = [k for k in _REQUIRED.get(kind, ()) if s.get(k) is None]
    if missing:
        raise ValueError(f"rope_scaling of type {kind!r} needs {missing}")
    f = s.get("factor")
    if f is not None and (not isinstance(f, (int, float)) or f <= 0):
        raise ValueError(f"rope_scaling factor must be a positive number, got {f!r}")
    if kind != "linear" and kind != "default":
        orig = s.get("original_max_position_embeddings") or max_len
        if orig is None or orig < 1:
            raise ValueError(
                f"rope_type {kind!r} needs original_max_position_embeddings in rope_scaling or max_len, got {orig!r}"
            )
    if kind == "longrope":
        for key in ("long_factor", "short_factor"):
            if len(s[key]) != dim // 2:
                raise ValueError(f"longrope {key} must have rotary_dim/2 = {dim // 2} entries, got {len(s[key])}")
        if s.get("factor") is None and max_len is None:
            raise ValueError("longrope without factor needs max_len (factor = max_len / original)")
    if kind == "llama3" and s["high_freq_factor"] <= s["low_freq_factor"]:
        raise ValueError(
            f"llama3 needs high_freq_factor > low_freq_factor, got {s['high_freq_factor']}, {s['low_freq_factor']}"
        )
    s["rope_type"] = kind
    return s
