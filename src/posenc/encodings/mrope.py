"""Multimodal rotary embedding (M-RoPE).

Wang et al., "Qwen2-VL: Enhancing Vision-Language Model's Perception of the World at Any
Resolution", 2024. Every token carries three positions ``(t, h, w)`` (time, row, column;
see :func:`posenc.positions.mrope_positions`). The ``Dr/2`` frequencies of a 1-D RoPE
(``base^(-2k/Dr)``, highest first) are cut into ``mrope_section`` consecutive sections;
section ``i`` turns by coordinate ``i mod 3``. Qwen3-VL's *interleaved* M-RoPE
(``mrope_interleaved=True``) spreads the axes over the spectrum instead: frequency ``k``
reads ``T, H, W, T, H, W, …`` (axis ``k mod 3``) while axis ``a`` still has pairs left
(``mrope_section[a]`` of them), then ``T`` for the rest, so each axis gets low and high
frequencies alike. Text tokens carry ``t = h = w = p``, so on
text M-RoPE *is* 1-D RoPE; one position per token (``(L,)`` or ``(B, L)``) means exactly
that. Relative along each axis: the score of ``q_i, k_j`` depends on ``pos_i - pos_j`` only.

Checked element-wise against HF transformers' ``Qwen2VLRotaryEmbedding`` (whose
``recomposition_frequencies`` replaced ``apply_multimodal_rotary_pos_emb``) with
``apply_rotary_pos_emb`` on a random tiny ``Qwen2VLTextConfig``, and its position ids
against ``Qwen2VLModel.get_rope_index``; the interleaved form against
``Qwen3VLTextRotaryEmbedding`` (``recomposition_frequencies``, formerly
``apply_interleaved_mrope``) in ``tests/test_rope_variants.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..registry import register
from .rotary import RoPE


def default_mrope_section(pairs: int, interleaved: bool = False) -> list[int]:
    """Qwen2-VL's split ``[16, 24, 24]`` of 64 pairs (``3/8`` each to h and w) or, interleaved,
    Qwen3-VL's ``[24, 20, 20]`` (``5/16`` each), scaled to ``pairs``."""
    hw = 5 * pairs // 16 if interleaved else 3 * pairs // 8
    return [pairs - 2 * hw, hw, hw]


@register
class MRoPE(RoPE):
    """Qwen2-VL's M-RoPE: 1-D RoPE frequencies split into sections over ``(t, h, w)``.

    Args:
        mrope_section: pairs per section, summing to ``Dh/2`` (HF's ``rope_parameters
            ["mrope_section"]``, ``[16, 24, 24]`` for ``Dh = 128``); section ``i`` reads
            axis ``i mod 3``. Default: ``[16, 24, 24]`` scaled to ``Dh/2`` (t gets the rest of
            ``3/8`` to each of h and w); interleaved, ``[24, 20, 20]`` scaled.
        mrope_interleaved: Qwen3-VL's layout of the sections (HF ``rope_parameters
            ["mrope_interleaved"]``): pair ``k`` reads axis ``k mod 3`` for ``k < 3·mrope_section[a]``
            (``a = 1, 2``), else ``t``. ``False``: consecutive sections (Qwen2-VL).
        base: ``θ`` (HF ``rope_theta``).
        layout: ``"half"`` (HF) or ``"interleaved"``.
        rope_scaling: HF's dict of a static type (``linear``, ``yarn``, ``llama3``) applied to
            the 1-D frequencies before they are split, as HF does.
    """

    name = "mrope"
    paper = "Wang et al., Qwen2-VL: Enhancing Vision-Language Model's Perception of the World at Any Resolution"
    year = 2024
    # per-layer instances with equal options share their tables within a call (RoPE.table_key)
    _table_fields = (*RoPE._table_fields, "mrope_section", "mrope_interleaved")

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        base: float = 10000.0,
        mrope_section: list[int] | tuple[int, ...] | None = None,
        mrope_interleaved: bool = False,
        layout: str | None = None,
        rope_scaling: dict | None = None,
    ):
        pairs = head_dim // 2
        section = default_mrope_section(pairs, mrope_interleaved) if mrope_section is None else mrope_section
        if (
            not isinstance(section, (list, tuple))
            or not section
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in section)
            or sum(section) != pairs
        ):
            raise ValueError(
                f"mrope_section must be a list of ints >= 0 summing to head_dim/2 = {pairs}, got {mrope_section!r}"
            )
        if not isinstance(mrope_interleaved, bool):
            raise TypeError(f"mrope_interleaved must be a bool, got {mrope_interleaved!r}")
        if mrope_interleaved and len(section) != 3:
            raise ValueError(f"interleaved M-RoPE takes one section per axis (t, h, w), got {mrope_section!r}")
        self.mrope_section = [int(s) for s in section]
        self.mrope_interleaved = mrope_interleaved
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
        if self.mrope_interleaved:  # HF recomposition_frequencies: h at 1, 4, …; w at 2, 5, …; t elsewhere
            axis = torch.zeros(len(inv_freq), dtype=torch.long)
            for a in (1, 2):
                axis[a : 3 * self.mrope_section[a] : 3] = a
            return inv_freq, axis, factor
        axis = torch.cat([torch.full((s,), i % 3, dtype=torch.long) for i, s in enumerate(self.mrope_section)])
        return inv_freq, axis, factor

    def extra_repr(self) -> str:
        s = super().extra_repr() + f", mrope_section={self.mrope_section}"
        return s + (", mrope_interleaved=True" if self.mrope_interleaved else "")
