"""Scalar score biases: ALiBi and T5 relative buckets.

* ``alibi`` — Press et al., "Train Short, Test Long: Attention with Linear Biases
  Enables Input Length Extrapolation", ICLR 2022. Bias ``-m_h·(i - j)`` (causal) or
  ``-m_h·|i - j|`` (bidirectional), head slopes from :func:`posenc.functional.alibi_slopes`.
  Not scaled by ``Dh^-1/2``. Checked against Bloom's ``_get_alibi_slopes`` and
  ``build_alibi_tensor`` (which differs by a per-row constant: same softmax).
* ``t5`` — Raffel et al., "Exploring the Limits of Transfer Learning with a Unified
  Text-to-Text Transformer", JMLR 2020. A learned scalar per head and bucket of
  ``j - i``; one table shared by every layer. Checked against HF ``T5Attention``.

Both provide a FlexAttention ``score_mod`` that reads per-head scalars, so no ``L×L``
tensor is built on the flex path.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import functional as PF
from ..base import PositionEncoding, ScoreMod, Stage, register


def _per_head(values: Tensor) -> Tensor:
    """``(..., Lq, Lk, H)`` -> ``(..., H, Lq, Lk)``."""
    return values.movedim(-1, -3)


@register
class ALiBi(PositionEncoding):
    name = "alibi"
    family = "bias"
    paper = "Press et al., Train Short, Test Long: Attention with Linear Biases"
    year = 2022
    stages = Stage.BIAS

    def __init__(self, *, heads, head_dim, max_len=None, causal=True):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        self.register_buffer("slopes", torch.empty(heads), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        self.slopes = PF.alibi_slopes(self.heads).to(self.slopes.device)

    @property
    def relative(self) -> bool:
        return True

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        rel = self.rel_distance(q_pos, k_pos).float()  # j - i, (..., Lq, Lk)
        if not self.causal:
            rel = -rel.abs()
        return rel.unsqueeze(-3) * self.slopes.float().view(-1, 1, 1)  # (..., H, Lq, Lk)

    def score_mod(self, q_pos: Tensor, k_pos: Tensor) -> ScoreMod:
        slopes, causal = self.slopes.float(), self.causal

        def mod(score, b, h, q_idx, kv_idx):
            rel = (k_pos[b, kv_idx] - q_pos[b, q_idx]).to(torch.float32)
            if not causal:
                rel = -rel.abs()
            return score + slopes[h] * rel

        return mod


def _is_range(pos: Tensor) -> bool:
    """``pos`` is one row of consecutive integers (``(L,)`` or ``(1, L)``)."""
    if pos.dim() == 2 and pos.shape[0] != 1:
        return False
    p = pos.reshape(-1)
    return p.numel() < 2 or bool((p[1:] - p[:-1] == 1).all())


@register
class T5(PositionEncoding):
    name = "t5"
    family = "bias"
    paper = "Raffel et al., Exploring the Limits of Transfer Learning with a Unified Text-to-Text Transformer"
    year = 2020
    stages = Stage.BIAS
    share_across_layers = True

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        num_buckets: int = 32,
        max_distance: int = 128,
        scale_logits: bool = True,
    ):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        min_buckets = 4 if not causal else 2
        if not isinstance(num_buckets, int) or num_buckets < min_buckets:
            raise ValueError(f"num_buckets must be an int >= {min_buckets}, got {num_buckets!r}")
        exact = num_buckets // (2 if not causal else 1) // 2
        if not isinstance(max_distance, int) or max_distance <= exact:
            raise ValueError(f"max_distance must be an int > {exact} (the exact buckets), got {max_distance!r}")
        self.num_buckets, self.max_distance, self.scale_logits = num_buckets, max_distance, scale_logits
        self.relative_attention_bias = nn.Embedding(num_buckets, heads)
        nn.init.normal_(self.relative_attention_bias.weight, std=0.02)

    @property
    def relative(self) -> bool:
        return True

    @property
    def scale(self) -> float:
        """``Dh^-1/2``, or 1 as in T5 itself with ``scale_logits=False``."""
        return self.head_dim**-0.5 if self.scale_logits else 1.0

    def buckets(self, relative_position: Tensor) -> Tensor:
        return PF.t5_relative_position_bucket(
            relative_position,
            bidirectional=not self.causal,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )

    def distance_table(self, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, int]:
        """Bias of every distance ``j - i`` in ``[lo, hi]``: ``((H, hi - lo + 1) float32, lo)``.

        Buckets and table lookups run once per distance (2L - 1 of them), not per pair, so
        the backward into the table is a sum over distances rather than over L² pairs.
        """
        lo = int(k_pos.min()) - int(q_pos.max())
        hi = int(k_pos.max()) - int(q_pos.min())
        dist = torch.arange(lo, hi + 1, device=q_pos.device)
        return self.relative_attention_bias(self.buckets(dist)).float().t(), lo  # (H, n)

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        table, lo = self.distance_table(q_pos, k_pos)  # (H, n)
        Lk = k_pos.shape[-1]
        if _is_range(q_pos) and _is_range(k_pos):
            # Toeplitz fast path: windows[h, a, j] = table[h, a + j]; row i is window Lq - 1 - i
            out = table.unfold(-1, Lk, 1).flip(-2)  # (H, Lq, Lk)
            return out if q_pos.dim() == 1 and k_pos.dim() == 1 else out.unsqueeze(0)
        idx = self.rel_distance(q_pos, k_pos) - lo  # (..., Lq, Lk) in [0, n)
        return table[:, idx].movedim(0, -3)  # (..., H, Lq, Lk)

    def score_mod(self, q_pos: Tensor, k_pos: Tensor) -> ScoreMod:
        # one value per head and distance, looked up by (j - i - lo): (H, n_distances)
        table, lo = self.distance_table(q_pos, k_pos)
        table = table.contiguous()

        def mod(score, b, h, q_idx, kv_idx):
            return score + table[h, k_pos[b, kv_idx] - q_pos[b, q_idx] - lo]

        return mod
