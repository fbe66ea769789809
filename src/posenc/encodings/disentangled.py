"""Disentangled position terms: DeBERTa (c2p, p2c, log buckets); TUPE is in :mod:`.tupe`.

* ``deberta`` — He, Liu, Gao, Chen, "DeBERTa: Decoding-enhanced BERT with Disentangled
  Attention", ICLR 2021 (v1) and the DeBERTa-v3 code (log buckets, ``share_att_key``,
  LayerNorm on the relative table). With ``δ = i - j`` (query minus key, the opposite
  sign to T5), ``idx = clamp(bucket(δ) + span, 0, 2·span - 1)`` and ``E`` the
  ``(2·span, D)`` relative table shared by all layers::

      s_ij = (q_i·k_j + q_i·Kr[idx] + k_j·Qr[idx]) / sqrt(Dh·(1 + #terms))
      Kr = E W_Kr + b,   Qr = E W_Qr + b     (W_K, W_Q themselves with share_att_key)

  Checked against HF ``DebertaV2`` and ``Deberta`` ``DisentangledSelfAttention``.
  The enhanced mask decoder (absolute positions added only before the top layers) is
  ``deberta-emd`` (:class:`DebertaEMD`, option ``absolute_from_layer=n``): DeBERTa plus an
  input stage that adds a learned absolute table to the residual stream before block ``n``
  of a :class:`posenc.TransformerLM`.

Fast path: the ``2·span`` relative vectors are projected once per call, each term is one
matmul against them and a gather into place; no ``(L, L, Dh)`` tensor.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .. import functional as PF
from ..base import Needs, PositionEncoding
from ..registry import register
from ..terms import DistanceTerms, saturation
from ..validate import check_table_len

_POS_ATT_TYPES = ("c2p", "p2c")


def make_log_bucket_position(relative_pos: Tensor, bucket_size: int, max_position: int) -> Tensor:
    """DeBERTa-v2's log buckets of ``δ``: exact for ``|δ| <= bucket_size // 2``, then log-spaced.

    Same arithmetic as HF ``make_log_bucket_position`` (float32), returned as int64.
    """
    sign = torch.sign(relative_pos)
    mid = bucket_size // 2
    abs_pos = torch.where(
        (relative_pos < mid) & (relative_pos > -mid), torch.tensor(mid - 1).type_as(relative_pos), relative_pos.abs()
    )
    log_pos = torch.ceil(torch.log(abs_pos / mid) / math.log((max_position - 1) / mid) * (mid - 1)) + mid
    return torch.where(abs_pos <= mid, relative_pos.type_as(log_pos), log_pos * sign).long()


@register
class DeBERTa(PositionEncoding):
    """DeBERTa disentangled attention (content-to-position and position-to-content).

    Args:
        pos_att_type: ``"c2p|p2c"``, ``"c2p"`` or ``"p2c"`` (HF spelling, any order).
        position_buckets: log buckets per side (v3: 256); 0 = no buckets (v1).
        max_relative_positions: largest distance the buckets reach; the span when
            ``position_buckets=0`` (HF default 512; ``max_len``, or 512, when < 1).
        share_att_key: project the table with the layer's own ``W_Q``/``W_K`` (v3) rather
            than separate ``pos_query_proj``/``pos_key_proj``.
        norm_rel_ebd: LayerNorm on the shared table (HF ``norm_rel_ebd="layer_norm"``).
        version: 2 (``pos_key_proj`` has a bias) or 1 (``pos_proj`` without, as DeBERTa v1).
        hidden_size: width ``D`` of the table; ``H·Dh`` by default. Must equal the layer
            width with ``share_att_key``.
        layer_norm_eps: eps of that LayerNorm (HF default 1e-7).
        clamp_relative_positions: clamp ``δ`` to ``±(max_relative_positions - 1)`` before
            log-bucketing, as Microsoft's code does (``da_utils.make_log_bucket_position`` since
            its 2023 DeBERTaV3 release; its 2021 v2 release did not); HF does not, so there a key more than ``max_relative_positions - 1`` positions
            *ahead* of the query lands in table row 0, which no distance inside the range
            uses (never trained), while Microsoft's lands in the last trained bucket. The two
            agree for every ``|δ| < max_relative_positions`` and for every causal pair. True
            (Microsoft's) by default; False reproduces HF exactly. No effect without buckets.
    """

    name = "deberta"
    paper = "He et al., DeBERTa: Decoding-enhanced BERT with Disentangled Attention"
    year = 2021
    # the relative table is the model's (HF shares it across layers); the table is as wide as the layer
    needs = Needs(shared_modules=("rel_embeddings", "rel_norm", "absolute"), width=True)

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        pos_att_type: str = "c2p|p2c",
        position_buckets: int = 256,
        max_relative_positions: int = 512,
        share_att_key: bool = True,
        norm_rel_ebd: bool = True,
        version: int = 2,
        hidden_size: int | None = None,
        layer_norm_eps: float = 1e-7,
        init_std: float = 0.02,
        clamp_relative_positions: bool = True,
    ):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        types = (
            [t.strip() for t in pos_att_type.lower().split("|") if t.strip()] if isinstance(pos_att_type, str) else []
        )
        if not types or any(t not in _POS_ATT_TYPES for t in types):
            raise ValueError(f"pos_att_type must be 'c2p', 'p2c' or 'c2p|p2c', got {pos_att_type!r}")
        if not isinstance(position_buckets, int) or position_buckets < 0 or position_buckets == 1:
            raise ValueError(f"position_buckets must be 0 (none) or an int >= 2, got {position_buckets!r}")
        if version not in (1, 2):
            raise ValueError(f"version must be 1 or 2, got {version!r}")
        if max_relative_positions < 1:
            max_relative_positions = max_len if max_len is not None else 512
        if position_buckets and max_relative_positions <= position_buckets // 2 + 1:
            raise ValueError(
                f"max_relative_positions must exceed position_buckets // 2 + 1 = {position_buckets // 2 + 1}, "
                f"got {max_relative_positions}"
            )
        if not isinstance(clamp_relative_positions, bool):
            raise ValueError(f"clamp_relative_positions must be a bool, got {clamp_relative_positions!r}")
        self.clamp_relative_positions = clamp_relative_positions
        self.c2p, self.p2c = "c2p" in types, "p2c" in types
        self.position_buckets, self.max_relative_positions = position_buckets, max_relative_positions
        self.span = position_buckets if position_buckets > 0 else max_relative_positions
        self.share_att_key, self.version = share_att_key, version
        self.hidden_size = self.dim if hidden_size is None else hidden_size
        D, inner = self.hidden_size, heads * head_dim
        self.rel_embeddings = nn.Embedding(2 * self.span, D)
        nn.init.normal_(self.rel_embeddings.weight, std=init_std)
        self.rel_norm = nn.LayerNorm(D, eps=layer_norm_eps) if norm_rel_ebd else None
        if not share_att_key:
            if self.c2p:
                self.pos_key_proj = nn.Linear(D, inner, bias=version == 2)
            if self.p2c:
                self.pos_query_proj = nn.Linear(D, inner)
        self.absolute = None  # DebertaEMD's absolute table
        self.absolute_from_layer = None

    @property
    def relative(self) -> bool:
        return self.absolute is None

    @property
    def extrapolates(self) -> bool:
        return self.absolute is None  # the enhanced-mask-decoder table has max_len rows

    @property
    def num_terms(self) -> int:
        return int(self.c2p) + int(self.p2c)

    @property
    def scale(self) -> float:
        """``(Dh·(1 + #terms))^-1/2``, applied to content and position terms alike (with a
        ``score_scale``, it replaces ``Dh^-1/2``: ``score_scale·(1 + #terms)^-1/2``)."""
        if self.score_scale is not None:
            return self.score_scale * (1 + self.num_terms) ** -0.5
        return (self.head_dim * (1 + self.num_terms)) ** -0.5

    def rel_index(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``clamp(bucket(i - j) + span, 0, 2·span - 1)``: ``(..., Lq, Lk)`` int64.

        With ``clamp_relative_positions``, ``i - j`` is first clamped to
        ``±(max_relative_positions - 1)`` (Microsoft's code).
        """
        delta = -self.rel_distance(q_pos, k_pos)  # i - j, (..., Lq, Lk)
        # bucket each distinct distance once (2L - 1 of them), then look the pairs up
        lo = int(q_pos.min()) - int(k_pos.max())
        hi = int(q_pos.max()) - int(k_pos.min())
        table = self.row_of(torch.arange(lo, hi + 1, device=delta.device))  # (hi - lo + 1,)
        return table[delta - lo]

    def row_of(self, delta: Tensor) -> Tensor:
        """Row of the relative table for each distance ``δ = i - j`` (int64, same shape)."""
        if self.position_buckets > 0:
            if self.clamp_relative_positions:  # Microsoft's original; HF does not clamp
                m = self.max_relative_positions - 1
                delta = delta.clamp(-m, m)
            delta = make_log_bucket_position(delta, self.position_buckets, self.max_relative_positions)
        return (delta + self.span).clamp(0, 2 * self.span - 1)

    def _saturation_limit(self) -> int:
        """A distance beyond which :meth:`row_of` no longer changes."""
        if self.position_buckets == 0:
            return self.span
        if self.clamp_relative_positions:
            return self.max_relative_positions - 1
        limit = self.max_relative_positions  # HF's buckets keep growing until the table clamps them
        while not (self.row_of(torch.tensor([-limit, limit])) == torch.tensor([0, 2 * self.span - 1])).all():
            limit *= 2
        return limit

    def rel_table(self) -> Tensor:
        """The shared ``(2·span, D)`` table, normalised if ``norm_rel_ebd``."""
        e = self.rel_embeddings.weight
        return self.rel_norm(e) if self.rel_norm is not None else e

    def project_table(self, table: Tensor, which: str, qk_proj=None) -> Tensor:
        """``(2·span, D)`` -> ``(H, 2·span, Dh)`` with the key (c2p) or query (p2c) projection.

        With ``share_att_key`` those are the layer's ``W_K``/``W_Q``, given as ``qk_proj``.
        """
        if self.share_att_key:
            if qk_proj is None:
                raise ValueError(
                    "share_att_key=True projects the table with the layer's W_Q/W_K: pass "
                    "ctx=posenc.Context(..., qk_proj=(q_proj, k_proj)) or qk_proj=, as posenc.Attention does"
                )
            proj = qk_proj[1] if which == "key" else qk_proj[0]
            width = getattr(proj, "out_features", self.dim)
            if width % self.head_dim or self.heads % (width // self.head_dim or self.heads + 1):
                raise ValueError(
                    f"share_att_key needs the layer's {which} projection to give g*head_dim features, g dividing "
                    f"heads={self.heads} (head_dim={self.head_dim}), got {width}"
                )
            if proj.in_features != self.hidden_size:
                raise ValueError(
                    f"share_att_key needs hidden_size == layer dim, got {self.hidden_size} and {proj.in_features}"
                )
        else:
            proj = self.pos_key_proj if which == "key" else self.pos_query_proj
        out = proj(table).view(table.shape[0], -1, self.head_dim).transpose(0, 1)  # (g, 2·span, Dh)
        # grouped k/v: W_K gives g < H heads; each serves its group of query heads, as the keys do
        return out.repeat_interleave(self.heads // out.shape[0], 0)

    def distance_terms(self, q: Tensor, k: Tensor, ctx=None, *, qk_proj=None) -> DistanceTerms:
        """c2p (``q·Kr``) and p2c (``k·Qr``) vectors per table row of ``δ = i - j = -d``."""
        qk_proj = _layer_projections(ctx, qk_proj)
        table = self.rel_table()
        kr = self.project_table(table, "key", qk_proj) if self.c2p else None  # (H, 2span, Dh)
        qr = self.project_table(table, "query", qk_proj) if self.p2c else None

        def rows(d: Tensor) -> Tensor:
            return self.row_of(-d)

        return DistanceTerms(
            rel_k=None if kr is None else (lambda r: kr[:, r]),
            rel_q=None if qr is None else (lambda r: qr[:, r]),
            rows=rows,
            kind="clamp",
            far=saturation(rows, self._saturation_limit(), device=table.device),
        )

    def score_terms(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, ctx=None, *, qk_proj=None) -> Tensor:
        """c2p and p2c. With ``share_att_key`` the table goes through the layer's ``W_Q``/``W_K``:
        ``ctx.qk_proj`` (:class:`posenc.Attention` puts them there), or ``qk_proj=`` in a direct call."""
        qk_proj = _layer_projections(ctx, qk_proj)
        if q.shape[-2] != q_pos.shape[-1] or k.shape[-2] != k_pos.shape[-1]:
            raise ValueError(
                f"q/k lengths {q.shape[-2]}/{k.shape[-2]} do not match positions {q_pos.shape[-1]}/{k_pos.shape[-1]}"
            )
        idx = self.rel_index(q_pos, k_pos)  # (B|1, Lq, Lk)
        table = self.rel_table()
        B, H, Lq, _ = q.shape
        out = None
        if self.c2p:
            kr = self.project_table(table, "key", qk_proj).to(q.dtype)  # (H, 2span, Dh)
            out = PF.gather_relative_logits(q @ kr.transpose(-1, -2), idx)  # q_i·Kr[idx]
        if self.p2c:
            qr = self.project_table(table, "query", qk_proj).to(k.dtype)  # (H, 2span, Dh)
            kq = (k @ qr.transpose(-1, -2)).transpose(-1, -2)  # (B, H, 2span, Lk): k_j·Qr[r]
            index = idx.unsqueeze(1).expand(B, H, Lq, k.shape[-2])
            p2c = torch.gather(kq, -2, index)  # k_j·Qr[idx(i, j)]
            out = p2c if out is None else out + p2c
        return out


def _layer_projections(ctx, qk_proj):
    """The layer's ``(W_Q, W_K)``: given directly, or from the call's context."""
    return qk_proj if qk_proj is not None or ctx is None else ctx.qk_proj


@register
class DebertaEMD(DeBERTa):
    """DeBERTa with its enhanced mask decoder, approximated: a learned absolute position table
    (``max_len`` rows of width ``hidden_size``) added to the hidden states just before block
    ``absolute_from_layer`` of a model (the input stage, ``input_at``), so only the blocks from
    there on see absolute positions (its ``embed``: the input stage ``deberta`` does not have).
    Built by its name, ``posenc.build("deberta-emd", absolute_from_layer=n, ...)``; every other
    option is DeBERTa's.
    """

    name = "deberta-emd"

    def __init__(self, *, heads, head_dim, max_len=None, causal=True, absolute_from_layer: int = 0, **options):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal, **options)
        if not isinstance(absolute_from_layer, int) or isinstance(absolute_from_layer, bool) or absolute_from_layer < 0:
            raise ValueError(f"absolute_from_layer must be a block index >= 0, got {absolute_from_layer!r}")
        if max_len is None:
            raise ValueError("absolute_from_layer needs max_len (the size of the absolute position table)")
        check_table_len(self, "max_len", max_len)
        self.absolute = nn.Embedding(max_len, self.hidden_size)
        nn.init.normal_(self.absolute.weight, std=options.get("init_std", 0.02))
        self.absolute_from_layer = absolute_from_layer
        self.needs = self.needs.replace(input_at=absolute_from_layer)  # before block absolute_from_layer

    def extra_repr(self) -> str:
        return super().extra_repr() + f", absolute_from_layer={self.absolute_from_layer}"

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        """Enhanced mask decoder (``absolute_from_layer``): ``x + P[pos]``, ``x`` ``(B, L, hidden_size)``."""
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"absolute_from_layer: table width hidden_size={self.hidden_size}, x {tuple(x.shape)}")
        return x + self.absolute(pos).to(x.dtype)  # (B|1, L, D)
