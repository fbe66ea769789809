"""Query/key normalisation per head, over ``head_dim``, with the weight conventions of HF's models.

``qk_norm`` of :class:`posenc.Attention` (and :class:`posenc.ModelConfig`):

==============  ==============================================  ===============================
kind            computes (``x`` one head's ``Dh`` vector)        as HF's
==============  ==============================================  ===============================
``"rms"``       ``w · (x·rsqrt(mean x² + eps))``, ``w`` init 1   ``Qwen3RMSNorm`` (Qwen3, OLMo 2
                                                                style; float32, cast back to the
                                                                input dtype, then ``·w``)
``"gemma-rms"`` ``(x·rsqrt(mean x² + eps))·(1 + w)``, ``w``      ``Gemma3RMSNorm`` (all float32,
                init 0                                          cast back at the end)
``"l2"``        ``x·rsqrt(mean x² + eps)``, no weight            ``Llama4TextL2Norm``
==============  ==============================================  ===============================

The weight has shape ``(head_dim,)``, shared by every head (as HF's ``q_norm``/``k_norm``);
queries and keys have one module each (``Attention.q_norm``/``k_norm``, the names HF uses).
``qk_norm_position``: ``"before"`` the q/k stage (Qwen3, Gemma 3: before RoPE) or ``"after"``
it (Llama 4). Both run after the encoding's ``read_input`` (which reads the raw projections).
None of these is ``torch.nn.RMSNorm``: its fused kernel rounds differently from HF's
float32 formula, and HF's order of cast and weight differs per family.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["QK_NORMS", "QK_NORM_POSITIONS", "QKNorm", "check_qk_norm", "qk_norms"]

QK_NORMS = ("rms", "gemma-rms", "l2")
QK_NORM_POSITIONS = ("before", "after")


class QKNorm(nn.Module):
    """One of :data:`QK_NORMS` over the last dimension (``head_dim``) of ``(B, H, L, Dh)``."""

    def __init__(self, kind: str, head_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        check_qk_norm(kind, "before", eps)
        self.kind, self.eps, self.head_dim = kind, float(eps), head_dim
        if kind == "rms":
            self.weight = nn.Parameter(torch.ones(head_dim))
        elif kind == "gemma-rms":
            self.weight = nn.Parameter(torch.zeros(head_dim))
        else:
            self.weight = None

    def extra_repr(self) -> str:
        return f"{self.kind!r}, head_dim={self.head_dim}, eps={self.eps}"

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.constant_(self.weight, 1.0 if self.kind == "rms" else 0.0)

    def forward(self, x: Tensor) -> Tensor:
        if self.weight is not None and x.shape[-1] != self.head_dim:
            raise ValueError(
                f"qk_norm={self.kind!r} has a weight of {self.head_dim} features, got vectors of {x.shape[-1]} "
                "(an encoding whose q/k stage changes the width, as pope: use qk_norm_position='before' or 'l2')"
            )
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.kind == "rms":  # Qwen3RMSNorm: cast back, then the weight
            return self.weight * normed.to(x.dtype)
        if self.kind == "gemma-rms":  # Gemma3RMSNorm: (1 + w) in float32, cast back last
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return normed.type_as(x)  # Llama4TextL2Norm


def check_qk_norm(kind: str | None, position: str, eps: float) -> None:
    """``ValueError`` naming the bad value and what is allowed."""
    if kind is not None and kind not in QK_NORMS:
        raise ValueError(f"qk_norm must be one of {QK_NORMS} or None, got {kind!r}")
    if position not in QK_NORM_POSITIONS:
        raise ValueError(f"qk_norm_position must be one of {QK_NORM_POSITIONS}, got {position!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"qk_norm_eps must be a finite number >= 0, got {eps!r}")


def qk_norms(kind: str | None, head_dim: int, eps: float) -> tuple[QKNorm | None, QKNorm | None]:
    """The ``(q_norm, k_norm)`` pair of a layer; ``(None, None)`` without a norm."""
    if kind is None:
        return None, None
    return QKNorm(kind, head_dim, eps), QKNorm(kind, head_dim, eps)
