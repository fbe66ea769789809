"""Absolute position encodings at the input: learned, hierarchical, sinusoidal, multiplicative.

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
* ``multiplicative`` — ``x ⊙ (1 + β·PE)`` instead of ``x + PE`` (sinusoidal or learned
  table); checked against the formula written out in the test.

All act on ``embed(x, pos)`` with ``x`` ``(B, L, D)``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor, nn

from .. import functional as PF
from ..base import PositionEncoding, Stage, register
from ..config import LayerSpec, ModelConfig


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


@register
class Hierarchical(PositionEncoding):
    """Su's hierarchical decomposition of a learned table: ``n`` rows serve ``n²`` positions.

    From the table ``p_0 .. p_{n-1}`` (0-based here; the paper counts from 1) build
    ``u_i = (p_i − α·p_0) / (1 − α)`` and encode position ``t = i·n + j`` as
    ``q_t = α·u_i + (1 − α)·u_j``. For ``t < n`` (``i = 0``) this is exactly ``p_t``, so a
    trained ``learned`` table converts without retraining (:meth:`from_learned`,
    :func:`learned_to_hierarchical`). Positions ``>= n²`` raise ``ValueError``.

    The parameter is named ``table`` like :class:`Learned`'s, so state dicts carry over.
    """

    name = "hierarchical"
    family = "absolute"
    paper = "Su, Transformer upgrade road 7: hierarchically decomposed position encoding"
    year = 2020
    stages = Stage.INPUT

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

    def length_error(self, hi: int) -> str:
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


def learned_to_hierarchical(model, *, alpha: float = 0.4):
    """Convert a trained ``learned`` :class:`~posenc.TransformerLM` into a ``hierarchical`` one.

    Every weight is reused (the position table keeps its name ``table``); the new model
    reproduces the old one exactly at positions below ``max_len`` and runs up to
    ``max_len²``. Its ``config`` says ``encoding="hierarchical"``, so
    :func:`posenc.save_checkpoint` / :func:`posenc.load_checkpoint` round-trip it.
    """
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig) or any(s.encoding != "learned" for s in cfg.layer_specs()):
        raise ValueError(
            f"expects a TransformerLM built with encoding='learned', got {type(model).__name__} "
            f"with encoding={getattr(cfg, 'encoding', None)!r}"
        )
    layers = (
        None if cfg.layers is None else [LayerSpec("hierarchical", {**s.options, "alpha": alpha}) for s in cfg.layers]
    )
    new_cfg = replace(cfg, encoding="hierarchical", options={**cfg.options, "alpha": alpha}, layers=layers)
    ref = model.head.weight
    with torch.device("meta"):
        new = type(model)(config=new_cfg)
    new = new.to_empty(device=ref.device).to(ref.dtype)
    new.load_state_dict(model.state_dict())
    for m in new.modules():
        if isinstance(m, PositionEncoding):
            m.init_buffers()
    return new


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
    family = "absolute"
    paper = "Multiplicative position encoding (x ⊙ p), cf. Vaswani et al. 2017 for the table"
    year = 2017
    stages = Stage.INPUT

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
