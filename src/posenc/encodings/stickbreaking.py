"""Stick-breaking attention: attention weights from a stick-breaking process, no softmax.

* ``stick-breaking`` — Tan, Yang, Courville, Panda, Shen, "Scaling Stick-Breaking Attention: An
  Efficient Implementation and In-depth Study", ICLR 2025 (arXiv 2410.17980; v1 "Stick-breaking
  Attention", 2024). No position enters anywhere: each query breaks a stick of length 1 over
  the keys before it, nearest first, and order is in the breaking::

      β_ij = σ(scale·q_i·k_j)
      A_ij = β_ij · ∏_{j<l<i} (1 − β_il)          (l over the keys query i sees)
      o_i  = Σ_{j<i} A_ij · v_j

  in log space: ``ln A_ij = ln σ(z_ij) + Σ_{l>j} ln σ(−z_il)`` (a reverse cumulative sum over
  the keys), float32.

Convention, checked against flash-linear-attention 0.6 (fla), ``fla/ops/stickbreaking_attn/
naive.py`` (``naive_stickbreaking_attn``: ``attend_current=False`` by default, the mask
``j < i``, the product over ``j < l < i``) and ``fla/layers/stickbreaking_attn.py`` (the layer
calls the kernel with ``attend_current=False`` and drops the remainder ``rem = 1 − Σ_j A_ij``
it returns), and the paper's "for each token *before* the current":

* the query's own key is **excluded** by default: a query attends to the keys before it, and
  the first token of a sequence attends to nothing (output 0). ``attend_current=True`` (fla's
  option of that name) includes it, which is the form ``A_ij = β_ij ∏_{j<l≤i} (1 − β_il)``
  for ``j ≤ i`` that posenc's notes (REFERENCES.md) wrote;
* **no remainder term**: the weights of a row sum to at most 1 and the leftover stick is
  dropped, as fla's layer does. (The authors' kernel tests add ``rem·v_i``, and IBM's
  dolomite-engine adds ``rem`` times a learned per-head vector; neither is in fla's layer.)

The whole encoding is the normaliser stage (:meth:`StickBreaking.weights`, ``Stage.NORM``): it
receives the masked scores, so windows, packed documents, padding and the KV cache need
nothing of their own; a hidden key neither gets weight nor breaks the stick. The query's own
key is the last key its row sees (the mask is causal and every real query sees itself).
Only the backends that hold a query's keys at once (``chunked``, ``eager``) run it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..base import PositionEncoding
from ..registry import register


@register
class StickBreaking(PositionEncoding):
    """Stick-breaking attention weights in place of softmax (see the module docstring).

    Args:
        attend_current: the query's own key takes part (gets weight and breaks the stick
            last); False (fla's default and the paper's): only the keys before it.

    Raises:
        ValueError: built with ``causal=False`` (the stick is broken from the query backwards).
    """

    name = "stick-breaking"
    paper = "Tan et al., Scaling Stick-Breaking Attention: An Efficient Implementation and In-depth Study"
    year = 2024
    causal_only = True

    def __init__(self, *, heads, head_dim, max_len=None, causal=True, attend_current: bool = False):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        self.attend_current = attend_current

    @property
    def relative(self) -> bool:
        return True  # no position is read at all

    def extra_repr(self) -> str:
        return super().extra_repr() + f", attend_current={self.attend_current}"

    def weights(self, s: Tensor, ctx=None) -> Tensor:
        """``A_ij`` from the masked scores ``s = scale·q_i·k_j`` ``(B, H, Lq, Lk)`` (hidden keys
        ``-inf``, key order): float32, same shape. A hidden key gets exactly 0 and leaves the
        stick alone; a row that sees no key gets zeros (no NaN)."""
        s = s.float()
        seen = s > float("-inf")  # (B, H, Lq, Lk): the keys each query sees
        if not self.attend_current:  # drop the query's own key: the last one its row sees
            idx = torch.arange(s.shape[-1], device=s.device)
            last = torch.where(seen, idx, -1).amax(-1, keepdim=True)  # (B, H, Lq, 1); -1: none
            seen = seen & (idx != last)
        log_keep = F.logsigmoid(-s).masked_fill(~seen, 0.0)  # ln(1 − β_ij); 0: a hidden key breaks nothing
        # Σ_{l>j} ln(1 − β_il): the reverse cumulative sum shifted by one key (exact, no subtraction)
        later = F.pad(log_keep.flip(-1).cumsum(-1).flip(-1)[..., 1:], (0, 1))
        log_a = F.logsigmoid(s).add(later).masked_fill(~seen, float("-inf"))
        return log_a.exp()
