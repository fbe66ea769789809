"""FIRE: functional interpolation for relative positions.

Li et al., "Functional Interpolation for Relative Positions Improves Long
Context Transformers", 2023. ``f_θ(ψ(i - j) / ψ(max(i, L_thr)))``, ``ψ(x) = log(c·x + 1)``,
``f_θ`` an MLP. Checked against the PyTorch listing of the paper's appendix.

Its ``score_mod`` evaluates the MLP inside the closure (FlexAttention), so no ``L×L``
tensor is built on the flex path.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..base import PositionEncoding, ScoreMod, Stage, register
from .bias import _per_head


@register
class FIRE(PositionEncoding):
    """FIRE: a learned function of the progressively normalised distance.

    ``bias_h(i, j) = f_θ(ψ(|i - j|) / (ψ(max(i, L_thr)) + eps))_h`` with ``ψ(x) = log(|c·x| + 1)``,
    ``f_θ: 1 → mlp_width → H`` (ReLU) and ``L_thr = |L_mult·init_L|``: distances are
    measured relative to the query's position once it passes ``L_thr``, the paper's
    progressive interpolation. ``c`` and ``L_mult`` are learned (the paper's listing,
    which keeps ``init_L`` fixed and learns a multiplier). Bidirectional mode uses
    ``|i - j|`` as that listing does.

    Args:
        mlp_width: hidden width of ``f_θ`` (32 in the paper).
        init_c: initial ``c`` (0.1).
        init_L: initial threshold ``L_thr`` (fixed; ``L_mult`` is learned): 512, the value of
            the paper's listing, whatever ``max_len``.
    """

    name = "fire"
    family = "bias"
    paper = "Li et al., Functional Interpolation for Relative Positions Improves Long Context Transformers"
    year = 2023
    stages = Stage.BIAS
    eps = 1e-6

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        mlp_width: int = 32,
        init_c: float = 0.1,
        init_L: float = 512.0,
    ):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        if not isinstance(mlp_width, int) or isinstance(mlp_width, bool) or mlp_width < 1:
            raise ValueError(f"mlp_width must be a positive int, got {mlp_width!r}")
        for arg, val in (("init_c", init_c), ("init_L", init_L)):
            if not isinstance(val, (int, float)) or val <= 0:
                raise ValueError(f"{arg} must be a positive number, got {val!r}")
        self.mlp_width = mlp_width
        self.mlp = nn.Sequential(nn.Linear(1, mlp_width), nn.ReLU(), nn.Linear(mlp_width, heads))
        self.c = nn.Parameter(torch.tensor(float(init_c)))
        self.register_buffer("init_L", torch.tensor(float(init_L)))
        self.L_multiplier = nn.Parameter(torch.tensor(1.0))

    @property
    def relative(self) -> bool:
        # the normaliser depends on the query position once it passes L_thr
        return False

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mlp_width={self.mlp_width}"

    def normalized_distance(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``ψ(|i - j|) / (ψ(max(i, L_thr)) + eps)``: float32 ``(..., Lq, Lk)``."""
        c = self.c.float()
        rel = self.rel_distance(q_pos, k_pos).float()  # (..., Lq, Lk)
        threshold = (self.L_multiplier.float() * self.init_L.float()).abs()
        norm = torch.maximum(q_pos.float(), threshold).unsqueeze(-1)  # (..., Lq, 1)
        return torch.log((c * rel).abs() + 1) / (torch.log((c * norm).abs() + 1) + self.eps)

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        u = self.normalized_distance(q_pos, k_pos)  # (..., Lq, Lk)
        w1, b1 = self.mlp[0].weight.float()[:, 0], self.mlp[0].bias.float()
        w2, b2 = self.mlp[2].weight.float(), self.mlp[2].bias.float()
        hidden = torch.relu(u.unsqueeze(-1) * w1 + b1)  # (..., Lq, Lk, W)
        return _per_head(hidden @ w2.t() + b2)  # (..., H, Lq, Lk)

    def score_mod(self, q_pos: Tensor, k_pos: Tensor) -> ScoreMod:
        """The MLP evaluated inside the closure, unrolled over its hidden units (pointwise only)."""
        c = self.c.float()
        threshold = (self.L_multiplier.float() * self.init_L.float()).abs()
        w1, b1 = self.mlp[0].weight.float()[:, 0], self.mlp[0].bias.float()
        w2, b2 = self.mlp[2].weight.float(), self.mlp[2].bias.float()
        eps, width = self.eps, self.mlp_width

        def mod(score, b, h, q_idx, kv_idx):
            i = q_pos[b, q_idx].to(torch.float32)
            rel = k_pos[b, kv_idx].to(torch.float32) - i
            norm = torch.maximum(i, threshold)
            u = torch.log((c * rel).abs() + 1) / (torch.log((c * norm).abs() + 1) + eps)
            out = b2[h]
            for m in range(width):
                out = out + torch.relu(u * w1[m] + b1[m]) * w2[h, m]
            return score + out

        return mod
