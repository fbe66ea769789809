"""The reference model: a decoder-only, pre-norm Transformer LM with any encoding.

Read top to bottom: :class:`MLP`, :class:`Block`, :class:`TransformerLM`. The model is
built from one :class:`~posenc.ModelConfig` (the keyword form builds it); each block's
:class:`~posenc.LayerSpec` names its encoding. Where position enters is the encoding's
business (see :mod:`posenc.base`); the model only reads what the encoding declares:

* ``input_at``: an input stage runs on the token embeddings (0), before a later block
  (``n``, added to the residual stream), inside every layer (``"layer"``), or builds the
  token embedding itself (``"tokens"``);
* ``share_across_layers`` / ``shared_modules``: one instance for all the layers with the
  same spec (``share_encoding`` forces it), or per-layer instances that share some tables;
* ``memory_len``: tokens of earlier segments each layer attends to (:meth:`init_memory`).

Every other stage runs inside each layer's :class:`posenc.Attention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .adaptive import AdaptiveInput, adaptive_head, tie_bands
from .base import PositionEncoding, Stage
from .config import ModelConfig
from .layer.attention import Attention
from .layer.cache import InputHistory, KVCache, ModelCache, run_input_stage
from .layer.call import Call, make_call
from .layer.memory import LayerMemory, SegmentMemory
from .layer.setup import build_for_layer, layer_encodings
from .validate import check_memory

__all__ = ["TransformerLM", "Block"]


class MLP(nn.Module):
    """``drop(proj(act_drop(gelu(fc(x)))))``: ``activation_dropout`` after the activation, as
    fairseq's ``activation_dropout``."""

    def __init__(self, dim: int, hidden: int, dropout: float, activation_dropout: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.proj = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)
        self.act_drop = nn.Dropout(activation_dropout) if activation_dropout else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(self.act_drop(F.gelu(self.fc(x)))))


class Block(nn.Module):
    """Pre-norm block: ``x + attn(LN(x))``, then ``x + mlp(LN(x))``."""

    def __init__(self, dim: int, attn: Attention, mlp_ratio: float, dropout: float, activation_dropout: float = 0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = attn
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, int(dim * mlp_ratio), dropout, activation_dropout)
        self.drop = nn.Dropout(dropout)
        enc = attn.encoding
        self.layer_input = bool(enc.stages & Stage.INPUT) and enc.needs.input_at == "layer"

    def attention_input(self, x: Tensor, call: Call, cache: KVCache | None = None) -> Tensor:
        """What the attention projects: ``LN(x)``, plus the encoding's input stage if it acts per layer."""
        h = self.ln1(x)
        return self.attn.embed_input(h, call, cache) if self.layer_input else h

    def forward(self, x: Tensor, call: Call, cache: KVCache | LayerMemory | None = None) -> Tensor:
        x = x + self.drop(self.attn.attend(self.attention_input(x, call, cache), call, cache))
        return x + self.mlp(self.ln2(x))


class TransformerLM(nn.Module):
    """Decoder-only language model.

    Build it from a :class:`~posenc.ModelConfig` (``TransformerLM(config=cfg)`` or
    :meth:`from_config`), or with the keyword form
    ``TransformerLM(vocab_size, dim, depth, heads, encoding="rope", max_len=None, **kw)``,
    where ``kw`` are :class:`~posenc.ModelConfig` fields (``causal``, ``dropout``,
    ``backend``, ...) and any other keyword is an encoding option. ``.config`` is the
    dataclass.

    Shapes: ``tokens`` ``(B, L)`` int64 -> logits ``(B, L, vocab_size)``.
    """

    def __init__(
        self,
        vocab_size: int | None = None,
        dim: int | None = None,
        depth: int | None = None,
        heads: int | None = None,
        encoding: str = "rope",
        max_len: int | None = None,
        *,
        config: ModelConfig | None = None,
        **kwargs,
    ) -> None:
        super().__init__()
        if config is None:
            config = ModelConfig.from_kwargs(vocab_size, dim, depth, heads, encoding, max_len, **kwargs)
        elif vocab_size is not None or kwargs:
            raise TypeError("pass either config= or the keyword form, not both")
        cfg = self.config = config
        self.vocab_size, self.dim, self.depth, self.heads = cfg.vocab_size, cfg.dim, cfg.depth, cfg.heads
        self.head_dim, self.max_len, self.causal, self.encoding_name = (
            cfg.head_dim,
            cfg.max_len,
            cfg.causal,
            cfg.encoding,
        )
        specs = cfg.layer_specs()
        args = [cfg.attention_args(spec) for spec in specs]
        # layers share an encoding only with equal score settings (they live on the encoding)
        keys = [(spec.key(), a["score_scale"], a["softcap"]) for spec, a in zip(specs, args, strict=True)]
        encs = layer_encodings(keys, lambda i: self._build_encoding(specs[i], args[i]), cfg.share_encoding)
        blocks = []
        for i, kw in enumerate(args):
            attn = Attention(
                cfg.dim, cfg.heads, encs.of(i), head_dim=cfg.head_dim, causal=cfg.causal, backend=cfg.backend, **kw
            )
            blocks.append(Block(cfg.dim, attn, cfg.mlp_ratio, cfg.dropout, cfg.activation_dropout))
        # input stages the model runs on the residual stream: block index -> encodings
        self.stages_before: dict[int, list[PositionEncoding]] = {}
        for enc in encs.firsts:
            at = enc.needs.input_at
            if enc.stages & Stage.INPUT and at != "layer":
                at = 0 if at == "tokens" else at
                if not isinstance(at, int) or not 0 <= at < cfg.depth:
                    raise ValueError(
                        f"encoding {enc.name!r}: input_at must be 'layer', 'tokens' or a block index in [0, {cfg.depth - 1}], got {enc.needs.input_at!r}"
                    )
                self.stages_before.setdefault(at, []).append(enc)
        # the stage at the embeddings, registered here too (checkpoints name its weights so)
        bottom = self.stages_before.get(0, [])
        self.input_encoding: PositionEncoding | None = bottom[0] if bottom else None
        builds = [e for e in bottom if e.needs.input_at == "tokens"]
        self.adaptive = cfg.adaptive_cutoffs is not None  # adaptive input and softmax (posenc.adaptive)
        if self.adaptive and builds:
            raise ValueError(f"adaptive_cutoffs needs a token embedding; encoding {builds[0].name!r} builds its own")
        if self.adaptive:
            self.tok_emb = AdaptiveInput(cfg.vocab_size, cfg.dim, cfg.adaptive_cutoffs, cfg.adaptive_factor)
            self.head = adaptive_head(cfg.dim, cfg.vocab_size, cfg.adaptive_cutoffs, cfg.adaptive_factor)
        else:
            self.tok_emb = None if builds else nn.Embedding(cfg.vocab_size, cfg.dim)
            self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(cfg.dim) if cfg.final_norm else nn.Identity()
        self.embed_std = cfg.embed_std
        self.reset_parameters()
        if cfg.tie_embeddings and self.adaptive:
            tie_bands(self.head, self.tok_emb)
        elif cfg.tie_embeddings and self.tok_emb is not None:
            self.head.weight = self.tok_emb.weight

    def _build_encoding(self, spec, args: dict) -> PositionEncoding:
        """A new encoding for layer ``spec`` (:func:`posenc.layer.setup.layer_encodings` decides sharing)."""
        cfg = self.config
        size = {"heads": cfg.heads, "head_dim": cfg.head_dim, "dim": cfg.dim, "max_len": cfg.max_len}
        enc = build_for_layer(spec.encoding, spec.options, causal=cfg.causal, vocab_size=cfg.vocab_size, **size)
        return enc.set_scores(scale=args["score_scale"], softcap=args["softcap"])

    @classmethod
    def from_config(cls, config: ModelConfig) -> TransformerLM:
        return cls(config=config)

    def reset_parameters(self) -> None:
        """Re-draw every weight but the encodings' (they init themselves).

        GPT-2 init, N(0, 0.02²), token embedding N(0, embed_std²); an adaptive input keeps
        fairseq's init (:class:`posenc.adaptive.AdaptiveInput`). Re-seeding and calling
        this gives models with different encodings identical shared weights.
        """
        own = {id(m) for e in self.modules() if isinstance(e, (PositionEncoding, AdaptiveInput)) for m in e.modules()}
        for m in self.modules():
            if id(m) in own:
                continue
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        if isinstance(self.tok_emb, AdaptiveInput):
            self.tok_emb.reset_parameters()
        elif self.tok_emb is not None:
            nn.init.normal_(self.tok_emb.weight, std=self.embed_std)

    @property
    def encodings(self) -> list[PositionEncoding]:
        """The distinct encoding instances of the model (one if shared)."""
        seen: dict[int, PositionEncoding] = {}
        for b in self.blocks:
            seen.setdefault(id(b.attn.encoding), b.attn.encoding)
        return list(seen.values())

    def init_cache(self, batch_size: int, max_len: int, *, dtype=None, device=None, policy=None) -> ModelCache:
        """An empty KV cache for ``batch_size`` sequences of up to ``max_len`` tokens (windowed layers:
        rolling, ``O(W)``; ``policy=SinkWindow(...)``: StreamingLLM's; :meth:`posenc.Attention.init_cache`).

        Raises:
            ValueError: the caches of all the layers need more bytes than ``device`` has
                (:func:`posenc.validate.check_memory`; the message names the bytes).
        """
        kw = {"dtype": dtype, "device": device, "policy": policy}
        sizes = [b.attn.init_cache(batch_size, max_len, **{**kw, "device": "meta"}) for b in self.blocks]  # no data
        need = sum(t.nbytes for c in sizes for t in (c.k, c.v, c.pos))
        where = device if device is not None else self.blocks[0].attn.q_proj.weight.device
        check_memory(f"TransformerLM.init_cache({batch_size}, {max_len})", need, where)
        return ModelCache([b.attn.init_cache(batch_size, max_len, **kw) for b in self.blocks])

    def init_memory(self, memory_len: int | None = None) -> SegmentMemory:
        """An empty Transformer-XL memory: ``memory_len`` tokens per layer, by default the
        longest memory the encodings declare (``xl``'s ``memory_len`` option)."""
        m = max(e.needs.memory_len for e in self.encodings) if memory_len is None else memory_len
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ValueError(
                f"memory_len must be an int >= 1, got {m!r}; build the encoding with memory_len >= 1 "
                "(xl) or pass init_memory(memory_len=M)"
            )
        return SegmentMemory.empty(m, self.depth)

    def _run_stages(self, at: int, x: Tensor, call: Call, cache: ModelCache | None) -> Tensor:
        for enc in self.stages_before.get(at, ()):
            history = None
            if cache is not None and enc.needs.input_context > 0:
                history = cache.inputs.setdefault(at, InputHistory(enc.needs.input_context))
            x = run_input_stage(enc, x, call.pos, history, call.documents)
        return x

    def embed(self, tokens: Tensor, call: Call, cache: ModelCache | None = None) -> Tensor:
        """Token embeddings plus the input stages at the embeddings: ``(B, L)`` -> ``(B, L, D)``.

        An adaptive input is scaled by ``D^1/2`` before the input stages, as fairseq's decoder
        scales it (``embed_scale``; ``transformer_lm_wiki103`` keeps ``no_scale_embedding`` False).
        """
        x = tokens if self.tok_emb is None else self.tok_emb(tokens)
        if self.adaptive:
            x = x * self.config.dim**0.5
        return self._run_stages(0, x, call, cache)

    def make_call(
        self,
        tokens: Tensor,
        pos: Tensor | None = None,
        cache: ModelCache | None = None,
        memory: SegmentMemory | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
    ) -> Call:
        """The :class:`~posenc.layer.call.Call` every layer of one forward shares (see :meth:`forward`)."""
        if not isinstance(tokens, Tensor) or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise TypeError(f"tokens must be an integer tensor, got {getattr(tokens, 'dtype', type(tokens))}")
        if tokens.dim() != 2:
            raise ValueError(f"tokens must have shape (B, L), got {tuple(tokens.shape)}")
        for what, held in (("cache", cache), ("memory", memory)):
            if held is not None and len(held.layers) != self.depth:
                raise ValueError(f"{what} has {len(held.layers)} layers, model has {self.depth}")
        B, L = tokens.shape
        past = cache.length if cache is not None else memory.seen if memory is not None else 0
        kw = {"key_padding_mask": key_padding_mask, "document_ids": document_ids}
        kind = {"cache": cache is not None, "memory": memory is not None}
        return make_call(B, L, encodings=self.encodings, pos=pos, past=past, device=tokens.device, **kw, **kind)

    def forward(
        self,
        tokens: Tensor,
        pos: Tensor | None = None,
        cache: ModelCache | None = None,
        memory: SegmentMemory | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        targets: Tensor | None = None,
    ) -> Tensor:
        """Logits ``(B, L, vocab_size)``; with ``cache``, append to it and advance it.

        With an adaptive softmax (``adaptive_cutoffs``) the "logits" are exact
        log-probabilities. ``targets`` ``(B, L)``: return each token's loss ``-log p(target)``
        ``(B, L)`` float32 instead (the adaptive softmax then computes only the bands the
        targets fall in).

        ``key_padding_mask``: ``(B, Lk)`` bool, True = a real token, over every key the call
        attends to (with a cache: the cached tokens first, then these). A query row that
        sees no key (a padding token in a left-padded batch) gets a zero attention output
        in every layer, so no NaN reaches the real tokens.

        ``document_ids``: ``(B, L)`` (or ``(L,)``) int, packed sequences: each run of equal
        ids is one document, whose tokens attend only to each other in every layer (and
        whose input stages see only its own tokens); with ``pos`` None the positions
        restart at 0 in every document (:func:`posenc.positions.document_positions`), so
        each document gets the logits it would get alone. Not with ``cache`` or ``memory``.

        With ``memory`` (:meth:`init_memory`, Transformer-XL), every layer also attends to
        the memorised inputs of earlier segments, and ``memory`` is updated in place with
        this segment (its last ``memory_len`` tokens, detached). Default positions continue
        from the tokens already seen, so distances across segments are true distances.

        Raises:
            ValueError: ``tokens`` not ``(B, L)``, bad positions, cache overflow, or a
                position past ``max_len`` for an encoding that does not extrapolate.
            TypeError: non-integer tokens or positions.
        """
        call = self.make_call(tokens, pos, cache, memory, key_padding_mask=key_padding_mask, document_ids=document_ids)
        try:
            x = self.drop(self.embed(tokens, call, cache))
        except IndexError:  # checked only on failure: no host sync on the hot path
            bad = tokens[(tokens < 0) | (tokens >= self.vocab_size)]
            if bad.numel():
                raise ValueError(
                    f"token id {int(bad[0])} is out of range for vocab_size={self.vocab_size} (ids must be 0..{self.vocab_size - 1})"
                ) from None
            raise
        layers = cache.layers if cache is not None else memory.layers if memory is not None else [None] * self.depth
        for i, (block, layer_cache) in enumerate(zip(self.blocks, layers, strict=True)):
            if i > 0:
                x = self._run_stages(i, x, call, cache)
            x = block(x, call, layer_cache)
        return self.output(self.ln_f(x), targets)

    def output(self, h: Tensor, targets: Tensor | None = None) -> Tensor:
        """The head on the final states ``h`` ``(B, L, D)``: logits (log-probabilities when
        adaptive), or with ``targets`` each token's loss ``(B, L)`` float32."""
        if not self.adaptive:
            logits = self.head(h)
            if targets is None:
                return logits
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view(
                targets.shape
            )
        flat = h.flatten(0, 1)
        if targets is None:
            return self.head.log_prob(flat).view(*h.shape[:-1], -1)
        nll = -self.head(flat, targets.flatten()).output.float().view(targets.shape)
        # a tail band no target falls in has a zero gradient, not none: the optimizer then
        # steps every band on every update, with any number of processes (and DDP sees every
        # parameter used)
        return nll + 0.0 * sum(p.sum() for p in self.head.tail.parameters())

    def num_params(self) -> int:
        """Distinct parameters, trainable or not (tied and shared tensors counted once)."""
        return sum(p.numel() for p in self.parameters())
