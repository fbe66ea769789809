"""Transcriptions of the reference attentions of ReRoPE / Leaky ReRoPE (bojone/rerope) and
Self-Extend (datamllab/LongLM), written from the official patches' forward passes with HF
Llama's rotary functions, for ``q, k, v`` ``(B, H, L, Dh)`` already projected.

Each function follows its patch step by step (log-n query scaling, the two rotated copies,
the selection mask, causal mask, float32 softmax); ``*_decode`` is the patch's separate
``q_len == 1`` path, which rotates the keys by minus the (clipped or grouped) distance and
leaves the query unrotated.
"""

from __future__ import annotations

import math

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, rotate_half


def llama_rotary(heads: int, head_dim: int, theta: float = 10000.0, factor: float | None = None):
    params = {"rope_type": "default", "rope_theta": theta}
    if factor is not None:  # LlamaLinearScalingRotaryEmbedding of the 4.31 patch
        params = {"rope_type": "linear", "rope_theta": theta, "factor": float(factor)}
    cfg = LlamaConfig(
        hidden_size=heads * head_dim, num_attention_heads=heads, head_dim=head_dim, rope_parameters=params
    )
    return LlamaRotaryEmbedding(cfg)


def _apply(rotary, x, position_ids, sign: float = 1.0):
    """HF ``apply_rotary_pos_emb`` for one tensor; ``position_ids`` ``(B, L)`` (may be float)."""
    cos, sin = rotary(x, position_ids)  # (B, L, Dh)
    cos, sin = cos.unsqueeze(1), sign * sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def _logn(q, position_ids, base):
    if base is None:
        return q
    return q * ((position_ids + 1)[:, None, :, None].double().log() / math.log(base)).clip(1).float()


def _softmax_out(weights, v, causal_from: int = 0):
    Lq, Lk = weights.shape[-2:]
    i = torch.arange(Lq)[:, None] + causal_from
    j = torch.arange(Lk)[None, :]
    weights = weights + torch.where(j <= i, 0.0, torch.finfo(weights.dtype).min)
    return torch.softmax(weights.float(), dim=-1) @ v


def rerope_prefill(q, k, v, pos, *, window, training_length, rotary):
    q = _logn(q, pos, training_length)
    q1, k1 = _apply(rotary, q, pos), _apply(rotary, k, pos)
    q2 = _apply(rotary, q, pos * 0 + window)
    s1 = q1 @ k1.transpose(2, 3) / math.sqrt(q.shape[-1])
    s2 = q2 @ k.transpose(2, 3) / math.sqrt(q.shape[-1])
    rect = (pos[:, :, None] - pos[:, None]).abs() < window
    return _softmax_out(torch.where(rect[:, None], s1, s2), v)


def rerope_decode(q, k, v, pos, *, window, training_length, rotary):
    """``q`` ``(B, H, 1, Dh)`` at ``pos[:, -1]``; ``k, v`` every key so far at ``pos``."""
    q = _logn(q, pos[:, -1:], training_length)
    rel = (pos[:, -1:] - pos).clip(max=window)
    kr = _apply(rotary, k, rel, sign=-1.0)
    s = q @ kr.transpose(2, 3) / math.sqrt(q.shape[-1])
    return torch.softmax(s.float(), dim=-1) @ v


def leaky_rerope_prefill(q, k, v, pos, *, window, factor, training_length, rotary, rotary_scaled):
    q = _logn(q, pos, training_length)
    offset = window * (factor - 1)
    q1, k1 = _apply(rotary, q, pos), _apply(rotary, k, pos)
    q2 = _apply(rotary_scaled, q, pos + offset)
    k2 = _apply(rotary_scaled, k, pos)
    s1 = q1 @ k1.transpose(2, 3) / math.sqrt(q.shape[-1])
    s2 = q2 @ k2.transpose(2, 3) / math.sqrt(q.shape[-1])
    rect = (pos[:, :, None] - pos[:, None]).abs() < window
    return _softmax_out(torch.where(rect[:, None], s1, s2), v)


def leaky_rerope_decode(q, k, v, pos, *, window, factor, training_length, rotary, rotary_scaled):
    """The patch's table ``cat(cos[:w], cos2[w + offset:])`` indexed by the distance ``d``."""
    q = _logn(q, pos[:, -1:], training_length)
    offset = window * (factor - 1)
    d = pos[:, -1:] - pos
    near = _apply(rotary, k, d, sign=-1.0)
    far = _apply(rotary_scaled, k, d + offset, sign=-1.0)
    kr = torch.where((d < window)[:, None, :, None], near, far)
    s = q @ kr.transpose(2, 3) / math.sqrt(q.shape[-1])
    return torch.softmax(s.float(), dim=-1) @ v


def self_extend_prefill(q, k, v, pos, *, group_size, window, scale_base, rotary):
    """LongLM ``self_extend_forward`` (non-flash), ``q_len == kv_seq_len``."""
    q = _logn(q, pos, scale_base)
    L = q.shape[2]
    nq, nk = _apply(rotary, q, pos), _apply(rotary, k, pos)
    re = 0 if pos.max() < window else window
    gq_pos = pos // group_size + re - re / group_size
    gq, gk = _apply(rotary, q, gq_pos), _apply(rotary, k, pos // group_size)
    sn = nq @ nk.transpose(2, 3) / math.sqrt(q.shape[-1])
    sg = gq @ gk.transpose(2, 3) / math.sqrt(q.shape[-1])
    neighbor = torch.tril(torch.ones(L, L))
    if L - window > 0:
        neighbor[window:, :-window] -= torch.tril(torch.ones(L - window, L - window))
    return _softmax_out(torch.where(neighbor.bool(), sn, sg), v)


def self_extend_decode(q, k, v, q_position, *, group_size, window, scale_base, rotary):
    """The ``q_len == 1`` path: keys at ``arange(kv_seq_len)``, neighbours = the last ``window`` keys."""
    q = _logn(q, q_position, scale_base)
    Lk = k.shape[2]
    key_pos = torch.arange(Lk).view(1, Lk)
    nq, nk = _apply(rotary, q, q_position), _apply(rotary, k, key_pos)
    re = 0 if q_position.max() < window else window
    gq, gk = (
        _apply(rotary, q, q_position // group_size + re - re / group_size),
        _apply(rotary, k, key_pos // group_size),
    )
    sn = nq @ nk.transpose(2, 3) / math.sqrt(q.shape[-1])
    sg = gq @ gk.transpose(2, 3) / math.sqrt(q.shape[-1])
    neighbor = torch.zeros(1, Lk, dtype=torch.bool)
    neighbor[:, -window:] = True
    return torch.softmax(torch.where(neighbor, sn, sg).float(), dim=-1) @ v
