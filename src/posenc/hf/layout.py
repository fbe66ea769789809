"""RoPE checkpoint layouts: Meta's interleaved pairs vs Hugging Face's split halves.

Meta's original Llama code rotates pairs ``(x_{2k}, x_{2k+1})`` (complex multiplication);
HF Llama rotates ``(x_k, x_{k+Dh/2})`` (``rotate_half``). The two give the same scores when
the rows of ``W_Q`` and ``W_K`` (and their biases) are permuted within each head,
``perm = [0, 2, 4, …, 1, 3, 5, …]``: what HF's ``convert_llama_weights_to_hf.py`` does.
:func:`rope_layout` applies it (or its inverse) to a Llama-family state dict, using
:func:`posenc.encodings.rotary.permute_for_layout`.
"""

from __future__ import annotations

import re

from torch import Tensor

from ..encodings.rope_scaling import rotary_width
from ..encodings.rotary import permute_for_layout
from .rope_config import rope_options_for

__all__ = ["rope_layout"]

_QK = re.compile(r"(?:^|\.)(q_proj|k_proj)\.(weight|bias)$")


def rope_layout(state_dict: dict[str, Tensor], config, *, to: str) -> dict[str, Tensor]:
    """A copy of ``state_dict`` with every ``q_proj``/``k_proj`` weight and bias permuted.

    Args:
        state_dict: HF Llama-family names (``…self_attn.q_proj.weight``); other entries
            are passed through (the same tensors).
        config: the model config: ``num_attention_heads``, ``num_key_value_heads``
            (``k_proj`` has that many heads), ``head_dim``, and ``partial_rotary_factor``
            (in ``rope_parameters`` or on the config) when only part of each head rotates.
        to: ``"half"`` (Meta's interleaved checkpoint -> HF) or ``"interleaved"`` (HF -> Meta).

    Raises:
        ValueError: ``to`` not one of the two, or a projection whose size does not match
            the config's heads.
    """
    if to not in ("half", "interleaved"):
        raise ValueError(f"to must be 'half' (Meta -> HF) or 'interleaved' (HF -> Meta), got {to!r}")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = rope_options_for(config)  # Llama family: flat rope_parameters; raises on a bad one
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    rotary_dim = rotary_width(head_dim, factor, rope.get("rope_scaling"))  # Dh for proportional
    out = {}
    for key, value in state_dict.items():
        m = _QK.search(key)
        if m is None:
            out[key] = value
            continue
        h = heads if m.group(1) == "q_proj" else kv_heads
        out[key] = permute_for_layout(value, heads=h, head_dim=head_dim, to=to, rotary_dim=rotary_dim)
    return out
