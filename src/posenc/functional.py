"""Pure functions shared by the encodings: tables, rotations, buckets, slopes, gathers.

Shape notation (see :mod:`posenc`): ``B`` batch, ``L`` length, ``H`` heads, ``Dh`` head
dim, ``i`` query, ``j`` key, ``R`` number of relative distances in a table.

Everything here computes angles and biases in float32 whatever the input dtype, and
takes integer positions (``int64``) so positions past 2**24 stay exact until the
final float conversion.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "as_positions",
    "check_lengths",
    "check_positions",
    "default_positions",
    "position_limit_reason",
    "sinusoidal_table",
    "sinusoidal_inv_freq",
    "rope_angles",
    "axial_rope_angles",
    "mixed_rope_angles",
    "mixed_frequencies",
    "interleaved_to_half_perm",
    "alibi_slopes",
    "t5_relative_position_bucket",
    "gather_relative_logits",
    "scatter_relative_values",
]


# --------------------------------------------------------------------------- positions
def default_positions(length: int, *, offset: int = 0, device=None) -> Tensor:
    """``arange(offset, offset + length)`` as int64 of shape ``(L,)``."""
    return torch.arange(offset, offset + length, device=device, dtype=torch.long)


def check_positions(pos: Tensor, length: int, name: str = "pos", batch: int | None = None, axes: int = 1) -> Tensor:
    """Validate user positions: ``(B or 1, L)`` int64, or ``(B or 1, L, A)`` when ``axes = A > 1``.

    ``axes`` is the number of coordinates per position the consumer reads (1 for a
    sequence; 2 or 3 for image rows/columns or video time/rows/columns). With ``A > 1``
    positions may be ``(L, A)`` or ``(B, L, A)``; one position per token, ``(L,)`` or
    ``(B, L)``, stands for the same coordinate on every axis (Qwen2-VL's text tokens,
    ``t = h = w``) and comes back expanded to ``(B or 1, L, A)``. A 2-D tensor that fits
    both readings (``(L, A)`` with ``L = A`` and a batch of ``L``) is refused as ambiguous.

    Raises:
        TypeError: ``pos`` is not an integer tensor.
        ValueError: wrong rank, wrong length or number of axes, mismatched batch, or
            negative values.
    """
    if not isinstance(pos, Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor or None, got {type(pos).__name__}")
    if pos.dtype.is_floating_point or pos.dtype.is_complex or pos.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype (int32/int64), got {pos.dtype}")
    shape = tuple(pos.shape)
    if axes == 1:
        if pos.dim() not in (1, 2):
            raise ValueError(
                f"{name} must have shape (L,) or (B, L) for an encoding with one position per token (axes=1), "
                f"got shape {shape}"
            )
        if pos.dim() == 2 and pos.shape[0] == length and pos.shape[1] != length:
            raise ValueError(
                f"{name} of shape {shape} looks like (L, A) positions with A={pos.shape[1]} axes, but the encoding "
                "takes one position per token (axes=1): pass (L,) or (B, L)"
            )
    else:
        bad = ValueError(
            f"{name} must have shape (L,) or (B, L) (one position per token), or (L, {axes}) or (B, L, {axes}) "
            f"for an encoding with axes={axes}; got shape {shape}"
        )
        which, layout = (" (mrope)", "HF's mrope position_ids") if axes == 3 else ("", "the axes-first layout")
        axes_first = ValueError(
            f"{name} of shape {shape} has the axes first; an encoding with axes={axes}{which} takes positions with "
            f"the axes last: (L, {axes}) or (B, L, {axes}); {layout}, ({axes}, L) / ({axes}, B, L), are that "
            f"layout transposed: pass {name}.movedim(0, -1)"
        )
        if pos.dim() >= 2 and pos.shape[0] == axes != shape[-1] == length:  # (A, L) or (A, B, L)
            if pos.dim() == 3 or (pos.dim() == 2 and batch is not None and axes not in (1, batch)):
                raise axes_first
        if pos.dim() == 2:
            if pos.shape[1] == length == axes:  # (B, L) and (L, A) read the same shape
                if pos.shape[0] == length:
                    raise ValueError(
                        f"{name} of shape {shape} is ambiguous for an encoding with axes={axes}: pass (1, L, {axes}) "
                        "for positions with axes, or (B, L, 1) expanded for one position per token"
                    )
            elif pos.shape[1] == axes:
                pos = pos.unsqueeze(0)  # (L, A) -> (1, L, A)
            elif pos.shape[0] == length and pos.shape[1] != length:
                raise bad
        if pos.dim() not in (1, 2, 3) or (pos.dim() == 3 and pos.shape[-1] != axes):
            raise bad
    seq = pos.shape[1] if pos.dim() == 3 else pos.shape[-1]
    if seq != length:
        raise ValueError(f"{name} has length {seq} but the sequence has length {length}")
    if batch is not None and pos.dim() >= 2 and pos.shape[0] not in (1, batch):
        raise ValueError(f"{name} has batch size {pos.shape[0]}, expected 1 or {batch}")
    if not torch.compiler.is_compiling() and pos.device.type != "meta" and pos.numel() > 0:
        lo = int(pos.min())
        if lo < 0:
            raise ValueError(f"{name} must be non-negative, got minimum {lo}")
    pos = pos.long()
    pos = pos if pos.dim() >= 2 else pos.unsqueeze(0)  # (B|1, L) or (B|1, L, A)
    if axes > 1 and pos.dim() == 2:
        pos = pos.unsqueeze(-1).expand(*pos.shape, axes)  # one position per token: t = h = w
    return pos


# --------------------------------------------------------------------------- sinusoids
def sinusoidal_inv_freq(dim: int, base: float = 10000.0, device=None, dtype=torch.float32) -> Tensor:
    """``base ** (-2k / dim)`` for ``k = 0 .. ceil(dim/2) - 1``, shape ``(ceil(dim/2),)``.

    float32 by default, bit-identical to HF's ``inv_freq``; float64 for tables that are
    rounded to float32 only at the end.
    """
    return 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.int64).to(dtype) / dim))


def sinusoidal_table(pos: Tensor, dim: int, *, base: float = 10000.0, layout: str = "interleaved") -> Tensor:
    """Sinusoidal position vectors, float32, shape ``pos.shape + (dim,)``.

    ``layout="interleaved"`` is Vaswani et al. / DistilBERT / ``positional-encodings``:
    ``[sin θ0, cos θ0, sin θ1, cos θ1, ...]``. ``layout="halves"`` is Transformer-XL /
    RoFormer / Marian: ``[sin θ0 .. sin θ(d/2-1), cos θ0 .. cos θ(d/2-1)]``.
    For odd ``dim`` the last cosine is dropped.
    """
    inv_freq = sinusoidal_inv_freq(dim, base, device=pos.device, dtype=torch.float64)
    angles = pos.to(torch.float64).unsqueeze(-1) * inv_freq  # (..., ceil(dim/2)), float64
    sin, cos = angles.sin().float(), angles.cos().float()
    if layout == "interleaved":
        out = torch.stack((sin, cos), dim=-1).flatten(-2)
    elif layout == "halves":
        out = torch.cat((sin, cos), dim=-1)
    else:
        raise ValueError(f"layout must be 'interleaved' or 'halves', got {layout!r}")
    return out[..., :dim]


# --------------------------------------------------------------------------- rotary
def rope_angles(pos: Tensor, inv_freq: Tensor) -> Tensor:
    """Rotation angles ``pos * inv_freq`` in float32, shape ``pos.shape + (Dr/2,)``.

    The product is formed in float64 and rounded once, so large positions keep full
    float32 accuracy.
    """
    return (pos.to(torch.float64).unsqueeze(-1) * inv_freq.to(torch.float64)).float()


def axial_rope_angles(pos: Tensor, inv_freq: Tensor, axis: Tensor) -> Tensor:
    """Angles of RoPE over positions with axes: pair ``k`` turns by ``pos[..., axis[k]] · inv_freq[k]``.

    ``pos``: ``(..., L, A)`` int64; ``inv_freq``, ``axis``: ``(Dr/2,)`` -> ``(..., L, Dr/2)``
    float32. Axial RoPE (each axis owns an equal band of pairs, Heo et al. 2024) and
    M-RoPE (each axis owns a section of the 1-D frequencies, Qwen2-VL) differ only in
    ``inv_freq`` and ``axis``. Formed in float64 and rounded once, like :func:`rope_angles`.
    """
    p = pos.index_select(-1, axis.to(pos.device))  # (..., L, Dr/2): each pair's own coordinate
    return (p.to(torch.float64) * inv_freq.to(torch.float64)).float()


def mixed_rope_angles(pos: Tensor, freqs: Tensor) -> Tensor:
    """RoPE-Mixed angles (Heo et al. 2024): pair ``k`` of head ``h`` turns by ``Σ_a pos_a · freqs[a, h, k]``.

    ``pos``: ``(B|1, L, A)`` int64; ``freqs``: ``(A, H, Dr/2)`` (learned) -> ``(B|1, H, L, Dr/2)``
    float32, differentiable in ``freqs``. Float32 like the reference (naver-ai/rope-vit).
    """
    return torch.einsum("bla,ahk->bhlk", pos.float(), freqs.float())


def mixed_frequencies(inv_freq: Tensor, axes: int, heads: int, generator: torch.Generator | None = None) -> Tensor:
    """Initial RoPE-Mixed frequencies ``(A, H, Dr/2)`` from axial ones (Heo et al. 2024).

    ``inv_freq`` ``(Dr/2,)`` holds ``A`` equal bands of the same magnitudes (axial RoPE).
    Each head draws a random rotation ``R_h`` of the ``A``-dim position space and band ``g``
    points along its column ``g``: ``freqs[:, h, band g] = R_h[:, g] · magnitude``. For
    ``A = 2`` that is naver-ai/rope-vit's ``init_random_2d_freqs``: ``R_h`` turns by an angle
    uniform in ``[0, 2π)``, band 0 along ``(cos φ, sin φ)``, band 1 along ``(cos(φ+π/2), sin(φ+π/2))``;
    for ``A > 2``, ``R_h`` is Haar-uniform in SO(A).
    """
    n = inv_freq.shape[0] // axes
    mag = inv_freq[:n].float()  # (Dr/2A,)
    if axes == 2:
        phi = torch.rand(heads, generator=generator) * 2 * math.pi
        rot = torch.stack((torch.stack((phi.cos(), -phi.sin()), -1), torch.stack((phi.sin(), phi.cos()), -1)), -2)
    else:
        qr, r = torch.linalg.qr(torch.randn(heads, axes, axes, generator=generator))
        rot = qr * torch.diagonal(r, dim1=-2, dim2=-1).sign().unsqueeze(-2)  # Haar in O(A)
        rot[:, :, 0] *= torch.linalg.det(rot).sign().unsqueeze(-1)  # det +1: SO(A)
    # rot: (H, A, A), column g = direction of band g; freqs[a, h, g*n + k] = rot[h, a, g]·mag[k]
    return (rot.permute(1, 0, 2).unsqueeze(-1) * mag).flatten(-2).contiguous()


def interleaved_to_half_perm(dim: int) -> Tensor:
    """Permutation ``[0, 2, 4, ..., 1, 3, 5, ...]`` of head dimensions.

    Rotating interleaved pairs of ``x`` and then permuting equals rotating split-halves
    pairs of ``x[..., perm]``: permuting W_Q/W_K rows per head with it converts an
    interleaved checkpoint to split halves (see :func:`posenc.encodings.rotary.permute_for_layout`).
    """
    if dim % 2:
        raise ValueError(f"rotary dim must be even, got {dim}")
    return torch.cat((torch.arange(0, dim, 2), torch.arange(1, dim, 2)))


# --------------------------------------------------------------------------- ALiBi
def alibi_slopes(heads: int) -> Tensor:
    """ALiBi head slopes (Press et al. 2022), float32 ``(H,)``.

    For a power of two ``n``: ``2^(-8k/n)``, k = 1..n. Otherwise the official recipe
    (and Bloom's ``_get_alibi_slopes``): the slopes of the closest lower power of two
    ``c``, then every other slope of ``2c`` for the remaining heads.
    """
    if heads < 1:
        raise ValueError(f"heads must be >= 1, got {heads}")
    c = 2 ** math.floor(math.log2(heads))
    base = 2.0 ** (-8.0 / c)
    slopes = [base**k for k in range(1, c + 1)]
    if c != heads:
        extra = 2.0 ** (-4.0 / c)  # = 2^(-8 / 2c)
        slopes += [extra**k for k in range(1, 2 * (heads - c), 2)]
    return torch.tensor(slopes, dtype=torch.float32)


# --------------------------------------------------------------------------- T5
def t5_relative_position_bucket(
    relative_position: Tensor, *, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> Tensor:
    """T5's bucket of ``relative_position = j - i`` (key minus query), int64.

    Bidirectional: half the buckets for ``j > i``; causal: ``max(i - j, 0)`` so future
    keys share bucket 0. The first half of each side is exact, the rest log-spaced up to
    ``max_distance`` and clamped (Raffel et al. 2020; HF ``T5Attention``).
    """
    rel = relative_position.long()
    buckets = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (rel > 0).long() * num_buckets
        n = rel.abs()
    else:
        n = (-rel).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    # n.float() / max_exact is >= 1 where used; the clamp keeps log() finite elsewhere.
    large = max_exact + (
        torch.log(n.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(torch.long)
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, n, large)


# --------------------------------------------------------------------------- relative gathers
def gather_relative_logits(rel_logits: Tensor, index: Tensor) -> Tensor:
    """Place per-distance logits into the (i, j) grid.

    Args:
        rel_logits: ``(B, H, Lq, R)``: query i dotted with each of the R relative vectors.
        index: ``(Bp, Lq, Lk)`` or ``(Lq, Lk)`` int64 in ``[0, R)``: which vector pair (i, j) uses.

    Returns:
        ``(B, H, Lq, Lk)`` with ``out[b, h, i, j] = rel_logits[b, h, i, index[i, j]]``.
        Memory O(Lq·Lk); never an ``(Lq, Lk, Dh)`` tensor.
    """
    B, H, Lq, _ = rel_logits.shape
    if index.dim() == 2:
        index = index.unsqueeze(0)
    index = index.unsqueeze(1).expand(B, H, Lq, index.shape[-1])
    return torch.gather(rel_logits, -1, index)


def scatter_relative_values(attn: Tensor, index: Tensor, num_rel: int) -> Tensor:
    """Sum attention mass per relative distance.

    Args:
        attn: ``(B, H, Lq, Lk)`` attention probabilities.
        index: ``(Bp, Lq, Lk)`` or ``(Lq, Lk)`` int64 in ``[0, R)``.
        num_rel: ``R``.

    Returns:
        ``(B, H, Lq, R)`` with ``out[b, h, i, r] = Σ_j attn[b, h, i, j]·[index[i, j] = r]``;
        multiply by an ``(R, Dh)`` table to get ``Σ_j a_ij R_ij``.
    """
    B, H, Lq, Lk = attn.shape
    if index.dim() == 2:
        index = index.unsqueeze(0)
    index = index.unsqueeze(1).expand(B, H, Lq, Lk)
    out = attn.new_zeros(B, H, Lq, num_rel)
    return out.scatter_add(-1, index, attn)


def as_positions(pos: Tensor | None, length: int, *, offset: int = 0, device=None, batch=None, axes: int = 1) -> Tensor:
    """Positions as ``(B or 1, L)`` int64, or ``(B or 1, L, A)`` for ``axes = A > 1``.

    ``None`` means ``arange(offset, offset+L)`` (on every axis when ``A > 1``); see
    :func:`posenc.functional.check_positions` for the accepted shapes.
    """
    if pos is None:
        pos = default_positions(length, offset=offset, device=device).unsqueeze(0)  # (1, L)
        return pos if axes == 1 else pos.unsqueeze(-1).expand(1, length, axes)
    return check_positions(pos, length, batch=batch, axes=axes)


def check_lengths(encodings, pos: Tensor) -> None:
    """Raise ``ValueError`` if a position in ``pos`` is at or past an encoding's :attr:`~PositionEncoding.position_limit`.

    One host sync for all of them (the largest position, per axis for positions with axes
    ``(B|1, L, A)``), none when every encoding extrapolates; skipped under
    ``torch.compile`` and on the meta device.
    """
    limited = [e for e in encodings if e.position_limit is not None]
    if not limited or torch.compiler.is_compiling() or pos.device.type == "meta" or pos.numel() == 0:
        return
    his = (pos.flatten(0, -2).amax(0) if pos.dim() == 3 else pos.max().reshape(1)).tolist()  # per axis
    for e in limited:
        limit = e.position_limit
        if isinstance(limit, tuple):
            for axis, (hi, n) in enumerate(zip(his, limit, strict=False)):
                if hi >= n:
                    raise ValueError(e.length_error(hi, axis))
        elif max(his) >= limit:
            raise ValueError(e.length_error(max(his)))


def position_limit_reason(encodings, seq_len: int) -> str | None:
    """Why a model of ``encodings`` cannot run ``seq_len`` positions (an encoding that does not
    extrapolate, with a table that ends before them), or None when it can."""
    for enc in encodings:
        if enc.position_limit is not None and seq_len > enc.position_limit:
            return f"{enc.name} supports positions < {enc.position_limit} (max_len={enc.max_len}); needs {seq_len}"
    return None
