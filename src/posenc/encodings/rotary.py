"""Rotary position embedding (RoPE).

Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021.
Each pair of query/key dimensions is rotated by ``pos · θ_k``, ``θ_k = base^(-2k/Dr)``,
so ``q̃_i·k̃_j`` depends on ``i - j`` only: the absolute encoding that is relative.

Two layouts of the pairs, both supported (``layout=``):

* ``"half"``: pairs ``(x_k, x_{k+Dr/2})``, HF Llama ``rotate_half`` (also NeoX,
  Mistral, Qwen, Gemma);
* ``"interleaved"``: pairs ``(x_{2k}, x_{2k+1})``, RoFormer, GPT-J, Meta's Llama.

``partial_rotary_factor`` rotates only the first ``Dr = Dh·factor`` dimensions (NeoX,
Phi). ``rotary_value`` also rotates the values, as RoFormer's option does. Angles are
computed from int64 positions in float64 and rounded once to float32, whatever the
activation dtype. Checked element-wise against HF Llama ``apply_rotary_pos_emb`` and HF
RoFormer ``apply_rotary_position_embeddings``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import functional as PF
from ..base import PositionEncoding, Stage, register


@register
class RoPE(PositionEncoding):
    name = "rope"
    family = "rotary"
    paper = "Su et al., RoFormer: Enhanced Transformer with Rotary Position Embedding"
    year = 2021
    stages = Stage.QK

    def __init__(
        self,
        *,
        heads,
        head_dim,
        max_len=None,
        causal=True,
        base: float = 10000.0,
        layout: str = "half",
        partial_rotary_factor: float = 1.0,
        rotary_value: bool = False,
    ):
        super().__init__(heads=heads, head_dim=head_dim, max_len=max_len, causal=causal)
        if layout not in ("half", "interleaved"):
            raise ValueError(f"layout must be 'half' or 'interleaved', got {layout!r}")
        if not 0.0 < partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {partial_rotary_factor}")
        rot = int(head_dim * partial_rotary_factor)
        if rot < 2 or rot % 2:
            raise ValueError(
                f"rotary dim head_dim*partial_rotary_factor = {head_dim}*{partial_rotary_factor} = {rot} "
                "must be even and >= 2"
            )
        if base <= 1:
            raise ValueError(f"base must be > 1, got {base}")
        self.base, self.layout, self.rotary_dim = float(base), layout, rot
        self.partial_rotary_factor = partial_rotary_factor
        self.rotary_value = rotary_value
        self.register_buffer("inv_freq", torch.empty(rot // 2), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        self.inv_freq = PF.sinusoidal_inv_freq(self.rotary_dim, self.base, device=self.inv_freq.device)

    @property
    def relative(self) -> bool:
        return True

    @property
    def rotates_value(self) -> bool:
        return self.rotary_value

    def extra_repr(self) -> str:
        return super().extra_repr() + f", base={self.base}, layout={self.layout!r}, rotary_dim={self.rotary_dim}"

    def _rotate_one(self, x: Tensor, pos: Tensor) -> Tensor:
        if x.shape[-2] != pos.shape[-1]:
            raise ValueError(f"positions of length {pos.shape[-1]} for a tensor of length {x.shape[-2]}")
        ang = PF.rope_angles(pos, self.inv_freq)  # (B|1, L, Dr/2) or (L, Dr/2), float32
        if pos.dim() == 2:
            ang = ang.unsqueeze(1)  # (B|1, 1, L, Dr/2)
        cos, sin = ang.cos(), ang.sin()
        fn = PF.apply_rope_half if self.layout == "half" else PF.apply_rope_interleaved
        r = self.rotary_dim
        if r == x.shape[-1]:
            return fn(x, cos, sin)
        return torch.cat((fn(x[..., :r], cos, sin), x[..., r:]), dim=-1)

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        return self._rotate_one(q, q_pos), self._rotate_one(k, k_pos)

    def rotate_value(self, v: Tensor, k_pos: Tensor) -> Tensor:
        return self._rotate_one(v, k_pos)
