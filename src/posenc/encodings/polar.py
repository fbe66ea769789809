"""PoPE: polar coordinate position embeddings.

Gopalakrishnan, Csordás, Schmidhuber and Mozer, "Decoupling the 'What' and 'Where' With
Polar Coordinate Positional Embeddings", 2025 (arXiv 2509.10534). RoPE rotates pairs of
query/key dimensions, so the angle of a pair mixes content (the pair's own angle) with
position. PoPE makes each of the ``Dh`` components a complex number whose *magnitude* is
the content, ``μ = softplus(x_c) > 0``, and whose *phase* is the position alone::

    q̃_ic = μq_ic · e^{i·iθ_c},   k̃_jc = μk_jc · e^{i(jθ_c + δ_c)},   θ_c = base^(-c/Dh)
    s_ij = Re[Σ_c conj(q̃_ic)·k̃_jc] = Σ_c μq_ic·μk_jc·cos((j - i)θ_c + δ_c)

(``c = 0 … Dh-1``: one frequency per component, not per pair, so twice RoPE's count).
``δ`` ``(H, Dh)`` is a learned phase per head and component, clamped to ``[-2π, 0]``.

The complex product is carried by real tensors: ``rotate`` returns
``q̃ = [μq·cos(iθ - δ), μq·sin(iθ - δ)]`` and ``k̃ = [μk·cos(jθ), μk·sin(jθ)]``, of last
dimension ``2·Dh`` while ``v`` keeps ``Dh`` (SDPA and the score sum take that), and
``q̃·k̃`` is the sum above. The phase turns the queries (the paper and x-transformers turn
the keys by ``+δ``: the same scores), so that keys shared by several query heads
(grouped-query attention) need no phase of their own. Scores depend on ``j - i`` only:
``relative`` is True, and any position works (``extrapolates``).

Reference: x-transformers 2.31.10 (``PolarEmbedding``, ``apply_polar_pos_emb`` and their
use in ``Attention``), whose scores and outputs ``tests/test_pope.py`` matches element-wise:
the same float32 frequencies ``1 / base^(c/Dh)`` and angles ``pos·θ``, the phase clamped to
``[-2π, 0]`` and initialised to zeros (``bias_uniform_init``: ``U(-2π, 0)``), and
``scale = Dh^-1/2``, the head dim before the doubling (the base class's default).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import functional as PF
from ..base import Needs, PositionEncoding
from ..registry import register

__all__ = ["PoPE", "polar_frequencies"]


def polar_frequencies(head_dim: int, base: float) -> Tensor:
    """``θ_c = 1 / base^(c/Dh)`` for ``c = 0 … Dh-1``: float32 ``(Dh,)`` (one per component)."""
    exponent = torch.arange(head_dim, dtype=torch.float32) / head_dim
    return 1.0 / (base**exponent)


@register
class PoPE(PositionEncoding):
    """Polar coordinate position embeddings: softplus magnitudes, position-only phases.

    ``rotate`` maps ``q``, ``k`` ``(B, H, L, Dh)`` to ``(B, H, L, 2·Dh)``: cosine parts
    then sine parts, in float32 and cast back to the input dtype. The attention scale
    stays ``Dh^-1/2`` (x-transformers scales by the head dim, not by the doubled width).

    KV cache: a cache holds ``Dh``-wide keys, so the encoding needs ``raw_keys``: the
    cache stores keys before ``rotate`` and the layer rotates every cached key again at
    each step (``O(Lk·Dh)`` elementwise work per step and layer, as x-transformers, whose
    cache also holds raw keys). Cached decoding equals the full forward.

    Args:
        base: ``θ`` of the frequencies ``base^(-c/Dh)`` (x-transformers ``base``), > 1.
        bias_uniform_init: initialise the phase ``δ`` from ``U(-2π, 0)`` instead of zeros
            (x-transformers ``polar_bias_uniform_init``).

    Raises:
        TypeError: ``base`` not a number, ``bias_uniform_init`` not a bool.
        ValueError: ``base`` at most 1, or not finite.
    """

    name = "pope"
    paper = "Gopalakrishnan et al., Decoupling the 'What' and 'Where' With Polar Coordinate Positional Embeddings"
    year = 2025
    needs = Needs(raw_keys=True)  # rotated keys are 2·Dh wide: the cache keeps the raw Dh-wide ones

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        base: float = 10000.0,
        bias_uniform_init: bool = False,
    ):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        if not isinstance(base, (int, float)) or isinstance(base, bool):
            raise TypeError(f"base must be a number > 1, got {base!r} ({type(base).__name__})")
        if base <= 1:
            raise ValueError(f"base must be a number > 1, got {base!r}")
        self.base = float(base)
        self.bias_uniform_init = bias_uniform_init
        self.register_buffer("inv_freq", torch.empty(head_dim), persistent=False)
        self.init_buffers()
        # δ: one learned phase per query head and component (rotate subtracts it from iθ)
        self.phase = nn.Parameter(torch.zeros(heads, head_dim))
        if bias_uniform_init:
            with torch.no_grad():
                self.phase.uniform_(-2.0 * math.pi, 0.0)

    def init_buffers(self) -> None:
        self.inv_freq = polar_frequencies(self.head_dim, self.base).to(self.inv_freq.device)

    @property
    def relative(self) -> bool:
        return True

    def extra_repr(self) -> str:
        return super().extra_repr() + f", base={self.base}, bias_uniform_init={self.bias_uniform_init}"

    # ------------------------------------------------------------------ rotation
    def clamped_phase(self) -> Tensor:
        """``δ`` clamped to ``[-2π, 0]`` as x-transformers does: float32 ``(H, Dh)``."""
        return self.phase.float().clamp(-2.0 * math.pi, 0.0)

    def angles(self, pos: Tensor) -> Tensor:
        """``pos · θ_c``: float32 ``(L, Dh)`` for ``(L,)`` positions, ``(B|1, 1, L, Dh)`` for ``(B|1, L)``."""
        ang = PF.rope_angles(pos, self.inv_freq)  # formed in float64, rounded once
        return ang.unsqueeze(1) if pos.dim() == 2 else ang

    def _check(self, x: Tensor, pos: Tensor, what: str, *, grouped: bool = False) -> None:
        """``x`` ``(B, H, L, Dh)`` (``grouped``: ``H`` may be any divisor of ``heads``) at ``L`` positions."""
        heads_ok = x.dim() == 4 and (
            0 < x.shape[1] and self.heads % x.shape[1] == 0 if grouped else x.shape[1] == self.heads
        )
        if not heads_ok or x.shape[-1] != self.head_dim:
            heads = f"a divisor of {self.heads}" if grouped else self.heads
            raise ValueError(
                f"pope: expected a {what} of shape (B, H, L, {self.head_dim}) with H = {heads}, got {tuple(x.shape)}"
            )
        if x.shape[-2] != pos.shape[-1]:
            raise ValueError(f"pope: positions of length {pos.shape[-1]} for a {what} of length {x.shape[-2]}")

    @staticmethod
    def _polar(x: Tensor, ang: Tensor) -> Tensor:
        """``[softplus(x)·cos(ang), softplus(x)·sin(ang)]``: ``(B, H, L, 2·Dh)`` in ``x``'s dtype."""
        mag = F.softplus(x.float())
        return torch.cat((mag * ang.cos(), mag * ang.sin()), dim=-1).to(x.dtype)

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, ctx=None) -> tuple[Tensor, Tensor]:
        """``q``: ``(B, H, Lq, Dh)``, ``k``: ``(B, Hk, Lk, Dh)`` -> ``(B, H, Lq, 2·Dh)``, ``(B, Hk, Lk, 2·Dh)``.

        ``Hk``: ``H``, or fewer key heads shared by groups of query heads (the HF adapter's
        grouped-query attention): the phase turns the queries, which have one head each.
        """
        self._check(q, q_pos, "query")
        self._check(k, k_pos, "key", grouped=True)
        k_ang = self.angles(k_pos)
        q_ang = k_ang if q_pos is k_pos else self.angles(q_pos)
        # iθ - δ on the queries: the same cos((j - i)θ + δ) as jθ + δ on the keys
        q_ang = q_ang - self.clamped_phase().unsqueeze(-2)  # (H, 1, Dh)
        return self._polar(q, q_ang), self._polar(k, k_ang)
