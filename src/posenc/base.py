"""The :class:`PositionEncoding` base class, its stage flags, and the registry.

Every position encoding is a choice of *where position enters attention* (see
``posenc/__init__.py`` for the picture). One class declares which of five stages it
uses and implements only those methods; :class:`posenc.Attention` calls them and
picks the fastest backend that can run them.

The score every backend computes, for one head::

    s_ij = scale · (q̃_i·k̃_j + score_terms_ij) + bias_ij + mask_ij
    o_i  = Σ_j softmax_j(s)_ij · v_j + value_term_i

with ``q̃, k̃ = rotate(q, k)`` (an encoding with the ``SCORES`` stage supplies the whole
``q̃_i·k̃_j`` term itself, per pair, from ``qk_scores``: ReRoPE, Self-Extend) and ``scale = encoding.scale`` (``Dh^-1/2`` unless the
encoding says otherwise: T5 optionally uses 1, DeBERTa ``(Dh·(1+#terms))^-1/2``).

The registry is filled by the encodings themselves (``@register``) when ``posenc``
imports :mod:`posenc.encodings`; this module imports nothing above it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import ClassVar

from torch import Tensor, nn

from . import functional as PF
from .context import InputRead
from .functional import (
    as_positions,  # re-exported: the layer and model call them from here
    check_lengths,
)
from .validate import checked_init, ignoring_keywords, missing_keywords, position_checked, score_setting

__all__ = [
    "Stage",
    "PositionEncoding",
    "ScoreMod",
    "check_lengths",
    "as_positions",
]

# FlexAttention's score_mod signature: (score, b, h, q_idx, kv_idx) -> score
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

BASE_ARGS = ("heads", "head_dim", "max_len", "causal")  # checked by PositionEncoding.__init__ itself
STAGE_METHODS = ("embed", "rotate", "rotate_value", "bias", "score_terms", "qk_scores", "value_term", "weights")
# the keywords the layer and the backends pass that a method may be written without: ``ctx=``
# (a posenc.Context) to the stages; which input rows are real tokens, and of which document,
# to read_input
CALL_KEYWORDS = {**{m: ("ctx",) for m in (*STAGE_METHODS[1:], "score_mod", "distance_terms")},
                 "read_input": ("keep", "documents")}  # fmt: skip
POSITION_ARGS = ("pos", "q_pos", "k_pos")  # the stage methods' position arguments


class Stage(enum.Flag):
    """Where an encoding enters attention."""

    NONE = 0
    INPUT = enum.auto()  # embed(x, pos): before the projections
    QK = enum.auto()  # rotate(q, k, q_pos, k_pos): on queries and keys
    BIAS = enum.auto()  # bias(q_pos, k_pos) / score_mod: a scalar per (h, i, j)
    TERMS = enum.auto()  # score_terms(q, k, q_pos, k_pos): content-dependent relative terms
    VALUE = enum.auto()  # value_term(attn, q_pos, k_pos): relative vectors on the values
    SCORES = enum.auto()  # qk_scores(q, k, q_pos, k_pos): the q·k term itself, per (i, j) (ReRoPE)
    NORM = enum.auto()  # weights(s): the attention weights from the masked scores, in place of softmax

    def names(self) -> list[str]:
        return [s.name.lower() for s in Stage if s in self and s is not Stage.NONE]


class PositionEncoding(nn.Module):
    """Base class of every encoding.

    Subclasses set the class attributes below, call ``super().__init__`` with the
    common arguments, and override the stage methods they declare in ``stages``.

    Class attributes (fixed by the encoding):
        name: registry name.
        family: "none", "absolute", "rotary", "bias", "relative".
        paper, year: the paper the encoding comes from.
        causal_only: raise when built with ``causal=False``.
        share_across_layers: one instance serves every layer of a model by default
            (T5's bucket table, as the paper does).
        shared_modules: submodules that every layer's instance takes from the first
            layer's when the instance itself is not shared (DeBERTa's relative table).
        variants: registered names of subclasses with other stages that ``build(name, ...)``
            makes instead when an option only they take is given (``nope`` with
            ``attn_scale``: ``nope-temperature``, :func:`posenc.registry.resolve`); an option
            never changes the stages of a class.

    Declarations (class defaults; an instance may set them from its options). They say
    what an encoding needs from the layer, the model and the cache, so that neither
    :class:`posenc.Attention` nor :class:`posenc.TransformerLM` knows any encoding:
        stages: the :class:`Stage` flags used.
        input_at: where a model applies the input stage: an int ``n`` adds it to the
            residual stream before block ``n`` (0, the default: once, on the token
            embeddings; DeBERTa's enhanced mask decoder: before a top block);
            ``"layer"`` on every attention layer's input, inside the layer (FLOATER);
            ``"tokens"`` builds the token embedding from the ids (Complex Order). A bare
            :class:`posenc.Attention` runs it on its input when it is 0 or ``"layer"``.
        input_context: preceding inputs the input stage reads (a causal convolution's
            ``k - 1``): a KV cache keeps that many and runs the stage on them plus the new ones.
        cache_raw_keys: the KV cache stores keys before ``rotate`` and re-rotates all of
            them at every step (rotations that depend on the whole call, such as dynamic
            NTK); otherwise it stores rotated keys.
        memory_len: tokens of earlier segments each layer attends to (Transformer-XL's
            recurrence, :meth:`posenc.TransformerLM.init_memory`); 0 = none.
        axes: coordinates per position the encoding reads, ``A``: 1 for a sequence, 2 or 3
            for image rows/columns or video time/rows/columns (set per instance by the
            encodings that take an ``axes`` option). With ``A > 1`` every stage receives
            positions ``(B|1, L, A)``; see :meth:`axis_positions`.
        per_head_keys: the key-side stages (``read_input``, ``rotate`` on keys, ``rotate_value``)
            hold per-head parameters: with grouped k/v the layer repeats keys and values to
            ``heads`` before them (:mod:`posenc.attention_setup`); else they run on ``kv_heads``.
        score_scale, softcap: the model's score scale in place of ``Dh^-1/2`` (Gemma 3's
            ``query_pre_attn_scalar**-0.5``) and tanh logit soft-capping (Gemma 2), None = off;
            set per instance by :meth:`set_scores` only.
    """

    name: ClassVar[str] = ""
    family: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    year: ClassVar[int] = 0
    causal_only: ClassVar[bool] = False
    share_across_layers: ClassVar[bool] = False
    shared_modules: ClassVar[tuple[str, ...]] = ()
    variants: ClassVar[tuple[str, ...]] = ()
    stages: Stage = Stage.NONE
    input_at: int | str = 0
    input_context: int = 0
    cache_raw_keys: bool = False
    memory_len: int = 0
    axes: int = 1
    per_head_keys: bool = False
    score_scale: float | None = None
    softcap: float | None = None

    def __init_subclass__(cls, **kwargs) -> None:
        """Wrap the class's ``__init__`` to check its options against their annotations (a bool
        option takes a bool, no NaN or infinity anywhere: :mod:`posenc.validate`), and its stage
        methods to turn the ``IndexError`` of a table read past its end into the ``ValueError``
        of :meth:`check_length` (nothing checked, no host sync, on a call that succeeds)."""
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None:
            cls.__init__ = checked_init(init, skip=BASE_ARGS)
        for name in STAGE_METHODS:
            fn = cls.__dict__.get(name)
            if fn is not None and not getattr(fn, "checks_positions", False):
                setattr(cls, name, position_checked(fn, POSITION_ARGS))
        for name, keywords in CALL_KEYWORDS.items():
            fn = cls.__dict__.get(name)
            if fn is not None and (missing := missing_keywords(fn, keywords)):
                setattr(cls, name, ignoring_keywords(fn, missing))

    def __init__(self, *, heads: int, head_dim: int, max_len: int | None = None, causal: bool = True) -> None:
        super().__init__()
        for arg, val in (("heads", heads), ("head_dim", head_dim)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{arg} must be a positive int, got {val!r}")
        if max_len is not None and (not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1):
            raise ValueError(f"max_len must be a positive int or None, got {max_len!r}")
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {causal!r} ({type(causal).__name__})")
        if self.causal_only and not causal:
            raise ValueError(f"encoding {self.name!r} is causal only; build it with causal=True")
        self.heads = heads
        self.head_dim = head_dim
        self.dim = heads * head_dim
        self.max_len = max_len
        self.causal = causal

    # ------------------------------------------------------------------ properties
    @property
    def relative(self) -> bool:
        """Scores are unchanged when every position shifts by the same amount."""
        raise NotImplementedError

    @property
    def extrapolates(self) -> bool:
        """The encoding works for positions at or past ``max_len``."""
        return True

    @property
    def position_limit(self) -> int | tuple[int, ...] | None:
        """Positions must be below this (a tuple: per axis); None when any position works.

        ``max_len`` for an encoding that does not extrapolate.
        """
        return None if self.extrapolates else self.max_len

    @property
    def scale(self) -> float:
        """Multiplier of ``q̃·k̃ + score_terms``: :attr:`dh_scale` by default. An encoding with a
        scale of its own overrides this and builds it on :attr:`dh_scale`, keeping its own factor."""
        return self.dh_scale

    @property
    def dh_scale(self) -> float:
        """``Dh^-1/2``, or :attr:`score_scale` in its place when set."""
        return self.head_dim**-0.5 if self.score_scale is None else self.score_scale

    def set_scores(self, *, scale: float | None = None, softcap: float | None = None) -> PositionEncoding:
        """Set :attr:`score_scale` (replaces the ``Dh^-1/2`` factor of :attr:`scale`) and
        :attr:`softcap` (every score ``s`` becomes ``c·tanh(s/c)`` before mask and sinks:
        :func:`posenc.scores`; backends that cannot express it drop out of
        :func:`posenc.supported_backends`). Each a positive finite number or None (off).
        Returns ``self``."""
        self.score_scale = score_setting("scale", scale)
        self.softcap = score_setting("softcap", softcap)
        return self

    def extra_repr(self) -> str:
        out = f"heads={self.heads}, head_dim={self.head_dim}, max_len={self.max_len}, causal={self.causal}"
        for name in ("score_scale", "softcap"):
            if getattr(self, name) is not None:
                out += f", {name}={getattr(self, name)}"
        return out

    # ------------------------------------------------------------------ buffers
    def init_buffers(self) -> None:
        """(Re)build non-persistent cached tables (float32) on their current device.

        Called after every ``.to()`` / ``.to_empty()`` / ``.cuda()`` (see :meth:`_apply`),
        so ``model.to(torch.bfloat16)`` keeps tables in float32 and a model built on the
        ``meta`` device gets real tables once materialised.
        """

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.init_buffers()
        return out

    def length_error(self, hi: int, axis: int | None = None) -> str:
        """The message for a position ``hi >= position_limit`` (on ``axis`` when the limit is per axis)."""
        return (
            f"encoding {self.name!r} supports positions 0..{self.position_limit - 1} (max_len={self.max_len}), "
            f"got position {hi}; it does not extrapolate"
        )

    def check_length(self, pos: Tensor) -> None:
        """Raise ``ValueError`` if ``pos`` holds a position at or past :attr:`position_limit`.

        Layers and models call it once per call, at the door (:func:`check_lengths`). A stage
        method called directly with such a position raises the same ``ValueError`` where
        its table read fails (on the CPU; on CUDA an out-of-range read is a device-side
        assert, so check first there).
        """
        check_lengths([self], self.axis_positions(pos) if self.axes > 1 else pos)

    def set_axes(self, axes: int) -> None:
        """Set :attr:`axes` from an encoding's ``axes`` option (a positive int)."""
        if not isinstance(axes, int) or isinstance(axes, bool) or axes < 1:
            raise ValueError(f"axes must be a positive int (1 for a sequence, 2 or 3 for grids), got {axes!r}")
        self.axes = axes

    def axis_positions(self, pos: Tensor, length: int | None = None) -> Tensor:
        """``pos`` as ``(B|1, L, A)`` with ``A = self.axes``, for direct calls of the stage methods.

        ``(B|1, L, A)`` passes through; ``(L, A)``, ``(L,)`` and ``(B, L)`` are validated and
        expanded by :func:`posenc.functional.check_positions` (one position per token stands
        for the same coordinate on every axis). ``length``: the sequence length, when known;
        without it a 2-D tensor whose last dimension is ``A`` is read as ``(L, A)``.
        """
        if pos.dim() == 3 and pos.shape[-1] == self.axes:
            return pos
        if length is None:
            length = pos.shape[0] if pos.dim() == 2 and pos.shape[-1] == self.axes else pos.shape[-1]
        return PF.check_positions(pos, length, axes=self.axes)

    def _position_message(self, given: dict, names: list[str]) -> str | None:
        """Why the positions ``given[name]`` of a failed stage call cannot be read (negative, or
        at or past :attr:`position_limit`), or None when they can."""
        for name in names:
            p = given.get(name)
            if not isinstance(p, Tensor) or p.is_floating_point() or p.numel() == 0:
                continue
            lo = int(p.min())
            if lo < 0:
                return f"encoding {self.name!r}: {name} holds position {lo}; positions must be >= 0"
            if self.position_limit is not None:
                try:
                    self.check_length(p)
                except ValueError as e:
                    return f"{e} ({name})"
        return None

    # ------------------------------------------------------------------ stages
    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        """Input stage. ``x``: ``(B, L, D)``, ``pos``: ``(L,)`` or ``(B, L)`` -> ``(B, L, D)``.

        An encoding whose :attr:`input_at` is ``"tokens"`` builds the embedding: ``x`` is
        then the ``(B, L)`` token ids.
        """
        return x

    def read_input(self, x: Tensor, k: Tensor, v: Tensor, carry=None, *, keep=None, documents=None) -> InputRead:
        """What the encoding computes from the layer input for the tokens a call adds.

        ``x`` ``(B, L, D)``: the layer input rows of those tokens (with Transformer-XL memory,
        the memory's rows first); ``k``, ``v`` ``(B, H, L, Dh)``: their projections, before
        the q/k stage; ``carry``: what the previous call of the same KV cache returned (None
        without a cache, on its first call, or when there is none); ``keep``: ``(B, L)`` bool,
        True = a real token (False: padding), or None; ``documents``: ``(B|1, L)`` int, packed
        sequences (no cache), or None: a stage that mixes neighbouring rows must not cross them. Returns an
        :class:`~posenc.context.InputRead`: the keys and values the layer uses, per-token
        state the score side reads as ``ctx.q_state``/``ctx.k_state`` (the cache keeps it
        beside the keys), and the next carry. The default reads nothing; an encoding whose
        position term comes from the hidden state (FoX's gates) overrides it.
        """
        return InputRead(k, v, {}, carry)

    @property
    def reads_input(self) -> bool:
        """The encoding overrides :meth:`read_input` (the layer calls it)."""
        return type(self).read_input is not PositionEncoding.read_input

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, ctx=None) -> tuple[Tensor, Tensor]:
        """q/k stage. ``q``: ``(B, H, Lq, Dh)``, ``k``: ``(B, H, Lk, Dh)``; same shapes out.

        ``ctx``: the call's :class:`~posenc.Context` (None in a direct call), for every
        method below: an encoding reads from it what the call has beyond its arguments.
        """
        return q, k

    def rotate_value(self, v: Tensor, k_pos: Tensor, ctx=None) -> Tensor:
        """Part of the q/k stage when :attr:`rotates_value`: values rotated by their key
        position (RoFormer's ``rotary_value``); identity by default."""
        return v

    @property
    def rotates_value(self) -> bool:
        return False

    def bias(self, q_pos: Tensor, k_pos: Tensor, ctx=None) -> Tensor:
        """Scalar score stage: ``(H, Lq, Lk)`` for 1-D positions, ``(B, H, Lq, Lk)`` for 2-D.

        Float32, added after ``scale``.
        """
        raise NotImplementedError

    def score_mod(self, q_pos: Tensor, k_pos: Tensor, ctx=None) -> ScoreMod:
        """The same bias as a FlexAttention ``score_mod`` closure.

        ``q_pos``/``k_pos`` are ``(B, L)``; the closure maps ``(score, b, h, q_idx, kv_idx)``
        to ``score + bias[b, h, q_idx, kv_idx]`` without an ``L×L`` tensor. The default
        indexes the dense :meth:`bias` and is meant only as a fallback.
        """
        dense = self.bias(q_pos, k_pos, ctx=ctx)

        def mod(score, b, h, q_idx, kv_idx):
            return score + dense[b, h, q_idx, kv_idx]

        return mod

    @property
    def has_score_mod(self) -> bool:
        """True when :meth:`score_mod` is a real elementwise form (not the dense fallback)."""
        return type(self).score_mod is not PositionEncoding.score_mod

    def score_terms(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, ctx=None) -> Tensor:
        """Vector score stage: ``(B, H, Lq, Lk)`` added to ``q̃·k̃`` before ``scale``.

        The score sum gives ``ctx.mask`` (the call's bool mask) and ``ctx.qk`` (the plain
        ``q·kᵀ`` it computed: CoPE's gates read both); ``ctx.qk_proj`` holds the layer's
        ``W_Q``/``W_K`` (DeBERTa's ``share_att_key``).
        """
        raise NotImplementedError

    def qk_scores(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, ctx=None) -> Tensor:
        """Pair score stage: float32 ``(B, H, Lq, Lk)`` that *replaces* ``q̃·k̃`` (before ``scale``).

        For encodings whose ``q·k`` term is not one rotation of the queries and keys, e.g.
        two score maps merged by distance (ReRoPE, Self-Extend). ``q``, ``k`` come from the
        q/k stage (the identity for such an encoding, so the KV cache holds raw keys).
        """
        raise NotImplementedError

    def weights(self, s: Tensor, ctx=None) -> Tensor:
        """Normaliser stage: float32 scores ``s`` ``(B, H, Lq, Lk)`` (masked keys ``-inf``, in key
        order) -> attention weights of the same shape, in place of ``softmax(s, -1)``.

        For encodings whose position signal is the normaliser itself (stick-breaking
        attention). A row's weights need not sum to 1; a masked key must get weight 0. Only
        the backends that hold every key a query sees at once run it (``chunked``, ``eager``).
        """
        raise NotImplementedError

    def value_term(self, attn: Tensor, q_pos: Tensor, k_pos: Tensor, ctx=None) -> Tensor:
        """Value stage: ``attn`` ``(B, H, Lq, Lk)`` -> ``(B, H, Lq, Dh)`` added to ``attn @ v``."""
        raise NotImplementedError

    def distance_terms(self, q: Tensor, k: Tensor, ctx=None):
        """The stages as tables per distance ``d = k_pos - q_pos`` (a :class:`posenc.terms.DistanceTerms`,
        run by the ``blockwise`` backend), or None: not a function of ``d`` alone. ``q``, ``k``
        after the q/k stage.
        """
        return None

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def rel_distance(q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``j - i`` for every pair: ``(..., Lq, Lk)`` int64 (broadcast over a batch dim)."""
        return k_pos.unsqueeze(-2) - q_pos.unsqueeze(-1)
