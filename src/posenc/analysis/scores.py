"""The attention scores of a layer, split by the stage where position entered.

The block inputs come from the model's own forward (hooks); then only the public
pipeline is called (``Block.attention_input``, ``Attention.project``, :func:`posenc.scores`),
so an encoding that registers is analysed without any change here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..attend.scores import scores
from ..model import TransformerLM
from .stats import distances

__all__ = ["attention_probs", "attention_scores", "causal_mask", "layer_inputs", "score_parts"]


def layer_inputs(model: TransformerLM, tokens: Tensor, pos: Tensor) -> list[Tensor]:
    """The input of every block (before ``ln1``), ``(B, L, D)`` each, read from the model's own
    forward (a forward pre-hook per block), so input stages the model runs before a later
    block and per-layer windows are what they are in the forward.

    Raises ``ValueError`` for positions past ``max_len`` of an encoding that does not extrapolate.
    """
    outs: list[Tensor | None] = [None] * len(model.blocks)

    def keep(i):
        def hook(_module, args):
            outs[i] = args[0]

        return hook

    handles = [block.register_forward_pre_hook(keep(i)) for i, block in enumerate(model.blocks)]
    try:
        model(tokens, pos)
    finally:
        for h in handles:
            h.remove()
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
        parts = score_parts(block, x, pos)
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


def score_parts(block, x: Tensor, pos: Tensor) -> dict[str, Tensor]:
    """One layer's logits split by stage: ``qk`` (``scale·q̃·k̃``), ``terms``, ``bias``.

    ``x``: the block input ``(B, L, D)`` (before ``ln1``); ``pos``: ``(1|B, L)``.
    The parts sum to the pre-mask logits; each is ``(B, H, L, L)`` float32
    (:func:`posenc.scores` with ``parts=True``, the sum every backend computes).
    """
    attn = block.attn
    call = attn.make_call(x, pos)
    p = attn.project(block.attention_input(x, call), call)
    return scores(attn.encoding, p.q, p.k, p.q_pos, p.k_pos, parts=True, ctx=p.ctx)
