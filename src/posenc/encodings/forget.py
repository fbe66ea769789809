"""Forgetting Transformer (FoX): softmax attention with a data-dependent forget gate.

* ``fox`` — Lin, Nikishin, He, Courville, "Forgetting Transformer: Softmax Attention with a
  Forget Gate", ICLR 2025 (arXiv 2503.02130). No position enters anywhere; every token
  ``t`` has a scalar forget gate per head, read from the layer input row ``x_t``, and the
  score of query ``i`` and key ``j`` is decayed by the gates of the tokens in between::

      f_t  = σ(w_h·x_t + b_h)                      (Linear(D, H), x the layer input)
      c_t  = Σ_{s <= t} ln f_s                     (float32 cumulative log gate)
      s_ij = scale·q_i·k_j + Σ_{s=j+1..i} ln f_s = scale·q_i·k_j + c_i − c_j

  As x-transformers' ``DataDependentAlibi`` (2.31.10, checked element-wise in the tests):
  ``nn.Linear`` default weight init, gate bias initialised to ``bias_init = 5`` (gates start
  at σ(5) ≈ 0.993: nearly no forgetting), ``post_log_scale`` multiplies ``ln f``. The
  authors' own code initialises the full gate's bias to 0 and its weight N(0, 0.02²)
  (gates start at 0.5); ``bias_init=0.0`` gives their bias. Bidirectional (``causal=False``,
  x-transformers' form, not in the paper): ``2H`` gates, the first ``H`` decay keys before the
  query (``c_i − c_j``), the last ``H`` keys after it (``c'_j − c'_i``); which side a key is on
  is read from its index in the stream (x-transformers' ``tril``/``triu``), not its position.

:meth:`FoX.read_input` computes ``c`` for the tokens a call adds (continuing the previous
call's sum through the KV cache's carry); the cache keeps each key's ``c``, so decoding,
rolling windows and sink windows give the scores of the full pass. The bias reads no
position: shifting every position changes nothing (``relative``), any length works.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..base import Needs, PositionEncoding, ScoreMod
from ..context import Context, InputRead
from ..registry import register


@register
class FoX(PositionEncoding):
    """FoX's forget gates as a score bias ``c_i − c_j`` (see the module docstring).

    Args:
        hidden_size: width ``D`` of the layer input the gates read; ``heads·head_dim`` by
            default (a layer whose ``dim`` differs must pass its ``dim``).
        bias_init: initial bias of every gate logit (x-transformers: 5; FoX's code: 0).
        post_log_scale: multiplier of ``ln f`` (x-transformers' option; 1 in the paper).
    """

    name = "fox"
    paper = "Lin et al., Forgetting Transformer: Softmax Attention with a Forget Gate"
    year = 2025
    needs = Needs(width=True)  # the gates read the layer input: hidden_size = the layer width

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        hidden_size: int | None = None,
        bias_init: float = 5.0,
        post_log_scale: float = 1.0,
    ):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        if hidden_size is not None and (
            not isinstance(hidden_size, int) or isinstance(hidden_size, bool) or hidden_size < 1
        ):
            raise ValueError(f"hidden_size must be a positive int or None, got {hidden_size!r}")
        self.hidden_size = self.dim if hidden_size is None else hidden_size
        self.bias_init, self.post_log_scale = float(bias_init), float(post_log_scale)
        self.gate = nn.Linear(self.hidden_size, heads * (1 if causal else 2))  # forward gates, then backward
        nn.init.constant_(self.gate.bias, self.bias_init)

    @property
    def relative(self) -> bool:
        return True

    def extra_repr(self) -> str:
        return (
            super().extra_repr()
            + f", hidden_size={self.hidden_size}, bias_init={self.bias_init}, post_log_scale={self.post_log_scale}"
        )

    def log_gates(self, x: Tensor) -> Tensor:
        """``ln f`` (times ``post_log_scale``) of every row of ``x`` ``(B, L, hidden_size)``:
        float32 ``(B, G·H, L)``, ``G = 1`` causal, 2 bidirectional (forward heads first)."""
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"encoding 'fox' reads the layer input (B, L, hidden_size={self.hidden_size}), got {tuple(x.shape)}; "
                "build it with hidden_size= the layer's dim"
            )
        logits = F.linear(x.float(), self.gate.weight.float(), self.gate.bias.float())  # (B, L, G·H)
        return F.logsigmoid(logits).transpose(1, 2) * self.post_log_scale

    def read_input(self, x: Tensor, k: Tensor, v: Tensor, carry=None) -> InputRead:
        """``c`` of the new rows, continuing ``carry`` = (last ``c`` ``(B, G·H, 1)``, tokens seen)
        of the same cache; k and v unchanged. Bidirectional: the stream index ``t`` too."""
        c = self.log_gates(x).cumsum(-1)  # (B, G·H, L)
        seen = 0
        if carry is not None:
            last, seen = carry
            c = c + last
        state = {"c": c}
        if not self.causal:
            B, L = x.shape[:2]
            state["t"] = torch.arange(seen, seen + L, device=x.device).expand(B, 1, L)
        return InputRead(k, v, state, (c[..., -1:].detach(), seen + x.shape[1]))

    def _states(self, q_pos: Tensor, k_pos: Tensor, ctx: Context | None) -> tuple[dict, dict]:
        """The queries' and keys' states from ``ctx``, checked against the positions' lengths."""
        if ctx is None or "c" not in ctx.q_state or "c" not in ctx.k_state:
            raise ValueError(
                "encoding 'fox' reads its forget gates from the layer input: call it through posenc.Attention, "
                "or pass ctx=posenc.Context(q_pos, k_pos, q_state=..., k_state=...) with the states of FoX.read_input"
            )
        qs, ks = ctx.q_state, ctx.k_state
        if qs["c"].shape[-1] != q_pos.shape[-1] or ks["c"].shape[-1] != k_pos.shape[-1]:
            raise ValueError(
                f"encoding 'fox': ctx states of {qs['c'].shape[-1]} queries and {ks['c'].shape[-1]} keys, "
                f"positions of {q_pos.shape[-1]} and {k_pos.shape[-1]}"
            )
        return qs, ks

    def bias(self, q_pos: Tensor, k_pos: Tensor, ctx: Context | None = None) -> Tensor:
        """``Σ_{s=j+1..i} ln f_s = c_i − c_j``: float32 ``(B, H, Lq, Lk)``. Needs ``ctx`` (the
        layer's call context: the per-token ``c`` that :meth:`read_input` computed)."""
        qs, ks = self._states(q_pos, k_pos, ctx)
        H, cq, ck = self.heads, qs["c"].float(), ks["c"].float()
        out = cq[:, :H, :, None] - ck[:, :H, None, :]
        if not self.causal:  # keys after the query: the backward gates, Σ_{s=i+1..j} ln f'_s
            after = ks["t"][:, :, None, :] > qs["t"][:, :, :, None]  # (B, 1, Lq, Lk)
            out = torch.where(after, ck[:, H:, None, :] - cq[:, H:, :, None], out)
        return out

    def score_mod(self, q_pos: Tensor, k_pos: Tensor, ctx: Context | None = None) -> ScoreMod:
        """The bias per ``(b, h, i, j)`` from the two per-token tables (no ``L×L`` tensor)."""
        qs, ks = self._states(q_pos, k_pos, ctx)
        H, cq, ck = self.heads, qs["c"].float(), ks["c"].float()
        if self.causal:

            def mod(score, b, h, q_idx, kv_idx):
                return score + (cq[b, h, q_idx] - ck[b, h, kv_idx])

            return mod
        tq, tk = qs["t"], ks["t"]
        # the forward and backward gates' sums as separate tensors, each indexed once: FlexAttention's
        # compiled CUDA backward refuses a score_mod that indexes one tensor with gradients twice
        cq_fwd, cq_bwd = cq[:, :H].clone(), cq[:, H:].clone()
        ck_fwd, ck_bwd = ck[:, :H].clone(), ck[:, H:].clone()

        def mod_bidir(score, b, h, q_idx, kv_idx):
            before = cq_fwd[b, h, q_idx] - ck_fwd[b, h, kv_idx]
            after = ck_bwd[b, h, kv_idx] - cq_bwd[b, h, q_idx]
            return score + torch.where(tk[b, 0, kv_idx] > tq[b, 0, q_idx], after, before)

        return mod_bidir
