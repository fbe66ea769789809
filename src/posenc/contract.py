"""What an encoding is, in three facts its class fixes: its stages, its kind and its needs.

* **Stages** are the stage methods a class defines (it or a parent, below
  :class:`posenc.PositionEncoding`): :data:`STAGE_OF` maps each method to its :class:`Stage`.
  Nothing declares them and no option changes them; a variant with other stages is another
  registered class (``nope-temperature``, ``rope-extension``, ``deberta-emd``).
* **Kind** is one word derived from the stages (:func:`kind_of`), the group ``posenc list``
  shows: ``none``, ``input``, ``qk``, ``bias``, ``terms``, ``scores``, ``hidden``, ``normaliser``.
* **Needs** (:class:`Needs`) is one frozen record of what the model, the layer and the cache
  must do for the encoding: where its input stage runs, how many preceding inputs it reads,
  whether the cache keeps raw keys, memory, axes, per-head key-side parameters, sharing
  across layers, and whether it takes the layer width and the vocabulary. A class declares
  its defaults (``needs = Needs(...)``); its ``__init__`` may set values from its options
  (``self.needs = self.needs.replace(axes=axes)``); after construction it never changes.

The names of posenc 0.x (a ``stages = ...`` class attribute, ``input_at``/``cache_raw_keys``/...
set in ``__init__``, the twin flags ``reads_input``/``rotates_value``/``has_score_mod``) keep
working for one release with a ``DeprecationWarning``: :func:`warn_deprecated`, :class:`OldSpelling`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import warnings
from collections.abc import Callable

import torch

__all__ = [
    "Stage",
    "Needs",
    "STAGE_OF",
    "HOOKS",
    "KINDS",
    "OLD_NAMES",
    "kind_of",
    "stages_of",
    "OldSpelling",
    "Deprecated",
]


class Stage(enum.Flag):
    """Where an encoding enters attention (one flag per stage method group, :data:`STAGE_OF`)."""

    NONE = 0
    INPUT = enum.auto()  # embed(x, pos): before the projections
    READ = enum.auto()  # read_input(x, k, v, carry): reads the layer input (FoX's gates, Inkling)
    QK = enum.auto()  # rotate(q, k, q_pos, k_pos) / rotate_value(v, k_pos): on queries, keys (values)
    BIAS = enum.auto()  # bias(q_pos, k_pos) / score_mod: a scalar per (h, i, j)
    TERMS = enum.auto()  # score_terms(q, k, q_pos, k_pos): content-dependent relative terms
    VALUE = enum.auto()  # value_term(attn, q_pos, k_pos): relative vectors on the values
    SCORES = enum.auto()  # qk_scores(q, k, q_pos, k_pos): the q·k term itself, per (i, j) (ReRoPE)
    NORM = enum.auto()  # weights(s): the attention weights from the masked scores, in place of softmax

    def names(self) -> list[str]:
        return [s.name.lower() for s in Stage if s in self and s is not Stage.NONE]


# the stage methods, and the stage each one makes a class have when it defines it
STAGE_OF: dict[str, Stage] = {
    "embed": Stage.INPUT,
    "read_input": Stage.READ,
    "rotate": Stage.QK,
    "rotate_value": Stage.QK,
    "bias": Stage.BIAS,
    "score_mod": Stage.BIAS,
    "score_terms": Stage.TERMS,
    "qk_scores": Stage.SCORES,
    "value_term": Stage.VALUE,
    "weights": Stage.NORM,
}
# what PositionEncoding.defines answers for: the stage methods, the blockwise backend's tables
# and the maps backend's score maps
HOOKS = (*STAGE_OF, "distance_terms", "score_maps")

# kind: the first of these whose stages a class has (the stage that decides how it computes)
KINDS: tuple[tuple[str, Stage], ...] = (
    ("normaliser", Stage.NORM),  # its own normaliser in place of softmax (stick-breaking)
    ("hidden", Stage.READ),  # a position term read from the layer input (fox, inkling)
    ("scores", Stage.SCORES),  # the q·k term per pair (rope-extension)
    ("terms", Stage.TERMS | Stage.VALUE),  # content-dependent score/value vectors (shaw, xl, deberta, cope)
    ("bias", Stage.BIAS),  # a scalar per pair (alibi, t5, tupe)
    ("qk", Stage.QK),  # queries and keys transformed (rope, xpos, pope, nope-temperature)
    ("input", Stage.INPUT),  # the layer input only (learned, sinusoidal, conv)
)


def stages_of(defined: frozenset[str]) -> Stage:
    """The stages of a class that defines the methods ``defined``."""
    out = Stage.NONE
    for method in defined:
        out |= STAGE_OF.get(method, Stage.NONE)
    return out


def kind_of(stages: Stage) -> str:
    """The kind of an encoding with ``stages`` (see :data:`KINDS`); ``"none"`` without any."""
    return next((kind for kind, st in KINDS if stages & st), "none")


@dataclasses.dataclass(frozen=True)
class Needs:
    """What the model, the layer and the cache must do for an encoding (fixed at construction).

    Attributes:
        input_at: where a model applies the input stage: an int ``n`` adds it to the residual
            stream before block ``n`` (0: once, on the token embeddings; DeBERTa's enhanced mask
            decoder: before a top block); ``"layer"`` on every attention layer's input, inside
            the layer (FLOATER); ``"tokens"`` builds the token embedding from the ids (Complex
            Order with a vocabulary). A bare :class:`posenc.Attention` runs it when 0 or ``"layer"``.
        input_context: preceding inputs the input stage reads (a causal convolution's ``k - 1``):
            a KV cache keeps that many and runs the stage on them plus the new ones.
        raw_keys: the KV cache stores keys before ``rotate`` and rotates all of them again at
            every step (rotations that depend on the whole call: dynamic NTK, xPos, PoPE's
            2·Dh-wide keys); otherwise it stores rotated keys.
        memory_len: tokens of earlier segments each layer attends to (Transformer-XL); 0: none.
        axes: coordinates per position, ``A``: 1 for a sequence, 2 or 3 for image rows/columns
            or video time/rows/columns; with ``A > 1`` every stage receives ``(B|1, L, A)``.
        per_head_keys: the key-side stages (``read_input``, ``rotate`` on keys, ``rotate_value``)
            hold per-head parameters: with grouped k/v the layer repeats keys and values to
            ``heads`` before them; else they run on ``kv_heads``.
        share_across_layers: one instance serves every layer of a model by default (T5's
            bucket table, as the paper does).
        shared_modules: submodules every layer's instance takes from the first layer's when the
            instance itself is not shared (DeBERTa's relative table).
        width: the class takes the layer width as its ``hidden_size`` option (FoX's gates,
            Inkling's ``r_proj``, DeBERTa's table): a layer of width ``dim`` passes
            ``hidden_size=dim`` unless the options give it.
        vocab: the class takes the model's vocabulary as its ``vocab_size`` option (it builds
            the token embedding: ``complex-order``).
    """

    input_at: int | str = 0
    input_context: int = 0
    raw_keys: bool = False
    memory_len: int = 0
    axes: int = 1
    per_head_keys: bool = False
    share_across_layers: bool = False
    shared_modules: tuple[str, ...] = ()
    width: bool = False
    vocab: bool = False

    def __post_init__(self) -> None:
        at = self.input_at
        if not (at in ("layer", "tokens") or (_is_int(at) and at >= 0)):
            raise ValueError(f"input_at must be a block index >= 0, 'layer' or 'tokens', got {at!r}")
        if not _is_int(self.axes) or self.axes < 1:
            raise ValueError(f"axes must be a positive int (1 for a sequence, 2 or 3 for grids), got {self.axes!r}")
        for name in ("input_context", "memory_len"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an int >= 0, got {getattr(self, name)!r}")
        for name in ("raw_keys", "per_head_keys", "share_across_layers", "width", "vocab"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        mods = self.shared_modules
        if not isinstance(mods, tuple) or not all(isinstance(m, str) for m in mods):
            raise TypeError(f"shared_modules must be a tuple of submodule names, got {mods!r}")

    def replace(self, **changes) -> Needs:
        """A copy with ``changes`` (the record itself never changes)."""
        return dataclasses.replace(self, **changes)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ------------------------------------------------------------------ the names of posenc 0.x


def warn_deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    """``DeprecationWarning``: ``old`` is replaced by ``new`` and goes in the next release."""
    if torch.compiler.is_compiling():  # (no frame inspection inside a traced graph)
        return
    warnings.warn(f"{old} is deprecated; {new} (the old spelling goes in the next release)", DeprecationWarning,
                  stacklevel=stacklevel)  # fmt: skip


# the declarations' names before Needs -> their field in Needs
OLD_NAMES = {
    "input_at": "input_at",
    "input_context": "input_context",
    "cache_raw_keys": "raw_keys",
    "memory_len": "memory_len",
    "axes": "axes",
    "per_head_keys": "per_head_keys",
    "share_across_layers": "share_across_layers",
    "shared_modules": "shared_modules",
}


# declarations of posenc 0.x that a class body may still hold for one release (with a warning)
_OLD_CLASS_NAMES = ("stages", *OLD_NAMES, "family", "variants")


class OldSpelling:
    """A declaration's name before :class:`Needs` (``enc.cache_raw_keys`` for ``enc.needs.raw_keys``),
    readable on a class and on an instance. (Setting one in ``__init__``, posenc 0.x's way, is
    :meth:`posenc.PositionEncoding.__setattr__`'s to handle.)"""

    def __init__(self, field: str) -> None:
        self.field = field

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        return getattr((owner if obj is None else obj).needs, self.field)

    def __set__(self, obj, value) -> None:
        raise AttributeError(f"{self.name} reads needs.{self.field}, which is fixed at construction")


class Deprecated:
    """A name of posenc 0.x that reads ``get(class or instance)`` with a ``DeprecationWarning``
    saying to use ``new`` instead; on a class and on an instance."""

    def __init__(self, get: Callable, new: str) -> None:
        self.get, self.new = get, new

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        warn_deprecated(self.name, f"use {self.new}")
        return self.get(owner if obj is None else obj)


# ------------------------------------------------------------------ class creation
def building(init: Callable) -> Callable:
    """``init`` marking the instance as under construction while the outermost ``__init__`` runs
    (then, and only then, :attr:`posenc.PositionEncoding.needs` may be set)."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if "_building" in self.__dict__:
            return init(self, *args, **kwargs)
        self.__dict__["_building"] = True
        try:
            return init(self, *args, **kwargs)
        finally:
            del self.__dict__["_building"]

    return __init__


def fold_old_declarations(cls: type) -> Stage | None:
    """Take a class body's posenc 0.x declarations (one release, with a warning): ``stages``
    (returned: the class keeps it over its methods' stages), ``input_at = ...`` and the other
    :data:`OLD_NAMES` (into ``cls.needs``), ``family`` and ``variants`` (dropped)."""
    old = {n: cls.__dict__[n] for n in _OLD_CLASS_NAMES if n in cls.__dict__}
    for n in old:
        delattr(cls, n)
    if old:
        fix = {"stages": "stages follow the stage methods the class defines", "family": "kind replaces family",
               "variants": "a variant is built by its registered name"}  # fmt: skip
        needs = ", ".join(f"{OLD_NAMES[n]}={v!r}" for n, v in old.items() if n in OLD_NAMES)
        new = [fix[n] for n in fix if n in old] + ([f"declare needs = Needs({needs})"] if needs else [])
        warn_deprecated(f"{cls.__name__} declaring {', '.join(old)} as class attributes", "; ".join(new), stacklevel=4)
    needs = {OLD_NAMES[n]: v for n, v in old.items() if n in OLD_NAMES}
    if needs:
        cls.needs = cls.needs.replace(**needs)
    if "stages" in old:
        cls._declared_stages = old["stages"]
    return getattr(cls, "_declared_stages", None)


def check_takes(cls: type, params) -> None:
    """``needs.width``/``needs.vocab`` only with a ``hidden_size``/``vocab_size`` option (or
    ``**options`` passed on); a class that takes one without declaring it gets it declared, with
    the warning of posenc 0.x's signature sniffing (one release)."""
    passes_on = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for flag, option in (("width", "hidden_size"), ("vocab", "vocab_size")):
        declared = getattr(cls.needs, flag)
        if declared and option not in params and not passes_on:
            raise TypeError(f"{cls.__name__} declares needs.{flag} but takes no {option} option")
        if option in params and not declared:
            warn_deprecated(f"{cls.__name__} taking a {option} option without needs.{flag}",
                  f"declare needs = Needs({flag}=True) to be given the layer's {option}", stacklevel=4)  # fmt: skip
            cls.needs = cls.needs.replace(**{flag: True})
