"""Inkling: a relative bias read from the hidden state, short convolutions on k and v.

* ``inkling`` — Thinking Machines Lab, Inkling (2026), as HF transformers implements it
  (``models/inkling/modeling_inkling.py``: ``InklingRelativeLogits``, ``InklingAttention``,
  ``InklingShortConvolution``). Per head ``h``, with ``r_i = W_r x_i`` ``(H, d_rel)`` and a
  learned bank ``P`` ``(d_rel, E)`` of bias-versus-distance profiles::

      b_h(i, j) = τ_i · (r_i)_h · P[:, i - j]     for 0 <= i - j < E,   0 otherwise
      s_ij      = τ_i · q_i·k_j / Dh + b_h(i, j)

  The bias is exactly 0 beyond ``E`` (not clipped to the last column). On Inkling's global
  layers ``τ_i = 1 + α·ln(max(1, (i + 1) / n_floor))`` multiplies the queries and the bias
  (in float32): ``inkling-temperature``, a class of its own (its q/k stage scales the
  queries); elsewhere ``τ = 1``: ``inkling``. ``k`` and ``v`` pass through depthwise causal
  convolutions of ``K`` taps with a residual (float32) before attention; a KV cache
  carries the last ``K - 1`` raw rows between calls (zeros before the first token, as
  HF's ``causal_conv1d_fn`` pads). ``1/Dh`` is Inkling's scale because its q and k are
  RMS-normalised per head; posenc has no q/k norms yet (issue #26), so this encoding
  keeps the scale without them.

* Inkling-2 (HF ``models/inkling2``: ``Inkling2RelativePositionBias``) keeps the bias on its
  sliding layers too (``E`` = the window) and, instead of an RMSNorm, scales each head's relative
  state by a learned vector and L2-clips it: ``r_h ← r_h·s_h``, ``r_h ← r_h·min(1, c/(‖r_h‖ +
  1e-6))`` (float32; ``c`` = ``rel_l2_clip_threshold``, 8): option ``rel_clip=c``, parameter
  ``rel_scale`` ``(H, d_rel)``. Its q and k are L2-clipped, not RMS-normed, and scaled by
  ``Dh^-1/2``: option ``sqrt_scale=True``. On its full layers ``τ_i`` multiplies the clipped
  states (``inkling-temperature``, as above).

The bias needs the layer input rows of the queries (``ctx.x``); the FlexAttention form
captures the per-row table ``r_i·P`` ``(B, H, Lq, E)``, never an ``L×L`` tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..base import Needs, PositionEncoding, ScoreMod
from ..context import InputRead
from ..registry import register


def _as_rows(pos: Tensor) -> Tensor:
    """Positions ``(L,)`` or ``(B|1, L)`` as ``(B|1, L)``."""
    return pos.unsqueeze(0) if pos.dim() == 1 else pos


@register
class Inkling(PositionEncoding):
    """Inkling's hidden-state relative logits and short convolutions (its local layers: ``τ = 1``).

    Args:
        d_rel: width per head of the relative states ``r = W_r x`` (HF ``d_rel``, 16).
        rel_extent: ``E``, the distances ``0 .. E-1`` that get a bias (HF ``rel_extent`` on
            global layers; on a sliding layer HF uses the window: pass ``rel_extent=window``).
            Default 1024, HF's ``InklingTextConfig.rel_extent``: past it the bias is 0, so it
            should reach at least the training length you want to distinguish positions in.
        hidden_size: width ``D`` of the layer input ``r_proj`` reads; ``heads·head_dim`` by default.
        sconv_kernel: ``K`` of the short convolutions on k and v (HF ``sconv_kernel_size``);
            0: none.
        init_std: standard deviation of the initial ``W_r``, ``P`` and convolution weights
            (HF ``initializer_range``).
        rel_clip: Inkling-2: each head's relative state is scaled by the learned ``rel_scale``
            and L2-clipped to this norm (HF ``rel_l2_clip_threshold``, 8.0); None: Inkling's
            plain ``r = W_r x``.
        sqrt_scale: scores scaled by ``Dh^-1/2`` (Inkling-2, whose q/k are L2-clipped) instead of
            Inkling's ``1/Dh``.

    Parameters: ``r_proj`` (``Linear(D, H·d_rel, bias=False)``), ``rel_proj`` ``P``
    ``(d_rel, E)``, with ``rel_clip`` ``rel_scale`` ``(H, d_rel)`` (ones: HF's
    ``norm.scale``), and with ``K > 0`` ``k_conv``/``v_conv`` ``(H·Dh, K)`` (HF's
    ``conv1d.weight`` ``(H·Dh, 1, K)`` squeezed).

    The layer hands :meth:`read_input` the key padding (``keep``) and packed ``documents``:
    padding enters the convolutions as 0 (HF's ``conv_mask``) and no row reads another
    document's rows (HF's ``seq_idx``).

    Raises:
        ValueError: an option out of range; :meth:`bias` / :meth:`score_mod` called without
            a context holding the layer input ``ctx.x``.
    """

    name = "inkling"
    paper = "Thinking Machines Lab, Inkling (HF transformers models/inkling)"
    year = 2026
    needs = Needs(width=True)  # r_proj reads the layer input: hidden_size = the layer width
    causal_only = True  # the bias covers past keys only and the convolutions are causal, as in HF

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        d_rel: int = 16,
        rel_extent: int = 1024,
        hidden_size: int | None = None,
        sconv_kernel: int = 0,
        init_std: float = 0.02,
        rel_clip: float | None = None,
        sqrt_scale: bool = False,
    ):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        for opt, val in (("d_rel", d_rel), ("rel_extent", rel_extent)):
            if val < 1:
                raise ValueError(f"{opt} must be an int >= 1, got {val!r}")
        if hidden_size is not None and hidden_size < 1:
            raise ValueError(f"hidden_size must be an int >= 1 or None, got {hidden_size!r}")
        if sconv_kernel < 0:
            raise ValueError(f"sconv_kernel must be an int >= 0 (0: no short convolutions), got {sconv_kernel!r}")
        if init_std <= 0:
            raise ValueError(f"init_std must be a number > 0, got {init_std!r}")
        if rel_clip is not None and (isinstance(rel_clip, bool) or not rel_clip > 0):
            raise ValueError(f"rel_clip must be a number > 0 or None (no clipping), got {rel_clip!r}")
        if not isinstance(sqrt_scale, bool):
            raise ValueError(f"sqrt_scale must be True or False, got {sqrt_scale!r}")
        self.rel_clip, self.sqrt_scale = None if rel_clip is None else float(rel_clip), sqrt_scale
        if rel_clip is not None:  # Inkling-2: a learned scale per head and channel before the clip
            self.rel_scale = nn.Parameter(torch.ones(heads, d_rel))
        self.d_rel, self.rel_extent, self.sconv_kernel = d_rel, rel_extent, sconv_kernel
        self.hidden_size = self.dim if hidden_size is None else hidden_size
        self.r_proj = nn.Linear(self.hidden_size, heads * d_rel, bias=False)
        self.rel_proj = nn.Parameter(torch.empty(d_rel, rel_extent))
        nn.init.normal_(self.r_proj.weight, std=init_std)
        nn.init.normal_(self.rel_proj, std=init_std)
        if sconv_kernel > 0:  # per-head channels: grouped k/v are repeated to all heads first
            self.needs = self.needs.replace(per_head_keys=True)
            self.k_conv = nn.Parameter(torch.randn(self.dim, sconv_kernel) * init_std)
            self.v_conv = nn.Parameter(torch.randn(self.dim, sconv_kernel) * init_std)

    def extra_repr(self) -> str:
        extra = f", d_rel={self.d_rel}, rel_extent={self.rel_extent}, sconv_kernel={self.sconv_kernel}"
        extra += f", rel_clip={self.rel_clip}" if self.rel_clip is not None else ""
        return super().extra_repr() + extra + (", sqrt_scale=True" if self.sqrt_scale else "")

    @property
    def relative(self) -> bool:
        return True

    @property
    def scale(self) -> float:
        """``1/Dh``, Inkling's scale (its q and k are RMS-normalised; posenc's are not yet); a
        ``score_scale`` replaces one ``Dh^-1/2`` factor: ``score_scale·Dh^-1/2``. With
        ``sqrt_scale`` (Inkling-2): ``Dh^-1/2``, or ``score_scale`` in its place."""
        if self.sqrt_scale:
            return self.dh_scale
        if self.score_scale is not None:
            return self.score_scale * self.head_dim**-0.5
        return 1.0 / self.head_dim

    def tau(self, q_pos: Tensor) -> Tensor:
        """``τ_i`` float32, same shape as ``q_pos``: 1 (``inkling-temperature`` has one)."""
        return torch.ones(q_pos.shape, device=q_pos.device)

    # ------------------------------------------------------------------ k/v convolutions
    def read_input(self, x: Tensor, k: Tensor, v: Tensor, carry=None, *, keep=None, documents=None) -> InputRead:
        """Depthwise causal convolutions plus residual on ``k`` and ``v`` ``(B, H, L, Dh)``
        (float32). ``carry``: the last ``K - 1`` convolution inputs of k and v of the previous
        call, ``(B, H·Dh, K - 1)`` each (None: zeros); returns the next one. As HF's
        ``InklingShortConvolution``: padding rows (``keep`` False) enter the convolution as 0
        (the residual keeps them), and with packed ``documents`` no row reads another
        document's rows (HF's ``seq_idx``)."""
        if self.sconv_kernel == 0:
            return InputRead(k, v, {}, carry)
        prev = (None, None) if carry is None else carry
        same = None if documents is None else _same_document(documents, self.sconv_kernel)
        (k, k_next), (v, v_next) = (
            self._conv(t, w, p, keep, same) for t, w, p in ((k, self.k_conv, prev[0]), (v, self.v_conv, prev[1]))
        )
        return InputRead(k, v, {}, (k_next, v_next))

    def _conv(self, t: Tensor, weight: Tensor, prev, keep, same) -> tuple[Tensor, Tensor]:
        B, H, L, Dh = t.shape
        x = t.float().transpose(1, 2).reshape(B, L, H * Dh).transpose(1, 2)  # (B, C, L), channels h·Dh + d
        inp = x if keep is None else x * keep[:, None, :].to(x.dtype)  # padding enters as 0
        if prev is None:
            prev = x.new_zeros(B, H * Dh, self.sconv_kernel - 1)
        full = torch.cat((prev.to(x), inp), dim=2)  # (B, C, K - 1 + L)
        if same is None:
            out = F.conv1d(full, weight.float().unsqueeze(1), groups=H * Dh) + x  # (B, C, L)
        else:  # window tap m of row t reads row t - (K - 1) + m only within t's document
            win = full.unfold(2, self.sconv_kernel, 1) * same[:, None].to(x.dtype)  # (B, C, L, K)
            out = (win * weight.float()[:, None, :]).sum(-1) + x
        out = out.transpose(1, 2).reshape(B, L, H, Dh).transpose(1, 2).to(t.dtype)
        return out, full[:, :, full.shape[2] - (self.sconv_kernel - 1) :].detach()

    # ------------------------------------------------------------------ scores
    def _rows_table(self, q_pos: Tensor, ctx, span: int | None = None) -> Tensor:
        """``τ_i·(r_i)_h·P[:, :span]`` float32 ``(B, H, Lq, span)``: row ``i``'s bias at the first
        ``span`` distances (all ``E`` by default)."""
        if ctx is None or ctx.x is None:
            raise ValueError(
                "encoding 'inkling' reads ctx.x (the layer input rows of the queries) for its bias; call it "
                "through posenc.Attention, or pass ctx=posenc.Context(q_pos, k_pos, x=x)"
            )
        x = ctx.x
        B, Lq = x.shape[0], x.shape[1]
        if Lq != q_pos.shape[-1]:
            raise ValueError(f"ctx.x has {Lq} rows for {q_pos.shape[-1]} query positions; they must match")
        r = self.r_proj(x.to(self.r_proj.weight.dtype)).view(B, Lq, self.heads, self.d_rel).float()
        if self.rel_clip is not None:  # Inkling-2: learned scale, then the L2 clip per head
            r = r * self.rel_scale.float()
            r = r * (self.rel_clip / (torch.linalg.vector_norm(r, dim=-1, keepdim=True) + 1e-6)).clamp(max=1.0)
        P = self.rel_proj if span is None else self.rel_proj[:, :span]
        return (r @ P.float()).transpose(1, 2)  # (B, H, Lq, span)

    def bias(self, q_pos: Tensor, k_pos: Tensor, ctx=None) -> Tensor:
        """``(B, H, Lq, Lk)`` float32: ``τ_i·(r_i)_h·P[:, i - j]`` for ``0 <= i - j < E``, else 0."""
        d = _as_rows(q_pos)[:, :, None] - _as_rows(k_pos)[:, None, :]  # (B|1, Lq, Lk): i - j
        # only the distances this call has: a short call does not project onto all E columns
        # (one host sync; at L = 64 with E = 1024 the full table was 6x the whole layer's time)
        span = max(1, min(self.rel_extent, int(d.max()) + 1)) if d.numel() else 1
        rel = self._rows_table(q_pos, ctx, span)
        B, H, Lq, E = rel.shape
        outside = (d < 0) | (d >= E)
        idx = d.clamp(0, E - 1)[:, None].expand(B, H, Lq, d.shape[-1])
        return rel.gather(-1, idx).masked_fill(outside[:, None], 0.0)

    def score_mod(self, q_pos: Tensor, k_pos: Tensor, ctx=None) -> ScoreMod:
        rel = self._rows_table(q_pos, ctx).contiguous()  # (B, H, Lq, E)
        B, _, Lq, E = rel.shape
        q_pos, k_pos = _as_rows(q_pos).expand(B, Lq), _as_rows(k_pos).expand(B, -1)

        def mod(score, b, h, q_idx, kv_idx):
            d = q_pos[b, q_idx] - k_pos[b, kv_idx]
            value = rel[b, h, q_idx, d.clamp(0, E - 1)]
            return score + torch.where((d >= 0) & (d < E), value, 0.0)

        return mod


@register
class InklingTemperature(Inkling):
    """Inkling on its global layers: the temperature ``τ_i = 1 + α·ln(max(1, (i + 1)/n_floor))``
    multiplies the queries (the q/k stage) and the bias, in float32.

    Args:
        log_scaling_n_floor: ``n_floor`` (HF ``log_scaling_n_floor``; HF's config default is None,
            set per checkpoint: 1024 here, the default ``rel_extent``).
        log_scaling_alpha: ``α`` (> 0; HF's default 0.1).
        (others as :class:`Inkling`.)
    """

    name = "inkling-temperature"

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        log_scaling_n_floor: int = 1024,
        log_scaling_alpha: float = 0.1,
        **options,
    ):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal, **options)
        if log_scaling_n_floor < 1:
            raise ValueError(f"log_scaling_n_floor must be an int >= 1, got {log_scaling_n_floor!r}")
        if log_scaling_alpha <= 0:
            raise ValueError(f"log_scaling_alpha must be a number > 0, got {log_scaling_alpha!r}")
        self.log_scaling_n_floor, self.log_scaling_alpha = log_scaling_n_floor, log_scaling_alpha

    def extra_repr(self) -> str:
        extra = f", log_scaling_n_floor={self.log_scaling_n_floor}, log_scaling_alpha={self.log_scaling_alpha}"
        return super().extra_repr() + extra

    @property
    def relative(self) -> bool:
        return False  # τ_i depends on the absolute query position: a shift changes it

    def tau(self, q_pos: Tensor) -> Tensor:
        """``τ_i = 1 + α·ln(max(1, (i + 1)/n_floor))`` float32, same shape as ``q_pos``."""
        n = (q_pos + 1).float() / self.log_scaling_n_floor
        return 1.0 + self.log_scaling_alpha * torch.log(n.clamp(min=1.0))

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, ctx=None) -> tuple[Tensor, Tensor]:
        """``τ_i·q_i`` (float32, back to ``q``'s dtype); keys unchanged."""
        if q_pos.shape[-1] != q.shape[2]:
            raise ValueError(f"q_pos holds {q_pos.shape[-1]} positions for {q.shape[2]} queries (length {q.shape[2]})")
        tau = self.tau(_as_rows(q_pos))[:, None, :, None]  # (B|1, 1, Lq, 1)
        return (q.float() * tau).to(q.dtype), k

    def _rows_table(self, q_pos: Tensor, ctx, span: int | None = None) -> Tensor:
        return super()._rows_table(q_pos, ctx, span) * self.tau(_as_rows(q_pos))[:, None, :, None]


def _same_document(documents: Tensor, K: int) -> Tensor:
    """``(B|1, L, K)`` bool: tap ``m`` of row ``t`` (row ``t - (K - 1) + m``) is in ``t``'s document."""
    L = documents.shape[-1]
    t = torch.arange(L, device=documents.device)
    src = t[:, None] - (K - 1) + torch.arange(K, device=documents.device)  # (L, K)
    ok = src >= 0
    docs = documents[:, src.clamp(min=0)]  # (B|1, L, K)
    return ok & (docs == documents[:, :, None])
