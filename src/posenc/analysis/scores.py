"""The attention scores of a layer, split by the stage where position entered.

Only the stage interface of the encodings is called (``embed``, ``rotate``,
``score_terms``, ``bias``), so an encoding that registers is analysed without any change
here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..base import Stage
from ..model import TransformerLM
from .stats import distances

__all__ = ["attention_probs", "attention_scores", "causal_mask", "layer_inputs", "score_parts"]


def layer_inputs(model: TransformerLM, tokens: Tensor, pos: Tensor) -> list[Tensor]:
    """The input of every block (before ``ln1``), ``(B, L, D)`` each, from a plain forward."""
    x = model.embed(tokens, pos)
    outs = []
    for block in model.blocks:
        outs.append(x)
        x = block(x, pos, None)
    return outs


def causal_mask(model: TransformerLM, L: int, device=None) -> Tensor | None:
    """``(L, L)`` bool, True = visible; None for a bidirectional model."""
    if not model.causal:
        return None
    return (distances(L) >= 0).to(device)


def attention_scores(model: TransformerLM, tokens: Tensor, pos: Tensor | None = None) -> list[Tensor]:
    """Pre-mask attention logits of every layer, ``(B, H, L, L)`` each, float32.

    The same sum every backend computes: ``scale·(q̃·k̃ + score_terms) + bias``.
    """
    B, L = tokens.shape
    pos = torch.arange(L).unsqueeze(0) if pos is None else pos.reshape(1, L) if pos.dim() == 1 else pos
    out = []
    for block, x in zip(model.blocks, layer_inputs(model, tokens, pos), strict=True):
        parts = score_parts(block.attn, block.ln1(x), pos)
        out.append(sum(parts.values()))
    return out


def attention_probs(model: TransformerLM, tokens: Tensor, pos: Tensor | None = None) -> list[Tensor]:
    """Attention probabilities of every layer, ``(B, H, L, L)`` each."""
    L = tokens.shape[1]
    mask = causal_mask(model, L)
    probs = []
    for s in attention_scores(model, tokens, pos):
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        probs.append(torch.softmax(s, dim=-1))
    return probs


def _project(attn, h: Tensor) -> tuple[Tensor, Tensor]:
    B, L, _ = h.shape
    q = attn.q_proj(h).view(B, L, attn.heads, attn.head_dim).transpose(1, 2)  # (B, H, L, Dh)
    k = attn.k_proj(h).view(B, L, attn.heads, attn.head_dim).transpose(1, 2)  # (B, H, L, Dh)
    return q, k


def score_parts(attn, h: Tensor, pos: Tensor) -> dict[str, Tensor]:
    """One layer's logits split by stage: ``qk`` (``scale·q̃·k̃``), ``terms``, ``bias``.

    ``h``: the attention input ``(B, L, D)`` (after ``ln1``); ``pos``: ``(1|B, L)``.
    The parts sum to the pre-mask logits; each is ``(B, H, L, L)`` float32.
    """
    enc = attn.encoding
    if attn.apply_input_stage and enc.stages & Stage.INPUT:
        h = enc.embed(h, pos)
    q, k = _project(attn, h)
    q, k = enc.rotate(q, k, pos, pos)
    parts = {"qk": (q @ k.transpose(-1, -2)).float() * enc.scale}  # (B, H, L, L)
    if enc.stages & Stage.TERMS:
        parts["terms"] = enc.score_terms(q, k, pos, pos).float() * enc.scale
    if enc.stages & Stage.BIAS:
        parts["bias"] = enc.bias(pos, pos).float().expand_as(parts["qk"])
    return parts
