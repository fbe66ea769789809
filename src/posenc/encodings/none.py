"""NoPE: no position encoding at all, optionally with Llama 4's query temperature.

Kazemnejad et al., "The Impact of Positional Encoding on Length Generalization in
Transformers", NeurIPS 2023. In a causal decoder, order still leaks through the causal
mask (a token can count how many tokens it sees); bidirectionally the model is a bag of
tokens. Checked by the contract suite only: there is nothing to compare.

Llama 4's NoPE layers (iRoPE, 2025; HF ``models/llama4/modeling_llama4.py``, after
Nakanishi, "Scalable-Softmax Is Superior for Attention", 2025) scale each query by a
temperature that grows with the log of its position::

    q_i ← q_i · (1 + attn_scale · log(1 + floor((p_i + 1) / floor_scale)))

so attention stays sharp over long contexts: the registered variant ``nope-temperature``
(a class of its own: its q/k stage scales the queries), built by its name.
Checked against HF ``Llama4TextAttention`` in ``tests/test_layers_parity.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..base import PositionEncoding
from ..registry import register


@register
class NoPE(PositionEncoding):
    """No position encoding (no stage). Llama 4's query temperature is :class:`NoPETemperature`
    (``nope-temperature``)."""

    name = "nope"
    paper = "Kazemnejad et al., The Impact of Positional Encoding on Length Generalization in Transformers"
    year = 2023

    @property
    def relative(self) -> bool:
        return True


@register
class NoPETemperature(NoPE):
    """NoPE with Llama 4's query temperature (its NoPE layers; the q/k stage scales the queries).

    Args:
        attn_scale: strength of the temperature (HF ``attn_scale``, 0.1 in Llama 4); 0 gives
            the identity.
        floor_scale: tokens per temperature step (HF ``floor_scale``, 8192 in Llama 4).
    """

    name = "nope-temperature"
    paper = "Meta, Llama 4 (iRoPE NoPE layers), after Nakanishi, Scalable-Softmax Is Superior for Attention"
    year = 2025

    def __init__(
        self, *, heads, head_dim, max_len=None, causal=True, attn_scale: float = 0.1, floor_scale: float = 8192
    ):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        if not isinstance(attn_scale, (int, float)) or isinstance(attn_scale, bool) or attn_scale < 0:
            raise ValueError(f"attn_scale must be a number >= 0, got {attn_scale!r}")
        if not isinstance(floor_scale, (int, float)) or isinstance(floor_scale, bool) or floor_scale <= 0:
            raise ValueError(f"floor_scale must be a number > 0, got {floor_scale!r}")
        self.attn_scale, self.floor_scale = float(attn_scale), float(floor_scale)

    @property
    def relative(self) -> bool:
        return self.attn_scale == 0.0

    def extra_repr(self) -> str:
        return super().extra_repr() + f", attn_scale={self.attn_scale}, floor_scale={self.floor_scale}"

    def temperature(self, pos: Tensor) -> Tensor:
        """Query scale ``1 + attn_scale·log1p(floor((p + 1)/floor_scale))``, float32, shape of ``pos``."""
        return torch.log1p(torch.floor((pos.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """Scale the queries (``(B, H, Lq, Dh)``) by their temperature; keys unchanged."""
        if q_pos.shape[-1] != q.shape[2]:
            raise ValueError(f"q_pos has length {q_pos.shape[-1]}, queries have length {q.shape[2]}")
        t = self.temperature(q_pos).view(q_pos.shape[0], 1, -1, 1)  # (B|1, 1, Lq, 1)
        return (q * t).to(q.dtype), k
