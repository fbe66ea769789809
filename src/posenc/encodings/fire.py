"""FIRE: functional interpolation for relative positions.

Li et al., "Functional Interpolation for Relative Positions Improves Long
Context Transformers", 2023. ``f_θ(ψ(i - j) / ψ(max(i, L_thr)))``, ``ψ(x) = log(c·x + 1)``,
``f_θ`` an MLP. Checked against the PyTorch listing of the paper's appendix.

Its ``score_mod`` evaluates the MLP inside the closure (FlexAttention), so no ``L×L``
tensor is built on the flex path.

Elsewhere (eager, dense, chunked) the MLP is evaluated as what it is: ``f_θ`` has one
scalar input and one ReLU layer, so it is piecewise linear in ``u`` with at most
``mlp_width`` kinks (``u = -b1_k/w1_k``). :func:`relu_mlp_1d` sorts the kinks, forms one
slope and one intercept per head for each of the ``mlp_width + 1`` pieces (from the
parameters, with autograd: ``(W+1)×H`` numbers), and per pair looks up its piece and
computes ``slope·u + intercept``; backward sums the incoming gradient per piece
(``Σ g`` and ``Σ g·u``). Per pair that is a few passes over ``H`` values instead of the
MLP's ``mlp_width``-wide hidden layer, which made FIRE's bias the bulk of its step.
The values are the MLP's up to rounding (the oracle test holds them, and the gradients of
every parameter, to the paper's listing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..base import PositionEncoding, ScoreMod
from ..registry import register
from .bias import _per_head


class _Pieces(torch.autograd.Function):
    """``slope[piece(u)]·u + intercept[piece(u)]``: ``u`` ``(...)`` -> ``(..., H)``.

    ``knots`` ``(K,)`` sorted; the piece of ``u`` is the number of knots ``<= u``;
    ``slope``, ``intercept`` ``(K + 1, H)``.
    """

    @staticmethod
    def forward(ctx, u: Tensor, slope: Tensor, intercept: Tensor, knots: Tensor) -> Tensor:
        u = u.contiguous()
        piece = torch.searchsorted(knots, u, right=True)
        H = slope.shape[1]
        both = F.embedding(piece, torch.cat((slope, intercept), 1))  # (..., 2H): one gather
        ctx.save_for_backward(u, piece, slope)
        return torch.addcmul(both[..., H:], both[..., :H], u.unsqueeze(-1))

    @staticmethod
    def backward(ctx, grad: Tensor):
        u, piece, slope = ctx.saved_tensors
        grad = grad.contiguous()
        gu = (grad * F.embedding(piece, slope)).sum(-1) if ctx.needs_input_grad[0] else None
        if not (ctx.needs_input_grad[1] or ctx.needs_input_grad[2]):
            return gu, None, None, None
        # per-piece sums, first along each row of keys (scatter), then over the rows
        # (a pairwise sum): float32 error grows with the row length, not with all L² pairs
        n, H, K1 = u.shape[-1] if u.dim() else 1, slope.shape[1], slope.shape[0]
        g = grad.reshape(-1, n, H)
        index = piece.reshape(-1, n, 1).expand(-1, -1, H)
        zeros = grad.new_zeros(g.shape[0], K1, H)
        d_intercept = zeros.scatter_add(1, index, g).sum(0)
        d_slope = zeros.scatter_add_(1, index, g * u.reshape(-1, n, 1)).sum(0)
        return gu, d_slope, d_intercept, None


def relu_mlp_1d(u: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """``w2·relu(w1·u + b1) + b2`` for a scalar ``u`` per element: ``u`` ``(...)`` -> ``(..., H)``.

    ``w1``, ``b1`` ``(W,)``, ``w2`` ``(H, W)``, ``b2`` ``(H,)``. Evaluated piece by piece
    (module doc); differentiable in ``u`` and every parameter (the piece boundaries carry
    no gradient: the function is continuous across them).
    """
    W = w1.shape[0]
    with torch.no_grad():
        kink = torch.where(w1 != 0, -b1 / w1, torch.full_like(b1, float("inf")))
        knots, order = torch.sort(kink)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(W, device=w1.device)
        piece = torch.arange(W + 1, device=w1.device)[:, None]  # piece t: knots[t-1] <= u < knots[t]
        # unit k is on in piece t: w1 > 0 and u >= its kink (t > rank), w1 < 0 and u < its kink
        # (t <= rank), or w1 = 0 and b1 > 0
        on = torch.where(w1 > 0, piece > rank, torch.where(w1 < 0, piece <= rank, b1 > 0)).to(w1.dtype)
    slope = (on * w1) @ w2.t()  # (W + 1, H)
    intercept = (on * b1) @ w2.t() + b2
    return _Pieces.apply(u, slope, intercept, knots)


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
    paper = "Li et al., Functional Interpolation for Relative Positions Improves Long Context Transformers"
    year = 2023
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
        return _per_head(relu_mlp_1d(u, w1, b1, w2, b2))  # (..., H, Lq, Lk)

    def score_mod(self, q_pos: Tensor, k_pos: Tensor) -> ScoreMod:
        """The MLP evaluated inside the closure, unrolled over its hidden units (pointwise only).

        Each weight the closure reads is a tensor of its own, indexed by the head exactly once
        (the scalars spread over the heads, one column of head weights per hidden unit):
        FlexAttention's compiled CUDA backward refuses a ``score_mod`` that indexes one tensor
        with gradients twice, and cannot add the gradient of an unindexed captured scalar
        (pytorch#145208, torch 2.11 and 2.13)."""
        heads = self.heads

        def per_head(x: Tensor) -> Tensor:  # a scalar as an (H,) tensor the closure indexes at h
            return x.float().expand(heads).contiguous()

        c = per_head(self.c)
        threshold = per_head((self.L_multiplier.float() * self.init_L.float()).abs())
        w1 = [per_head(w) for w in self.mlp[0].weight[:, 0].unbind()]
        b1 = [per_head(b) for b in self.mlp[0].bias.unbind()]
        w2, b2 = self.mlp[2].weight.float().unbind(1), self.mlp[2].bias.float()
        eps = self.eps

        def mod(score, b, h, q_idx, kv_idx):
            i = q_pos[b, q_idx].to(torch.float32)
            rel = k_pos[b, kv_idx].to(torch.float32) - i
            c_h = c[h]
            norm = torch.maximum(i, threshold[h])
            u = torch.log((c_h * rel).abs() + 1) / (torch.log((c_h * norm).abs() + 1) + eps)
            out = b2[h]
            for w1_m, b1_m, w2_m in zip(w1, b1, w2):
                out = out + torch.relu(u * w1_m[h] + b1_m[h]) * w2_m[h]
            return score + out

        return mod
