"""``posenc compare``: train one small model per encoding, measure quality and length extrapolation.

The question it answers is "which encoding, and what happens past my training
length?", the way Press et al. ("Train Short, Test Long", ICLR 2022, Table 2) and
Kazemnejad et al. (NeurIPS 2023) answered it: the same model, data, seed and data order
for every encoding; evaluation at several lengths past the training length; loss,
perplexity, bits per byte and the loss by position (or exact-match accuracy on the
synthetic tasks). See ``docs/compare.md``.

Python use::

    from posenc.compare import compare, preset_config
    results = compare(preset_config("quick", encodings=["rope", "alibi"], steps=50), out="runs/x")
"""

from .config import CORE_ENCODINGS, PRESETS, CompareConfig, from_dict, preset_config
from .runner import compare

__all__ = ["CORE_ENCODINGS", "PRESETS", "CompareConfig", "compare", "from_dict", "preset_config"]

# the paper studies stand above compare: importing them registers their presets and readings
from .. import studies  # noqa: E402, F401
