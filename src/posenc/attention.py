"""One multi-head attention layer for every position encoding, with a KV cache.

The layer projects ``x`` to ``q, k, v``, calls the stages its encoding declares, and
dispatches to the fastest backend that can run them:

============  ======================================  =====================================
backend       runs                                    how
============  ======================================  =====================================
``sdpa``      input and q/k stages only               ``F.scaled_dot_product_attention``
                                                      (flash / memory-efficient kernels)
``flex``      + scalar ``bias`` with a ``score_mod``   FlexAttention, no L×L tensor
                                                      (compiled on CUDA; CPU: forward only)
``dense``     + scalar ``bias``                       SDPA with the bias as a float mask
``relative``  every stage                             per-distance logits gathered into
                                                      place, chunked over queries (memory
                                                      O(chunk·Lk + L·Dh), never L²·Dh)
``eager``     every stage                             everything materialised at once, in
                                                      float32: the oracle
============  ======================================  =====================================

``backend="auto"`` picks ``sdpa`` when it can, then ``flex`` on CUDA (``dense`` on CPU,
where FlexAttention has no backward), then ``relative``. Tests force each backend and
compare it with ``eager``.

Masks are by *index*, not by position: query ``t`` of a call made with ``c`` tokens in
the cache sees keys ``0 .. c + t``. Positions only feed the encoding, so left padding,
shifted or randomized positions change nothing in the masking.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .base import PositionEncoding, Stage, as_positions, build

__all__ = ["Attention", "KVCache", "BACKENDS", "select_backend", "supported_backends"]

BACKENDS = ("auto", "sdpa", "flex", "dense", "relative", "eager")

_compiled_flex = None


def _flex_attention(device_type: str):
    """FlexAttention: compiled on CUDA (fused kernel); the eager reference elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if device_type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def supported_backends(enc: PositionEncoding) -> list[str]:
    """Backends able to run ``enc`` (every one of them equals ``eager``)."""
    st = enc.stages
    out = []
    if not st & (Stage.BIAS | Stage.TERMS | Stage.VALUE) and not enc.rotates_value:
        out.append("sdpa")
    if st & Stage.BIAS and not st & (Stage.TERMS | Stage.VALUE) and not enc.rotates_value:
        out += ["flex", "dense"]
    return out + ["relative", "eager"]


def select_backend(enc: PositionEncoding, device_type: str, needs_grad: bool) -> str:
    """The backend ``auto`` picks for ``enc`` on ``device_type``.

    FlexAttention is chosen on CUDA only: on CPU it has no backward, and its compiled
    forward costs a long compile for each new shape.
    """
    ok = supported_backends(enc)
    if "sdpa" in ok:
        return "sdpa"
    if "flex" in ok and enc.has_score_mod and device_type == "cuda":
        return "flex"
    if "dense" in ok:
        return "dense"
    return "relative"


class KVCache(nn.Module):
    """Keys, values and key positions of past tokens for one attention layer.

    Shapes: ``k, v``: ``(B, H, Lmax, Dh)``; ``pos``: ``(B, Lmax)``, or ``(B, Lmax, A)`` for an
    encoding that reads ``axes = A > 1`` coordinates per position. The keys are stored
    after ``rotate`` unless the encoding sets ``cache_raw_keys`` (then before, and the
    whole cache is rotated again at each step).
    """

    def __init__(
        self, batch_size: int, max_len: int, heads: int, head_dim: int, *, dtype=None, device=None, axes: int = 1
    ):
        super().__init__()
        if batch_size < 1 or max_len < 1:
            raise ValueError(f"batch_size and max_len must be >= 1, got {batch_size}, {max_len}")
        shape = (batch_size, heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        pos_shape = (batch_size, max_len) if axes == 1 else (batch_size, max_len, axes)
        self.register_buffer("pos", torch.zeros(pos_shape, dtype=torch.long, device=device), persistent=False)
        self.length = 0
        self.input_state: nn.Module | None = None  # the encoding's init_state(), if its input stage has one

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def reset(self) -> None:
        self.length = 0
        if self.input_state is not None:
            self.input_state.reset()

    def update(self, k: Tensor, v: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Append ``k, v`` ``(B, H, L, Dh)`` at ``pos`` ``(B|1, L[, A])``; return all cached so far."""
        B, _, L, _ = k.shape
        start, end = self.length, self.length + L
        if B != self.k.shape[0]:
            raise ValueError(f"cache was made for batch size {self.k.shape[0]}, got {B}")
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {start} cached + {L} new > max_len={self.max_len}")
        self.k[:, :, start:end] = k.to(self.k.dtype)
        self.v[:, :, start:end] = v.to(self.v.dtype)
        self.pos[:, start:end] = pos.expand(B, *pos.shape[1:])
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end], self.pos[:, :end]


class Attention(nn.Module):
    """Multi-head attention with a pluggable position encoding.

    Args:
        dim: model width ``D``.
        heads: number of heads ``H``.
        encoding: a registered name (see :func:`posenc.available`) or a built
            :class:`~posenc.PositionEncoding` (e.g. one shared with other layers).
        head_dim: ``Dh``; ``dim // heads`` by default.
        causal: causal (decoder) or bidirectional masking.
        max_len: training length, passed to the encoding.
        backend: one of :data:`BACKENDS`; ``"auto"`` picks the fastest that can run.
        qkv_bias: bias terms on the q/k/v/o projections.
        apply_input_stage: run the encoding's input stage on ``x`` here; a model that
            applies it once to its embeddings passes False.
        chunk_size: query chunk of the ``relative`` backend (``dense`` uses at most
            ``dense_chunk`` of it).
        **options: encoding options (``base``, ``num_buckets``, ...).

    Shape notation: ``x``: ``(B, L, D)`` -> ``(B, L, D)``; ``pos``: ``(L,)`` or ``(B, L)``
    int64, or ``(L, A)`` / ``(B, L, A)`` for an encoding with ``axes = A > 1`` (see
    :func:`posenc.positions.grid`); ``key_padding_mask``: ``(B, Lk)`` bool, True = attend.
    """

    # query block of the dense backend: small blocks let causal attention skip most
    # masked keys while the fused kernel still sees long rows
    dense_chunk = 256
    # saved-score budget of one call above which dense/relative recompute blocks in backward
    checkpoint_bytes = 2 * 2**30

    def __init__(
        self,
        dim: int,
        heads: int,
        encoding: str | PositionEncoding = "nope",
        *,
        head_dim: int | None = None,
        causal: bool = True,
        max_len: int | None = None,
        backend: str = "auto",
        qkv_bias: bool = False,
        apply_input_stage: bool = True,
        chunk_size: int = 1024,
        **options,
    ) -> None:
        super().__init__()
        if not isinstance(dim, int) or dim < 1 or not isinstance(heads, int) or heads < 1:
            raise ValueError(f"dim and heads must be positive ints, got dim={dim!r}, heads={heads!r}")
        if head_dim is None:
            if dim % heads:
                raise ValueError(f"dim={dim} is not divisible by heads={heads}; pass head_dim explicitly")
            head_dim = dim // heads
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.dim, self.heads, self.head_dim, self.causal = dim, heads, head_dim, causal
        self.backend = backend
        self.chunk_size = chunk_size
        self.apply_input_stage = apply_input_stage
        if isinstance(encoding, PositionEncoding):
            if options:
                raise ValueError(f"options {sorted(options)} given with an already built encoding")
            if (encoding.heads, encoding.head_dim) != (heads, head_dim):
                raise ValueError(
                    f"encoding built for heads={encoding.heads}, head_dim={encoding.head_dim}; "
                    f"attention has heads={heads}, head_dim={head_dim}"
                )
            if encoding.causal != causal:
                raise ValueError(f"encoding built with causal={encoding.causal}, attention has causal={causal}")
            self.encoding = encoding
        else:
            self.encoding = build(encoding, heads=heads, head_dim=head_dim, max_len=max_len, causal=causal, **options)
        self.encoding.attach(self)
        if backend != "auto" and backend not in supported_backends(self.encoding):
            raise ValueError(
                f"backend {backend!r} cannot run encoding {self.encoding.name!r}; "
                f"supported: {supported_backends(self.encoding)}"
            )
        inner = heads * head_dim
        self.q_proj = nn.Linear(dim, inner, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, inner, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, inner, bias=qkv_bias)
        self.o_proj = nn.Linear(inner, dim, bias=qkv_bias)

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, causal={self.causal}"

    def init_cache(self, batch_size: int, max_len: int, *, dtype=None, device=None) -> KVCache:
        w = self.q_proj.weight
        dtype, device = dtype or w.dtype, device or w.device
        cache = KVCache(
            batch_size, max_len, self.heads, self.head_dim, dtype=dtype, device=device, axes=self.encoding.axes
        )
        if self.apply_input_stage and self.encoding.stages & Stage.INPUT:
            cache.input_state = self.encoding.init_state(batch_size, dtype=dtype, device=device)
        return cache

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        x: Tensor,
        pos: Tensor | None = None,
        cache: KVCache | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        backend: str | None = None,
    ) -> Tensor:
        """Attend. See the class docstring for shapes.

        Raises:
            ValueError: ``x`` not ``(B, L, dim)``; bad positions (see
                :func:`posenc.functional.check_positions`); unknown backend.
            TypeError: float positions.
        """
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape (B, L, {self.dim}), got {tuple(x.shape)}")
        offset = cache.length if cache is not None else 0
        pos2 = as_positions(pos, x.shape[1], offset=offset, device=x.device, batch=x.shape[0], axes=self.encoding.axes)
        return self._forward(x, pos2, cache, key_padding_mask=key_padding_mask, backend=backend)

    def _forward(
        self,
        x: Tensor,
        pos: Tensor,
        cache: KVCache | None,
        *,
        key_padding_mask: Tensor | None = None,
        backend: str | None = None,
        memory: Tensor | None = None,
        memory_pos: Tensor | None = None,
    ) -> Tensor:
        """Forward with positions already validated as ``(B|1, L)`` int64.

        ``memory`` ``(B, M, D)`` are the layer inputs of earlier segments (Transformer-XL
        recurrence, already detached), at positions ``memory_pos`` ``(B|1, M)``: keys and
        values are computed from ``cat(memory, x)``, queries from ``x`` only.
        """
        enc = self.encoding
        B, L, _ = x.shape
        if self.apply_input_stage and enc.stages & Stage.INPUT:
            state = cache.input_state if cache is not None else None
            x = enc.embed(x, pos) if state is None else enc.embed(x, pos, state=state)
        q = self.q_proj(x).view(B, L, self.heads, self.head_dim).transpose(1, 2)  # (B, H, L, Dh)
        offset = 0
        q_pos = k_pos = pos
        if memory is not None:
            if cache is not None:
                raise ValueError("memory and cache cannot be used together")
            offset = memory.shape[1]
            x = torch.cat((memory.to(x.dtype), x), dim=1)  # (B, M + L, D)
            b = max(pos.shape[0], memory_pos.shape[0])
            k_pos = torch.cat((memory_pos.expand(b, -1), pos.expand(b, -1)), dim=1)  # (B|1, M + L)
        Lk = x.shape[1]
        k = self.k_proj(x).view(B, Lk, self.heads, self.head_dim).transpose(1, 2)  # (B, H, Lk, Dh)
        v = self.v_proj(x).view(B, Lk, self.heads, self.head_dim).transpose(1, 2)  # (B, H, Lk, Dh)

        if enc.rotates_value:
            v = enc.rotate_value(v, k_pos)
        if cache is None:
            q, k = enc.rotate(q, k, q_pos, k_pos)
        elif enc.cache_raw_keys:
            offset = cache.length
            k, v, k_pos = cache.update(k, v, pos)
            q, k = enc.rotate(q, k, q_pos, k_pos)
        else:
            offset = cache.length
            q, k = enc.rotate(q, k, q_pos, k_pos)
            k, v, k_pos = cache.update(k, v, pos)
        k, v = k.to(q.dtype), v.to(q.dtype)

        name = backend or self.backend
        if name == "auto":
            needs_grad = torch.is_grad_enabled() and (
                x.requires_grad or any(p.requires_grad for p in self.parameters())
            )
            name = select_backend(enc, x.device.type, needs_grad)
        elif name not in supported_backends(enc):
            raise ValueError(f"backend {name!r} cannot run encoding {enc.name!r}; supported: {supported_backends(enc)}")
        run = getattr(self, f"_attend_{name}")
        out = run(q, k, v, q_pos, k_pos, offset, key_padding_mask)  # (B, H, L, Dh)
        out = out.transpose(1, 2).reshape(B, L, self.heads * self.head_dim)
        return self.o_proj(out)

    # ------------------------------------------------------------------ masks
    def _bool_mask(self, Lq: int, Lk: int, offset: int, kpm: Tensor | None, device) -> Tensor | None:
        """``(B|1, 1, Lq, Lk)`` bool, True = attend; None when everything is visible."""
        mask = None
        if self.causal and not (Lq == 1 and offset == Lk - 1):
            i = torch.arange(Lq, device=device).unsqueeze(-1) + offset
            j = torch.arange(Lk, device=device)
            mask = (j <= i)[None, None]
        if kpm is not None:
            if kpm.shape[-1] != Lk or kpm.dtype != torch.bool:
                raise ValueError(
                    f"key_padding_mask must be bool of shape (B, {Lk}), got {kpm.dtype} {tuple(kpm.shape)}"
                )
            pad = kpm[:, None, None, :]
            mask = pad if mask is None else mask & pad
        return mask

    # ------------------------------------------------------------------ backends
    def _attend_sdpa(self, q, k, v, q_pos, k_pos, offset, kpm):
        Lq, Lk = q.shape[2], k.shape[2]
        scale = self.encoding.scale
        if self.causal and kpm is None and offset == 0 and Lq == Lk:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        mask = self._bool_mask(Lq, Lk, offset, kpm, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    def _saved_score_bytes(self, B: int, H: int, Lq: int, Lk: int) -> int:
        """Bytes autograd keeps for the math kernel: ~3 float32 score-sized tensors."""
        return B * H * Lq * Lk * 4 * 3 // (2 if self.causal else 1)

    def _attend_dense(self, q, k, v, q_pos, k_pos, offset, kpm):
        """SDPA with the bias as a float mask, in query blocks of ``dense_chunk`` rows.

        Blocking bounds the bias at ``(B|1, H, chunk, Lk)`` and, when causal, drops the
        keys a block cannot see (about half the work). A 4-D bias that needs no gradient
        runs the fused (flash) kernel; a learned bias (T5) needs ``dS`` per (i, j), which
        only the math kernel returns: its blocks are recomputed in backward when their
        saved scores would exceed ``checkpoint_bytes``.
        """
        B, H, Lq, _ = q.shape
        Lk = k.shape[2]
        c = min(self.chunk_size, self.dense_chunk)
        scale = self.encoding.scale

        def block(qb, kb, vb, qp, kp, off, kpm_b):
            bias = self.encoding.bias(qp, kp)  # (B|1, H, Lq_b, Lk_b) float32
            mask = self._bool_mask(qb.shape[2], kb.shape[2], off, kpm_b, qb.device)
            if mask is not None:
                bias = bias.masked_fill(~mask, float("-inf"))
            return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=bias.to(qb.dtype), scale=scale)

        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        learned_bias = grad and any(p.requires_grad for p in self.encoding.parameters())
        recompute = learned_bias and self._saved_score_bytes(B, H, Lq, Lk) > self.checkpoint_bytes
        return self._in_query_blocks(block, c, recompute, q, k, v, q_pos, k_pos, offset, kpm)

    def _in_query_blocks(self, block, c, recompute, q, k, v, q_pos, k_pos, offset, kpm):
        """Run ``block`` on query rows ``[s, s + c)``; causal blocks get only the keys they see.

        ``recompute``: checkpoint each block (its scores are rebuilt in backward).
        """
        Lq, Lk = q.shape[2], k.shape[2]
        if Lq <= c:
            return block(q, k, v, q_pos, k_pos, offset, kpm)
        outs = []
        for s in range(0, Lq, c):
            e = min(s + c, Lq)
            kend = min(Lk, offset + e) if self.causal else Lk  # keys past the block's last query are masked
            args = (
                q[:, :, s:e],
                k[:, :, :kend],
                v[:, :, :kend],
                q_pos[:, s:e],
                k_pos[:, :kend],
                offset + s,
                kpm[:, :kend] if kpm is not None else None,
            )
            outs.append(checkpoint(block, *args, use_reentrant=False) if recompute else block(*args))
        return torch.cat(outs, dim=2)  # (B, H, Lq, Dh)

    def _attend_flex(self, q, k, v, q_pos, k_pos, offset, kpm):
        from torch.nn.attention.flex_attention import create_block_mask

        B, _, Lq, _ = q.shape
        Lk = k.shape[2]
        score_mod = self.encoding.score_mod(q_pos.expand(B, Lq), k_pos.expand(B, Lk))
        block_mask = None
        if self.causal or kpm is not None:
            causal = self.causal

            def mask_mod(b, h, i, j):
                keep = (j <= i + offset) if causal else (j >= 0)
                if kpm is not None:
                    keep = keep & kpm[b, j]
                return keep

            block_mask = create_block_mask(mask_mod, B if kpm is not None else None, None, Lq, Lk, device=q.device.type)
        flex = _flex_attention(q.device.type)
        with warnings.catch_warnings():
            # off CUDA the unfused reference runs on purpose (FlexAttention has no CPU backward)
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=self.encoding.scale)

    def _attend_eager(self, q, k, v, q_pos, k_pos, offset, kpm):
        """The oracle: every term materialised, float32 throughout."""
        dtype = q.dtype
        out = self._attend_chunk(q.float(), k.float(), v.float(), q_pos, k_pos, offset, kpm)
        return out.to(dtype)

    def _attend_relative(self, q, k, v, q_pos, k_pos, offset, kpm):
        """Chunk over queries (causal: each chunk sees only keys up to its last query).

        With gradients, each chunk is recomputed in backward when the saved scores of the
        whole call would exceed ``checkpoint_bytes``.
        """
        B, H, Lq, _ = q.shape
        Lk = k.shape[2]
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        recompute = grad and self._saved_score_bytes(B, H, Lq, Lk) > self.checkpoint_bytes
        return self._in_query_blocks(self._attend_chunk, self.chunk_size, recompute, q, k, v, q_pos, k_pos, offset, kpm)

    def _attend_chunk(self, q, k, v, q_pos, k_pos, offset, kpm):
        """Scores, softmax and output for a block of queries (all keys)."""
        enc = self.encoding
        st = enc.stages
        Lq, Lk = q.shape[2], k.shape[2]
        # in place from the matmul on: none of these intermediates is saved for backward,
        # and each L×L pass that allocates costs as much as the arithmetic on CPU
        s = q @ k.transpose(-1, -2)  # (B, H, Lq, Lk)
        if st & Stage.TERMS:
            s.add_(enc.score_terms(q, k, q_pos, k_pos))
        s = s.float().mul_(enc.scale)
        if st & Stage.BIAS:
            s.add_(enc.bias(q_pos, k_pos))
        mask = self._bool_mask(Lq, Lk, offset, kpm, q.device)
        blind = None  # query rows that see no key at all (a fully padded row)
        if mask is not None:
            s.masked_fill_(~mask, float("-inf"))
            if kpm is not None:  # causal masks alone always leave the diagonal visible
                blind = ~mask.any(-1, keepdim=True)  # (B|1, 1, Lq, 1)
                s.masked_fill_(blind, 0.0)  # a finite row: no NaN in forward or backward
        attn = torch.softmax(s, dim=-1)
        if blind is not None:
            attn = attn.masked_fill(blind, 0.0)  # output 0, as SDPA and FlexAttention give
        attn = attn.to(v.dtype)
        out = attn @ v  # (B, H, Lq, Dh)
        if st & Stage.VALUE:
            out = out + enc.value_term(attn, q_pos, k_pos).to(out.dtype)
        return out
