"""The layers being timed: one posenc attention layer per encoding, and the originals.

Every case is one multi-head self-attention layer with q/k/v/o projections of width
``D = H·Dh`` on ``x`` of shape ``(B, L, D)``, computing the position encoding as part of
the call (tables, buckets, angles, masks), exactly as each implementation does in its
own model. A case is built by a factory ``make(L) -> (module, fn)`` with ``fn(x) -> out``.

The baseline is posenc's layer with ``nope`` on the ``sdpa`` backend: plain
``scaled_dot_product_attention`` with no position, in the same masking mode.

References (each only where its package is installed and, for posenc's side, where the
encoding is registered):

=============  =======================================================================
encoding       reference
=============  =======================================================================
``t5``         HF ``T5Attention`` (eager, its only implementation), decoder mode with
               an additive causal mask; x-transformers ``Attention`` +
               ``RelativePositionBias``
``alibi``      x-transformers ``Attention`` + ``AlibiPositionalBias``
``rope``       HF ``LlamaAttention`` (``sdpa``) + ``LlamaRotaryEmbedding``;
               x-transformers ``Attention`` + ``RotaryEmbedding``
``xpos``       x-transformers ``Attention`` + ``RotaryEmbedding(use_xpos=True)``
``deberta``    HF DeBERTa-v2 ``DisentangledSelfAttention`` (c2p + p2c, shared keys,
               256 log buckets), bidirectional as in DeBERTa
=============  =======================================================================

x-transformers runs with ``flash=True`` (its SDPA path, the fastest it has), except
with ``RelativePositionBias``, which it only allows on its einsum path.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..layer.attention import Attention
from ..registry import available

__all__ = ["Case", "posenc_case", "baseline_case", "reference_cases", "resolved_backend", "REFERENCE_ENCODINGS"]

Fn = Callable[[Tensor], Tensor]


@dataclass
class Case:
    """One layer to time: ``make(L)`` returns ``(module, fn)``."""

    label: str  # row label, e.g. "posenc:t5", "hf:T5Attention"
    encoding: str  # the encoding it computes ("none" for the baseline)
    impl: str  # "posenc", "hf", "x-transformers"
    causal: bool
    make: Callable[[int], tuple[nn.Module, Fn]]
    backend: str = ""
    options: dict = field(default_factory=dict)


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# --------------------------------------------------------------------------- posenc
def posenc_case(
    encoding: str,
    *,
    heads: int,
    head_dim: int,
    causal: bool,
    max_len: int,
    backend: str = "auto",
    device: torch.device,
    dtype: torch.dtype,
    chunk_size: int = 1024,
    **options,
) -> Case:
    """posenc's :class:`~posenc.Attention` with ``encoding`` on ``backend``."""

    def make(L: int):
        m = Attention(
            heads * head_dim,
            heads,
            encoding,
            head_dim=head_dim,
            causal=causal,
            max_len=max_len,
            backend=backend,
            chunk_size=chunk_size,
            **options,
        ).to(device=device, dtype=dtype)
        return m, m

    label = f"posenc:{encoding}" + (f"[{backend}]" if backend != "auto" else "")
    label += f"[W={options['window']}]" if options.get("window") else ""
    return Case(label, encoding, "posenc", causal, make, backend=backend, options=dict(options))


def baseline_case(*, heads: int, head_dim: int, causal: bool, device, dtype) -> Case:
    """Plain SDPA with no position: posenc ``nope`` on the ``sdpa`` backend."""
    c = posenc_case(
        "nope", heads=heads, head_dim=head_dim, causal=causal, max_len=1, backend="sdpa", device=device, dtype=dtype
    )
    c.label, c.encoding = "sdpa (no position)", "none"
    return c


# --------------------------------------------------------------------------- HF
def _hf_t5(heads, head_dim, device, dtype) -> Case:
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    def make(L):
        cfg = T5Config(
            d_model=heads * head_dim,
            d_kv=head_dim,
            num_heads=heads,
            relative_attention_num_buckets=32,
            relative_attention_max_distance=128,
            dropout_rate=0.0,
            is_decoder=True,
        )
        cfg._attn_implementation = "eager"
        m = T5Attention(cfg, has_relative_attention_bias=True, layer_idx=0).to(device=device, dtype=dtype)

        def fn(x):
            n = x.shape[1]
            keep = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
            mask = torch.zeros(1, 1, n, n, dtype=x.dtype, device=x.device).masked_fill(~keep, torch.finfo(x.dtype).min)
            return m(x, mask=mask)[0]

        return m, fn

    return Case("hf:T5Attention", "t5", "hf", True, make)


def _hf_llama_rope(heads, head_dim, device, dtype) -> Case:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    def make(L):
        cfg = LlamaConfig(
            hidden_size=heads * head_dim,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=head_dim,
            max_position_embeddings=max(L, 2048),
            attention_bias=False,
        )
        cfg._attn_implementation = "sdpa"
        attn = LlamaAttention(cfg, layer_idx=0)
        rot = LlamaRotaryEmbedding(cfg)
        m = nn.ModuleDict({"attn": attn, "rot": rot}).to(device=device, dtype=dtype)

        def fn(x):
            pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            cos_sin = rot(x, pos)
            return attn(x, position_embeddings=cos_sin, attention_mask=None)[0]  # is_causal inside

        return m, fn

    return Case("hf:LlamaAttention+rotary", "rope", "hf", True, make)


def _hf_deberta(heads, head_dim, device, dtype) -> Case:
    from transformers import DebertaV2Config
    from transformers.models.deberta_v2.modeling_deberta_v2 import DisentangledSelfAttention, build_relative_position

    def make(L):
        D = heads * head_dim
        cfg = DebertaV2Config(
            hidden_size=D,
            num_attention_heads=heads,
            intermediate_size=4 * D,
            relative_attention=True,
            position_buckets=256,
            max_relative_positions=512,
            max_position_embeddings=512,
            pos_att_type=["p2c", "c2p"],
            share_att_key=True,
            norm_rel_ebd="layer_norm",
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        cfg._attn_implementation = "eager"
        attn = DisentangledSelfAttention(cfg)
        rel = nn.Embedding(2 * 256, D)
        ln = nn.LayerNorm(D)
        m = nn.ModuleDict({"attn": attn, "rel": rel, "ln": ln}).to(device=device, dtype=dtype)

        def fn(x):
            n = x.shape[1]
            mask = torch.ones(x.shape[0], 1, n, n, dtype=torch.long, device=x.device)
            rp = build_relative_position(x, x, bucket_size=256, max_position=512)
            out = attn(x, mask, relative_pos=rp, rel_embeddings=ln(rel.weight))
            return out[0] if isinstance(out, tuple) else out

        return m, fn

    return Case("hf:DeBERTa-v2 DisentangledSelfAttention", "deberta", "hf", False, make)


# --------------------------------------------------------------------------- x-transformers
def _xt(kind: str, heads, head_dim, device, dtype) -> Case:
    from x_transformers.x_transformers import (
        AlibiPositionalBias,
        RelativePositionBias,
        RotaryEmbedding,
    )
    from x_transformers.x_transformers import Attention as XAttention

    def make(L):
        D = heads * head_dim
        # x-transformers refuses flash (SDPA) with its T5 bias: that one runs its einsum path
        attn = XAttention(D, dim_head=head_dim, heads=heads, causal=True, flash=(kind != "t5"))
        mods = {"attn": attn}
        if kind == "t5":
            mods["pos"] = RelativePositionBias(scale=head_dim**0.5, causal=True, heads=heads)
        elif kind == "alibi":
            mods["pos"] = AlibiPositionalBias(heads=heads, total_heads=heads)
        else:
            mods["pos"] = RotaryEmbedding(head_dim, use_xpos=(kind == "xpos"))
        m = nn.ModuleDict(mods).to(device=device, dtype=dtype)
        pos_mod = mods["pos"]

        def fn(x):
            if kind in ("t5", "alibi"):
                return attn(x, rel_pos=pos_mod)
            t = torch.arange(x.shape[1], device=x.device)
            return attn(x, rotary_pos_emb=pos_mod(t))

        return m, fn

    names = {
        "t5": "RelativePositionBias",
        "alibi": "AlibiPositionalBias",
        "rope": "RotaryEmbedding",
        "xpos": "RotaryEmbedding(xpos)",
    }
    return Case(f"x-transformers:{names[kind]}", kind, "x-transformers", True, make)


REFERENCE_ENCODINGS = ("t5", "alibi", "rope", "xpos", "deberta")


def reference_cases(encodings: list[str], *, heads: int, head_dim: int, device, dtype) -> list[Case]:
    """Reference layers for the selected encodings that are registered and installed."""
    reg = set(available())
    want = [e for e in encodings if e in reg]
    out: list[Case] = []
    hf, xt = _has("transformers"), _has("x_transformers")
    for e in want:
        if e == "t5":
            if hf:
                out.append(_hf_t5(heads, head_dim, device, dtype))
            if xt:
                out.append(_xt("t5", heads, head_dim, device, dtype))
        elif e == "alibi" and xt:
            out.append(_xt("alibi", heads, head_dim, device, dtype))
        elif e == "rope":
            if hf:
                out.append(_hf_llama_rope(heads, head_dim, device, dtype))
            if xt:
                out.append(_xt("rope", heads, head_dim, device, dtype))
        elif e == "xpos" and xt:
            out.append(_xt("xpos", heads, head_dim, device, dtype))
        elif e == "deberta" and hf:
            out.append(_hf_deberta(heads, head_dim, device, dtype))
    return out


def resolved_backend(case: Case, module, device: torch.device, L: int) -> str:
    """The backend a posenc case actually runs at length ``L`` (``auto`` resolved by the layer itself)."""
    if not isinstance(module, Attention):
        return ""
    return module.resolve_backend(case.backend, device.type, L, L)
