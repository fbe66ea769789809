"""Learned attention sinks (gpt-oss): one logit per head that joins every softmax row.

For head ``h`` with sink logit ``s_h`` and scores ``x_ij`` (after scale, bias and mask)::

    p_ij = exp(x_ij) / (exp(s_h) + Σ_j exp(x_ij))        o_i = Σ_j p_ij · v_j

so a head may give part of its attention to nothing (HF ``GptOssAttention``: the sink
column is concatenated to the scores, soft-maxed, and dropped before ``@ v``). Every
backend runs it in one of two equivalent ways:

* materialising backends append the column to their scores (:func:`sink_softmax`);
* fused backends (SDPA, FlexAttention) attend to one extra key: a zero key with a zero
  value whose score is the sink logit (:func:`append_sink_key`, :func:`sink_bias`,
  :func:`sink_mods`), since ``scale·q·0 + s_h = s_h``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["sink_softmax", "append_sink_key", "sink_bias", "sink_mods", "check_sinks"]


def check_sinks(sinks: Tensor | None, heads: int) -> None:
    """``ValueError`` unless ``sinks`` is None or a float ``(H,)`` tensor."""
    if sinks is not None and (
        not isinstance(sinks, Tensor) or not sinks.is_floating_point() or sinks.shape != (heads,)
    ):
        raise ValueError(
            f"sinks must be a float tensor of shape ({heads},) (one logit per head), got "
            f"{getattr(sinks, 'dtype', type(sinks).__name__)} {tuple(getattr(sinks, 'shape', ()))}"
        )


def sink_softmax(s: Tensor, sinks: Tensor) -> Tensor:
    """Softmax over ``[s, sink]`` with the sink column dropped: ``(B, H, Lq, Lk)`` float32.

    ``sinks``: ``(H,)``, one logit per head (gpt-oss), or ``(B, H, Lq)``, one per query row
    (Inkling-2 projects them from each query's hidden state; the materialising backends only)."""
    if sinks.dim() == 3:
        col = sinks.float().unsqueeze(-1)  # (B, H, Lq, 1)
    else:
        col = sinks.float().view(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)  # (B, H, Lq, 1)
    return torch.softmax(torch.cat((s, col), -1), -1)[..., :-1]


def append_sink_key(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``k``, ``v`` ``(B, H, Lk, Dh)`` with one zero key and value appended: ``(B, H, Lk + 1, Dh)``."""
    z = k.new_zeros(*k.shape[:2], 1, k.shape[-1])
    return torch.cat((k, z), 2), torch.cat((v, z.to(v.dtype)), 2)


def sink_bias(bias: Tensor | None, keep: Tensor | None, sinks: Tensor, shape: tuple[int, int, int, int]) -> Tensor:
    """The float ``attn_mask`` ``(B|1, H, Lq, Lk + 1)`` of SDPA against :func:`append_sink_key`'s keys.

    ``bias``: ``(B|1, H|1, Lq, Lk)`` float or None; ``keep``: bool ``(B|1, 1, Lq, Lk)`` or None;
    ``shape``: ``(B, H, Lq, Lk)``.
    """
    B, H, Lq, Lk = shape
    b = torch.zeros(1, 1, Lq, Lk, dtype=torch.float32, device=sinks.device) if bias is None else bias.float()
    if keep is not None:
        b = b.masked_fill(~keep, float("-inf"))
    b = b.expand(b.shape[0], H, Lq, Lk)
    col = sinks.float().view(1, H, 1, 1).expand(b.shape[0], H, Lq, 1)
    return torch.cat((b, col), -1)


def sink_mods(score_mod, mask_mod, sinks: Tensor, k_len: int):
    """FlexAttention ``score_mod``/``mask_mod`` for keys ``0 .. Lk`` where key ``Lk`` is the sink key."""

    def score(s, b, h, q_idx, kv_idx):
        inner = s if score_mod is None else score_mod(s, b, h, q_idx, kv_idx.clamp(max=k_len - 1))
        return torch.where(kv_idx == k_len, sinks[h].to(s.dtype), inner)

    def mask(b, h, q_idx, kv_idx):
        inner = mask_mod(b, h, q_idx, kv_idx.clamp(max=k_len - 1))
        return inner | (kv_idx == k_len)

    return score, None if mask_mod is None else mask
