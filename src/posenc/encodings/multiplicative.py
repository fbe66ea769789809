"""Multiplicative absolute positions: ``x ⊙ (1 + β·PE)`` instead of ``x + PE``.

The table ``PE`` is the sinusoidal one of Vaswani et al., "Attention Is All You Need",
2017 (interleaved layout) or a trainable one. Checked against the formula written out in
the test.
"""

from __future__ import annotations

from torch import Tensor, nn

from .. import functional as PF
from ..base import PositionEncoding
from ..registry import register
from ..validate import check_table_len


@register
class Multiplicative(PositionEncoding):
    """``x ⊙ m(pos)``: position multiplies the embedding instead of adding to it.

    The multiplier is ``m = 1 + β·PE`` with ``PE`` the sinusoidal table (``table="sinusoidal"``,
    interleaved, values in [−1, 1]) or a trainable table initialised N(0, 1)
    (``table="learned"``, needs ``max_len``); ``β = strength`` (default 0.5).

    Conditioning at initialisation: a bare sinusoid as multiplier would zero half the
    coordinates of every token at position 0 (sin 0 = 0) and flip signs elsewhere. With
    ``m = 1 + β·PE``, ``β < 1``, every multiplier lies in ``[1 − β, 1 + β]``: no coordinate
    is annihilated or sign-flipped and each coordinate's scale changes by at most a
    factor ``1 ± β``, so a fresh model sees embeddings of the usual scale. For the learned
    table ``m`` starts at ``1 + β·N(0, 1)``: keep ``strength`` well below 1 there.
    """

    name = "multiplicative"
    paper = "Multiplicative position encoding (x ⊙ p), cf. Vaswani et al. 2017 for the table"
    year = 2017

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        table: str = "sinusoidal",
        strength: float = 0.5,
        base: float = 10000.0,
    ):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        if table not in ("sinusoidal", "learned"):
            raise ValueError(f"table must be 'sinusoidal' or 'learned', got {table!r}")
        if not 0.0 < strength:
            raise ValueError(f"strength must be > 0, got {strength}")
        if base <= 1:
            raise ValueError(f"base must be > 1, got {base}")
        self.table_kind, self.strength, self.base = table, float(strength), float(base)
        self.table = None
        if table == "learned":
            if max_len is None:
                raise ValueError("multiplicative with table='learned' needs max_len (the size of its table)")
            check_table_len(self, "max_len", max_len)
            self.table = nn.Embedding(max_len, self.dim)
            nn.init.normal_(self.table.weight, std=1.0)

    @property
    def relative(self) -> bool:
        return False

    @property
    def extrapolates(self) -> bool:
        return self.table is None

    def multiplier(self, pos: Tensor) -> Tensor:
        """``1 + β·PE(pos)``: ``pos.shape + (D,)`` float32 (sinusoidal) or the table's dtype."""
        pe = PF.sinusoidal_table(pos, self.dim, base=self.base) if self.table is None else self.table(pos)
        return 1.0 + self.strength * pe

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        return x * self.multiplier(pos).to(x.dtype)
