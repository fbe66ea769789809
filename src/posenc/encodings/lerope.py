"""LeRoPE: RoPE whose frequencies each carry a learned log-scale.

* ``lerope`` — Mistral Large 4 (Mistral AI, 2026), as HF transformers implements it
  (``models/mistral_large4/modular_mistral_large4.py``, ``MistralLarge4TextRotaryEmbedding``,
  lines 226–245): the frequencies of the configured RoPE (Mistral Large 4: YaRN with factor 2048
  over a 512-token window and ``attention_factor`` 1) are multiplied by ``exp(α)``, one learned
  ``α`` per frequency shared by every head and layer position, initialised to 0 (plain RoPE)::

      θ'_k = θ_k · exp(α_k)        angle(i, k) = i · θ'_k

  The rotation is ``rope``'s in every other respect (layouts, ``partial_rotary_factor``, the
  attention factor of the scaling type on cos and sin). Checked against HF's module with random
  ``α`` in ``tests/test_lerope.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..registry import register
from .rotary import RoPE

__all__ = ["LeRoPE"]


@register
class LeRoPE(RoPE):
    """``lerope``: :class:`~posenc.encodings.rotary.RoPE` with a learned log-scale ``alpha``
    ``(Dr/2,)`` per frequency (HF Mistral Large 4's ``rotary_emb.alpha``). Options: ``rope``'s
    ``base``, ``layout``, ``partial_rotary_factor``, ``rope_scaling`` (1-D positions: one ``α``
    per frequency). Tables are this instance's (its angles are learned), built once per call.

    Raises:
        ValueError: whatever ``rope`` raises for these options.
    """

    name = "lerope"
    paper = "Mistral AI, Mistral Large 4 (LeRoPE; HF transformers models/mistral_large4)"
    year = 2026

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        base: float = 10000.0,
        layout: str | None = None,
        partial_rotary_factor: float = 1.0,
        rope_scaling: dict | None = None,
    ):
        super().__init__(
            heads=heads,
            head_dim=head_dim,
            max_len=max_len,
            causal=causal,
            base=base,
            layout=layout,
            partial_rotary_factor=partial_rotary_factor,
            rope_scaling=rope_scaling,
        )
        self.alpha = nn.Parameter(torch.zeros(self.rotary_dim // 2))  # exp(0) = 1: RoPE until trained

    def table_key(self):
        return None  # learned angles: no table shared across layers or kept between calls

    def frequencies(self, seq_len: int) -> Tensor:
        """The configured type's ``inv_freq`` times ``exp(alpha)`` (float32)."""
        return super().frequencies(seq_len).float() * self.alpha.float().exp()
