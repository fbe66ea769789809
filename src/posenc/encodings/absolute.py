"""Absolute position encodings added to the input: learned and sinusoidal.

* ``learned`` — a trainable table, one vector per position (BERT, Devlin et al. 2019;
  GPT, Radford et al. 2018). Cannot run past ``max_len``.
* ``sinusoidal`` — Vaswani et al., "Attention Is All You Need", NeurIPS 2017:
  ``PE[p, 2k] = sin(p / 10000^(2k/D))``, ``PE[p, 2k+1] = cos(...)`` (interleaved
  layout). Checked element-wise against ``positional-encodings`` (``PositionalEncoding1D``)
  and HF DistilBERT's ``create_sinusoidal_embeddings``.

Both are ``x + p``: ``embed(x, pos)`` with ``x`` ``(B, L, D)``.
"""

from __future__ import annotations

from torch import Tensor, nn

from .. import functional as PF
from ..base import PositionEncoding, Stage, register


@register
class Learned(PositionEncoding):
    """Trainable absolute positions, ``nn.Embedding(max_len, D)`` initialised N(0, 0.02²)."""

    name = "learned"
    family = "absolute"
    paper = "Devlin et al., BERT; Radford et al., GPT"
    year = 2018
    stages = Stage.INPUT

    def __init__(self, *, heads, head_dim, max_len=None, causal=True, init_std: float = 0.02):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        if max_len is None:
            raise ValueError("encoding 'learned' needs max_len (the size of its table)")
        self.table = nn.Embedding(max_len, self.dim)
        nn.init.normal_(self.table.weight, std=init_std)

    @property
    def relative(self) -> bool:
        return False

    @property
    def extrapolates(self) -> bool:
        return False

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        self.check_length(pos)
        return x + self.table(pos).to(x.dtype)  # (B|1, L, D) broadcast over B


@register
class Sinusoidal(PositionEncoding):
    """Fixed sinusoids, interleaved layout (Vaswani); ``layout="halves"`` for XL/RoFormer."""

    name = "sinusoidal"
    family = "absolute"
    paper = "Vaswani et al., Attention Is All You Need"
    year = 2017
    stages = Stage.INPUT

    def __init__(
        self, *, heads, head_dim, max_len=None, causal=True, base: float = 10000.0, layout: str = "interleaved"
    ):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        if layout not in ("interleaved", "halves"):
            raise ValueError(f"layout must be 'interleaved' or 'halves', got {layout!r}")
        if base <= 1:
            raise ValueError(f"base must be > 1, got {base}")
        self.base, self.layout = float(base), layout

    @property
    def relative(self) -> bool:
        return False

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        # computed on the fly from int64 positions in float64 -> float32: no table to outgrow
        return x + PF.sinusoidal_table(pos, self.dim, base=self.base, layout=self.layout).to(x.dtype)
