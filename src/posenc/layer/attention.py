"""One multi-head attention layer for every position encoding, with a KV cache.

The layer is a pipeline of public steps; each can be called on its own::

    attn(x, pos, cache)                      # all of it: the call, input stage, attend
    call = attn.make_call(x, pos, cache)     # the checked posenc.layer.call.Call of x (a model makes one for all layers)
    attn.embed_input(x, call, cache)         # the input stage (through the cache's input history)
    attn.project(x, call, cache)             # q, k, v after the q/k stage (and the cache update)
    attn.attend(x, call, cache)              # project -> backend -> o_proj
    call.mask(causal=, window=, chunk=, k_len=)   # the posenc.AttentionMask of a layer
    encode(enc, q, k, v, ctx, norms=, cache=)    # the q/k step on projections: posenc.hf runs it too

The backend is a function of :data:`posenc.BACKENDS` (see :mod:`posenc.attend.backends`):
``backend="auto"`` picks the fastest that can run the encoding's stages
(:func:`posenc.select_backend`), and every backend equals ``eager``. Masks are by index
(:mod:`posenc.mask`); positions only feed the encoding.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..attend.backends import BlockOptions, attend, canonical_backend, require_backend, select_backend
from ..attend.scores import expand_kv
from ..base import PositionEncoding, Stage, as_positions
from ..context import Context
from ..mask import AttentionMask
from ..validate import check_args, check_dropout
from .cache import InputHistory, KVCache, layer_cache, run_input_stage
from .call import Call, make_call
from .memory import LayerMemory
from .qk_norm import check_qk_norm, qk_norms
from .setup import check_kv_heads, layer_encoding

__all__ = ["Attention", "Projection", "encode"]


class Projection(NamedTuple):
    """What :meth:`posenc.Attention.project` returns: the inputs of a backend.

    ``q`` ``(B, H, Lq, Dh)``, ``k``/``v`` ``(B, Hk, Lk, Dh)`` after the q/k stage (with a cache:
    every cached key; ``Hk``: the layer's ``key_heads``, grouped k/v that the backends
    expand), ``q_pos`` ``(B|1, Lq)``, ``k_pos`` ``(B|1, Lk)`` int64, ``ctx`` the call's
    :class:`~posenc.Context` (what the score side may read). A backend takes
    ``BACKENDS[name](enc, *p[:5], mask, ctx=p.ctx)``.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    q_pos: Tensor
    k_pos: Tensor
    ctx: Context


def encode(
    enc: PositionEncoding,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ctx: Context,
    *,
    norms: tuple[nn.Module, nn.Module] | None = None,
    cache=None,
) -> Projection:
    """The encoding's q/k side on projected ``q`` ``(B, H, Lq, Dh)``, ``k``/``v`` ``(B, Hk, Lk, Dh)``
    at ``ctx.q_pos``/``ctx.k_pos``, then the q/k ``norms`` that run after it (None: none).

    ``cache``: the layer's posenc KV cache that stores keys, or None (no cache, a memory, or
    HF's cache, which hands every raw key in ``k``). With one, ``k``/``v``/``ctx.k_state``
    are the new tokens' and the projection holds every key the cache returns.
    """
    if enc.defines("rotate_value"):  # values carry their own key position (RoFormer's rotary_value)
        v = enc.rotate_value(v, ctx.k_pos, ctx=ctx)
    if cache is None:
        q, k = _qk(enc, q, k, ctx, norms)
    elif enc.needs.raw_keys or cache.reassigns_positions:  # rotate every cached key again
        L = q.shape[2]
        k, v, k_pos = cache.update(k, v, ctx.k_pos)
        state = cache.update_state(ctx.k_state)
        q_pos = k_pos[:, k_pos.shape[1] - L :] if cache.reassigns_positions else ctx.q_pos  # (SinkWindow)
        ctx = replace(ctx, q_pos=q_pos, k_pos=k_pos, k_state=state)
        q, k = _qk(enc, q, k, ctx, norms)
    else:
        q, k = _qk(enc, q, k, ctx, norms)
        k, v, k_pos = cache.update(k, v, ctx.k_pos)
        ctx = replace(ctx, k_pos=k_pos, k_state=cache.update_state(ctx.k_state))
    return Projection(q, k.to(q.dtype), v.to(q.dtype), ctx.q_pos, ctx.k_pos, ctx)


def _qk(enc: PositionEncoding, q: Tensor, k: Tensor, ctx: Context, norms) -> tuple[Tensor, Tensor]:
    q, k = enc.rotate(q, k, ctx.q_pos, ctx.k_pos, ctx=ctx)  # (the identity without a q/k stage)
    if norms is not None:
        q, k = norms[0](q), norms[1](k)
    return q, k


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
        backend: ``"auto"`` or a name in :data:`posenc.BACKENDS` (``"relative"`` is the
            old name of ``"chunked"``).
        qkv_bias: bias terms on the q/k/v/o projections.
        chunk_size: the most query rows in one block of any blocked backend; each uses
            its own measured block below it (``chunked``
            :func:`posenc.attend.backends.chunked_rows`, ``dense`` ``dense_chunk``,
            ``blockwise`` :data:`posenc.kernels.backend.BLOCK`).
        window: attend to the last ``window`` keys only, the query included (sliding
            window; :class:`~posenc.AttentionMask`); None: no window.
        chunk: attend only within aligned chunks of ``chunk`` tokens (Llama 4); None: no chunks.
        sinks: learn one sink logit per head (gpt-oss, :mod:`posenc.attend.sinks`; ``.sinks``
            ``(H,)``, initialised to 0); every backend runs it.
        kv_heads: key/value heads (grouped-query; 1: multi-query); None = ``heads``. The
            projections, the encoding's key side and the KV cache use ``kv_heads``
            (:mod:`posenc.layer.setup`); ``heads`` must be a multiple.
        qk_norm: ``"rms"``, ``"gemma-rms"``, ``"l2"`` or None: per-head q/k normalisation
            with HF's conventions (:mod:`posenc.layer.qk_norm`), ``qk_norm_position`` ``"before"``
            or ``"after"`` the q/k stage, ``qk_norm_eps``.
        score_scale, softcap: the score scale in place of ``Dh^-1/2`` and tanh logit
            soft-capping, set on the encoding (:meth:`PositionEncoding.set_scores`).
        attn_dropout: dropout on the attention probabilities in training (fairseq's
            ``attention_dropout``, HF's ``attention_dropout``/``attn_pdrop``), in ``[0, 1)``;
            every backend but ``flex`` runs it (``"auto"`` then picks another).
        **options: encoding options (``base``, ``num_buckets``, ...).

    Shape notation: ``x``: ``(B, L, D)`` -> ``(B, L, D)``; ``pos``: ``(L,)`` or ``(B, L)``
    int64, or ``(L, A)`` / ``(B, L, A)`` for an encoding with ``axes = A > 1`` (see
    :func:`posenc.positions.grid`); ``key_padding_mask``: ``(B, Lk)`` bool, True = attend;
    ``document_ids``: ``(B|1, L)`` int, packed sequences: a token attends only to tokens
    with its id (each run of equal ids is one document; no cache or memory with them).
    """

    dense_chunk = 256  # see posenc.BlockOptions
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
        chunk_size: int = 1024,
        window: int | None = None,
        chunk: int | None = None,
        sinks: bool = False,
        kv_heads: int | None = None,
        qk_norm: str | None = None,
        qk_norm_position: str = "before",
        qk_norm_eps: float = 1e-6,
        score_scale: float | None = None,
        softcap: float | None = None,
        attn_dropout: float = 0.0,
        **options,
    ) -> None:
        super().__init__()
        if not isinstance(dim, int) or dim < 1 or not isinstance(heads, int) or heads < 1:
            raise ValueError(f"dim and heads must be positive ints, got dim={dim!r}, heads={heads!r}")
        # the annotated types (a bool is a bool, not a truthy "no"; an int is not a float or bool)
        given = {"dim": dim, "heads": heads, "causal": causal, "qkv_bias": qkv_bias, "chunk_size": chunk_size}
        check_args("Attention", Attention.__init__, given)
        if head_dim is None:
            if dim % heads:
                raise ValueError(f"dim={dim} is not divisible by heads={heads}; pass head_dim explicitly")
            head_dim = dim // heads
        backend = canonical_backend(backend)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.dim, self.heads, self.head_dim, self.causal = dim, heads, head_dim, causal
        self.backend = backend
        self.chunk_size = chunk_size
        AttentionMask(window=window, chunk=chunk)  # validates them
        self.window, self.chunk = window, chunk
        if not isinstance(sinks, bool):
            raise TypeError(f"sinks must be a bool, got {sinks!r}")
        self.sinks = nn.Parameter(torch.zeros(heads)) if sinks else None
        self.kv_heads = check_kv_heads(heads, kv_heads)
        check_qk_norm(qk_norm, qk_norm_position, qk_norm_eps)
        self.qk_norm, self.qk_norm_position = qk_norm, qk_norm_position
        self.q_norm, self.k_norm = qk_norms(qk_norm, head_dim, qk_norm_eps)
        scores = {"score_scale": score_scale, "softcap": softcap}
        kw = {"heads": heads, "head_dim": head_dim, "dim": dim, "causal": causal, "max_len": max_len, **scores}
        self.encoding = layer_encoding(encoding, options=options, **kw)
        # heads of the keys the encoding's key side, and so the cache, holds
        self.key_heads = heads if self.encoding.needs.per_head_keys else self.kv_heads
        if backend != "auto":
            require_backend(self.encoding, backend)
        self.attn_dropout = check_dropout(attn_dropout, "attn_dropout")
        if self.attn_dropout and backend == "flex":
            raise ValueError(f"backend 'flex' has no attention dropout, got attn_dropout={attn_dropout}")
        inner = heads * head_dim
        self.q_proj = nn.Linear(dim, inner, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, self.kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, self.kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(inner, dim, bias=qkv_bias)

    def extra_repr(self) -> str:
        named = ("window", "chunk", "qk_norm")
        extra = "".join(f", {k}={getattr(self, k)!r}" for k in named if getattr(self, k) is not None)
        extra += ", sinks=True" if self.sinks is not None else ""
        extra += f", kv_heads={self.kv_heads}" if self.kv_heads != self.heads else ""
        extra += f", attn_dropout={self.attn_dropout}" if self.attn_dropout else ""
        return f"backend={self.backend!r}, causal={self.causal}{extra}"

    @property
    def block_options(self) -> BlockOptions:
        """Block sizes the ``dense``/``chunked`` backends use for this layer."""
        return BlockOptions(self.chunk_size, self.dense_chunk, self.checkpoint_bytes)

    def resolve_backend(
        self, backend: str | None, device_type: str, q_len: int | None = None, k_len: int | None = None, *,
        causal: bool | None = None, dropout: bool = False,
    ) -> str:  # fmt: skip
        """The backend a call runs: ``backend`` (or the layer's), ``"auto"`` resolved for
        ``device_type`` and ``q_len`` queries over ``k_len`` keys, causal or not (None: the
        layer's), with attention dropout or not (:func:`posenc.select_backend`)."""
        name = canonical_backend(backend or self.backend)
        if name != "auto":
            return require_backend(self.encoding, name)
        causal = self.causal if causal is None else causal
        return select_backend(self.encoding, device_type, q_len, k_len, causal=causal, dropout=dropout)

    @property
    def runs_input_stage(self) -> bool:
        """Called on its own, the layer runs its encoding's input stage on ``x``."""
        enc = self.encoding
        return bool(enc.stages & Stage.INPUT) and enc.needs.input_at in (0, "layer")

    def init_cache(self, batch_size: int, max_len: int, *, dtype=None, device=None, policy=None) -> KVCache:
        """An empty KV cache for ``batch_size`` sequences of up to ``max_len`` tokens; a causal
        layer with a ``window``/``chunk`` gets a rolling :class:`~posenc.layer.cache.WindowKVCache`
        (``O(W)`` memory, no length limit), ``policy=SinkWindow(...)`` StreamingLLM's cache."""
        w = self.q_proj.weight
        shape = (batch_size, max_len, self.key_heads, self.head_dim)
        kw = {"dtype": dtype or w.dtype, "device": device or w.device, "policy": policy}
        return layer_cache(self.encoding, *shape, window=self.window, chunk=self.chunk, causal=self.causal, **kw)

    # ------------------------------------------------------------------ forward
    def make_call(
        self,
        x: Tensor,
        pos: Tensor | None = None,
        cache: KVCache | LayerMemory | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        memory: bool = False,
    ) -> Call:
        """The :class:`~posenc.layer.call.Call` of this layer alone on ``x`` ``(B, L, dim)`` (a model makes one
        for all its layers), positions continuing from ``cache``; ``memory``: a memory was given too."""
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape (B, L, {self.dim}), got {tuple(x.shape)}")
        B, L, _ = x.shape
        given = {"key_padding_mask": key_padding_mask, "document_ids": document_ids}
        kind = {"cache": isinstance(cache, KVCache), "memory": memory or isinstance(cache, LayerMemory)}
        past = 0 if cache is None else cache.length
        return make_call(B, L, encodings=[self.encoding], pos=pos, past=past, device=x.device, **given, **kind)

    def forward(
        self,
        x: Tensor,
        pos: Tensor | None = None,
        cache: KVCache | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        backend: str | None = None,
        memory: Tensor | None = None,
        memory_pos: Tensor | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Attend. See the class docstring for shapes.

        ``memory`` ``(B, M, dim)`` at ``memory_pos`` ``(B|1, M)`` (Transformer-XL; default
        ``0..M-1``, and ``pos`` then continues from ``M``): keys and values come from
        ``cat(memory, x)``, queries from ``x`` only (a :class:`~posenc.layer.cache.LayerMemory`).

        Raises:
            ValueError: ``x`` not ``(B, L, dim)``; bad positions (see
                :func:`posenc.functional.check_positions`), or past ``max_len`` for an
                encoding that does not extrapolate; unknown backend; what
                :func:`posenc.layer.call.make_call` refuses.
            TypeError: float positions.
        """
        if memory is not None and cache is None:  # (both: make_call refuses them)
            B = x.shape[0] if isinstance(x, Tensor) else None
            if (
                not isinstance(memory, Tensor)
                or memory.dim() != 3
                or memory.shape[0] != B
                or memory.shape[2] != self.dim
            ):
                raise ValueError(
                    f"memory must have shape ({B}, M, {self.dim}), got {tuple(getattr(memory, 'shape', ()))}"
                )
            M, axes = memory.shape[1], self.encoding.needs.axes
            cache = LayerMemory.given(memory, as_positions(memory_pos, M, device=memory.device, batch=B, axes=axes))
        call = self.make_call(
            x, pos, cache, key_padding_mask=key_padding_mask, document_ids=document_ids, memory=memory is not None
        )
        if self.runs_input_stage:
            x = self.embed_input(x, call, cache)
        return self.attend(x, call, cache, backend=backend)

    def embed_input(self, x: Tensor, call: Call, cache: KVCache | None = None) -> Tensor:
        """The encoding's input stage on ``x`` ``(B, L, D)``; with a cache, over its input history
        too; with packed documents, on each document alone."""
        enc = self.encoding
        history = None
        if cache is not None and enc.needs.input_context > 0:
            if cache.inputs is None:
                cache.inputs = InputHistory(enc.needs.input_context)
            history = cache.inputs
        return run_input_stage(enc, x, call.pos, history, call.documents)

    def project(self, x: Tensor, call: Call, cache: KVCache | LayerMemory | None = None) -> Projection:
        """Projections, what the encoding reads from the input, the q/k stage (:func:`encode`):
        the inputs of a backend (see :class:`Projection`).

        The keys come from the rows the ``cache`` names (:meth:`posenc.KVCache.key_rows`: the
        new tokens, or a memory's rows followed by them); a KV cache appends the new keys and
        values (and the encoding's per-key state) and returns every cached one.
        """
        enc = self.encoding
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.heads, self.head_dim).transpose(1, 2)  # (B, H, L, Dh)
        rows, k_pos = (x, call.pos) if cache is None else cache.key_rows(x, call.pos)  # (B, Lk, D), (B|1, Lk)
        Lk = rows.shape[1]
        k = self.k_proj(rows).view(B, Lk, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, Hk, Lk, Dh)
        v = self.v_proj(rows).view(B, Lk, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, Hk, Lk, Dh)
        if self.key_heads != self.kv_heads:  # key-side stages with per-head parameters
            k, v = expand_kv(k, v, self.key_heads)
        state: dict[str, Tensor] = {}
        if enc.defines("read_input"):
            keep = None if call.key_padding is None else call.key_padding[:, -Lk:]
            read = enc.read_input(
                rows, k, v, None if cache is None else cache.carry, keep=keep, documents=call.documents
            )
            k, v, state = read.k, read.v, read.state
            if cache is not None:
                cache.carry = read.carry
        if self.q_norm is not None and self.qk_norm_position == "before":
            q, k = self.q_norm(q), self.k_norm(k)
        q_state = {n: t[:, :, Lk - L :] for n, t in state.items()}  # the queries are the last L rows
        ctx = Context(
            call.pos, k_pos, x=x, q_state=q_state, k_state=state, qk_proj=(self.q_proj, self.k_proj), tables=call.tables
        )
        norms = (self.q_norm, self.k_norm) if self.q_norm is not None and self.qk_norm_position == "after" else None
        return encode(enc, q, k, v, ctx, norms=norms, cache=cache if cache is not None and cache.stores_keys else None)

    def attend(
        self, x: Tensor, call: Call, cache: KVCache | LayerMemory | None = None, *, backend: str | None = None
    ) -> Tensor:
        """:meth:`project`, the backend, the output projection: ``(B, L, D)``, for ``x`` whose
        input stage ran where it belongs (a model runs it; :meth:`forward` does for a bare layer).

        A cache that cannot take all ``L`` tokens in one call without evicting keys an
        earlier query of the call sees (:attr:`posenc.KVCache.room`: a
        :class:`~posenc.SinkWindow` cache, whose positions depend on what is kept) is fed in
        pieces: the tokens that fit, then one at a time, so the call equals decoding token
        by token.
        """
        L = x.shape[1]
        room = None if cache is None else cache.room
        if room is None or L <= room:
            return self._attend(x, call, cache, backend)
        outs, start = [], 0
        while start < L:
            end = start + max(1, min(L - start, cache.room))
            outs.append(self._attend(x[:, start:end], call.piece(start, end), cache, backend))
            start = end
        return torch.cat(outs, dim=1)

    def _attend(self, x: Tensor, call: Call, cache, backend: str | None) -> Tensor:
        B, L, _ = x.shape
        p = self.project(x, call, cache)
        Lk = p.k.shape[2]
        mask = call.mask(causal=self.causal, window=self.window, chunk=self.chunk, k_len=Lk, cache=cache)
        drop = self.attn_dropout if self.training else 0.0
        name = self.resolve_backend(backend, x.device.type, L, Lk, causal=mask.causal, dropout=drop > 0)
        kw = {"ctx": p.ctx, "backend": name, "options": self.block_options, "sinks": self.sinks, "dropout": drop}
        out = attend(self.encoding, *p[:5], mask, **kw)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, self.heads * self.head_dim))  # (B, L, D)
