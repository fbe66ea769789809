"""TUPE: untied positional attention.

Ke, He, Liu, "Rethinking Positional Encoding in Language Pre-training",
ICLR 2021. Positions never enter the token stream; each layer adds a positional score
computed with projections of its own, shared by all layers::

    s_ij = (x_i W_Q)·(x_j W_K) / sqrt(2·Dh) + (p_i U_Q)·(p_j U_K) / sqrt(2·Dh) [+ b_{j-i}]

``p = LayerNorm(P[pos])`` from a learned table; ``relative_bias=True`` adds T5's
bucketed bias (TUPE-R; TUPE-A without); ``untie_cls=True`` replaces the whole positional
term (absolute and relative) of every pair involving position 0 ([CLS]) by two learned
scalars per head, as eq. (11) (``reset_θ`` of eq. 9 around the sum) and the official code
(own [CLS] buckets) do.
Checked against the formula written out in the tests (there is no installable
reference).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import functional as PF
from ..base import Needs, PositionEncoding
from ..registry import register
from ..validate import check_table_len


@register
class TUPE(PositionEncoding):
    """TUPE: untied absolute positional attention, optionally with T5's relative bias.

    Args:
        relative_bias: add T5's bucketed relative bias (TUPE-R); False is TUPE-A.
        num_buckets, max_distance: T5 bucket options of that bias.
        untie_cls: pairs involving position 0 ([CLS]) get learned per-head scalars
            (``θ_cls→·`` for query 0, ``θ_·→cls`` for key 0) instead of the whole
            positional term, the relative bias included (eq. 9, ``reset_θ``).
        init_std: std of the normal init of the tables and projections.

    Needs ``max_len`` (the size of the learned position table); does not extrapolate.
    """

    name = "tupe"
    paper = "Ke et al., Rethinking Positional Encoding in Language Pre-training"
    year = 2021
    needs = Needs(share_across_layers=True)

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        relative_bias: bool = False,
        num_buckets: int = 32,
        max_distance: int = 128,
        untie_cls: bool = False,
        init_std: float = 0.02,
    ):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        if max_len is None:
            raise ValueError("encoding 'tupe' needs max_len (the size of its position table)")
        check_table_len(self, "max_len", max_len)
        self.relative_bias, self.untie_cls = relative_bias, untie_cls
        self.num_buckets, self.max_distance = num_buckets, max_distance
        D = self.dim
        self.pos_emb = nn.Embedding(max_len, D)
        self.pos_ln = nn.LayerNorm(D)
        self.pos_q = nn.Linear(D, D)  # U_Q
        self.pos_k = nn.Linear(D, D)  # U_K
        for m in (self.pos_emb, self.pos_q, self.pos_k):
            nn.init.normal_(m.weight, std=init_std)
        if relative_bias:
            exact = num_buckets // (1 if causal else 2) // 2
            if not isinstance(num_buckets, int) or num_buckets < (2 if causal else 4):
                raise ValueError(f"num_buckets must be an int >= {2 if causal else 4}, got {num_buckets!r}")
            if not isinstance(max_distance, int) or max_distance <= exact:
                raise ValueError(f"max_distance must be an int > {exact} (the exact buckets), got {max_distance!r}")
            self.relative_attention_bias = nn.Embedding(num_buckets, heads)
            nn.init.normal_(self.relative_attention_bias.weight, std=init_std)
        if untie_cls:
            self.cls_to_others = nn.Parameter(torch.zeros(heads))
            self.others_to_cls = nn.Parameter(torch.zeros(heads))

    @property
    def relative(self) -> bool:
        return False

    @property
    def extrapolates(self) -> bool:
        return False

    @property
    def scale(self) -> float:
        """``(2·Dh)^-1/2``: content and positional terms share the softmax budget (with a
        ``score_scale``, it replaces ``Dh^-1/2``: ``score_scale·2^-1/2``)."""
        if self.score_scale is not None:
            return self.score_scale * 2**-0.5
        return (2 * self.head_dim) ** -0.5

    def _pos_proj(self, pos: Tensor, proj: nn.Linear) -> Tensor:
        """``(..., L)`` -> ``(..., H, L, Dh)``: ``LN(P[pos]) U``."""
        p = proj(self.pos_ln(self.pos_emb(pos)))  # (..., L, D)
        return p.unflatten(-1, (self.heads, self.head_dim)).transpose(-2, -3).float()

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        pq, pk = self._pos_proj(q_pos, self.pos_q), self._pos_proj(k_pos, self.pos_k)
        out = (pq @ pk.transpose(-1, -2)) * self.scale  # (..., H, Lq, Lk)
        if self.relative_bias:
            b = PF.t5_relative_position_bucket(
                self.rel_distance(q_pos, k_pos),
                bidirectional=not self.causal,
                num_buckets=self.num_buckets,
                max_distance=self.max_distance,
            )
            out = out + self.relative_attention_bias(b).float().movedim(-1, -3)
        if self.untie_cls:
            # eq. (9)/(11): reset_θ replaces the WHOLE positional term of pairs involving [CLS]
            # (absolute and relative alike; the official code gives [CLS] its own buckets)
            h = (-1, 1, 1)
            q0 = (q_pos == 0).unsqueeze(-1).unsqueeze(-3)  # (..., 1, Lq, 1)
            k0 = (k_pos == 0).unsqueeze(-2).unsqueeze(-3)  # (..., 1, 1, Lk)
            out = torch.where(k0, self.others_to_cls.float().view(h), out)
            out = torch.where(q0, self.cls_to_others.float().view(h), out)
        return out
