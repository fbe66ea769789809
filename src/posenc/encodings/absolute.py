"""Absolute position encodings at the input: learned, hierarchical, sinusoidal.

* ``learned`` — a trainable table, one vector per position (BERT, Devlin et al. 2019;
  GPT, Radford et al. 2018). Cannot run past ``max_len``.
* ``sinusoidal`` — Vaswani et al., "Attention Is All You Need", NeurIPS 2017:
  ``PE[p, 2k] = sin(p / 10000^(2k/D))``, ``PE[p, 2k+1] = cos(...)`` (interleaved
  layout). Checked element-wise against ``positional-encodings`` (``PositionalEncoding1D``)
  and HF DistilBERT's ``create_sinusoidal_embeddings``.

* ``hierarchical`` — Su Jianlin, "Transformer upgrade road 7: hierarchically decomposed
  position encoding" (kexue.fm/archives/7947), 2020: a learned table of ``n`` rows
  serves ``n²`` positions; a trained ``learned`` model converts without retraining.
  Checked against the formula written out in the test.

All act on ``embed(x, pos)`` with ``x`` ``(B, L, D)``.

With ``axes=2|3`` (``pos`` ``(B|1, L, A)``), ``sinusoidal`` concatenates one table per axis
like ``positional-encodings``' ``PositionalEncoding2D/3D`` (checked element-wise), MAE and
DETR (summed sinusoids would be symmetric in the axes); ``learned`` sums one table per axis
(lucidrains' ``axial-positional-embedding``, ViViT) or concatenates them (``axial_dims``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import functional as PF
from ..base import PositionEncoding
from ..registry import register
from ..validate import check_table_len


@register
class Learned(PositionEncoding):
    """Trainable absolute positions, ``nn.Embedding(max_len, D)`` initialised N(0, 0.02²).

    Args:
        init_std: standard deviation of the initial table(s).
        axes: coordinates per position (1: a sequence; 2, 3: grids), see the module docstring.
        axial_shape: table length per axis, ``(n_1, …, n_A)``; ``max_len`` on every axis by default.
        axial_dims: ``None``: the ``A`` tables are ``D`` wide and summed; ``(d_1, …, d_A)``
            summing to ``D``: concatenated (lucidrains' ``axial_dims``).
    """

    name = "learned"
    paper = "Devlin et al., BERT; Radford et al., GPT"
    year = 2018

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        init_std: float = 0.02,
        axes: int = 1,
        axial_shape: tuple[int, ...] | None = None,
        axial_dims: tuple[int, ...] | None = None,
    ):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        self.needs = self.needs.replace(axes=axes)
        if axes == 1 and (axial_shape is not None or axial_dims is not None):
            raise ValueError("axial_shape and axial_dims need axes >= 2")
        if max_len is None and axial_shape is None:
            raise ValueError("encoding 'learned' needs max_len (the size of its table)")
        if axes == 1:
            check_table_len(self, "max_len", max_len)
            self.table = nn.Embedding(max_len, self.dim)
            nn.init.normal_(self.table.weight, std=init_std)
            return
        shape = tuple(axial_shape) if axial_shape is not None else (max_len,) * axes
        dims = tuple(axial_dims) if axial_dims is not None else (self.dim,) * axes
        concat = f" summing to D = {self.dim}" if axial_dims is not None else ""
        for opt, val, rule in (("axial_shape", shape, ""), ("axial_dims", dims, concat)):
            if (
                len(val) != axes
                or not all(isinstance(n, int) and n >= 1 for n in val)
                or (rule and sum(val) != self.dim)
            ):
                raise ValueError(f"{opt} must be {axes} positive ints{rule}, got {val!r}")
        check_table_len(self, *(("axial_shape", shape) if axial_shape is not None else ("max_len", max_len)))
        self.axial_shape, self.axial_dims, self.summed = shape, dims, axial_dims is None
        self.tables = nn.ModuleList(nn.Embedding(n, d) for n, d in zip(shape, dims))
        for t in self.tables:
            nn.init.normal_(t.weight, std=init_std)

    @property
    def relative(self) -> bool:
        return False

    @property
    def extrapolates(self) -> bool:
        return False

    @property
    def position_limit(self) -> int | tuple[int, ...]:
        return self.max_len if self.axes == 1 else self.axial_shape

    def length_error(self, hi: int, axis: int | None = None) -> str:
        if axis is None:
            return super().length_error(hi)
        n = self.axial_shape[axis]
        return (
            f"encoding 'learned' supports positions 0..{n - 1} on axis {axis} (axial_shape={self.axial_shape}, "
            f"max_len={self.max_len}), got position {hi}; it does not extrapolate"
        )

    def positions(self, pos: Tensor) -> Tensor:
        """The position vectors: ``pos.shape + (D,)``, or ``(B|1, L, D)`` for positions with axes (unchecked)."""
        if self.axes == 1:
            return self.table(pos)
        pos = self.axis_positions(pos)
        parts = [t(pos[..., a]) for a, t in enumerate(self.tables)]  # A × (B|1, L, d_a)
        return torch.stack(parts).sum(0) if self.summed else torch.cat(parts, dim=-1)

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        pos = self.axis_positions(pos, x.shape[1]) if self.axes > 1 else pos
        return x + self.positions(pos).to(x.dtype)  # (B|1, L, D) broadcast over B


@register
class Sinusoidal(PositionEncoding):
    """Fixed sinusoids, interleaved layout (Vaswani); ``layout="halves"`` for XL/RoFormer/MAE.

    ``axes=2|3``: per-axis tables of ``2·ceil(D/2A)`` channels concatenated, cut to ``D``."""

    name = "sinusoidal"
    paper = "Vaswani et al., Attention Is All You Need"
    year = 2017

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        base: float = 10000.0,
        layout: str = "interleaved",
        axes: int = 1,
    ):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        self.needs = self.needs.replace(axes=axes)
        if layout not in ("interleaved", "halves"):
            raise ValueError(f"layout must be 'interleaved' or 'halves', got {layout!r}")
        if base <= 1:
            raise ValueError(f"base must be > 1, got {base}")
        self.base, self.layout = float(base), layout

    @property
    def relative(self) -> bool:
        return False

    def table(self, pos: Tensor) -> Tensor:
        """Position vectors, float32: ``pos.shape + (D,)``, or ``(B|1, L, D)`` for positions with axes.

        Computed on the fly from int64 positions in float64 -> float32: no table to outgrow.
        """
        if self.axes == 1:
            return PF.sinusoidal_table(pos, self.dim, base=self.base, layout=self.layout)
        pos = self.axis_positions(pos)
        c = 2 * -(-self.dim // (2 * self.axes))  # channels per axis, even
        parts = [PF.sinusoidal_table(pos[..., a], c, base=self.base, layout=self.layout) for a in range(self.axes)]
        return torch.cat(parts, dim=-1)[..., : self.dim]

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        pos = self.axis_positions(pos, x.shape[1]) if self.axes > 1 else pos
        return x + self.table(pos).to(x.dtype)


@register
class Hierarchical(PositionEncoding):
    """Su's hierarchical decomposition of a learned table: ``n`` rows serve ``n²`` positions.

    From the table ``p_0 .. p_{n-1}`` (0-based here; the paper counts from 1) build
    ``u_i = (p_i − α·p_0) / (1 − α)`` and encode position ``t = i·n + j`` as
    ``q_t = α·u_i + (1 − α)·u_j``. For ``t < n`` (``i = 0``) this is exactly ``p_t``, so a
    trained ``learned`` table converts without retraining (:meth:`from_learned`,
    :func:`posenc.conversions.learned_to_hierarchical`). Positions ``>= n²`` raise ``ValueError``.

    The parameter is named ``table`` like :class:`Learned`'s, so state dicts carry over.
    """

    name = "hierarchical"
    paper = "Su, Transformer upgrade road 7: hierarchically decomposed position encoding"
    year = 2020

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        alpha: float = 0.4,
        table_len: int | None = None,
        init_std: float = 0.02,
    ):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        n = max_len if table_len is None else table_len
        if n is None:
            raise ValueError("encoding 'hierarchical' needs max_len or table_len (the size of its table)")
        if not isinstance(n, int) or n < 2:
            raise ValueError(f"table_len must be an int >= 2, got {n!r}")
        check_table_len(self, "max_len" if table_len is None else "table_len", n)
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"alpha must be in [0, 1), got {alpha}")
        self.alpha, self.table_len = float(alpha), n
        self.table = nn.Embedding(n, self.dim)
        nn.init.normal_(self.table.weight, std=init_std)

    @classmethod
    def from_learned(cls, learned: Learned, *, alpha: float = 0.4) -> Hierarchical:
        """A hierarchical encoding reusing a (trained) ``learned`` table; no retraining."""
        if not isinstance(learned, Learned):
            raise TypeError(f"from_learned expects a Learned encoding, got {type(learned).__name__}")
        out = cls(
            heads=learned.heads, head_dim=learned.head_dim, max_len=learned.max_len, causal=learned.causal, alpha=alpha
        )
        out.to(learned.table.weight.device)
        with torch.no_grad():
            out.table.weight.copy_(learned.table.weight)
        return out

    @property
    def relative(self) -> bool:
        return False

    @property
    def extrapolates(self) -> bool:
        return True  # up to table_len² (check_length raises beyond)

    @property
    def position_limit(self) -> int:
        return self.table_len**2

    def length_error(self, hi: int, axis: int | None = None) -> str:
        return (
            f"encoding 'hierarchical' supports positions 0..{self.table_len**2 - 1} (table_len² = {self.table_len}², "
            f"max_len={self.max_len}), got position {hi}"
        )

    def positions(self, pos: Tensor) -> Tensor:
        """``q_pos``: ``pos.shape + (D,)`` in the table's dtype (positions below ``table_len²``, unchecked)."""
        n, a = self.table_len, self.alpha
        w = self.table.weight  # (n, D)
        u = (w - a * w[:1]) / (1.0 - a)  # (n, D)
        hi, lo = torch.div(pos, n, rounding_mode="floor"), pos % n
        mixed = a * u[hi] + (1.0 - a) * u[lo]  # (..., D)
        # below n the formula equals the table up to rounding: return the table bit-exactly
        return torch.where((pos < n).unsqueeze(-1), w[lo], mixed)

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        return x + self.positions(pos).to(x.dtype)
