"""The :class:`PositionEncoding` base class.

Every position encoding is a choice of *where position enters attention* (see
``posenc/__init__.py`` for the picture). A class implements the stage methods it uses, and
those are its stages (:mod:`posenc.contract`); :class:`posenc.Attention` calls them and picks
the fastest backend that can run them.

The score every backend computes, for one head::

    s_ij = scale · (q̃_i·k̃_j + score_terms_ij) + bias_ij + mask_ij
    o_i  = Σ_j softmax_j(s)_ij · v_j + value_term_i

with ``q̃, k̃ = rotate(q, k)`` (an encoding with the ``SCORES`` stage supplies the whole
``q̃_i·k̃_j`` term itself, per pair, from ``qk_scores``: ReRoPE, Self-Extend; one with ``NORM``
replaces softmax with ``weights``) and ``scale = encoding.scale`` (``Dh^-1/2`` unless the
encoding says otherwise: T5 optionally uses 1, DeBERTa ``(Dh·(1+#terms))^-1/2``).

The registry is filled by the encodings themselves (``@register``) when ``posenc``
imports :mod:`posenc.encodings`; this module imports nothing above it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import ClassVar

from torch import Tensor, nn

from . import contract
from . import functional as PF
from .context import InputRead
from .contract import OLD_NAMES, Deprecated, Needs, OldSpelling, Stage
from .functional import (
    as_positions,  # re-exported: the layer and model call them from here
    check_lengths,
)
from .validate import checked_init, ignoring_keywords, missing_keywords, position_checked, score_setting

__all__ = [
    "Stage",
    "Needs",
    "PositionEncoding",
    "ScoreMod",
    "check_lengths",
    "as_positions",
]

# FlexAttention's score_mod signature: (score, b, h, q_idx, kv_idx) -> score
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

BASE_ARGS = ("heads", "head_dim", "max_len", "causal")  # checked by PositionEncoding.__init__ itself
# the keywords the layer and the backends pass that a method may be written without: ``ctx=``
# (a posenc.Context) to the stages; which input rows are real tokens, and of which document,
# to read_input
CALL_KEYWORDS = {**{m: ("ctx",) for m in contract.HOOKS if m not in ("embed", "read_input")},
                 "read_input": ("keep", "documents")}  # fmt: skip
POSITION_ARGS = ("pos", "q_pos", "k_pos")  # the stage methods' position arguments
_FIXED = ("stages", "kind")  # class facts no instance may set


class PositionEncoding(nn.Module):
    """Base class of every encoding.

    A subclass sets the class attributes below, calls ``super().__init__`` with the common
    arguments, and overrides the stage methods it uses: those make its :attr:`stages`
    (``embed`` → ``INPUT``, ``read_input`` → ``READ``, ``rotate``/``rotate_value`` → ``QK``,
    ``bias``/``score_mod`` → ``BIAS``, ``score_terms`` → ``TERMS``, ``qk_scores`` → ``SCORES``,
    ``value_term`` → ``VALUE``, ``weights`` → ``NORM``), and :meth:`defines` answers which it has.
    A variant with other stages is another registered class (``nope-temperature``); an
    option never changes the stages, and an instance cannot set them.

    Class attributes (fixed by the encoding):
        name: registry name.
        paper, year: the paper the encoding comes from.
        causal_only: raise when built with ``causal=False``.
        needs: a :class:`~posenc.contract.Needs`, what the model, the layer and the cache do
            for the encoding (the class's defaults; ``__init__`` may set values from its
            options, ``self.needs = self.needs.replace(...)``; fixed after construction).

    Derived once per class (read-only): :attr:`stages` (the :class:`Stage` flags) and :attr:`kind`
    (one word for them: :func:`posenc.contract.kind_of`). The old spellings, which read ``needs``
    for the layer, the model and the cache: ``input_at``, ``input_context``, ``cache_raw_keys``
    (``needs.raw_keys``), ``memory_len``, ``axes``, ``per_head_keys``, ``share_across_layers``,
    ``shared_modules``. Deprecated (a warning): ``reads_input``, ``rotates_value``, ``has_score_mod``
    (:meth:`defines`), ``family`` (:attr:`kind`), :meth:`set_axes`.

    Per instance: ``score_scale``, ``softcap``: the model's score scale in place of ``Dh^-1/2``
    (Gemma 3) and tanh logit soft-capping (Gemma 2), None = off; set by :meth:`set_scores` only.
    """

    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    year: ClassVar[int] = 0
    causal_only: ClassVar[bool] = False
    needs: Needs = Needs()
    stages: ClassVar[Stage] = Stage.NONE
    kind: ClassVar[str] = "none"
    _defined: ClassVar[frozenset[str]] = frozenset()
    score_scale: float | None = None
    softcap: float | None = None

    input_at = OldSpelling("input_at")
    input_context = OldSpelling("input_context")
    cache_raw_keys = OldSpelling("raw_keys")
    memory_len = OldSpelling("memory_len")
    axes = OldSpelling("axes")
    per_head_keys = OldSpelling("per_head_keys")
    share_across_layers = OldSpelling("share_across_layers")
    shared_modules = OldSpelling("shared_modules")
    reads_input = Deprecated(lambda e: e.defines("read_input"), 'enc.defines("read_input")')
    rotates_value = Deprecated(lambda e: e.defines("rotate_value"), 'enc.defines("rotate_value")')
    has_score_mod = Deprecated(lambda e: e.defines("score_mod"), 'enc.defines("score_mod")')
    family = Deprecated(lambda e: e.kind, "kind, derived from the stage methods")

    def __init_subclass__(cls, **kwargs) -> None:
        """Derive the class's :attr:`stages` and :attr:`kind` from the stage methods it defines;
        wrap its ``__init__`` to check its options against their annotations (a bool option
        takes a bool, no NaN or infinity anywhere: :mod:`posenc.validate`) and to let it set
        :attr:`needs` while it runs, and its stage methods to turn the ``IndexError`` of a table
        read past its end into the ``ValueError`` of :meth:`check_length` (nothing checked, no
        host sync, on a call that succeeds)."""
        super().__init_subclass__(**kwargs)
        declared = contract.fold_old_declarations(cls)
        init = cls.__dict__.get("__init__")
        if init is not None:
            cls.__init__ = contract.building(checked_init(init, skip=BASE_ARGS))
            contract.check_takes(cls, inspect.signature(init).parameters)
        if not isinstance(cls.needs, Needs):
            raise TypeError(f"{cls.__name__}.needs must be a posenc.contract.Needs, got {cls.needs!r}")
        for name in contract.STAGE_OF.keys() - {"read_input", "score_mod"}:
            fn = cls.__dict__.get(name)
            if fn is not None and not getattr(fn, "checks_positions", False):
                setattr(cls, name, position_checked(fn, POSITION_ARGS))
        for name, keywords in CALL_KEYWORDS.items():
            fn = cls.__dict__.get(name)
            if fn is not None and (missing := missing_keywords(fn, keywords)):
                setattr(cls, name, ignoring_keywords(fn, missing))
        cls._defined = frozenset(h for h in contract.HOOKS if getattr(cls, h) is not getattr(PositionEncoding, h))
        if "score_mod" in cls._defined and "bias" not in cls._defined:
            raise TypeError(f"{cls.__name__} defines score_mod without bias: score_mod is bias's FlexAttention form")
        cls.stages = contract.stages_of(cls._defined) if declared is None else declared
        cls.kind = contract.kind_of(cls.stages)

    @classmethod
    def defines(cls, method: str) -> bool:
        """The class (or a parent below :class:`PositionEncoding`) defines ``method``: a stage
        method (``"score_mod"``: a real elementwise form, not the dense fallback;
        ``"read_input"``: the layer calls it), ``"distance_terms"`` (``blockwise``) or ``"score_maps"`` (``maps``)."""
        if method in cls._defined:
            return True
        if method not in contract.HOOKS:
            raise ValueError(f"defines() answers for the stage methods {', '.join(contract.HOOKS)}; got {method!r}")
        return False

    def __setattr__(self, name: str, value) -> None:
        if name in _FIXED:
            raise AttributeError(
                f"encoding {self.name!r}: {name} follows the stage methods its class defines; an instance cannot "
                "set it (a variant with other stages is another class)"
            )
        if name == "needs" or name in OLD_NAMES:
            if "_building" not in self.__dict__:
                raise AttributeError(f"encoding {self.name!r}: {name} is fixed at construction; build another one")
            if name != "needs":  # posenc 0.x: self.input_at = ... in __init__
                contract.warn_deprecated(
                    f"setting self.{name} in __init__", f"set self.needs = self.needs.replace({OLD_NAMES[name]}=...)"
                )
                value = self.needs.replace(**{OLD_NAMES[name]: value})
            if not isinstance(value, Needs):
                raise TypeError(f"needs must be a posenc.contract.Needs, got {value!r}")
            self.__dict__["needs"] = value
            return
        super().__setattr__(name, value)

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
        self.heads, self.head_dim, self.dim = heads, head_dim, heads * head_dim
        self.max_len, self.causal = max_len, causal

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
        """Positions must be below this (a tuple: per axis; ``max_len`` for an encoding that does
        not extrapolate); None when any position works."""
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

    def set_axes(self, axes: int) -> None:  # deprecated
        """In ``__init__``: ``self.needs = self.needs.replace(axes=axes)``."""
        contract.warn_deprecated("set_axes(axes)", "set self.needs = self.needs.replace(axes=axes) in __init__")
        self.needs = self.needs.replace(axes=axes)

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
        """Input stage. ``x``: ``(B, L, D)``, ``pos``: ``(L,)`` or ``(B, L)`` -> ``(B, L, D)``. With
        ``needs.input_at == "tokens"`` it builds the embedding: ``x`` is the ``(B, L)`` token ids."""
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

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, ctx=None) -> tuple[Tensor, Tensor]:
        """q/k stage. ``q``: ``(B, H, Lq, Dh)``, ``k``: ``(B, H, Lk, Dh)``; same shapes out.

        ``ctx``: the call's :class:`~posenc.Context` (None in a direct call), for every
        method below: an encoding reads from it what the call has beyond its arguments.
        """
        return q, k

    def rotate_value(self, v: Tensor, k_pos: Tensor, ctx=None) -> Tensor:
        """Part of the q/k stage: values rotated by their key position (RoFormer's rotary values,
        ``rope-value``); the layer calls it when the class defines it."""
        return v

    def bias(self, q_pos: Tensor, k_pos: Tensor, ctx=None) -> Tensor:
        """Scalar score stage: float32 ``(H, Lq, Lk)`` for 1-D positions, ``(B, H, Lq, Lk)`` for 2-D,
        added after ``scale``."""
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

    def score_terms(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, ctx=None) -> Tensor:
        """Vector score stage: ``(B, H, Lq, Lk)`` added to ``q̃·k̃`` before ``scale``.

        The score sum gives ``ctx.mask`` (the call's bool mask) and ``ctx.qk`` (the plain
        ``q·kᵀ`` it computed: CoPE's gates read both); ``ctx.qk_proj`` holds the layer's
        ``W_Q``/``W_K`` (DeBERTa's ``share_att_key``).
        """
        raise NotImplementedError

    def qk_scores(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, ctx=None) -> Tensor:
        """Pair score stage: float32 ``(B, H, Lq, Lk)`` that *replaces* ``q̃·k̃`` (before ``scale``).

        For encodings whose ``q·k`` term is not one rotation of the queries and keys, e.g. two score
        maps merged by distance (ReRoPE, Self-Extend; their maps themselves: :meth:`score_maps`).
        ``q``, ``k`` come from the q/k stage (the identity here, so the KV cache holds raw keys)."""
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
        """The stages as tables per distance ``d = k_pos - q_pos`` (a :class:`posenc.terms.DistanceTerms`, run by
        the ``blockwise`` backend), or None: not a function of ``d`` alone. ``q``, ``k`` after the q/k stage."""
        return None

    def score_maps(self, ctx=None):
        """``qk_scores`` as maps picked by positions (:class:`posenc.terms.ScoreMap`s: the ``maps`` backend)."""
        return None

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def rel_distance(q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``j - i`` for every pair: ``(..., Lq, Lk)`` int64 (broadcast over a batch dim)."""
        return k_pos.unsqueeze(-2) - q_pos.unsqueeze(-1)
