"""The reference model: a decoder-only, pre-norm Transformer LM with any encoding.

Read top to bottom: :class:`ModelCache`, :class:`MLP`, :class:`Block`,
:class:`TransformerLM`. The encoding is chosen by name; where position enters is the
encoding's business (see :mod:`posenc.base`):

* input-stage encodings (``learned``, ``sinusoidal``) are applied once to the token
  embeddings, unless the encoding asks for every layer (``input_every_layer``);
* encodings that build the embedding from token ids (``builds_embedding``) replace
  the token embedding;
* every other stage runs inside each layer's :class:`posenc.Attention`; encodings whose
  paper shares one table across layers (T5) get one shared instance
  (``share_encoding=None`` follows the encoding; True/False force it).

Transformer-XL's segment-level recurrence is ``memory_len``: pass a
:class:`SegmentMemory` (``lm.init_memory()``) and every layer also attends to its own
inputs from the previous segments (detached), at their true positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import Attention, KVCache
from .base import PositionEncoding, Stage, as_positions, build, get_class, options_of

__all__ = ["TransformerLM", "ModelCache", "SegmentMemory", "save_checkpoint", "load_checkpoint"]


@dataclass
class ModelCache:
    """One :class:`KVCache` per layer; ``length`` tokens are cached so far."""

    layers: list[KVCache]
    input_state: nn.Module | None = None  # state of a model-level input stage (conv), if any

    @property
    def length(self) -> int:
        return self.layers[0].length

    @property
    def max_len(self) -> int:
        return self.layers[0].max_len

    def reset(self) -> None:
        for c in self.layers:
            c.reset()
        if self.input_state is not None:
            self.input_state.reset()


@dataclass
class SegmentMemory:
    """Transformer-XL memory: the last ``memory_len`` inputs of each layer, detached.

    ``layers[l]`` is ``(B, M, D)`` (None before the first segment), ``pos`` their
    positions ``(B|1, M)``; ``seen`` counts the tokens passed so far, which is where the
    next segment's default positions start.
    """

    memory_len: int
    layers: list[Tensor | None]
    pos: Tensor | None = None
    seen: int = 0

    @property
    def length(self) -> int:
        return 0 if self.pos is None else self.pos.shape[-1]

    def reset(self) -> None:
        self.layers = [None] * len(self.layers)
        self.pos, self.seen = None, 0


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, dropout: float):
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.proj = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm block: ``x + attn(LN(x))``, then ``x + mlp(LN(x))``."""

    def __init__(self, dim: int, attn: Attention, mlp_ratio: float, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = attn
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, int(dim * mlp_ratio), dropout)
        self.drop = nn.Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        pos: Tensor,
        cache: KVCache | None,
        memory: Tensor | None = None,
        memory_pos: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        memory = None if memory is None else self.ln1(memory)  # memory holds block inputs
        h = self.attn._forward(
            self.ln1(x), pos, cache, memory=memory, memory_pos=memory_pos, key_padding_mask=key_padding_mask
        )
        x = x + self.drop(h)
        return x + self.mlp(self.ln2(x))


class TransformerLM(nn.Module):
    """Decoder-only language model.

    Args:
        vocab_size: number of token ids.
        dim: model width ``D``.
        depth: number of blocks.
        heads: attention heads ``H`` (``Dh = D / H`` unless ``head_dim`` is given).
        encoding: a registered encoding name.
        max_len: training length, passed to the encoding (``learned`` needs it).
        causal: causal LM (True) or a bidirectional encoder stack (False).
        mlp_ratio: MLP hidden width over ``D``.
        dropout: residual and MLP dropout.
        backend: attention backend for every layer (see :mod:`posenc.attention`).
        share_encoding: one encoding instance for all layers; None follows the encoding.
        tie_embeddings: share the token embedding with the output layer.
        embed_std: std of the token embedding init. GPT-2's 0.02 suits learned and
            relative encodings; encodings that add unit-amplitude vectors
            (``sinusoidal``) drown such tokens: use ~1 (untied) there.
        memory_len: tokens of past segments each layer keeps as memory (Transformer-XL);
            used when ``forward`` gets ``memory=lm.init_memory()``.
        absolute_from_layer: DeBERTa's enhanced mask decoder: a learned absolute position
            table (``max_len`` rows) added to the hidden states just before this block
            index, so only the top ``depth - absolute_from_layer`` blocks see absolute
            positions. None: no such table.
        **options: encoding options.

    Shapes: ``tokens`` ``(B, L)`` int64 -> logits ``(B, L, vocab_size)``.
    """

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        depth: int,
        heads: int,
        encoding: str = "rope",
        max_len: int | None = None,
        *,
        head_dim: int | None = None,
        causal: bool = True,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
        backend: str = "auto",
        share_encoding: bool | None = None,
        tie_embeddings: bool = True,
        embed_std: float = 0.02,
        memory_len: int = 0,
        absolute_from_layer: int | None = None,
        **options,
    ) -> None:
        super().__init__()
        for arg, val in (("vocab_size", vocab_size), ("dim", dim), ("depth", depth), ("heads", heads)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{arg} must be a positive int, got {val!r}")
        if not isinstance(memory_len, int) or memory_len < 0:
            raise ValueError(f"memory_len must be an int >= 0, got {memory_len!r}")
        self.memory_len = memory_len
        if absolute_from_layer is not None:
            if not isinstance(absolute_from_layer, int) or not 0 <= absolute_from_layer < depth:
                raise ValueError(f"absolute_from_layer must be an int in [0, {depth - 1}], got {absolute_from_layer!r}")
            if max_len is None:
                raise ValueError("absolute_from_layer needs max_len (the size of the absolute position table)")
        self.absolute_from_layer = absolute_from_layer
        if head_dim is None:
            if dim % heads:
                raise ValueError(f"dim={dim} is not divisible by heads={heads}; pass head_dim explicitly")
            head_dim = dim // heads
        self.vocab_size, self.dim, self.depth, self.heads, self.head_dim = vocab_size, dim, depth, heads, head_dim
        self.max_len, self.causal, self.encoding_name = max_len, causal, encoding
        # everything needed to rebuild the model (see save_checkpoint / load_checkpoint)
        self.config = dict(
            vocab_size=vocab_size,
            dim=dim,
            depth=depth,
            heads=heads,
            encoding=encoding,
            max_len=max_len,
            head_dim=head_dim,
            causal=causal,
            mlp_ratio=mlp_ratio,
            dropout=dropout,
            backend=backend,
            share_encoding=share_encoding,
            tie_embeddings=tie_embeddings,
            embed_std=embed_std,
            memory_len=memory_len,
            absolute_from_layer=absolute_from_layer,
            **options,
        )
        cls = get_class(encoding)
        share = cls.share_across_layers if share_encoding is None else share_encoding

        enc_options = dict(options)
        if cls.builds_embedding and "vocab_size" in options_of(cls):
            enc_options.setdefault("vocab_size", vocab_size)  # it builds the token embedding

        def make() -> PositionEncoding:
            return build(encoding, heads=heads, head_dim=head_dim, max_len=max_len, causal=causal, **enc_options)

        first = make()
        # Input stage at the bottom of the stack, once, unless the paper injects it per layer.
        self.input_encoding: PositionEncoding | None = None
        if first.stages & Stage.INPUT and not first.input_every_layer:
            self.input_encoding = first
            share = True  # the layers only run its other stages (if any): one instance
        self.tok_emb = None if first.builds_embedding else nn.Embedding(vocab_size, dim)
        self.drop = nn.Dropout(dropout)
        blocks = []
        for i in range(depth):
            enc = first if (share or i == 0) else make()
            if enc is not first:
                enc.tie_to(first)  # e.g. DeBERTa's relative table, shared while projections are not
            attn = Attention(
                dim,
                heads,
                enc,
                head_dim=head_dim,
                causal=causal,
                backend=backend,
                apply_input_stage=self.input_encoding is None,
            )
            blocks.append(Block(dim, attn, mlp_ratio, dropout))
        self.blocks = nn.ModuleList(blocks)
        # DeBERTa's enhanced mask decoder: absolute positions enter only the top blocks
        self.emd_pos = nn.Embedding(max_len, dim) if absolute_from_layer is not None else None
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.embed_std = embed_std
        self.reset_parameters()
        if tie_embeddings and self.tok_emb is not None:
            self.head.weight = self.tok_emb.weight

    def reset_parameters(self) -> None:
        """Re-draw every weight but the encodings' (they init themselves).

        GPT-2 init, N(0, 0.02²), token embedding N(0, embed_std²). Re-seeding and calling
        this gives models with different encodings identical shared weights.
        """
        own = {id(m) for e in self.modules() if isinstance(e, PositionEncoding) for m in e.modules()}
        for m in self.modules():
            if id(m) in own:
                continue
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        if self.tok_emb is not None:
            nn.init.normal_(self.tok_emb.weight, std=self.embed_std)

    @property
    def encodings(self) -> list[PositionEncoding]:
        """The distinct encoding instances of the model (one if shared)."""
        seen: dict[int, PositionEncoding] = {}
        for b in self.blocks:
            seen.setdefault(id(b.attn.encoding), b.attn.encoding)
        return list(seen.values())

    def init_cache(self, batch_size: int, max_len: int, *, dtype=None, device=None) -> ModelCache:
        """An empty KV cache for ``batch_size`` sequences of up to ``max_len`` tokens."""
        layers = [b.attn.init_cache(batch_size, max_len, dtype=dtype, device=device) for b in self.blocks]
        state = None
        if self.input_encoding is not None:
            w = self.blocks[0].attn.q_proj.weight
            state = self.input_encoding.init_state(batch_size, dtype=dtype or w.dtype, device=device or w.device)
        return ModelCache(layers, state)

    def init_memory(self) -> SegmentMemory:
        """An empty Transformer-XL memory of ``memory_len`` tokens per layer."""
        if self.memory_len < 1:
            raise ValueError("this model was built with memory_len=0; pass memory_len >= 1 to use memory")
        return SegmentMemory(self.memory_len, [None] * self.depth)

    def embed(self, tokens: Tensor, pos: Tensor, state: nn.Module | None = None) -> Tensor:
        """Token embeddings plus the input stage: ``(B, L)`` -> ``(B, L, D)``.

        ``state``: the input stage's decoding state (``ModelCache.input_state``), if any.
        """
        enc = self.input_encoding or self.blocks[0].attn.encoding
        if enc.builds_embedding:
            enc.check_length(pos)
            return enc.embed_tokens(tokens, pos)
        x = self.tok_emb(tokens)
        if self.input_encoding is not None:
            enc = self.input_encoding
            x = enc.embed(x, pos) if state is None else enc.embed(x, pos, state=state)
        return x

    def forward(
        self,
        tokens: Tensor,
        pos: Tensor | None = None,
        cache: ModelCache | None = None,
        memory: SegmentMemory | None = None,
        *,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """Logits ``(B, L, vocab_size)``; with ``cache``, append to it and advance it.

        ``key_padding_mask``: ``(B, Lk)`` bool, True = a real token, over every key the call
        attends to (with a cache: the cached tokens first, then these). A query row that
        sees no key (a padding token in a left-padded batch) gets a zero attention output
        in every layer, so no NaN reaches the real tokens.

        With ``memory`` (Transformer-XL), every layer also attends to the memorised
        inputs of earlier segments, and ``memory`` is updated in place with this
        segment (its last ``memory_len`` tokens, detached). Default positions continue
        from the tokens already seen, so distances across segments are true distances.

        Raises:
            ValueError: ``tokens`` not ``(B, L)``, bad positions, cache overflow, or a
                position past ``max_len`` for an encoding that does not extrapolate.
            TypeError: non-integer tokens or positions.
        """
        if not isinstance(tokens, Tensor) or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise TypeError(f"tokens must be an integer tensor, got {getattr(tokens, 'dtype', type(tokens))}")
        if tokens.dim() != 2:
            raise ValueError(f"tokens must have shape (B, L), got {tuple(tokens.shape)}")
        B, L = tokens.shape
        if cache is not None and len(cache.layers) != self.depth:
            raise ValueError(f"cache has {len(cache.layers)} layers, model has {self.depth}")
        if memory is not None and cache is not None:
            raise ValueError("memory and cache cannot be used together")
        if memory is not None and key_padding_mask is not None:
            raise ValueError("key_padding_mask is not supported together with memory")
        offset = cache.length if cache is not None else memory.seen if memory is not None else 0
        axes = self.blocks[0].attn.encoding.axes  # coordinates per position (1: a sequence)
        pos = as_positions(pos, L, offset=offset, device=tokens.device, batch=B, axes=axes)  # (B|1, L[, A])
        for enc in self.encodings:
            enc.check_length(pos)
        if self.emd_pos is not None and pos.numel() and int(pos.max()) >= self.max_len:
            raise ValueError(
                f"absolute_from_layer uses a table of max_len={self.max_len} positions, got position {int(pos.max())}"
            )
        try:
            x = self.drop(self.embed(tokens, pos, cache.input_state if cache is not None else None))
        except IndexError:  # checked only on failure: no host sync on the hot path
            bad = tokens[(tokens < 0) | (tokens >= self.vocab_size)]
            if bad.numel():
                raise ValueError(
                    f"token id {int(bad[0])} is out of range for vocab_size={self.vocab_size} (ids must be 0..{self.vocab_size - 1})"
                ) from None
            raise
        for i, block in enumerate(self.blocks):
            if i == self.absolute_from_layer:
                x = x + self.emd_pos(pos).to(x.dtype)  # (B|1, L, D)
            if memory is None:
                x = block(x, pos, cache.layers[i] if cache is not None else None, key_padding_mask=key_padding_mask)
                continue
            mem = memory.layers[i]
            if mem is not None and mem.shape[0] != B:
                raise ValueError(f"memory holds batch size {mem.shape[0]}, got tokens of batch size {B}")
            x_in = x
            x = block(x, pos, None, memory=mem, memory_pos=memory.pos if mem is not None else None)
            memory.layers[i] = (x_in if mem is None else torch.cat((mem, x_in), 1))[:, -memory.memory_len :].detach()
        if memory is not None:
            if memory.pos is None:
                mpos = pos
            else:
                b = max(pos.shape[0], memory.pos.shape[0])
                mpos = torch.cat((memory.pos.expand(b, -1), pos.expand(b, -1)), 1)  # (B|1, M + L)
            memory.pos = mpos[:, -memory.memory_len :]
            memory.seen += L
        return self.head(self.ln_f(x))

    def num_params(self) -> int:
        """Distinct trainable parameters (tied and shared tensors counted once)."""
        return sum(p.numel() for p in self.parameters())


def save_checkpoint(path, model: TransformerLM, **extra) -> None:
    """Save ``model`` (config + weights) and any ``extra`` picklable data to ``path``."""
    torch.save({"model_config": model.config, "model": model.state_dict(), **extra}, path)


def load_checkpoint(path, *, map_location="cpu") -> tuple[TransformerLM, dict]:
    """Rebuild a model saved by :func:`save_checkpoint`; returns ``(model, extra)``."""
    ckpt = torch.load(path, map_location=map_location, weights_only=False)
    if "model_config" not in ckpt or "model" not in ckpt:
        raise ValueError(f"{path} is not a posenc checkpoint (keys: {sorted(ckpt)})")
    model = TransformerLM(**ckpt.pop("model_config"))
    model.load_state_dict(ckpt.pop("model"))
    return model, ckpt
