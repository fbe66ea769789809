"""Inference-time context extension of RoPE by changing the attention pattern: ReRoPE,
Leaky ReRoPE, Self-Extend and Dual Chunk Attention (the ``rope_extension`` option of
``rope-extension``).

A model trained at length ``L`` never saw relative distances ``>= L``. These methods keep
every distance the model sees inside the trained range by giving each (query, key) pair
one of two or three score maps, chosen by the positions of the pair; the first three by the
distance ``d = i - j``:

* ``rerope`` — Su, "ReRoPE: Rectified Rotary Position Embeddings", 2023 (kexue.fm/archives/9708;
  bojone/rerope ``rerope_patch.py``): ``d < w``: RoPE at distance ``d``; ``d >= w``: RoPE at
  distance ``w`` (the query rotated to position ``w``, the key not rotated).
* ``leaky-rerope`` — the same post (``leaky_rerope_patch.py``): beyond ``w`` the distance
  grows with slope ``1/k``: ``w + (d - w)/k`` (both sides rotated with frequencies ``θ/k``,
  the query moved to ``i + w(k - 1)``).
* ``self-extend`` — Jin et al., "LLM Maybe LongLM: Self-Extend LLM Context Window Without
  Tuning", ICML 2024 (datamllab/LongLM ``self_extend_patch/Llama.py``): ``d < W`` (the
  neighbour window): RoPE at distance ``d``; beyond, grouped positions: keys at
  ``floor(j/G)``, queries at ``floor(i/G) + W - W/G``, the shift that makes the two maps meet
  at ``d = W``.

and Dual Chunk Attention by the chunks of the two positions:

* ``dca`` — An et al., "Training-Free Long-Context Scaling of Large Language Models", ICML
  2024 (HKUNLP/ChunkLlama ``chunkllama_attn_replace.py``; vLLM
  ``model_executor/layers/rotary_embedding/dual_chunk_rope.py``, ``DualChunkRotaryEmbedding``,
  and ``attention/backends/dual_chunk_flash_attn.py``; Qwen2.5-1M's
  ``dual_chunk_attention_config``). Positions fall into chunks of ``n = chunk_size -
  local_size`` tokens; every key sits at ``j mod n``. A query at ``i`` reads keys of its own
  chunk from ``i mod n`` (intra-chunk: exact distances), keys of the chunk before from
  ``min(i mod n + n, chunk_size)`` (successive-chunk: exact for the first ``local_size``
  queries of a chunk, clipped after) and keys of every earlier chunk from the constant
  ``min(2n - 1, chunk_size)`` (inter-chunk); the three maps are merged in one softmax, as
  ChunkLlama's log-sum-exp merge of its three flash-attention calls is. No distance exceeds
  ``chunk_size``. (vLLM's optional length scaling, ``original_max_position_embeddings``,
  multiplies keys by a factor of the whole sequence's length, not of positions; it is not
  part of ChunkLlama and not implemented.)

ReRoPE's and Self-Extend's reference patches optionally multiply each query by ``max(1, log(i + 1)/log(scale_base))``
(log-n scaling; bojone's ReRoPE applies it with ``scale_base`` = the training length,
LongLM's is off by default): the ``scale_base`` key.

The maps are computed from *unrotated* queries and keys, so ``rope-extension`` has the
``SCORES`` stage instead of ``QK``: it rotates nothing itself (the KV cache holds raw keys
and their positions, as both references' caches do) and it supplies the whole
``q·k`` term through :meth:`~posenc.PositionEncoding.qk_scores`, which every backend that
materialises scores (``chunked``, ``eager``) runs; the fused ones (``sdpa``, ``flex``,
``dense``) cannot. The same maps one by one, each with the pairs it holds (:func:`score_maps`),
run on the CPU's fused kernel over only their own keys (the ``maps`` backend,
:mod:`posenc.kernels.maps`): what their pairs cost, no ``L×L`` scores. Every pair's score depends on its two positions only, so cached decoding
equals the full forward exactly (bojone's decoding path rotates the raw cached keys by the
clipped distance; LongLM's by the grouped one; ChunkLlama's picks the three maps by the
cached keys' chunks: the same numbers). Causal (decoder) models
only, as in both references; one position per token (no ``axes``).

Checked against a transcription of each reference's attention (prefill and one-token
decoding) built on HF Llama's rotary functions; DCA against a float64 transcription of
vLLM's position tables and ChunkLlama's prefill and decoding paths.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..terms import ScoreMap

__all__ = ["EXTENSION_TYPES", "check_extension", "extended_qk_scores", "score_maps"]

EXTENSION_TYPES = ("rerope", "leaky-rerope", "self-extend", "dca")
_KEYS = {
    "rerope": {"window", "scale_base"},
    "leaky-rerope": {"window", "factor", "scale_base"},
    "self-extend": {"window", "group_size", "scale_base"},
    "dca": {"chunk_size", "local_size"},  # vLLM's dual_chunk_attention_config names
}
_REQUIRED = {
    "rerope": ("window",),
    "leaky-rerope": ("window", "factor"),
    "self-extend": ("window", "group_size"),
    "dca": ("chunk_size", "local_size"),
}


def check_extension(ext: dict | None, *, causal: bool, max_len: int | None) -> dict | None:
    """Validate ``rope_extension`` and return a normalised copy (``scale_base`` filled in).

    ``{"type": "rerope", "window": w}``, ``{"type": "leaky-rerope", "window": w, "factor": k}``,
    ``{"type": "self-extend", "window": W, "group_size": G}``, each optionally with
    ``"scale_base"`` (``None``: no log-n query scaling); ``{"type": "dca", "chunk_size": c,
    "local_size": l}`` with ``0 <= l < c`` (no log-n scaling, no ``scale_base`` key).
    """
    if ext is None:
        return None
    if not isinstance(ext, dict):
        raise TypeError(f"rope_extension must be a dict or None, got {type(ext).__name__}")
    e = dict(ext)
    kind = e.pop("type", None)
    if kind not in EXTENSION_TYPES:
        raise ValueError(f"rope_extension type must be one of {EXTENSION_TYPES}, got {kind!r}")
    unknown = sorted(set(e) - _KEYS[kind])
    if unknown:
        raise ValueError(f"unknown rope_extension key(s) {unknown} for type {kind!r}; valid: {sorted(_KEYS[kind])}")
    missing = [key for key in _REQUIRED[kind] if key not in e]
    if missing:
        raise ValueError(f"rope_extension of type {kind!r} needs {missing}")
    if not causal:
        raise ValueError(f"rope_extension {kind!r} is defined for causal (decoder) attention; build with causal=True")
    for key in ("window", "group_size", "chunk_size"):
        if key in e and (not isinstance(e[key], int) or isinstance(e[key], bool) or e[key] < 1):
            raise ValueError(f"rope_extension {key} must be a positive int, got {e[key]!r}")
    if kind == "leaky-rerope":
        f = e["factor"]
        if not isinstance(f, (int, float)) or isinstance(f, bool) or f <= 1:
            raise ValueError(f"leaky-rerope factor (the k of slope 1/k beyond the window) must be > 1, got {f!r}")
    if kind == "dca":
        c, loc = e["chunk_size"], e["local_size"]
        if not isinstance(loc, int) or isinstance(loc, bool) or not 0 <= loc < c:
            raise ValueError(
                f"rope_extension dca local_size must be an int in [0, chunk_size - 1 = {c - 1}], got {loc!r}"
            )
        return {**e, "type": kind}  # no log-n scaling in ChunkLlama or vLLM: no scale_base key
    # bojone's ReRoPE scales queries by log n with the training length; LongLM's default is off
    default_base = max_len if kind != "self-extend" else None
    base = e.get("scale_base", default_base)
    if base is not None and (not isinstance(base, (int, float)) or isinstance(base, bool) or base <= 1):
        raise ValueError(f"rope_extension scale_base must be a number > 1 or None (no log-n scaling), got {base!r}")
    e["scale_base"] = base
    e["type"] = kind
    return e


def _at(rope, x: Tensor, pos: Tensor, inv_freq: Tensor) -> Tensor:
    """``x`` ``(B, H, L, Dh)`` rotated to positions ``pos`` ``(B|1, L)`` (int or float)."""
    return rope._rotate_one(x, pos, rope._cos_sin(pos, inv_freq))


def extended_qk_scores(rope, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """The ``q·k`` term of ``rope`` under its ``rope_extension``: float32 ``(B, H, Lq, Lk)``.

    ``q``, ``k``: unrotated ``(B, H, Lq|Lk, Dh)``; ``q_pos``, ``k_pos``: ``(B|1, L)`` int64.
    """
    ext = rope.rope_extension
    if ext["type"] == "dca":
        return _dual_chunk_scores(rope, q.float(), k.float(), q_pos, k_pos)
    kind, w = ext["type"], ext["window"]
    inv = rope.inv_freq
    q = q.float()
    k = k.float()
    if ext["scale_base"] is not None:  # log-n: max(1, log(i + 1)/log(base)) per query
        gain = (torch.log(q_pos.double() + 1) / math.log(ext["scale_base"])).clamp(min=1).float()
        q = q * gain.unsqueeze(1).unsqueeze(-1)  # (B|1, 1, Lq, 1)
    near = _at(rope, q, q_pos, inv) @ _at(rope, k, k_pos, inv).transpose(-1, -2)  # RoPE at d = i - j
    if kind == "rerope":  # d >= w: the query at position w, the key at 0
        far = _at(rope, q, torch.full_like(q_pos, w), inv) @ k.transpose(-1, -2)
    elif kind == "leaky-rerope":  # d >= w: w + (d - w)/k, frequencies θ/k
        f = ext["factor"]
        far = _at(rope, q, q_pos + w * (f - 1), inv / f) @ _at(rope, k, k_pos, inv / f).transpose(-1, -2)
    else:  # self-extend: grouped positions, shifted to meet the neighbours at d = W
        g = ext["group_size"]
        gq = torch.div(q_pos, g, rounding_mode="floor").double() + (w - w / g)  # float when g ∤ W
        far = _at(rope, q, gq, inv) @ _at(rope, k, torch.div(k_pos, g, rounding_mode="floor"), inv).transpose(-1, -2)
    d = q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)  # (B|1, Lq, Lk)
    inside = (d.abs() < w) if kind != "self-extend" else (d < w)
    return torch.where(inside.unsqueeze(1), near, far)  # (B, H, Lq, Lk)


def score_maps(rope) -> tuple[ScoreMap, ...]:
    """The maps of :func:`extended_qk_scores` one by one, each with the pairs it holds (the ``maps``
    backend runs each through the fused kernel over only its own keys and merges them by their
    log-sum-exp): ReRoPE's, Leaky ReRoPE's and Self-Extend's near map ``d < w`` and far map
    ``d >= w``; DCA's intra-, successive- and inter-chunk maps (chunks ``0``, ``1``, ``>= 2`` apart).
    """
    ext, inv = rope.rope_extension, rope.inv_freq
    if ext["type"] == "dca":
        c = ext["chunk_size"]
        n = c - ext["local_size"]

        def key(k, p):  # every map reads the keys at j mod n
            return _at(rope, k, p % n, inv)

        return (
            ScoreMap(n, None, 0, lambda q, p: _at(rope, q, p % n, inv), key),
            ScoreMap(n, 1, 1, lambda q, p: _at(rope, q, (p % n + n).clamp(max=c), inv), key),
            ScoreMap(n, 2, None, lambda q, p: _at(rope, q, torch.full_like(p, min(2 * n - 1, c)), inv), key),
        )
    kind, w, base = ext["type"], ext["window"], ext["scale_base"]

    def gained(q, p):  # log-n: max(1, log(i + 1)/log(base)) per query
        if base is None:
            return q
        return q * (torch.log(p.double() + 1) / math.log(base)).clamp(min=1).float().unsqueeze(1).unsqueeze(-1)

    near = ScoreMap(1, None, w - 1, lambda q, p: _at(rope, gained(q, p), p, inv), lambda k, p: _at(rope, k, p, inv))
    if kind == "rerope":  # the query at position w, the key at 0 (as it is)
        far = ScoreMap(1, w, None, lambda q, p: _at(rope, gained(q, p), torch.full_like(p, w), inv))
    elif kind == "leaky-rerope":
        f = ext["factor"]
        far = ScoreMap(1, w, None, lambda q, p: _at(rope, gained(q, p), p + w * (f - 1), inv / f),
                       lambda k, p: _at(rope, k, p, inv / f))  # fmt: skip
    else:  # self-extend
        g = ext["group_size"]
        far = ScoreMap(
            1,
            w,
            None,
            lambda q, p: _at(rope, gained(q, p), torch.div(p, g, rounding_mode="floor").double() + (w - w / g), inv),
            lambda k, p: _at(rope, k, torch.div(p, g, rounding_mode="floor"), inv),
        )
    return near, far


def _dual_chunk_scores(rope, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """Dual Chunk Attention's three maps merged by the chunks of each pair (module docstring).

    Position tables as vLLM's ``DualChunkRotaryEmbedding._compute_cos_sin_cache``: keys at
    ``j mod n``; queries at ``i mod n`` (intra), ``min(i mod n + n, chunk_size)`` (successive)
    and ``min(2n - 1, chunk_size)`` (inter: its ``qc`` table read at ``n - 1``).
    """
    c = rope.rope_extension["chunk_size"]
    n = c - rope.rope_extension["local_size"]  # tokens per chunk (ChunkLlama's chunk_len)
    inv = rope.inv_freq
    kt = _at(rope, k, k_pos % n, inv).transpose(-1, -2)  # (B, H, Dh, Lk)
    qi = q_pos % n
    intra = _at(rope, q, qi, inv) @ kt
    succ = _at(rope, q, (qi + n).clamp(max=c), inv) @ kt
    inter = _at(rope, q, torch.full_like(q_pos, min(2 * n - 1, c)), inv) @ kt
    gap = (
        torch.div(q_pos, n, rounding_mode="floor").unsqueeze(-1)
        - torch.div(k_pos, n, rounding_mode="floor").unsqueeze(-2)
    ).unsqueeze(1)  # (B|1, 1, Lq, Lk): chunks apart
    return torch.where(gap <= 0, intra, torch.where(gap == 1, succ, inter))  # (B, H, Lq, Lk)
