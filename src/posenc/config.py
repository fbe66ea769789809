"""The model's configuration: one typed, serialisable dataclass, with a per-layer spec.

::

    cfg = posenc.ModelConfig(vocab_size=256, dim=128, depth=4, heads=4, encoding="t5", max_len=128,
                             options={"num_buckets": 16})
    lm = posenc.TransformerLM.from_config(cfg)      # == posenc.TransformerLM(256, 128, 4, 4, "t5", 128, num_buckets=16)
    lm.config.to_dict()                             # JSON-ready; ModelConfig.from_dict reads it back

``layers`` gives each block its own :class:`LayerSpec`; left out, every block gets
``LayerSpec(encoding, options)``. What varies per layer is a field of the spec, never
another model argument.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .adaptive import check_cutoffs
from .attend.backends import canonical_backend
from .fields import DROPOUT, Float, Int, check
from .layer.qk_norm import check_qk_norm
from .layer.setup import check_kv_heads
from .layer.spec import SPEC_FIELDS, LayerSpec
from .patterns import is_pattern, layers
from .registry import get_class, options_of
from .validate import check_args, score_setting

__all__ = ["LayerSpec", "ModelConfig"]

_OWN = ("kv_heads", "score_scale", "softcap")  # ModelConfig fields a LayerSpec may override
_POSITIVE = Int(1)


@dataclass
class ModelConfig:
    """Everything :class:`posenc.TransformerLM` needs.

    Attributes:
        vocab_size: number of token ids.
        dim: model width ``D``.
        depth: number of blocks.
        heads: attention heads ``H``.
        encoding: the encoding of every block (unless ``layers`` says otherwise), or a
            layer pattern / preset (``"rope*3,nope"``, ``"gemma3"``; see :func:`posenc.layers`),
            or a list of names / specs, one per layer; these fill ``layers`` (``options``
            then act as the pattern's overrides).
        max_len: training length, passed to the encodings (``learned`` needs it).
        head_dim: ``Dh``; ``dim // heads`` when None (filled in).
        causal: causal LM (True) or a bidirectional encoder stack (False).
        mlp_ratio: MLP hidden width over ``D``.
        dropout: residual and MLP dropout.
        attn_dropout: dropout on the attention probabilities of every layer (fairseq's
            ``attention_dropout``; :class:`posenc.Attention`).
        activation_dropout: dropout after the MLP's activation (fairseq's ``activation_dropout``).
        backend: attention backend of every layer (``"auto"`` or a :data:`posenc.BACKENDS` name).
        share_encoding: one encoding instance for all layers with the same spec; None
            follows the encoding (T5 shares its table, as the paper does).
        tie_embeddings: share the token embedding with the output layer.
        embed_std: std of the token embedding init (GPT-2's 0.02; ~1, untied, for
            encodings that add unit-amplitude vectors such as ``sinusoidal``).
        kv_heads: key/value heads of every layer (grouped-query; 1: multi-query); None = ``heads``.
        qk_norm, qk_norm_position, qk_norm_eps: per-head q/k normalisation (``"rms"``,
            ``"gemma-rms"``, ``"l2"`` or None; ``"before"``/``"after"`` the q/k stage;
            :mod:`posenc.layer.qk_norm`).
        score_scale, softcap: the score scale in place of ``Dh^-1/2`` and the tanh logit
            soft-cap of every layer (None: off). A :class:`LayerSpec`'s own ``kv_heads``,
            ``score_scale``, ``softcap`` override these for its layer.
        options: encoding options of every block (unless ``layers`` is given).
        layers: one :class:`LayerSpec` per block; None = ``LayerSpec(encoding, options)`` each.
        final_norm: a LayerNorm after the last block (False: pre-norm without a final norm,
            fairseq's ``no_decoder_final_norm``, as Press et al.'s WikiText-103 models).
        adaptive_cutoffs: None (a token embedding and a linear output), or the band cutoffs of
            an adaptive input and an adaptive softmax (:mod:`posenc.adaptive`); the forward then
            returns exact log-probabilities, and ``tie_embeddings`` ties the tail bands.
        adaptive_factor: band ``i``'s width is ``dim // adaptive_factor**i`` (fairseq: 4).
    """

    # a field with a range declares it (posenc.fields); the others are checked by their annotation
    # (posenc.validate.check_args) or by the check Attention shares (kv_heads, qk_norm, scores)
    vocab_size: int = _POSITIVE.field()
    dim: int = _POSITIVE.field()
    depth: int = _POSITIVE.field()
    heads: int = _POSITIVE.field()
    encoding: str | list | tuple = "rope"
    max_len: int | None = Int(1, optional=True).field(None)
    head_dim: int | None = Int(1, optional=True).field(None)
    causal: bool = True
    mlp_ratio: float = Float(0, lo_open=True).field(4.0)
    dropout: float = DROPOUT.field(0.0)
    attn_dropout: float = DROPOUT.field(0.0)
    activation_dropout: float = DROPOUT.field(0.0)
    backend: str = "auto"
    share_encoding: bool | None = None
    tie_embeddings: bool = True
    embed_std: float = Float(0).field(0.02)
    kv_heads: int | None = None
    qk_norm: str | None = None
    qk_norm_position: str = "before"
    qk_norm_eps: float = 1e-6
    score_scale: float | None = None
    softcap: float | None = None
    options: dict[str, Any] = field(default_factory=dict)
    layers: list[LayerSpec] | None = None
    final_norm: bool = True
    adaptive_cutoffs: list[int] | None = None
    adaptive_factor: float = Float(1).field(4.0)

    def __post_init__(self) -> None:
        check(self)  # every declared field's type and range
        if self.head_dim is None:
            if self.dim % self.heads:
                raise ValueError(f"dim={self.dim} is not divisible by heads={self.heads}; pass head_dim explicitly")
            self.head_dim = self.dim // self.heads
        if int(self.dim * self.mlp_ratio) < 1:
            raise ValueError(
                f"mlp_ratio must be a finite number > 0 with int(dim * mlp_ratio) >= 1 (dim={self.dim}), "
                f"got {self.mlp_ratio!r}"
            )
        canonical_backend(self.backend)
        if self.adaptive_cutoffs is not None:
            self.adaptive_cutoffs = check_cutoffs(self.adaptive_cutoffs, self.vocab_size)
        check_qk_norm(self.qk_norm, self.qk_norm_position, self.qk_norm_eps)
        self.score_scale = score_setting("score_scale", self.score_scale)
        self.softcap = score_setting("softcap", self.softcap)
        # the annotated types of the rest (causal, tie_embeddings, share_encoding: bools)
        check_args("ModelConfig", ModelConfig, {f.name: getattr(self, f.name) for f in fields(self)})
        self.options = dict(self.options)
        if isinstance(self.encoding, (list, tuple)):  # one entry per layer (names, patterns, specs)
            if self.layers is not None:
                raise ValueError("give the layers as encoding=[...] or layers=[...], not both")
            self.layers = layers(list(self.encoding), self.depth, **self.options)
            self.encoding = ",".join(s.describe() for s in self.layers)
        elif self.layers is None and isinstance(self.encoding, str) and is_pattern(self.encoding):
            self.layers = layers(self.encoding, self.depth, **self.options)
        elif self.layers is None and any(k in self.options for k in SPEC_FIELDS):
            # a plain encoding with layer fields (window=8): every layer gets them, as Attention does
            own = options_of(get_class(self.encoding))  # (an option of the encoding's own name stays one)
            spec = {k: self.options.pop(k) for k in SPEC_FIELDS if k in self.options and k not in own}
            self.layers = [LayerSpec(self.encoding, dict(self.options), **spec) for _ in range(self.depth)]
        if self.layers is not None:
            self.layers = [s if isinstance(s, LayerSpec) else LayerSpec(**s) for s in self.layers]
            if len(self.layers) != self.depth:
                raise ValueError(f"layers has {len(self.layers)} specs for depth={self.depth}")
        for spec in self.layers or ():
            check_kv_heads(self.heads, spec.kv_heads)
        check_kv_heads(self.heads, self.kv_heads)

    def layer_specs(self) -> list[LayerSpec]:
        """The spec of every block: ``layers``, or ``LayerSpec(encoding, options)`` repeated."""
        if self.layers is not None:
            return list(self.layers)
        return [LayerSpec(self.encoding, self.options) for _ in range(self.depth)]

    def attention_args(self, spec: LayerSpec) -> dict[str, Any]:
        """The :class:`posenc.Attention` keywords of the layer ``spec`` (its fields over the model's)."""
        pick = {n: getattr(spec, n) if getattr(spec, n) is not None else getattr(self, n) for n in _OWN}
        norm = {"qk_norm": self.qk_norm, "qk_norm_position": self.qk_norm_position, "qk_norm_eps": self.qk_norm_eps}
        return {"window": spec.window, "chunk": spec.chunk, "sinks": spec.sinks, **pick, **norm,
                "attn_dropout": self.attn_dropout}  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (JSON-ready when the options are)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Read :meth:`to_dict`'s output, or a flat dict with the encoding options at the top level."""
        d = dict(d)
        names = {f.name for f in fields(cls)}
        options = dict(d.pop("options", None) or {})
        options.update({k: d.pop(k) for k in list(d) if k not in names})
        return cls(**d, options=options)

    @classmethod
    def from_kwargs(cls, *args, **kwargs) -> ModelConfig:
        """``TransformerLM``'s keyword form: config fields by name, any other keyword an encoding option."""
        names = [f.name for f in fields(cls)]
        if len(args) > 6:
            raise TypeError(f"at most 6 positional arguments ({', '.join(names[:6])}), got {len(args)}")
        given = dict(zip(names, args, strict=False))
        clash = sorted(set(given) & set(kwargs))
        if clash:
            raise TypeError(f"got multiple values for {clash}")
        options = dict(kwargs.pop("options", None) or {})
        options.update({k: kwargs.pop(k) for k in list(kwargs) if k not in names})
        return cls(**given, **kwargs, options=options)
