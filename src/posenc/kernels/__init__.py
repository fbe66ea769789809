"""CPU fast paths for attention with position terms (pure functions of tensors).

PyTorch's fused CPU attention runs fast only without a float mask, and a learned bias
needs ``dS`` per pair, which the fused kernel does not return. These kernels keep the
fused kernel on every key range where the encoding's terms can be folded into ``q``,
``k``, ``v`` (far fields of clipped or saturated distances, linear biases) and compute
only a band near the diagonal explicitly, block by block, in a custom autograd function
that recomputes scores in backward instead of storing them.

* :func:`distance_attention` — terms that depend on ``d = k_pos - q_pos`` (T5, ALiBi,
  Kerple, Shaw, Transformer-XL, DeBERTa) through :class:`DistanceTerms`;
* :mod:`.plan` — which keys of a query block are fused calls and which are the band;
* :mod:`.segments` — the autograd function that runs a plan;
* :mod:`.band` — the explicit block; :mod:`.flash` — the fused kernel with its log-sum-exp.
"""

from ..terms import DistanceTerms, saturation  # (on the ground floor: the encodings build them)
from .relative import distance_attention

__all__ = ["DistanceTerms", "distance_attention", "saturation"]
