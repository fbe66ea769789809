"""Rotary position embedding (RoPE), its context-extension scalings, and xPos.

* ``rope`` — Su et al., "RoFormer: Enhanced Transformer with Rotary Position
  Embedding", 2021. Each pair of query/key dimensions is rotated by ``pos · θ_k``,
  ``θ_k = base^(-2k/Dr)``, so ``q̃_i·k̃_j`` depends on ``i - j`` only.
* ``xpos`` — Sun et al., "A Length-Extrapolatable Transformer", 2022. RoPE whose
  pair ``k`` is also scaled by ``ζ_k^(n/scale_base)`` on queries and ``ζ_k^(-n/scale_base)``
  on keys, ``ζ_k = (2k/Dr + γ)/(1 + γ)``: an exponential decay in ``i - j``.

Two layouts of the pairs (``layout=``), converted into each other by
:func:`permute_for_layout` (a permutation of the rows of ``W_Q``/``W_K``):

* ``"half"``: pairs ``(x_k, x_{k+Dr/2})``, HF Llama ``rotate_half`` (also NeoX,
  Mistral, Qwen, Gemma);
* ``"interleaved"``: pairs ``(x_{2k}, x_{2k+1})``, RoFormer, GPT-J, Meta's Llama.

``rope_scaling`` takes HF's dict (``{"rope_type": "linear"|"dynamic"|"yarn"|
"longrope"|"llama3", "factor": …, …}``) and reproduces, operation for operation,
``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``: the same float32
``inv_freq`` and the same attention factor, which multiplies ``cos`` and ``sin``.

Length-dependent types (``dynamic``, ``longrope``) pick their frequencies from the
length ``s = max(position) + 1`` of the current call. They set ``cache_raw_keys``:
the KV cache holds keys *before* rotation and all of them are rotated again, with
the frequencies of the current length, at every decoding step. A cached step at
length ``s`` therefore sees, in that layer, exactly the scores of a full forward
over the first ``s`` tokens (HF instead caches keys rotated with whatever base was
current when they were written, so one cache mixes several bases).

Angles are ``int64 position × float32 inv_freq`` formed in float64 and rounded once
(bit-identical to HF's float32 product below 2^24), cos/sin in float32 whatever the
activation dtype, and ``inv_freq`` stays float32 through ``model.to(torch.bfloat16)``.

Checked element-wise against HF ``ROPE_INIT_FUNCTIONS`` and Llama
``apply_rotary_pos_emb``, HF RoFormer ``apply_rotary_position_embeddings`` (also on
values), torchtune 0.6.1 ``RotaryPositionalEmbeddings`` / ``Llama3ScaledRoPE``, and
``rotary-embedding-torch`` (also ``use_xpos=True``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .. import functional as PF
from ..base import PositionEncoding, Stage, register

__all__ = ["RoPE", "XPos", "ROPE_TYPES", "rope_parameters", "permute_for_layout"]

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


def _base_inv_freq(dim: int, base: float) -> Tensor:
    # HF: 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), float32
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


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
        return _base_inv_freq(dim, base), 1.0
    if kind == "linear":
        inv_freq = _base_inv_freq(dim, base)
        inv_freq /= scaling["factor"]
        return inv_freq, 1.0
    if kind == "dynamic":
        factor = scaling["factor"]
        s = orig if seq_len is None else max(seq_len, orig)
        base = base * ((factor * s / orig) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(dim, base), 1.0
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
        inv_freq = _base_inv_freq(dim, base)
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


def _check_scaling(scaling: dict | None, dim: int, max_len: int | None) -> dict:
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


def permute_for_layout(weight: Tensor, *, heads: int, head_dim: int, to: str, rotary_dim: int | None = None) -> Tensor:
    """Convert a q/k projection between the two RoPE layouts.

    Permutes, within each head, the first ``rotary_dim`` output rows of ``weight``
    (``(H·Dh, D)`` for ``W_Q``/``W_K``, or ``(H·Dh,)`` for their biases) so that a model
    using ``layout="interleaved"`` gives the same scores with ``layout="half"``
    (``to="half"``) or back (``to="interleaved"``). This is the permutation of HF's
    Llama conversion script: ``perm = [0, 2, 4, …, 1, 3, 5, …]``.
    """
    if to not in ("half", "interleaved"):
        raise ValueError(f"to must be 'half' or 'interleaved', got {to!r}")
    r = head_dim if rotary_dim is None else rotary_dim
    if weight.shape[0] != heads * head_dim:
        raise ValueError(f"weight has {weight.shape[0]} rows, expected heads*head_dim = {heads * head_dim}")
    if r % 2 or not 0 < r <= head_dim:
        raise ValueError(f"rotary_dim must be even and in [2, {head_dim}], got {r}")
    perm = PF.interleaved_to_half_perm(r)
    if to == "interleaved":
        perm = torch.argsort(perm)
    perm = torch.cat((perm, torch.arange(r, head_dim))).to(weight.device)
    w = weight.reshape(heads, head_dim, *weight.shape[1:])  # (H, Dh, ...)
    return w[:, perm].reshape(weight.shape)


@register
class RoPE(PositionEncoding):
    """Rotary embedding with HF's scaling variants.

    Args:
        base: ``θ`` (HF ``rope_theta``).
        layout: ``"half"`` (HF Llama / NeoX) or ``"interleaved"`` (RoFormer / GPT-J / Meta).
        partial_rotary_factor: rotate only the first ``Dr = int(Dh·factor)`` dimensions.
        rotary_value: also rotate the values by their key position (RoFormer's option).
        rope_scaling: HF's dict, ``None`` for plain RoPE. ``rope_theta`` and
            ``partial_rotary_factor`` keys in it override ``base`` and ``partial_rotary_factor``.
        axes: coordinates per position (Heo et al. 2024, "Rotary Position Embedding for
            Vision Transformer"). ``1``: a sequence. ``A = 2`` or ``3`` (axial RoPE): the
            ``Dr/2`` pairs split into ``A`` equal bands, band ``a`` a 1-D RoPE of ``Dr/A``
            dims on coordinate ``a`` (naver-ai/rope-vit ``compute_axial_cis``,
            rotary-embedding-torch ``get_axial_freqs``); positions ``(B|1, L, A)``.
        rope_mixed: RoPE-Mixed (Heo et al. 2024): every head learns its own frequencies,
            pair ``k`` of head ``h`` turning by ``Σ_a pos_a·freqs[a, h, k]``; initialised as
            the axial bands rotated by a random angle per head (``axes >= 2``). The paper
            uses ``base=10`` (mixed) and ``base=100`` (axial) on 14×14 ViT grids.
    """

    name = "rope"
    family = "rotary"
    paper = "Su et al., RoFormer: Enhanced Transformer with Rotary Position Embedding"
    year = 2021
    stages = Stage.QK
    default_layout = "half"

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        base: float = 10000.0,
        layout: str | None = None,
        partial_rotary_factor: float = 1.0,
        rotary_value: bool = False,
        rope_scaling: dict | None = None,
        axes: int = 1,
        rope_mixed: bool = False,
    ):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        self.set_axes(axes)
        self.rope_mixed = bool(rope_mixed)
        layout = self.default_layout if layout is None else layout
        if layout not in ("half", "interleaved"):
            raise ValueError(f"layout must be 'half' or 'interleaved', got {layout!r}")
        if isinstance(rope_scaling, dict):
            base = rope_scaling.get("rope_theta", base)
            partial_rotary_factor = rope_scaling.get("partial_rotary_factor", partial_rotary_factor)
        if not isinstance(partial_rotary_factor, (int, float)) or not 0.0 < partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {partial_rotary_factor!r}")
        rot = int(head_dim * partial_rotary_factor)
        if rot < 2 or rot % 2:
            raise ValueError(
                f"rotary dim head_dim*partial_rotary_factor = {head_dim}*{partial_rotary_factor} = {rot} "
                "must be even and >= 2"
            )
        if not isinstance(base, (int, float)) or base <= 1:
            raise ValueError(f"base must be a number > 1, got {base!r}")
        self.base, self.layout, self.rotary_dim = float(base), layout, rot
        self.partial_rotary_factor = partial_rotary_factor
        self.rotary_value = bool(rotary_value)
        self.rope_scaling = _check_scaling(rope_scaling, rot, max_len)
        self.rope_type = self.rope_scaling["rope_type"]
        # frequencies depend on the current length: keep raw keys in the KV cache
        self.length_dependent = self.rope_type in ("dynamic", "longrope")
        self.cache_raw_keys = self.length_dependent
        self.original_max_len = self.rope_scaling.get("original_max_position_embeddings") or max_len
        self.register_buffer("inv_freq", torch.empty(rot // 2), persistent=False)
        self.attention_factor = 1.0
        if self.rope_type == "longrope":
            self.register_buffer("long_inv_freq", torch.empty(rot // 2), persistent=False)
        if self.axes > 1:
            self._check_axes()
            self.register_buffer("axis", torch.empty(rot // 2, dtype=torch.long), persistent=False)
        elif self.rope_mixed:
            raise ValueError("rope_mixed=True mixes the coordinates of several axes: it needs axes >= 2")
        self.init_buffers()
        if self.rope_mixed:  # learned (A, H, Dr/2), from the axial frequencies turned per head
            self.freqs = nn.Parameter(PF.mixed_frequencies(self.inv_freq, self.axes, heads))

    def _params(self, seq_len: int | None = None) -> tuple[Tensor, float]:
        return rope_parameters(
            self.rope_scaling, dim=self.rotary_dim, base=self.base, max_len=self.max_len, seq_len=seq_len
        )

    def _check_axes(self) -> None:
        """Options that do not combine with positions with axes."""
        if self.length_dependent:
            raise ValueError(
                f"rope_type {self.rope_type!r} picks frequencies from the sequence length; with axes={self.axes} "
                "use a static type (linear, yarn, llama3) or none"
            )
        if (self.rotary_dim // 2) % self.axes:
            raise ValueError(
                f"axial RoPE splits the {self.rotary_dim // 2} rotary pairs into axes={self.axes} equal bands: "
                f"rotary dim {self.rotary_dim} must be a multiple of 2*axes = {2 * self.axes}"
            )

    def axis_frequencies(self) -> tuple[Tensor, Tensor, float]:
        """``(inv_freq, axis, attention_factor)``, ``(Dr/2,)`` each, for ``axes > 1``: pair ``k``
        turns by ``pos[axis[k]]·inv_freq[k]``. Axial: band ``a`` holds the 1-D frequencies of
        a ``Dr/A``-dim RoPE (``base^(-2k·A/Dr)``) on coordinate ``a``."""
        n = self.rotary_dim // 2 // self.axes
        inv, factor = rope_parameters(self.rope_scaling, dim=2 * n, base=self.base, max_len=self.max_len)
        return inv.repeat(self.axes), torch.arange(self.axes).repeat_interleave(n), factor

    def init_buffers(self) -> None:
        device = self.inv_freq.device
        if self.axes > 1:
            inv_freq, axis, self.attention_factor = self.axis_frequencies()
            self.inv_freq, self.axis = inv_freq.to(device), axis.to(device)
            return
        inv_freq, self.attention_factor = self._params()
        self.inv_freq = inv_freq.to(device)
        if self.rope_type == "longrope":
            self.long_inv_freq = self._params(self.original_max_len + 1)[0].to(device)

    @property
    def relative(self) -> bool:
        return True

    @property
    def rotates_value(self) -> bool:
        return self.rotary_value

    def extra_repr(self) -> str:
        s = super().extra_repr() + f", base={self.base}, layout={self.layout!r}, rotary_dim={self.rotary_dim}"
        s += f", axes={self.axes}" + (", rope_mixed=True" if self.rope_mixed else "") if self.axes > 1 else ""
        return s + (f", rope_scaling={self.rope_scaling}" if self.rope_type != "default" else "")

    # ------------------------------------------------------------------ rotation
    def frequencies(self, seq_len: int) -> Tensor:
        """``inv_freq`` used for a call whose longest position is ``seq_len - 1``."""
        if self.rope_type == "dynamic" and seq_len > self.original_max_len:
            return self._params(seq_len)[0].to(self.inv_freq.device)
        if self.rope_type == "longrope" and seq_len > self.original_max_len:
            return self.long_inv_freq
        return self.inv_freq

    def _cos_sin(self, pos: Tensor, inv_freq: Tensor, scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Full-width tables ``(…, L, Dr)`` such that ``x̃ = x·cos + swap(x)·sin`` in this layout.

        ``swap`` exchanges the two members of each pair; the sign of the sine is folded into
        ``sin``, so a rotation is one copy, two products and a sum (few passes over ``x``,
        which matters on CPU, where each elementwise op costs a thread wake-up).
        """
        ang = self.angles(pos, inv_freq)  # (B|1, 1|H, L, Dr/2) or (L, Dr/2), float32
        cos, sin = ang.cos(), ang.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        if scale is not None:  # xPos: one factor per pair
            cos, sin = cos * scale, sin * scale
        if self.layout == "half":
            return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
        return cos.repeat_interleave(2, -1), torch.stack((-sin, sin), -1).flatten(-2)

    def angles(self, pos: Tensor, inv_freq: Tensor) -> Tensor:
        """Rotation angles: ``(L, Dr/2)`` for ``(L,)`` positions, ``(B|1, 1, L, Dr/2)`` for ``(B|1, L)``
        and, with axes, ``(B|1, 1, L, Dr/2)`` (axial, M-RoPE) or ``(B|1, H, L, Dr/2)`` (mixed)."""
        if self.axes == 1:
            ang = PF.rope_angles(pos, inv_freq)  # (B|1, L, Dr/2) or (L, Dr/2), float32
            return ang.unsqueeze(1) if pos.dim() == 2 else ang
        if self.rope_mixed:
            return PF.mixed_rope_angles(pos, self.freqs)
        return PF.axial_rope_angles(pos, inv_freq, self.axis).unsqueeze(1)

    def _swap(self, x: Tensor) -> Tensor:
        if self.layout == "half":
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((x2, x1), dim=-1)
        return torch.stack((x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)

    def _rotate_one(self, x: Tensor, pos: Tensor, tables: tuple[Tensor, Tensor]) -> Tensor:
        if x.dim() != 4:
            raise ValueError(f"expected a (B, H, L, Dh) tensor, got shape {tuple(x.shape)}")
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"expected head dim {self.head_dim}, got shape {tuple(x.shape)}")
        n = pos.shape[-2] if self.axes > 1 else pos.shape[-1]
        if x.shape[-2] != n:
            raise ValueError(f"positions of length {n} for a tensor of length {x.shape[-2]}")
        cos, sin = tables
        r = self.rotary_dim
        xr = x[..., :r].float() if r < x.shape[-1] else x.float()
        out = (xr * cos + self._swap(xr) * sin).to(x.dtype)
        return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), dim=-1)

    def _seq_len(self, *positions: Tensor) -> int:
        if not self.length_dependent:
            return 0
        return max(int(p.max()) for p in positions if p.numel()) + 1

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        if self.axes > 1:
            same = k_pos is q_pos
            q_pos = self.axis_positions(q_pos, q.shape[-2])
            k_pos = q_pos if same else self.axis_positions(k_pos, k.shape[-2])
        inv_freq = self.frequencies(self._seq_len(q_pos, k_pos))
        q_tab = self._cos_sin(q_pos, inv_freq)
        k_tab = q_tab if k_pos is q_pos else self._cos_sin(k_pos, inv_freq)
        return self._rotate_one(q, q_pos, q_tab), self._rotate_one(k, k_pos, k_tab)

    def rotate_value(self, v: Tensor, k_pos: Tensor) -> Tensor:
        k_pos = self.axis_positions(k_pos, v.shape[-2]) if self.axes > 1 else k_pos
        return self._rotate_one(v, k_pos, self._cos_sin(k_pos, self.frequencies(self._seq_len(k_pos))))


@register
class XPos(RoPE):
    """xPos: RoPE with an exponential decay, ``q·ζ^(n/scale_base)``, ``k·ζ^(-n/scale_base)``.

    Scores depend only on ``i - j``: ``ζ^((i-r)/s)·ζ^(-(j-r)/s) = ζ^((i-j)/s)`` for any
    reference position ``r``. Each call takes ``r`` at the middle of its query positions
    (per batch row), as ``rotary-embedding-torch`` does for a full sequence (``n - L//2``),
    so the factors stay bounded by half the query span whatever the absolute positions:
    a float16 layer at position 10⁵ is as exact as at position 0. Because ``r`` moves
    with the queries, the KV cache keeps keys before the rotation (``cache_raw_keys``)
    and rotates them again at every step, so cached decoding still equals a full forward.

    The factors are float32; the rotated ``q``/``k`` are cast to the activation dtype,
    so the growth ``ζ_min^(-span/2/s)`` must fit it: a ``ValueError`` names the limit
    when one call's query span is too long (about 4 500 query positions in float16,
    32 000 in bfloat16/float32 with the defaults).

    Args:
        scale_base: the ``512`` of the paper.
        gamma: ``γ = 0.4``.
        (others as :class:`RoPE`; the default layout is interleaved, as in the paper's code.)
    """

    name = "xpos"
    paper = "Sun et al., A Length-Extrapolatable Transformer"
    year = 2022
    causal_only = True
    default_layout = "interleaved"

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        base: float = 10000.0,
        layout: str | None = None,
        partial_rotary_factor: float = 1.0,
        scale_base: float = 512.0,
        gamma: float = 0.4,
    ):
        if not isinstance(scale_base, (int, float)) or scale_base <= 0:
            raise ValueError(f"scale_base must be a positive number, got {scale_base!r}")
        if not isinstance(gamma, (int, float)) or gamma <= 0:
            raise ValueError(f"gamma must be a positive number, got {gamma!r}")
        self.scale_base, self.gamma = float(scale_base), float(gamma)
        super().__init__(
            heads=heads,
            head_dim=head_dim,
            max_len=max_len,
            causal=causal,
            base=base,
            layout=layout,
            partial_rotary_factor=partial_rotary_factor,
        )
        self.cache_raw_keys = True  # the reference position moves with the queries
        self.register_buffer("zeta", torch.empty(self.rotary_dim // 2), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        super().init_buffers()
        if "zeta" in self._buffers:
            d = self.rotary_dim
            zeta = (torch.arange(0, d, 2, dtype=torch.float32) / d + self.gamma) / (1 + self.gamma)
            self.zeta = zeta.to(self.inv_freq.device)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", scale_base={self.scale_base}, gamma={self.gamma}"

    # largest exponent of a factor per activation dtype: ln(max) less ln(256) of headroom
    # for the magnitude of q/k themselves and the dot product
    _MAX_EXPONENT = {torch.float16: math.log(65504.0) - math.log(256.0)}

    def decay(self, offset: Tensor) -> Tensor:
        """``ζ^(offset/scale_base)``: float32 ``offset.shape + (Dr/2,)``, broadcast like cos."""
        power = offset.to(torch.float32).unsqueeze(-1) / self.scale_base
        scale = self.zeta**power
        return scale.unsqueeze(1) if offset.dim() == 2 else scale

    def reference(self, q_pos: Tensor) -> Tensor:
        """The middle of each row's query positions, ``(min + max + 1) // 2``: ``(B|1, 1)`` or ``()``."""
        return (q_pos.amin(-1, keepdim=True) + q_pos.amax(-1, keepdim=True) + 1) // 2

    def _check_growth(self, q_pos: Tensor, k_pos: Tensor, ref: Tensor, dtype: torch.dtype) -> None:
        """Raise when a factor ``ζ_min^(-d/s)`` would overflow ``dtype`` (d: distance to ``ref``)."""
        if not q_pos.numel() or torch.compiler.is_compiling() or q_pos.device.type == "meta":
            return
        limit = self._MAX_EXPONENT.get(dtype, 80.0)
        per_pos = -math.log(float(self.zeta.min())) / self.scale_base
        far = max(int((ref - q_pos).amax()), int((k_pos - ref).amax()) if k_pos.numel() else 0)
        if far * per_pos > limit:
            raise ValueError(
                f"xpos: the decay factors of this call overflow {dtype}: a query or key lies {far} positions "
                f"from the middle of the queries, at most {int(limit / per_pos)} fit (about "
                f"{2 * int(limit / per_pos)} query positions per call with scale_base={self.scale_base}); "
                "attend in shorter calls, use a wider dtype, or raise scale_base"
            )

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        ref = self.reference(q_pos)
        self._check_growth(q_pos, k_pos, ref, q.dtype)
        q = self._rotate_one(q, q_pos, self._cos_sin(q_pos, self.inv_freq, self.decay(q_pos - ref)))
        # keys far behind the reference decay to 0 (never inf): ζ^((r - j)/s)
        k = self._rotate_one(k, k_pos, self._cos_sin(k_pos, self.inv_freq, self.decay(ref - k_pos)))
        return q, k
