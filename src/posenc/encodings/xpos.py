"""xPos: RoPE with an exponential decay in the distance.

Sun et al., "A Length-Extrapolatable Transformer", ACL 2023 (arXiv 2022). RoPE whose
pair ``k`` is also scaled by ``ζ_k^(n/scale_base)`` on queries and ``ζ_k^(-n/scale_base)``
on keys, ``ζ_k = (2k/Dr + γ)/(1 + γ)``: an exponential decay in ``i - j``. Everything
else (layouts, angles in float32) is :class:`posenc.encodings.rotary.RoPE`'s. Checked
against ``rotary-embedding-torch`` (``use_xpos=True``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..base import Needs
from ..context import table
from ..registry import register
from .rotary import RoPE

__all__ = ["XPos"]


@register
class XPos(RoPE):
    """xPos: RoPE with an exponential decay, ``q·ζ^(n/scale_base)``, ``k·ζ^(-n/scale_base)``.

    Scores depend only on ``i - j``: ``ζ^((i-r)/s)·ζ^(-(j-r)/s) = ζ^((i-j)/s)`` for any
    reference position ``r``. Each call takes ``r`` at the middle of its query positions
    (per batch row), as ``rotary-embedding-torch`` does for a full sequence (``n - L//2``),
    so the factors stay bounded by half the query span whatever the absolute positions:
    a float16 layer at position 10⁵ is as exact as at position 0. Because ``r`` moves
    with the queries, the KV cache keeps keys before the rotation (``needs.raw_keys``)
    and rotates them again at every step, so cached decoding still equals a full forward.

    The factors are float32; the rotated ``q``/``k`` are cast to the activation dtype,
    so the growth ``ζ_min^(-span/2/s)`` must fit it: a ``ValueError`` names the limit
    when one call's query span is too long (about 4 500 query positions in float16,
    65 000 in bfloat16/float32 with the defaults); a longer prompt goes in chunks through
    the KV cache.

    Args:
        scale_base: the ``512`` of the paper.
        gamma: ``γ = 0.4``.
        (others as :class:`RoPE`; the default layout is interleaved, as in the paper's code.)
    """

    name = "xpos"
    paper = "Sun et al., A Length-Extrapolatable Transformer"
    year = 2022
    causal_only = True
    default_layout = "interleaved"
    needs = Needs(raw_keys=True)  # the reference position moves with the queries
    _table_fields = (*RoPE._table_fields, "scale_base", "gamma")  # what fixes the tables (RoPE.table_key)

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        base: float = 10000.0,
        layout: str | None = None,
        partial_rotary_factor: float = 1.0,
        scale_base: float = 512.0,
        gamma: float = 0.4,
    ):
        if not isinstance(scale_base, (int, float)) or scale_base <= 0:
            raise ValueError(f"scale_base must be a positive number, got {scale_base!r}")
        if not isinstance(gamma, (int, float)) or gamma <= 0:
            raise ValueError(f"gamma must be a positive number, got {gamma!r}")
        self.scale_base, self.gamma = float(scale_base), float(gamma)
        super().__init__(
            heads=heads,
            head_dim=head_dim,
            max_len=max_len,
            causal=causal,
            base=base,
            layout=layout,
            partial_rotary_factor=partial_rotary_factor,
        )
        self.register_buffer("zeta", torch.empty(self.rotary_dim // 2), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        super().init_buffers()
        if "zeta" in self._buffers:
            d = self.rotary_dim
            zeta = (torch.arange(0, d, 2, dtype=torch.float32) / d + self.gamma) / (1 + self.gamma)
            self.zeta = zeta.to(self.inv_freq.device)
            self._mark_built()

    def extra_repr(self) -> str:
        return super().extra_repr() + f", scale_base={self.scale_base}, gamma={self.gamma}"

    # largest exponent of a factor per activation dtype: ln(max) less ln(256) of headroom
    # for the magnitude of q/k themselves and the dot product
    _MAX_EXPONENT = {torch.float16: math.log(65504.0) - math.log(256.0)}

    def decay(self, offset: Tensor) -> Tensor:
        """``ζ^(offset/scale_base)``: float32 ``offset.shape + (Dr/2,)``, broadcast like cos."""
        power = offset.to(torch.float32).unsqueeze(-1) / self.scale_base
        scale = self.zeta**power
        return scale.unsqueeze(1) if offset.dim() == 2 else scale

    def reference(self, q_pos: Tensor) -> Tensor:
        """The middle of each row's query positions, ``(min + max + 1) // 2``: ``(B|1, 1)`` or ``()``."""
        return (q_pos.amin(-1, keepdim=True) + q_pos.amax(-1, keepdim=True) + 1) // 2

    def _check_growth(self, q_pos: Tensor, k_pos: Tensor, ref: Tensor, dtype: torch.dtype) -> None:
        """Raise when a factor ``ζ_min^(-d/s)`` would overflow ``dtype`` (d: distance to ``ref``)."""
        if not q_pos.numel() or torch.compiler.is_compiling() or q_pos.device.type == "meta":
            return
        limit = self._MAX_EXPONENT.get(dtype, 80.0)
        per_pos = -math.log(float(self.zeta.min())) / self.scale_base
        far = max(int((ref - q_pos).amax()), int((k_pos - ref).amax()) if k_pos.numel() else 0)
        if far * per_pos > limit:
            raise ValueError(
                f"xpos: the decay factors of this call overflow {dtype}: a query or key lies {far} positions "
                f"from the middle of the queries, at most {int(limit / per_pos)} fit (about "
                f"{2 * int(limit / per_pos)} query positions per call with scale_base={self.scale_base}); "
                "attend in shorter calls, use a wider dtype, or raise scale_base"
            )

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, ctx=None) -> tuple[Tensor, Tensor]:
        def make():
            ref = self.reference(q_pos)
            self._check_growth(q_pos, k_pos, ref, q.dtype)
            q_tab = self._cos_sin(q_pos, self.inv_freq, self.decay(q_pos - ref))
            # keys far behind the reference decay to 0 (never inf): ζ^((r - j)/s)
            return q_tab, self._cos_sin(k_pos, self.inv_freq, self.decay(ref - k_pos))

        # once per model call for the layers with equal options (RoPE.table_key); the
        # growth check depends on the activation dtype, which is part of the key
        owner, name = self.table_key()
        q_tab, k_tab = table(ctx, owner, f"{name}:{q.dtype}", (q_pos, k_pos), make)
        return self._rotate_one(q, q_pos, q_tab), self._rotate_one(k, k_pos, k_tab)
