"""RoPE's context-extension scalings: HF's ``rope_scaling`` dict, step for step.

``rope_parameters(scaling, dim=, base=, max_len=, seq_len=)`` returns ``(inv_freq,
attention_factor)`` exactly as ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``
(``linear``, ``dynamic``, ``yarn`` (Peng et al. 2023), ``longrope``, ``llama3``,
``proportional`` (Gemma 4's global layers)): the same float32 ``inv_freq`` and the same
attention factor. One registry, :data:`ROPE_REGISTRY`, maps each ``rope_type`` to its
function and the facts the encoding reads about it (keys, length dependence, width).
:func:`check_scaling` validates and normalises the dict. Used by
:class:`posenc.encodings.rotary.RoPE`; checked against HF in ``tests/test_rope_scaling.py``
and ``tests/test_rope_variants.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import functional as PF

__all__ = ["ROPE_TYPES", "ROPE_REGISTRY", "RopeType", "rope_parameters", "check_scaling", "rotary_width"]


@dataclass(frozen=True)
class RopeType:
    """One ``rope_type``: ``init(scaling, dim, base, orig, max_len, seq_len, partial) -> (inv_freq, factor)``.

    ``keys``: what it reads from the dict (besides ``rope_type`` / ``rope_theta`` /
    ``partial_rotary_factor``); ``required``: those it cannot go without;
    ``length_dependent``: frequencies follow the current length (raw keys in the KV cache);
    ``full_width``: the tables span the whole head and ``partial_rotary_factor`` zeroes the
    tail frequencies instead of shortening the rotated part (``proportional``).
    """

    init: Callable[..., tuple[Tensor, float]]
    keys: frozenset = frozenset()
    required: tuple = ()
    length_dependent: bool = False
    full_width: bool = False


def _default(s, *, dim, base, **_) -> tuple[Tensor, float]:
    return PF.sinusoidal_inv_freq(dim, base), 1.0


def _linear(s, *, dim, base, **_) -> tuple[Tensor, float]:
    inv_freq = PF.sinusoidal_inv_freq(dim, base)
    inv_freq /= s["factor"]
    return inv_freq, 1.0


def _dynamic(s, *, dim, base, orig, seq_len, **_) -> tuple[Tensor, float]:
    factor = s["factor"]
    n = orig if seq_len is None else max(seq_len, orig)
    base = base * ((factor * n / orig) - (factor - 1)) ** (dim / (dim - 2))
    return PF.sinusoidal_inv_freq(dim, base), 1.0


def _yarn(s, *, dim, base, orig, **_) -> tuple[Tensor, float]:
    """YaRN (Peng et al. 2023): NTK-by-parts ramp between interpolated and original frequencies."""
    factor = s["factor"]

    def get_mscale(scale, mscale=1):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(rotations):  # the dimension whose wavelength makes `rotations` turns in orig
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 where the original frequency is kept (high frequencies)
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def _longrope(s, *, dim, base, orig, max_len, seq_len, **_) -> tuple[Tensor, float]:
    factor = s.get("factor")
    if factor is None:
        factor = max_len / orig
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = s["long_factor"] if seq_len and seq_len > orig else s["short_factor"]
    ext = torch.tensor(ext, dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * base**shape), attention_factor


def _llama3(s, *, dim, base, orig, **_) -> tuple[Tensor, float]:
    inv_freq = PF.sinusoidal_inv_freq(dim, base)
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    low_freq_wavelen, high_freq_wavelen = orig / lo, orig / hi
    wavelen = 2 * math.pi / inv_freq
    inv = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)  # low frequencies: / factor
    smooth = (orig / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * inv / factor + smooth * inv
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv), 1.0


def _proportional(s, *, dim, base, partial, **_) -> tuple[Tensor, float]:
    """Gemma 4: the first ``int(p·Dh // 2)`` frequencies of the *full* ``Dh`` spectrum
    (``base^(-2k/Dh)``), the other pairs frequency 0 (unrotated), all ``/ factor``.
    ``partial_rotary_factor`` instead rotates ``p·Dh`` dims with ``base^(-2k/(p·Dh))``."""
    n = int(partial * dim // 2)  # HF: int(rope_proportion * head_dim // 2)
    rotated = 1.0 / (base ** (torch.arange(0, 2 * n, 2, dtype=torch.int64).float() / dim))
    inv_freq = torch.cat((rotated, torch.zeros(dim // 2 - n, dtype=torch.float32)))
    inv_freq /= s.get("factor", 1.0)
    return inv_freq, 1.0


def _ntk_alpha(s, *, dim, base, **_) -> tuple[Tensor, float]:
    """HunYuan's fixed-alpha NTK (``modeling_hunyuan_v1_dense.py``
    ``compute_ntk_alpha_rope_parameters``): the base stretched to ``θ·α^(Dr/(Dr-2))`` whatever
    the length. HF's checkpoints label it ``"dynamic"`` with an ``alpha``; ``factor`` is not read."""
    return PF.sinusoidal_inv_freq(dim, base * s["alpha"] ** (dim / (dim - 2))), 1.0


_ORIG = "original_max_position_embeddings"
ROPE_REGISTRY: dict[str, RopeType] = {
    "default": RopeType(_default),
    "linear": RopeType(_linear, frozenset({"factor"}), ("factor",)),
    "dynamic": RopeType(_dynamic, frozenset({"factor", _ORIG}), ("factor",), length_dependent=True),
    "yarn": RopeType(
        _yarn,
        frozenset(
            {"factor", _ORIG, "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}
        ),
        ("factor",),
    ),
    "longrope": RopeType(
        _longrope,
        frozenset({"factor", _ORIG, "attention_factor", "long_factor", "short_factor"}),
        ("long_factor", "short_factor"),
        length_dependent=True,
    ),
    "llama3": RopeType(
        _llama3,
        frozenset({"factor", _ORIG, "low_freq_factor", "high_freq_factor"}),
        ("factor", "low_freq_factor", "high_freq_factor"),
    ),
    "proportional": RopeType(_proportional, frozenset({"factor"}), full_width=True),
    "ntk_alpha": RopeType(_ntk_alpha, frozenset({"alpha", "factor", _ORIG}), ("alpha",)),
}
ROPE_TYPES = tuple(ROPE_REGISTRY)
# types whose frequencies need original_max_position_embeddings (or max_len)
_NEEDS_ORIG = ("dynamic", "yarn", "longrope", "llama3")


def rope_parameters(
    scaling: dict,
    *,
    dim: int,
    base: float,
    max_len: int | None,
    seq_len: int | None = None,
    partial_rotary_factor: float = 1.0,
) -> tuple[Tensor, float]:
    """``(inv_freq (Dr/2,) float32, attention_factor)`` for a validated ``rope_scaling`` dict.

    The arithmetic is HF's ``ROPE_INIT_FUNCTIONS[rope_type](config, seq_len=seq_len)``
    step for step, so the results are bit-identical. ``max_len`` plays the role of
    ``config.max_position_embeddings``; ``original_max_position_embeddings`` defaults
    to it. ``seq_len`` matters only for ``dynamic`` and ``longrope``;
    ``partial_rotary_factor`` only for ``proportional`` (whose ``dim`` is the full ``Dh``).
    """
    kind = scaling["rope_type"]
    if kind not in ROPE_REGISTRY:
        raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {kind!r}")
    orig = scaling.get(_ORIG) or max_len
    return ROPE_REGISTRY[kind].init(
        scaling, dim=dim, base=base, orig=orig, max_len=max_len, seq_len=seq_len, partial=partial_rotary_factor
    )


def scaling_type(scaling: dict | None) -> str:
    """The ``rope_type`` of a ``rope_scaling`` dict (``"default"`` for ``None``); ``ValueError`` if unknown."""
    if scaling is None:
        return "default"
    if not isinstance(scaling, dict):
        raise TypeError(f"rope_scaling must be a dict (HF form) or None, got {type(scaling).__name__}")
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind not in ROPE_REGISTRY:
        raise ValueError(f"rope_scaling rope_type must be one of {ROPE_TYPES}, got {kind!r}")
    return kind


def rotary_width(head_dim: int, partial_rotary_factor: float, rope_scaling: dict | None) -> int:
    """``Dr``, the dims the cos/sin tables span: ``int(Dh·p)``, or ``Dh`` for a full-width type."""
    if ROPE_REGISTRY[scaling_type(rope_scaling)].full_width:
        return head_dim
    return int(head_dim * partial_rotary_factor)


def check_scaling(scaling: dict | None, dim: int, max_len: int | None) -> dict:
    """Validate ``rope_scaling`` and return a normalised copy with ``rope_type`` set."""
    kind = scaling_type(scaling)
    if scaling is None:
        return {"rope_type": "default"}
    s = dict(scaling)
    s.pop("rope_type", None), s.pop("type", None)
    s.pop("rope_theta", None), s.pop("partial_rotary_factor", None)  # handled by the caller
    spec = ROPE_REGISTRY[kind]
    unknown = sorted(set(s) - spec.keys)
    if unknown:
        raise ValueError(f"unknown rope_scaling key(s) {unknown} for rope_type {kind!r}; valid: {sorted(spec.keys)}")
    missing = [k for k in spec.required if s.get(k) is None]
    if missing:
        raise ValueError(f"rope_scaling of type {kind!r} needs {missing}")
    f = s.get("factor")
    if f is not None and (not isinstance(f, (int, float)) or f <= 0):
        raise ValueError(f"rope_scaling factor must be a positive number, got {f!r}")
    if kind in _NEEDS_ORIG:
        orig = s.get(_ORIG) or max_len
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
