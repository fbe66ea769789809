"""NoPE: no position encoding at all.

Kazemnejad et al., "The Impact of Positional Encoding on Length Generalization in
Transformers", NeurIPS 2023. In a causal decoder, order still leaks through the causal
mask (a token can count how many tokens it sees); bidirectionally the model is a bag of
tokens. Checked by the contract suite only: there is nothing to compare.
"""

from __future__ import annotations

from ..base import PositionEncoding, Stage, register


@register
class NoPE(PositionEncoding):
    name = "nope"
    family = "none"
    paper = "Kazemnejad et al., The Impact of Positional Encoding on Length Generalization in Transformers"
    year = 2023
    stages = Stage.NONE

    @property
    def relative(self) -> bool:
        return True
