"""Multimodal rotary embedding (M-RoPE).

Wang et al., "Qwen2-VL: Enhancing Vision-Language Model's Perception of the World at Any
Resolution", 2024. Every token carries three positions ``(t, h, w)`` (time, row, column;
see :func:`posenc.positions.mrope_positions`). The ``Dr/2`` frequencies of a 1-D RoPE
(``base^(-2k/Dr)``, highest first) are cut into ``mrope_section`` consecutive sections;
section ``i`` turns by coordinate ``i mod 3``. Text tokens carry ``t = h = w = p``, so on
text M-RoPE *is* 1-D RoPE; one position per token (``(L,)`` or ``(B, L)``) means exactly
that. Relative along each axis: the score of ``q_i, k_j`` depends on ``pos_i - pos_j`` only.

Checked element-wise against HF transformers' ``Qwen2VLRotaryEmbedding`` (whose
``recomposition_frequencies`` replaced ``apply_multimodal_rotary_pos_emb``) with
``apply_rotary_pos_emb`` on a random tiny ``Qwen2VLTextConfig``, and its position ids
against ``Qwen2VLModel.get_rope_index``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..base import register
from .rotary import RoPE


def default_mrope_section(pairs: int) -> list[int]:
    """Qwen2-VL's split ``[16, 24, 24]`` of 64 pairs, scaled to ``pairs``: ``3/8`` each to h and w."""
    hw = 3 * pairs // 8
    return [pairs - 2 * hw, hw, hw]


@register
class MRoPE(RoPE):
    """Qwen2-VL's M-RoPE: 1-D RoPE frequencies split into sections over ``(t, h, w)``.

    Args:
        mrope_section: pairs per section, summing to ``Dh/2`` (HF's ``rope_parameters
            ["mrope_section"]``, ``[16, 24, 24]`` for ``Dh = 128``); section ``i`` reads
            axis ``i mod 3``. Default: ``[16, 24, 24]`` scaled to ``Dh/2`` (t gets the rest of
            ``3/8`` to each of h and w).
        base: ``θ`` (HF ``rope_theta``).
        layout: ``"half"`` (HF) or ``"interleaved"``.
        rope_scaling: HF's dict of a static type (``linear``, ``yarn``, ``llama3``) applied to
            the 1-D frequencies before they are split, as HF does.
    """

    name = "mrope"
    family = "rotary"
    paper = "Wang et al., Qwen2-VL: Enhancing Vision-Language Model's Perception of the World at Any Resolution"
    year = 2024

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        base: float = 10000.0,
        mrope_section: list[int] | tuple[int, ...] | None = None,
        layout: str | None = None,
        rope_scaling: dict | None = None,
    ):
        pairs = head_dim // 2
        section = default_mrope_section(pairs) if mrope_section is None else mrope_section
        if (
            not isinstance(section, (list, tuple))
            or not section
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in section)
            or sum(section) != pairs
        ):
            raise ValueError(
                f"mrope_section must be a list of ints >= 0 summing to head_dim/2 = {pairs}, got {mrope_section!r}"
            )
        self.mrope_section = [int(s) for s in section]
        super().__init__(
            heads=heads,
            head_dim=head_dim,
            max_len=max_len,
            causal=causal,
            base=base,
            layout=layout,
            rope_scaling=rope_scaling,
            axes=3,
        )

    def _check_axes(self) -> None:
        if self.length_dependent:
            super()._check_axes()  # only the length-dependent types are refused; sections need no divisibility

    def axis_frequencies(self) -> tuple[Tensor, Tensor, float]:
        """The 1-D ``inv_freq`` unchanged; pair ``k`` reads the axis of the section holding it."""
        inv_freq, factor = self._params()
        axis = torch.cat([torch.full((s,), i % 3, dtype=torch.long) for i, s in enumerate(self.mrope_section)])
        return inv_freq, axis, factor

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mrope_section={self.mrope_section}"
