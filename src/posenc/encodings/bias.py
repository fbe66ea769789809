"""Scalar score biases: ALiBi, KERPLE and T5 relative buckets (FIRE: :mod:`.fire`).

* ``alibi`` — Press et al., "Train Short, Test Long: Attention with Linear Biases
  Enables Input Length Extrapolation", ICLR 2022. Bias ``-m_h·(i - j)`` (causal) or
  ``-m_h·|i - j|`` (bidirectional), head slopes from :func:`posenc.functional.alibi_slopes`.
  Not scaled by ``Dh^-1/2``. Checked against Bloom's ``_get_alibi_slopes`` and
  ``build_alibi_tensor`` (which differs by a per-row constant: same softmax).
* ``kerple`` — Chi et al., "KERPLE: Kernelized Relative Positional Embedding for
  Length Extrapolation", NeurIPS 2022. ``-r1·log(1 + r2·|i - j|)`` or ``-r1·|i - j|^r2``
  per head, ``r`` learnable and kept positive. Checked against the paper's formula.
* ``t5`` — Raffel et al., "Exploring the Limits of Transfer Learning with a Unified
  Text-to-Text Transformer", JMLR 2020. A learned scalar per head and bucket of
  ``j - i``; one table shared by every layer. Checked against HF ``T5Attention``.

Each provides a FlexAttention ``score_mod`` that computes the bias of one ``(h, i, j)``
from per-head parameters or a per-distance table, so no ``L×L`` tensor is built on the
flex path. ALiBi, T5 and KERPLE also give their bias per distance (``distance_terms``) for
the CPU ``blockwise`` backend (:mod:`posenc.kernels`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import functional as PF
from ..base import Needs, PositionEncoding, ScoreMod
from ..context import table as memo
from ..registry import register
from ..terms import DistanceTerms, saturation


def _per_head(values: Tensor) -> Tensor:
    """``(..., Lq, Lk, H)`` -> ``(..., H, Lq, Lk)``."""
    return values.movedim(-1, -3)


@register
class ALiBi(PositionEncoding):
    name = "alibi"
    paper = "Press et al., Train Short, Test Long: Attention with Linear Biases"
    year = 2022

    def __init__(self, *, heads, head_dim, max_len=None, causal=True, alibi_num_heads: int | None = None):
        """``alibi_num_heads``: only the first ``n`` heads get a bias, with the slopes of an
        ``n``-head model; the others get none (x-transformers' ``alibi_num_heads``)."""
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        n = heads if alibi_num_heads is None else alibi_num_heads
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= heads:
            raise ValueError(f"alibi_num_heads must be an int in [1, heads={heads}], got {alibi_num_heads!r}")
        self.alibi_num_heads = n
        self.register_buffer("slopes", torch.empty(heads), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        slopes = torch.zeros(self.heads)
        slopes[: self.alibi_num_heads] = PF.alibi_slopes(self.alibi_num_heads)
        self.slopes = slopes.to(self.slopes.device)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", alibi_num_heads={self.alibi_num_heads}"

    @property
    def relative(self) -> bool:
        return True

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        rel = self.rel_distance(q_pos, k_pos).float()  # j - i, (..., Lq, Lk)
        if not self.causal:
            rel = -rel.abs()
        return rel.unsqueeze(-3) * self.slopes.float().view(-1, 1, 1)  # (..., H, Lq, Lk)

    def distance_terms(self, q: Tensor, k: Tensor) -> DistanceTerms:
        """``m·d`` for ``d <= 0`` and ``-m·d`` for ``d >= 0``: linear on each side."""
        m = self.slopes.float()
        if self.causal:
            return DistanceTerms(bias=lambda d: m[:, None] * d, kind="linear", far=(0, 0), slopes=(m, -m))
        return DistanceTerms(bias=lambda d: -m[:, None] * d.abs(), kind="linear", far=(0, 0), slopes=(m, -m))

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


def _span(ctx, q_pos: Tensor, k_pos: Tensor) -> tuple[int, int]:
    """``(lo, hi)``: the smallest and largest ``k_pos - q_pos`` of a call, once per model call."""

    def make():
        return int(k_pos.min()) - int(q_pos.max()), int(k_pos.max()) - int(q_pos.min())

    return memo(ctx, _span, "span", (q_pos, k_pos), make)


@register
class T5(PositionEncoding):
    name = "t5"
    paper = "Raffel et al., Exploring the Limits of Transfer Learning with a Unified Text-to-Text Transformer"
    year = 2020
    needs = Needs(share_across_layers=True)  # one bucket table for the whole model, as the paper

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
        """``Dh^-1/2``, or 1 as in T5 itself with ``scale_logits=False``; a ``score_scale``
        replaces either."""
        if self.score_scale is not None:
            return self.score_scale
        return self.head_dim**-0.5 if self.scale_logits else 1.0

    def buckets(self, relative_position: Tensor) -> Tensor:
        return PF.t5_relative_position_bucket(
            relative_position,
            bidirectional=not self.causal,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )

    def _table_key(self, what: str, device) -> tuple[object, str]:
        """``(owner, name)`` of a parameter-free table in the call's memo: the bucket options fix
        it, so T5 instances with equal options share it (a subclass: per instance)."""
        owner = T5 if type(self) is T5 else self
        return owner, f"t5:{what}:{self.causal}:{self.num_buckets}:{self.max_distance}:{device}"

    def distance_buckets(self, lo: int, hi: int, device, ctx=None) -> Tensor:
        """Bucket of every distance in ``[lo, hi]``, int64 ``(hi - lo + 1,)``: once per model call for
        every T5 layer with these bucket options (no parameter in it)."""

        def make():
            return self.buckets(torch.arange(lo, hi + 1, device=device))

        return memo(ctx, *self._table_key(f"buckets:{lo}:{hi}", device), (), make)

    def distance_table(self, q_pos: Tensor, k_pos: Tensor, ctx=None) -> tuple[Tensor, int]:
        """Bias of every distance ``j - i`` in ``[lo, hi]``: ``((H, hi - lo + 1) float32, lo)``.

        Buckets and table lookups run once per distance (2L - 1 of them), not per pair, so
        the backward into the table is a sum over distances rather than over L² pairs. The
        distance range and the buckets come once per model call (``ctx.tables``); the
        lookup into the learned table runs in every layer.
        """
        lo, hi = _span(ctx, q_pos, k_pos)
        buckets = self.distance_buckets(lo, hi, q_pos.device, ctx)
        return self.relative_attention_bias(buckets).float().t(), lo  # (H, n)

    def bias(self, q_pos: Tensor, k_pos: Tensor, ctx=None) -> Tensor:
        table, lo = self.distance_table(q_pos, k_pos, ctx)  # (H, n)
        Lk = k_pos.shape[-1]
        # the Toeplitz view crashes inductor's CPU backward (torch 2.13): gather when compiling
        if not torch.compiler.is_compiling() and memo(
            ctx, _is_range, "ranges", (q_pos, k_pos), lambda: _is_range(q_pos) and _is_range(k_pos)
        ):
            # Toeplitz fast path: windows[h, a, j] = table[h, a + j]; row i is window Lq - 1 - i
            out = table.unfold(-1, Lk, 1).flip(-2)  # (H, Lq, Lk)
            return out if q_pos.dim() == 1 and k_pos.dim() == 1 else out.unsqueeze(0)
        idx = self.rel_distance(q_pos, k_pos) - lo  # (..., Lq, Lk) in [0, n)
        return table[:, idx].movedim(0, -3)  # (..., H, Lq, Lk)

    def distance_terms(self, q: Tensor, k: Tensor, ctx=None) -> DistanceTerms:
        """One bias per bucket; the buckets stop changing near ``±max_distance``.

        The far field ``(lo, hi)`` and the buckets of ``[lo, hi]`` come once per model call:
        the rows of any distance are those buckets read at ``clamp(d, lo, hi)``."""
        table = self.relative_attention_bias.weight  # (num_buckets, H)
        device = table.device
        key = self._table_key("far", device)
        lo, hi = memo(ctx, *key, (), lambda: saturation(self.buckets, self.max_distance, device=device))
        near = self.distance_buckets(lo, hi, device, ctx)  # constant below lo and above hi

        def rows(d: Tensor) -> Tensor:
            return near[d.clamp(lo, hi) - lo]

        return DistanceTerms(bias=lambda r: table[r].t().float(), rows=rows, kind="clamp", far=(lo, hi))

    def score_mod(self, q_pos: Tensor, k_pos: Tensor, ctx=None) -> ScoreMod:
        # one value per head and distance, looked up by (j - i - lo): (H, n_distances)
        table, lo = self.distance_table(q_pos, k_pos, ctx)
        table = table.contiguous()

        def mod(score, b, h, q_idx, kv_idx):
            return score + table[h, k_pos[b, kv_idx] - q_pos[b, q_idx] - lo]

        return mod


def _inverse_softplus(y: Tensor) -> Tensor:
    return y + torch.log(-torch.expm1(-y))


@register
class Kerple(PositionEncoding):
    """KERPLE: a conditionally positive definite kernel of the distance, per head.

    Args:
        kernel: ``"log"``: ``-r1·log(1 + r2·|i - j|)``; ``"power"``: ``-r1·|i - j|^r2``.

    ``r1 = softplus(a)`` and ``r2 = softplus(b)`` (log kernel) or ``r2 = 2·sigmoid(b)`` (power
    kernel, where the paper requires ``0 < r2 <= 2``) stay positive without the paper's
    clamping. Initial values as the paper's code: ``r1 ~ U(0, 2)``, ``r2 ~ U(0, 1)``
    (log) and ``r1 ~ U(0, 1)``, ``r2 ~ U(0, 2)`` (power), floored at 0.01.
    """

    name = "kerple"
    paper = "Chi et al., KERPLE: Kernelized Relative Positional Embedding for Length Extrapolation"
    year = 2022

    def __init__(self, *, heads, head_dim, max_len=None, causal=True, kernel: str = "log"):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        if kernel not in ("log", "power"):
            raise ValueError(f"kernel must be 'log' or 'power', got {kernel!r}")
        self.kernel = kernel
        self.r1_raw = nn.Parameter(torch.empty(heads))
        self.r2_raw = nn.Parameter(torch.empty(heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        eps = 1e-2
        with torch.no_grad():
            if self.kernel == "log":
                r1 = (torch.rand(self.heads) * 2).clamp(min=eps)
                r2 = torch.rand(self.heads).clamp(min=eps)
                self.r2_raw.copy_(_inverse_softplus(r2))
            else:
                r1 = torch.rand(self.heads).clamp(min=eps)
                r2 = (torch.rand(self.heads) * 2).clamp(eps, 2 - eps)
                self.r2_raw.copy_(torch.logit(r2 / 2))
            self.r1_raw.copy_(_inverse_softplus(r1))

    @property
    def relative(self) -> bool:
        return True

    def extra_repr(self) -> str:
        return super().extra_repr() + f", kernel={self.kernel!r}"

    def coefficients(self) -> tuple[Tensor, Tensor]:
        """``(r1, r2)``, each ``(H,)`` float32 and positive."""
        r1 = torch.nn.functional.softplus(self.r1_raw.float())
        r2 = self.r2_raw.float()
        r2 = torch.nn.functional.softplus(r2) if self.kernel == "log" else 2 * torch.sigmoid(r2)
        return r1, r2

    @staticmethod
    def _kernel(kind: str, d: Tensor, r1: Tensor, r2: Tensor) -> Tensor:
        """``d = |i - j|`` float32; ``r1, r2`` broadcast against it."""
        if kind == "log":
            return -r1 * torch.log1p(r2 * d)
        # d^r2 through exp/log, with 0^r2 = 0 and no NaN gradient for r2 at d = 0
        return -r1 * torch.where(d > 0, torch.exp(r2 * torch.log(d.clamp(min=1))), torch.zeros_like(d))

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        d = self.rel_distance(q_pos, k_pos).abs().float().unsqueeze(-3)  # (..., 1, Lq, Lk)
        r1, r2 = (c.view(-1, 1, 1) for c in self.coefficients())
        return self._kernel(self.kernel, d, r1, r2)  # (..., H, Lq, Lk)

    def distance_terms(self, q: Tensor, k: Tensor) -> DistanceTerms:
        r1, r2 = (c[:, None] for c in self.coefficients())
        return DistanceTerms(bias=lambda d: self._kernel(self.kernel, d.abs().float(), r1, r2))

    def score_mod(self, q_pos: Tensor, k_pos: Tensor) -> ScoreMod:
        r1, r2 = self.coefficients()
        kind = self.kernel

        def mod(score, b, h, q_idx, kv_idx):
            d = (k_pos[b, kv_idx] - q_pos[b, q_idx]).abs().to(torch.float32)
            return score + self._kernel(kind, d, r1[h], r2[h])

        return mod
