"""Contextual position encoding (CoPE).

Golovneva et al., "Contextual Position Encoding: Learning to Count What's Important",
2024. A query counts the keys it finds relevant instead of the tokens in between:

    g_ij = σ(scale · q_i·k_j)                   gates, 0 for j > i
    p_ij = Σ_{t=j..i} g_it                      contextual position (reverse cumsum), ≤ npos_max - 1
    e_ij = (1 - w)·(q_i·E[⌊p_ij⌋]) + w·(q_i·E[⌈p_ij⌉]),   w = p_ij - ⌊p_ij⌋
    s_ij = scale · q_i·k_j + e_ij

``E`` is ``(Dh, npos_max)`` and shared by the heads of a layer, zero-initialised, as
in the paper's listing. The term depends on the content, so it is a ``TERMS`` stage:
:meth:`CoPE.score_terms` returns ``e / scale`` (the attention layer multiplies the
terms by ``scale``). Causal only. Checked against the formula above written out
in the test, and against the paper's ``CoPE``/``SelfAttn`` listing.

The gates count only keys the query sees. The score sum hands the call's mask (causal,
key padding, packed documents) to the stage as ``ctx.mask``, and the plain ``q·kᵀ`` it
computed as ``ctx.qk`` (the gates' logits, computed and differentiated once), so
gates of hidden keys are 0, as in the paper's listing (``attn_logits += mask.log()``
before the sigmoid). Without a mask (a direct call) causality comes from positions
(``k_pos <= q_pos``), which equals the causal mask whenever positions increase along
the sequence.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..base import PositionEncoding
from ..registry import register
from ..validate import check_table_len


@register
class CoPE(PositionEncoding):
    """CoPE. Args: ``npos_max``: number of integer positions in ``E`` (``p`` is clipped below it)."""

    name = "cope"
    paper = "Golovneva et al., Contextual Position Encoding: Learning to Count What's Important"
    year = 2024
    causal_only = True

    def __init__(self, *, heads, head_dim, max_len=None, causal=True, npos_max: int = 64):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        if not isinstance(npos_max, int) or isinstance(npos_max, bool) or npos_max < 2:
            raise ValueError(f"npos_max must be an int >= 2, got {npos_max!r}")
        check_table_len(self, "npos_max", npos_max)
        self.npos_max = npos_max
        self.pos_emb = nn.Parameter(torch.zeros(head_dim, npos_max))

    @property
    def relative(self) -> bool:
        return True

    def extra_repr(self) -> str:
        return super().extra_repr() + f", npos_max={self.npos_max}"

    def positions(
        self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, mask: Tensor | None = None, qk: Tensor | None = None
    ) -> Tensor:
        """Contextual positions ``p``: float32 ``(B, H, Lq, Lk)``, clipped to ``npos_max - 1``.

        ``mask``: bool ``(B|1, 1, Lq, Lk)``, True = the query sees the key; hidden keys do not count.
        ``qk``: ``q @ kᵀ`` when the caller has it (computed here otherwise).
        """
        if qk is None:
            qk = q @ k.transpose(-1, -2)
        logits = qk.float() * self.scale  # (B, H, Lq, Lk), a new tensor: qk itself is not saved
        visible = (self.rel_distance(q_pos, k_pos) <= 0).unsqueeze(-3)  # (B|1, 1, Lq, Lk): key j at or before query i
        if mask is not None:
            visible = visible & mask
        gates = torch.sigmoid(logits) * visible
        pos = gates.flip(-1).cumsum(-1).flip(-1)  # Σ_{t >= j} g_it
        # clipped with fmin, not clamp: a NaN gate (a NaN q or k) gives the last position, a
        # valid index, instead of an out-of-range gather; the backends make that head NaN
        return pos.fmin(pos.new_tensor(self.npos_max - 1))

    def score_terms(
        self,
        q: Tensor,
        k: Tensor,
        q_pos: Tensor,
        k_pos: Tensor,
        ctx=None,
        *,
        mask: Tensor | None = None,
        qk: Tensor | None = None,
    ) -> Tensor:
        """CoPE's term ``e[p_ij] / scale``. The mask and ``q·kᵀ`` come from ``ctx`` (or, in a
        direct call, ``mask=``/``qk=``; without either, causality from positions)."""
        if ctx is not None:
            mask = ctx.mask if mask is None else mask
            qk = ctx.qk if qk is None else qk
        if q.dim() != 4 or k.dim() != 4 or q.shape[-1] != self.head_dim:
            raise ValueError(f"q, k must be (B, H, L, {self.head_dim}), got {tuple(q.shape)}, {tuple(k.shape)}")
        if q_pos.shape[-1] != q.shape[-2] or k_pos.shape[-1] != k.shape[-2]:
            raise ValueError(
                f"positions of lengths {q_pos.shape[-1]}, {k_pos.shape[-1]} for q, k of lengths "
                f"{q.shape[-2]}, {k.shape[-2]}"
            )
        if qk is not None and qk.shape != (*q.shape[:-1], k.shape[-2]):
            raise ValueError(f"qk must be q @ k^T, shape {(*q.shape[:-1], k.shape[-2])}, got {tuple(qk.shape)}")
        pos = self.positions(q, k, q_pos, k_pos, mask, qk)
        lo = pos.floor()
        # q·E[m] / scale for every integer position (the layer multiplies the terms by scale:
        # dividing the (Dh, npos_max) table costs nothing, dividing e a pass over every pair)
        # in float32 under autocast too, as the positions p it is interpolated at
        with torch.autocast(q.device.type, enabled=False):
            logits_int = q.float() @ (self.pos_emb.float() / self.scale)  # (B, H, Lq, npos_max)
        # (1 - w)·e[⌊p⌋] + w·e[⌈p⌉] as one fused pass, w = p - ⌊p⌋ (differentiable through p)
        return torch.lerp(logits_int.gather(-1, lo.long()), logits_int.gather(-1, pos.ceil().long()), pos - lo)
