"""Shaw et al. relative position representations (keys and values).

Shaw, Uszkoreit, Vaswani, "Self-Attention with Relative Position Representations",
NAACL 2018. Distance ``j - i`` clipped to ``[-k, k]`` (``k = max_relative_position``)
indexes two ``(2k+1, Dh)`` tables shared across heads (or one per head,
``per_head=True``)::

    e_ij = (q_i·k_j + q_i·aK_ij) / sqrt(Dh)        o_i = Σ_j a_ij (v_j + aV_ij)

Fast path, no ``(L, L, Dh)`` tensor: ``q_i·aK_r`` once per distance ``r`` then gathered
into place (:func:`posenc.functional.gather_relative_logits`), and the value term as the
attention mass per distance times ``aV`` (:func:`posenc.functional.scatter_relative_values`).
Checked against a direct transcription of tensor2tensor's
``dot_product_attention_relative``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import functional as PF
from ..base import PositionEncoding, Stage, register


@register
class Shaw(PositionEncoding):
    name = "shaw"
    family = "relative"
    paper = "Shaw et al., Self-Attention with Relative Position Representations"
    year = 2018
    stages = Stage.TERMS | Stage.VALUE

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        max_relative_position: int = 16,
        per_head: bool = False,
        init_std: float | None = None,
    ):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        if not isinstance(max_relative_position, int) or max_relative_position < 1:
            raise ValueError(f"max_relative_position must be an int >= 1, got {max_relative_position!r}")
        self.max_relative_position = max_relative_position
        self.per_head = per_head
        n = 2 * max_relative_position + 1
        shape = (heads, n, head_dim) if per_head else (n, head_dim)
        self.rel_k = nn.Parameter(torch.empty(shape))
        self.rel_v = nn.Parameter(torch.empty(shape))
        std = head_dim**-0.5 if init_std is None else init_std
        nn.init.normal_(self.rel_k, std=std)
        nn.init.normal_(self.rel_v, std=std)

    @property
    def relative(self) -> bool:
        return True

    @property
    def num_rel(self) -> int:
        return 2 * self.max_relative_position + 1

    def rel_index(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``clip(j - i, -k, k) + k``: ``(..., Lq, Lk)`` int64 in ``[0, 2k]``."""
        k = self.max_relative_position
        return self.rel_distance(q_pos, k_pos).clamp(-k, k) + k

    def score_terms(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        if q.shape[-2] != q_pos.shape[-1] or k.shape[-2] != k_pos.shape[-1]:
            raise ValueError(
                f"q/k lengths {q.shape[-2]}/{k.shape[-2]} do not match positions {q_pos.shape[-1]}/{k_pos.shape[-1]}"
            )
        table = self.rel_k.to(q.dtype)
        if self.per_head:
            rel = torch.einsum("bhid,hrd->bhir", q, table)  # (B, H, Lq, R)
        else:
            rel = q @ table.t()  # (B, H, Lq, R)
        return PF.gather_relative_logits(rel, self.rel_index(q_pos, k_pos))

    def value_term(self, attn: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        mass = PF.scatter_relative_values(attn, self.rel_index(q_pos, k_pos), self.num_rel)  # (B, H, Lq, R)
        table = self.rel_v.to(attn.dtype)
        if self.per_head:
            return torch.einsum("bhir,hrd->bhid", mass, table)
        return mass @ table  # (B, H, Lq, Dh)
