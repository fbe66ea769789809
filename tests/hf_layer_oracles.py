"""Oracles for the per-layer designs of 2025 LLMs: HF attention layers built with tiny random configs.

Each builder returns an :class:`HFLayer`: the HF attention module of one layer index of a
tiny random config, and ``run(x)`` that calls it the way its model does (HF's own mask
function for that layer type, HF's own rotary table for that layer type, eager attention).
The parity tests copy the module's projection weights into a posenc layer built from the
matching preset and compare outputs element-wise.

Conventions read from ``transformers`` 5.23 (``models/{llama4,gemma3,gpt_oss}``,
``masking_utils.py``):

* Llama 4 (``Llama4TextAttention``): layer ``i`` skips RoPE iff ``(i + 1) % no_rope_layer_interval == 0``
  (``no_rope_layers[i] == 0``; 1 means *use* RoPE). RoPE layers attend within chunks
  (``layer_types[i] == "chunked_attention"``: ``kv // C == q // C`` and ``kv <= q``), NoPE
  layers attend to everything causal. RoPE is Meta's interleaved-pairs layout (complex
  multiply on ``(x_{2k}, x_{2k+1})``). NoPE layers scale queries by
  ``1 + attn_scale · log1p(floor((p + 1) / floor_scale))`` with ``p`` the query's index
  (``arange(L) + past_seen_tokens``), before the ``Dh^-1/2`` score scale. The optional
  ``qk_norm`` (an L2 norm of q and k on RoPE layers) is content normalisation, not position:
  the oracle turns it off (``use_qk_norm=False``).
* Gemma 3 (``Gemma3Attention``): layer ``i`` is ``"sliding_attention"`` iff
  ``(i + 1) % 6 != 0`` (five local layers, then one global). Local layers use
  ``rope_local_base_freq`` (10 000) and a sliding window ``kv > q - W`` (``W`` keys, the query
  included); global layers ``rope_theta`` (1 000 000) and full causal attention. Split-halves
  RoPE. ``q_norm``/``k_norm`` (RMSNorm of q and k, before RoPE) are content normalisation:
  the oracle replaces them with identities; the score scale is ``query_pre_attn_scalar^-1/2``,
  set to ``Dh`` here.
* gpt-oss (``GptOssAttention``): even layers ``"sliding_attention"`` (window 128), odd layers
  full; YaRN RoPE (split halves); one learned sink logit per head: ``softmax`` over
  ``[scores, sink_h]``, the sink column dropped before ``@ v``. q/k/v/o carry biases.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class HFLayer:
    """One HF attention layer and the call its model makes."""

    module: nn.Module
    layer_type: str  # "full_attention" | "chunked_attention" | "sliding_attention"
    uses_rope: bool
    run: Callable[[torch.Tensor], torch.Tensor]  # x (B, L, D) -> (B, L, D)


def _randomize(m: nn.Module, std: float = 0.3) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, std)


def llama4_layer(
    layer_idx: int,
    *,
    dim: int = 32,
    heads: int = 4,
    head_dim: int = 8,
    depth: int = 4,
    chunk: int = 5,
    theta: float = 10000.0,
    floor_scale: int = 4,
    attn_scale: float = 0.1,
    temperature_tuning: bool = True,
) -> HFLayer:
    """Layer ``layer_idx`` of a tiny random Llama 4 text model (``Llama4TextAttention``)."""
    from transformers import Llama4TextConfig
    from transformers.masking_utils import create_causal_mask, create_chunked_causal_mask
    from transformers.models.llama4.modeling_llama4 import Llama4TextAttention, Llama4TextRotaryEmbedding

    cfg = Llama4TextConfig(
        hidden_size=dim,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        num_hidden_layers=depth,
        intermediate_size=dim,
        intermediate_size_mlp=dim,
        vocab_size=64,
        attention_chunk_size=chunk,
        attn_temperature_tuning=temperature_tuning,
        floor_scale=floor_scale,
        attn_scale=attn_scale,
        use_qk_norm=False,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
    )
    cfg._attn_implementation = "eager"
    att = Llama4TextAttention(cfg, layer_idx).eval()
    _randomize(att)
    rotary = Llama4TextRotaryEmbedding(cfg)
    kind = cfg.layer_types[layer_idx]
    make_mask = create_chunked_causal_mask if kind == "chunked_attention" else create_causal_mask

    def run(x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1]).unsqueeze(0)
        mask = make_mask(config=cfg, inputs_embeds=x, attention_mask=None, past_key_values=None, position_ids=pos)
        return att(x, rotary(x, pos), mask)[0]

    return HFLayer(att, kind, bool(cfg.no_rope_layers[layer_idx]), run)


def gemma3_layer(
    layer_idx: int,
    *,
    dim: int = 32,
    heads: int = 4,
    head_dim: int = 8,
    depth: int = 6,
    window: int = 4,
    local_theta: float = 10000.0,
    global_theta: float = 1000000.0,
) -> HFLayer:
    """Layer ``layer_idx`` of a tiny random Gemma 3 text model (``Gemma3Attention``)."""
    from transformers import Gemma3TextConfig
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention, Gemma3RotaryEmbedding

    cfg = Gemma3TextConfig(
        hidden_size=dim,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        num_hidden_layers=depth,
        intermediate_size=dim,
        vocab_size=64,
        sliding_window=window,
        query_pre_attn_scalar=head_dim,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
            "full_attention": {"rope_type": "default", "rope_theta": global_theta},
        },
    )
    cfg._attn_implementation = "eager"
    att = Gemma3Attention(cfg, layer_idx).eval()
    att.q_norm, att.k_norm = nn.Identity(), nn.Identity()  # content normalisation, not position
    _randomize(att)
    rotary = Gemma3RotaryEmbedding(cfg)
    kind = cfg.layer_types[layer_idx]
    make_mask = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask

    def run(x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1]).unsqueeze(0)
        mask = make_mask(config=cfg, inputs_embeds=x, attention_mask=None, past_key_values=None, position_ids=pos)
        return att(x, rotary(x, pos, kind), mask)[0]

    return HFLayer(att, kind, True, run)


def gpt_oss_layer(
    layer_idx: int,
    *,
    dim: int = 32,
    heads: int = 4,
    head_dim: int = 8,
    depth: int = 2,
    window: int = 4,
    rope_parameters: dict | None = None,
) -> HFLayer:
    """Layer ``layer_idx`` of a tiny random gpt-oss model (``GptOssAttention``, with sinks)."""
    from transformers import GptOssConfig
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

    rope_parameters = rope_parameters or {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 16,
    }
    cfg = GptOssConfig(
        hidden_size=dim,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        num_hidden_layers=depth,
        intermediate_size=dim,
        num_local_experts=2,
        num_experts_per_tok=1,
        vocab_size=64,
        sliding_window=window,
        rope_parameters=dict(rope_parameters),
        max_position_embeddings=512,
    )
    cfg._attn_implementation = "eager"
    att = GptOssAttention(cfg, layer_idx).eval()
    _randomize(att)  # sinks included (HF leaves them uninitialised standalone)
    rotary = GptOssRotaryEmbedding(cfg)
    kind = cfg.layer_types[layer_idx]
    make_mask = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask

    def run(x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1]).unsqueeze(0)
        mask = make_mask(config=cfg, inputs_embeds=x, attention_mask=None, past_key_values=None, position_ids=pos)
        return att(x, rotary(x, pos), mask)[0]

    return HFLayer(att, kind, True, run)


def copy_projections(hf: nn.Module, attn: nn.Module) -> None:
    """Copy HF ``q/k/v/o_proj`` (weights and biases) into a posenc :class:`~posenc.Attention`."""
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            src, dst = getattr(hf, name), getattr(attn, name)
            dst.weight.copy_(src.weight)
            if src.bias is not None:
                dst.bias.copy_(src.bias)
            elif dst.bias is not None:
                dst.bias.zero_()


# ------------------------------------------------------------------ formula transcriptions
# Written from the sources cited above, for checks at the level of one formula (no projections).


def sink_softmax_attention(q, k, v, sinks, mask, scale):
    """gpt-oss eager attention: ``softmax([q·kᵀ·scale + mask, sink_h])[..., :-1] @ v``.

    ``q, k, v``: ``(B, H, L, Dh)``; ``sinks``: ``(H,)``; ``mask``: additive ``(Lq, Lk)`` or None.
    """
    s = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        s = s + mask
    sink = sinks.view(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
    p = torch.softmax(torch.cat((s, sink), -1), -1)[..., :-1]
    return p @ v


def llama4_query_temperature(pos: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """Llama 4's NoPE-layer query scale ``1 + attn_scale·log(1 + floor((p + 1)/floor_scale))``."""
    return torch.log1p(torch.floor((pos.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def streaming_llm_positions(cache_len: int) -> tuple[torch.Tensor, int]:
    """StreamingLLM's position shift (``pos_shift/modify_llama.py``): cached keys sit at
    ``arange(n)`` inside the cache (re-rotated from raw keys each step), the new query at
    ``n`` (= HF's ``past_key_values_length``, the trimmed cache length)."""
    return torch.arange(cache_len), cache_len
