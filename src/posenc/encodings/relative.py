"""Relative position representations: Shaw et al. (keys and values) and Transformer-XL.

* ``shaw`` — Shaw, Uszkoreit, Vaswani, "Self-Attention with Relative Position
  Representations", NAACL 2018. Distance ``j - i`` clipped to ``[-k, k]``
  (``k = max_relative_position``) indexes two ``(2k+1, Dh)`` tables shared across heads
  (or one per head, ``per_head=True``)::

      e_ij = (q_i·k_j + q_i·aK_ij) / sqrt(Dh)        o_i = Σ_j a_ij (v_j + aV_ij)

  ``table="sinusoidal"`` replaces the trained tables by NEZHA's fixed one (Wei et al.,
  "NEZHA: Neural Contextualized Representation for Chinese Language Understanding",
  2019): row ``r`` of the ``2k+1`` rows is the interleaved sinusoid of ``r``, the same
  table for keys and values. Checked against a direct transcription of tensor2tensor's
  ``dot_product_attention_relative`` and, causally, Music Transformer's skew.

* ``xl`` — Dai et al., "Transformer-XL: Attentive Language Models Beyond a Fixed-Length
  Context", ACL 2019 (also XLNet). With ``R_δ`` the sinusoid of ``δ = i - j`` (halves
  layout, ``[sin | cos]``), ``u``/``v`` per head and ``W_R`` a projection of its own::

      e_ij = ((q_i + u)·k_j + (q_i + v)·W_R R_{i-j}) / sqrt(Dh)

  No clipping unless ``clamp_len`` is given. Checked against HF transformers 4.57.6
  ``RelPartialLearnableMultiHeadAttn`` (with and without memories of past segments).

Fast path for both, no ``(L, L, Dh)`` tensor: the query is dotted once with each of the
``R`` relative vectors and the ``(B, H, Lq, R)`` result is gathered into place
(:func:`posenc.functional.gather_relative_logits`, equivalent to XL's rel-shift and
Music Transformer's skew, but also right for arbitrary positions); Shaw's value term is
the attention mass per distance times ``aV``
(:func:`posenc.functional.scatter_relative_values`). With consecutive positions on the
CPU, ``distance_terms`` hands the same tables to :mod:`posenc.kernels`, which keeps Shaw's
clipped far field in the fused kernel (``k + aK[-k]``, ``v + aV[-k]``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import functional as PF
from ..base import PositionEncoding
from ..registry import register
from ..terms import DistanceTerms
from ..validate import check_table_len


def _check_lengths(q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> None:
    if q.shape[-2] != q_pos.shape[-1] or k.shape[-2] != k_pos.shape[-1]:
        raise ValueError(
            f"q/k lengths {q.shape[-2]}/{k.shape[-2]} do not match positions {q_pos.shape[-1]}/{k_pos.shape[-1]}"
        )


@register
class Shaw(PositionEncoding):
    """Shaw et al. relative key and value vectors (NEZHA's sinusoidal table as an option).

    Args:
        max_relative_position: clipping distance ``k``; tables have ``2k+1`` rows.
        per_head: one pair of tables per head instead of one shared by all heads.
        table: ``"learned"`` (Shaw) or ``"sinusoidal"`` (NEZHA, fixed, shared by heads).
        init_std: std of the learned tables' normal init (``Dh^-1/2`` by default).
    """

    name = "shaw"
    paper = "Shaw et al., Self-Attention with Relative Position Representations"
    year = 2018

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        max_relative_position: int = 16,
        per_head: bool = False,
        table: str = "learned",
        init_std: float | None = None,
    ):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        if not isinstance(max_relative_position, int) or max_relative_position < 1:
            raise ValueError(f"max_relative_position must be an int >= 1, got {max_relative_position!r}")
        check_table_len(self, "max_relative_position", max_relative_position)
        if table not in ("learned", "sinusoidal"):
            raise ValueError(f"table must be 'learned' or 'sinusoidal', got {table!r}")
        if table == "sinusoidal" and per_head:
            raise ValueError("table='sinusoidal' is one fixed table shared by all heads; per_head=True needs 'learned'")
        self.max_relative_position = max_relative_position
        self.per_head = per_head
        self.table = table
        n = 2 * max_relative_position + 1
        if table == "sinusoidal":
            self.register_buffer("rel_k", torch.empty(n, head_dim), persistent=False)
            self.init_buffers()
            self.rel_v = self.rel_k
        else:
            shape = (heads, n, head_dim) if per_head else (n, head_dim)
            self.rel_k = nn.Parameter(torch.empty(shape))
            self.rel_v = nn.Parameter(torch.empty(shape))
            std = head_dim**-0.5 if init_std is None else init_std
            nn.init.normal_(self.rel_k, std=std)
            nn.init.normal_(self.rel_v, std=std)

    def init_buffers(self) -> None:
        if self.table == "sinusoidal":
            rows = torch.arange(self.num_rel, device=self.rel_k.device)
            self.rel_k = PF.sinusoidal_table(rows, self.head_dim, layout="interleaved")
            self.rel_v = self.rel_k

    @property
    def relative(self) -> bool:
        return True

    @property
    def num_rel(self) -> int:
        return 2 * self.max_relative_position + 1

    def rel_index(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``clip(j - i, -k, k) + k``: ``(..., Lq, Lk)`` int64 in ``[0, 2k]``."""
        k = self.max_relative_position
        return self.rel_distance(q_pos, k_pos).clamp(-k, k) + k

    def score_terms(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        _check_lengths(q, k, q_pos, k_pos)
        table = self.rel_k.to(q.dtype)
        if self.per_head:
            rel = torch.einsum("bhid,hrd->bhir", q, table)  # (B, H, Lq, R)
        else:
            rel = q @ table.t()  # (B, H, Lq, R)
        return PF.gather_relative_logits(rel, self.rel_index(q_pos, k_pos))

    def distance_terms(self, q: Tensor, k: Tensor) -> DistanceTerms:
        """Key and value vectors per clipped distance: constant beyond ``±k``."""
        K = self.max_relative_position

        def table(t: Tensor):
            return lambda r: t[:, r] if self.per_head else t[r].unsqueeze(0)  # (H|1, m, Dh)

        return DistanceTerms(
            rel_k=table(self.rel_k),
            rel_v=table(self.rel_v),
            rows=lambda d: d.clamp(-K, K) + K,
            kind="clamp",
            far=(-K, K),
        )

    def value_term(self, attn: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        mass = PF.scatter_relative_values(attn, self.rel_index(q_pos, k_pos), self.num_rel)  # (B, H, Lq, R)
        table = self.rel_v.to(attn.dtype)
        if self.per_head:
            return torch.einsum("bhir,hrd->bhid", mass, table)
        return mass @ table  # (B, H, Lq, Dh)


@register
class TransformerXL(PositionEncoding):
    """Transformer-XL relative encoding: global content bias ``u``, position bias ``v``.

    Args:
        d_model: width of the sinusoids ``R`` fed to ``W_R`` (HF ``d_model``);
            ``H·Dh`` by default.
        clamp_len: clip ``|i - j|`` to this many positions (HF ``clamp_len``); None = no clip.
        base: sinusoid base.
        init_std: std of the normal init of ``u``, ``v`` and ``W_R`` (HF ``init_std``).
        memory_len: tokens of earlier segments each layer attends to (HF ``mem_len``;
            the segment-level recurrence): ``lm.init_memory()`` makes a memory that long.

    Parameter names follow HF: ``r_w_bias`` (u), ``r_r_bias`` (v), both ``(H, Dh)``,
    and ``r_net`` (``W_R``, ``d_model -> H·Dh``, no bias).
    """

    name = "xl"
    paper = "Dai et al., Transformer-XL: Attentive Language Models Beyond a Fixed-Length Context"
    year = 2019

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        d_model: int | None = None,
        clamp_len: int | None = None,
        base: float = 10000.0,
        init_std: float = 0.02,
        memory_len: int = 0,
    ):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        if not isinstance(memory_len, int) or isinstance(memory_len, bool) or memory_len < 0:
            raise ValueError(f"memory_len must be an int >= 0, got {memory_len!r}")
        self.needs = self.needs.replace(memory_len=memory_len)
        d_model = self.dim if d_model is None else d_model
        if not isinstance(d_model, int) or d_model < 2 or d_model % 2:
            raise ValueError(f"d_model must be an even int >= 2, got {d_model!r}")
        if clamp_len is not None and (not isinstance(clamp_len, int) or clamp_len < 1):
            raise ValueError(f"clamp_len must be an int >= 1 or None, got {clamp_len!r}")
        if base <= 1:
            raise ValueError(f"base must be > 1, got {base}")
        self.d_model, self.clamp_len, self.base = d_model, clamp_len, float(base)
        self.r_w_bias = nn.Parameter(torch.empty(heads, head_dim))  # u
        self.r_r_bias = nn.Parameter(torch.empty(heads, head_dim))  # v
        self.r_net = nn.Linear(d_model, heads * head_dim, bias=False)  # W_R
        for p in (self.r_w_bias, self.r_r_bias, self.r_net.weight):
            nn.init.normal_(p, std=init_std)

    @property
    def relative(self) -> bool:
        return True

    def rel_keys(self, distances: Tensor) -> Tensor:
        """``W_R R_δ`` for each distance ``δ = i - j``: ``(R,)`` int64 -> ``(H, R, Dh)``."""
        if self.clamp_len is not None:
            distances = distances.clamp(-self.clamp_len, self.clamp_len)
        r = PF.sinusoidal_table(distances, self.d_model, base=self.base, layout="halves")  # (R, d_model)
        r = r.to(self.r_net.weight.dtype)
        return self.r_net(r).view(-1, self.heads, self.head_dim).transpose(0, 1)  # (H, R, Dh)

    def score_terms(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        _check_lengths(q, k, q_pos, k_pos)
        delta = -self.rel_distance(q_pos, k_pos)  # i - j, (B|1, Lq, Lk)
        lo = int(q_pos.min()) - int(k_pos.max())
        hi = int(q_pos.max()) - int(k_pos.min())
        rk = self.rel_keys(torch.arange(lo, hi + 1, device=q.device)).to(q.dtype)  # (H, R, Dh)
        v = self.r_r_bias.to(q.dtype)[None, :, None]  # (1, H, 1, Dh)
        u = self.r_w_bias.to(q.dtype)[None, :, None]
        bd = PF.gather_relative_logits((q + v) @ rk.transpose(-1, -2).unsqueeze(0), delta - lo)  # (B, H, Lq, Lk)
        return bd + u @ k.transpose(-1, -2)  # + u·k_j, (B, H, 1, Lk) broadcast over i

    def distance_terms(self, q: Tensor, k: Tensor) -> DistanceTerms:
        """``(q + u)·k_j + (q + v)·W_R R_{i-j}``: one vector per distance, no far field."""
        u = self.r_w_bias.to(q.dtype)[None, :, None]  # (1, H, 1, Dh)
        v = self.r_r_bias.to(q.dtype)[None, :, None]
        return DistanceTerms(rel_k=lambda d: self.rel_keys(-d), q=q + u, q_rel=q + v)
