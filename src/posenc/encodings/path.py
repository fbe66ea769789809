"""PaTH: position as a product of data-dependent Householder-like transforms between query and key.

* ``path`` — Yang, Shen, Wen, Tan, Mishra, Ren, Panda, Kim, "PaTH Attention: Position Encoding via
  Accumulating Householder Transformations", 2025 (arXiv 2505.16381). Every token ``t`` carries
  a transform read from the layer input ``x_t``, and the score of query ``i`` and key ``j``
  passes ``k_j`` through the transforms of the tokens after ``j`` up to ``i``::

      H_t  = I − β_t·w_t·w_tᵀ                  (per head; β_t ∈ (0, 2), ‖w_t‖ = 1)
      s_ij = scale·q_iᵀ·H_i·H_{i−1}···H_{j+1}·k_j      (j ≤ i; s_ii = scale·q_i·k_i)
      o_i  = Σ_j softmax_j(s_i)_j·v_j

Conventions, as flash-linear-attention 0.6 (fla) has them: ``fla/layers/path_attn.py``
(``PaTHAttention``) and ``fla/ops/path_attn/naive.py`` (``naive_path_attn``, the tests'
element-wise reference):

* ``w_t``: a low-rank projection ``Linear(D, 32) → Linear(32, Hw·Dh)``, no biases (layer lines
  61–70, ``use_low_rank_w=True``; ``w_rank=None``: one ``Linear(D, Hw·Dh)``), then a depthwise
  causal convolution of 3 taps with SiLU and no bias (line 81, ``ShortConvolution(kv_dim,
  conv_size=3, activation='silu')``; ``conv_size=0``: none), then L2-normalised per head in
  float32, ``w / sqrt(Σw² + 1e-6)`` (lines 124, 203: ``l2_norm``; eps 1e-6: ``fla/modules/norm/l2norm.py``
  line 189);
* ``β_t = 2·σ(Linear(D, Hw)(x_t))`` with a bias (lines 83, 111: "allowing negative eigenvalues");
* the product runs over ``s = j+1 .. i``, ``H_i`` nearest the query: the naive reference's
  intra-chunk term ``(q·wᵀ).tril()`` (the query's own ``w`` included) times
  ``(w_β·kᵀ)`` strictly below the diagonal (the key's own ``w`` excluded), naive.py lines 63–71;
  decoding (layer lines 150–158) applies ``H_t`` to every cached key before appending ``k_t``;
* ``Hw`` = fla's ``num_kv_heads`` (w and β per key head, shared by each group of query heads);
  here the option ``w_heads``, ``heads`` by default (the encoding is not told the layer's
  ``kv_heads``: pass ``w_heads=kv_heads`` for fla's layout);
* initialisation as fla's ``PaTHAttentionPreTrainedModel._init_weights``
  (``fla/models/path_attn/modeling_path_attention.py`` lines 177–195): weights ``N(0, 0.02²)``
  (Linear and Conv1d), biases 0 (β starts near 1); ``init_std``.
* fla's optional forget gate (``use_forget_gate``: PaTH-FoX) and q/k norms are not part of
  this encoding (``fox``; ``Attention(qk_norm=...)``).

:meth:`PaTH.read_input` computes ``w`` and ``β`` for the tokens a call adds: the per-key state
``{"w": (B, Hw, L, Dh), "beta": (B, Hw, L)}`` the KV cache keeps beside the keys, and the last
``K − 1`` convolution inputs as the cache's carry. Padding rows enter the convolution as 0 and
no row reads another packed document's rows. :meth:`PaTH.qk_scores` applies the transforms
to the queries, from the last key down (``U ← H_t·U`` after scoring key ``t``), only on the
query rows whose mask sees key ``t``: a hidden key (padding, another document, outside a
window) transforms nothing, so a left-padded or packed sequence scores as it does alone, and
a rolling window cache, which keeps the ``w``/``β`` of the keys it keeps, equals the full pass.
(With StreamingLLM's ``SinkWindow`` a sink key is reached through the kept tokens only.) It
runs in blocks of 16 keys with the UT transform (fla's chunked form; ``Lk/16`` sequential
steps) where each row sees one run of keys, and key by key where a row's keys have a hole.
No position is read: shifting every position changes nothing, and any length works.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..base import Needs, PositionEncoding
from ..context import InputRead
from ..registry import register

L2_EPS = 1e-6  # fla's l2_norm: w / sqrt(Σw² + eps)


@register
class PaTH(PositionEncoding):
    """PaTH's accumulated Householder-like transforms as the ``q·k`` term (see the module docstring).

    Args:
        hidden_size: width ``D`` of the layer input ``w`` and ``β`` are read from;
            ``heads·head_dim`` by default (a layer whose ``dim`` differs passes it).
        w_heads: heads of ``w`` and ``β``, ``Hw`` (dividing ``heads``; query head ``h`` uses
            ``h // (heads/Hw)``); None: ``heads``. fla: the layer's key/value heads.
        w_rank: rank of the low-rank ``w`` projection (fla: 32); None: one full ``Linear``.
        conv_size: taps of the causal convolution on ``w`` (fla: 3); 0: none.
        init_std: standard deviation of the initial weights (fla's ``initializer_range``).

    Parameters (fla's names): ``w_proj`` (``Sequential(Linear(D, r), Linear(r, Hw·Dh))`` or
    ``Linear(D, Hw·Dh)``), ``w_conv1d`` (a depthwise ``Conv1d``, weight ``(Hw·Dh, 1, K)``),
    ``bt_proj`` (``Linear(D, Hw)`` with bias).

    Raises:
        ValueError: an option out of range; :meth:`qk_scores` without the call's ``ctx.k_state``.
    """

    name = "path"
    paper = "Yang et al., PaTH Attention: Position Encoding via Accumulating Householder Transformations"
    year = 2025
    causal_only = True  # the transforms accumulate from the key up to the query
    needs = Needs(width=True)  # w and β read the layer input: hidden_size = the layer width

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        hidden_size: int | None = None,
        w_heads: int | None = None,
        w_rank: int | None = 32,
        conv_size: int = 3,
        init_std: float = 0.02,
    ):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        if hidden_size is not None and hidden_size < 1:
            raise ValueError(f"hidden_size must be an int >= 1 or None, got {hidden_size!r}")
        if w_heads is not None and (w_heads < 1 or heads % w_heads):
            raise ValueError(f"w_heads must be a positive int dividing heads={heads}, or None, got {w_heads!r}")
        if w_rank is not None and w_rank < 1:
            raise ValueError(f"w_rank must be an int >= 1 or None (a full projection), got {w_rank!r}")
        if conv_size < 0:
            raise ValueError(f"conv_size must be an int >= 0 (0: no convolution on w), got {conv_size!r}")
        if init_std <= 0:
            raise ValueError(f"init_std must be a number > 0, got {init_std!r}")
        self.hidden_size = self.dim if hidden_size is None else hidden_size
        self.w_heads = heads if w_heads is None else w_heads
        self.w_rank, self.conv_size, self.init_std = w_rank, conv_size, float(init_std)
        D, C = self.hidden_size, self.w_heads * head_dim
        if w_rank is None:
            self.w_proj = nn.Linear(D, C, bias=False)
        else:
            self.w_proj = nn.Sequential(nn.Linear(D, w_rank, bias=False), nn.Linear(w_rank, C, bias=False))
        self.w_conv1d = nn.Conv1d(C, C, conv_size, groups=C, bias=False) if conv_size else None
        self.bt_proj = nn.Linear(D, self.w_heads, bias=True)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv1d)):
                nn.init.normal_(m.weight, std=self.init_std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    @property
    def relative(self) -> bool:
        return True  # no position is read at all

    def extra_repr(self) -> str:
        return super().extra_repr() + (
            f", hidden_size={self.hidden_size}, w_heads={self.w_heads}, w_rank={self.w_rank}, "
            f"conv_size={self.conv_size}"
        )

    # ------------------------------------------------------------------ the transforms
    def read_input(self, x: Tensor, k: Tensor, v: Tensor, carry=None, *, keep=None, documents=None) -> InputRead:
        """``w`` and ``β`` of the rows of ``x`` ``(B, L, hidden_size)``, float32: state
        ``{"w": (B, Hw, L, Dh), "beta": (B, Hw, L)}``; ``k``, ``v`` unchanged. ``carry``: the last
        ``K − 1`` convolution inputs ``(B, Hw·Dh, K − 1)`` of the previous call of the same cache
        (None: zeros, as fla's convolution starts); returns the next one. ``keep`` ``(B, L)``
        (False: padding, entering the convolution as 0) and packed ``documents`` ``(B|1, L)``
        (no row reads another document's rows)."""
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"encoding 'path' reads the layer input (B, L, hidden_size={self.hidden_size}), got {tuple(x.shape)}; "
                "build it with hidden_size= the layer's dim"
            )
        B, L, _ = x.shape
        xf = x.float()
        w = xf
        for lin in self.w_proj if isinstance(self.w_proj, nn.Sequential) else (self.w_proj,):
            w = F.linear(w, lin.weight.float())  # (B, L, ·) -> (B, L, Hw·Dh)
        if self.w_conv1d is not None:
            w, carry = self._conv(w, carry, keep, documents)
        w = w.view(B, L, self.w_heads, self.head_dim).transpose(1, 2)  # (B, Hw, L, Dh)
        w = w * torch.rsqrt(w.square().sum(-1, keepdim=True) + L2_EPS)
        beta = 2.0 * torch.sigmoid(F.linear(xf, self.bt_proj.weight.float(), self.bt_proj.bias.float()))  # (B, L, Hw)
        return InputRead(k, v, {"w": w, "beta": beta.transpose(1, 2)}, carry)

    def _conv(self, w: Tensor, prev, keep, documents) -> tuple[Tensor, Tensor]:
        """SiLU of the depthwise causal convolution of ``w`` ``(B, L, C)`` over its rows, after the
        ``K − 1`` rows ``prev`` ``(B, C, K − 1)`` (None: zeros); and the next ``prev``."""
        B, L, C = w.shape
        K = self.conv_size
        inp = w.transpose(1, 2)  # (B, C, L)
        if keep is not None:
            inp = inp * keep[:, None, :].to(inp.dtype)  # padding enters as 0
        if prev is None:
            prev = inp.new_zeros(B, C, K - 1)
        full = torch.cat((prev.to(inp), inp), dim=2)  # (B, C, K − 1 + L)
        weight = self.w_conv1d.weight.float()  # (C, 1, K)
        if documents is None:
            out = F.conv1d(full, weight, groups=C)  # (B, C, L)
        else:  # tap m of row t reads row t − (K − 1) + m only within t's document
            win = full.unfold(2, K, 1) * _same_document(documents, K)[:, None].to(inp.dtype)  # (B, C, L, K)
            out = (win * weight[:, 0][:, None, :]).sum(-1)
        return F.silu(out).transpose(1, 2), full[:, :, full.shape[2] - (K - 1) :].detach()

    # ------------------------------------------------------------------ scores
    def qk_scores(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, ctx=None) -> Tensor:
        """``q_iᵀ·H_i···H_{j+1}·k_j`` for every pair: float32 ``(B, H, Lq, Lk)`` (before ``scale``).

        Reads ``w``/``β`` of every key from ``ctx.k_state`` and the call's ``ctx.mask`` (a query
        applies ``H_t`` only where it sees key ``t``); without a mask, the queries are the last
        ``Lq`` keys and see every key up to their own (the causal rule of :class:`posenc.AttentionMask`).
        Where every row sees one run of keys (causal, windows, left padding, packed documents),
        :func:`blocked_scores` runs; else (a hole: a padded key between seen ones, sink tokens)
        :func:`per_key_scores`. They agree on every key a row sees.
        """
        state = {} if ctx is None else ctx.k_state
        if "w" not in state or "beta" not in state:
            raise ValueError(
                "encoding 'path' reads its transforms (w, beta) from ctx.k_state: call it through posenc.Attention, "
                "or pass ctx=posenc.Context(q_pos, k_pos, k_state=...) with the state of PaTH.read_input"
            )
        H, Lq, Lk = q.shape[1], q.shape[2], k.shape[2]
        w, beta = state["w"], state["beta"]
        if w.shape[2] != Lk or beta.shape[-1] != Lk:
            raise ValueError(f"encoding 'path': ctx.k_state holds {w.shape[2]} keys' transforms for {Lk} keys")
        k, w, beta = (_per_query_head(t, H) for t in (k, w, beta))
        see = ctx.mask if ctx is not None else None
        if see is None:  # causal by index: query r is key Lk − Lq + r
            see = torch.arange(Lk, device=q.device) <= torch.arange(Lk - Lq, Lk, device=q.device)[:, None]
        idx = torch.arange(Lk, device=q.device)
        last = torch.where(see, idx, -1).amax(-1)  # (B|1, 1, Lq): the last key each row sees; -1: none
        first = torch.where(see, idx, Lk).amin(-1)
        count = see.sum(-1)
        contiguous = bool(((count == 0) | (count == last - first + 1)).all())
        with torch.autocast(q.device.type, enabled=False):  # the products accumulate: float32 throughout
            if contiguous:  # a row's H_t of keys before its run only move scores it does not see
                return blocked_scores(q, k, w, beta, last)  # (so every t <= last applies)
            return per_key_scores(q, k, w, beta, see)


BLOCK = 16  # keys per block of blocked_scores: Lk/BLOCK sequential steps, BLOCK×BLOCK triangular solves


def blocked_scores(q: Tensor, k: Tensor, w: Tensor, beta: Tensor, last: Tensor) -> Tensor:
    """The transformed ``q·k`` where row ``i`` applies ``H_t`` for every key ``t <= last_i``.

    ``q`` ``(B, H, Lq, Dh)``, ``k``/``w`` ``(B, H, Lk, Dh)``, ``beta`` ``(B, H, Lk)``, ``last``
    ``(B|1, 1, Lq)`` int -> float32 ``(B, H, Lq, Lk)``. Keys go in blocks of :data:`BLOCK` from the
    last, as fla's chunked form: a block's ``H_a···H_b = I − Wᵀ·T·W`` with ``T`` upper triangular,
    ``T = (I + diag(β)·striu(W·Wᵀ))⁻¹·diag(β)`` (the UT transform; a run of the block uses the
    principal sub-block of ``T``), so with ``l_is = (u_i·w_s)·[s <= last_i]`` the block's scores
    are ``u_i·k_t − Σ_{s,r} l_is·T_rs·(w_r·k_t)·[r > t]`` and the query moves to
    ``u_i − Σ_s l_is·Σ_r T_rs·w_r``.
    """
    B, H, Lq, Dh = q.shape
    Lk, C = k.shape[2], BLOCK
    nb = -(-Lk // C)
    pad = nb * C - Lk  # padded keys: β = 0, w = k = 0, past every row's last key
    Kb = F.pad(k.float(), (0, 0, 0, pad)).view(B, H, nb, C, Dh)
    Wb = F.pad(w.float(), (0, 0, 0, pad)).view(B, H, nb, C, Dh)
    bb = F.pad(beta.float(), (0, pad)).view(B, H, nb, C)
    eye = torch.eye(C, device=q.device)
    gram = Wb @ Wb.transpose(-1, -2)  # (B, H, nb, C, C): w_r·w_s
    T = torch.linalg.solve_triangular(
        eye + bb[..., :, None] * gram.triu(1), torch.diag_embed(bb), upper=True, unitriangular=True
    )
    Tt = T.transpose(-1, -2)
    G = Tt @ (Wb @ Kb.transpose(-1, -2)).tril(-1)  # (B, H, nb, C, C): Σ_r T_rs·(w_r·k_t)·[r > t]
    TW = Tt @ Wb  # (B, H, nb, C, Dh): Σ_r T_rs·w_r
    u = q.float()
    cols = [None] * nb
    for n in range(nb - 1, -1, -1):
        applies = (n * C + torch.arange(C, device=q.device)) <= last[..., None]  # (B|1, 1, Lq, C)
        lw = (u @ Wb[:, :, n].transpose(-1, -2)) * applies  # (B, H, Lq, C)
        cols[n] = u @ Kb[:, :, n].transpose(-1, -2) - lw @ G[:, :, n]
        u = u - lw @ TW[:, :, n]
    return torch.cat(cols, dim=-1)[..., :Lk] if nb else q.new_zeros(B, H, Lq, 0, dtype=torch.float32)


def per_key_scores(q: Tensor, k: Tensor, w: Tensor, beta: Tensor, see: Tensor) -> Tensor:
    """The transformed ``q·k`` where row ``i`` applies ``H_t`` only where ``see`` ``(B|1, 1, Lq, Lk)``
    holds, one key at a time from the last: score key ``t`` with ``u``, then ``u ← u − β_t·(u·w_t)·w_t``.
    Shapes as :func:`blocked_scores`."""
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    coef = (beta.float()[:, :, None, :] * see).unbind(-1)  # Lk × (B, H, Lq): β_t where the row applies H_t
    kw = torch.stack((k.float(), w.float()), dim=-1).unbind(2)  # Lk × (B, H, Dh, 2)
    ws = w.float().unsqueeze(-2).unbind(2)  # Lk × (B, H, 1, Dh)
    u = q.float()  # (B, H, Lq, Dh): H_{t+1}···H_i·q_i while key t is scored
    cols = [None] * Lk
    for t in range(Lk - 1, -1, -1):
        d = u @ kw[t]  # (B, H, Lq, 2): u·k_t, u·w_t
        cols[t] = d[..., 0]
        if t:
            u = torch.addcmul(u, (coef[t] * d[..., 1]).unsqueeze(-1), ws[t], value=-1.0)
    return torch.stack(cols, dim=-1) if Lk else q.new_zeros(B, H, Lq, 0, dtype=torch.float32)


def _per_query_head(t: Tensor, heads: int) -> Tensor:
    """``t`` ``(B, Hw, ...)`` for ``heads`` query heads, head ``h`` reading ``h // (heads/Hw)``."""
    hw = t.shape[1]
    if hw == heads:
        return t
    if heads % hw:
        raise ValueError(f"encoding 'path': {hw} heads of keys or transforms for {heads} query heads")
    return t.repeat_interleave(heads // hw, dim=1)


def _same_document(documents: Tensor, K: int) -> Tensor:
    """``(B|1, L, K)`` bool: tap ``m`` of row ``t`` (row ``t − (K − 1) + m``) is in ``t``'s document
    (a tap before row 0 reads the zero history, so it counts as in)."""
    L = documents.shape[-1]
    t = torch.arange(L, device=documents.device)
    src = t[:, None] - (K - 1) + torch.arange(K, device=documents.device)  # (L, K)
    return (src < 0) | (documents[:, src.clamp(min=0)] == documents[:, :, None])
