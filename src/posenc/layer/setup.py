"""What :class:`posenc.Attention` checks and builds at construction: its encoding (named or
given), the k/v head count, and the score settings the encoding carries.

Grouped k/v (``kv_heads``): the layer projects ``kv_heads`` keys and values, its KV cache
stores them, and :func:`posenc.attend.backends.attend` expands them to the ``H`` query heads (HF's
``repeat_kv``; SDPA's ``enable_gqa``). The encoding's key-side stages (``read_input``, the
key half of ``rotate``, ``rotate_value``) run on the ``kv_heads`` keys when they treat
every head alike, the default; an encoding whose key-side stages hold per-head parameters
sized by ``heads`` (Inkling's short convolutions, ``(H·Dh, K)``) says so
(``needs.per_head_keys``), and the layer repeats its keys and values to
``H`` heads *before* those stages: the layer then computes as an ``H``-head layer whose
k/v projections are shared within each group, and its cache holds ``H`` heads.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from ..base import PositionEncoding, Stage
from ..registry import build, get_class
from ..validate import score_setting

__all__ = ["LayerEncodings", "layer_encodings", "build_for_layer", "check_kv_heads", "layer_encoding"]


def build_for_layer(
    name: str,
    options: dict,
    *,
    heads: int,
    head_dim: int,
    dim: int,
    max_len: int | None,
    causal: bool,
    vocab_size: int | None = None,
) -> PositionEncoding:
    """``name`` built for a layer of width ``dim`` with ``heads`` heads of ``head_dim`` (the one
    rule :class:`posenc.Attention`, :class:`posenc.TransformerLM` and ``posenc.hf`` share).

    What the class declares it takes (:class:`~posenc.contract.Needs`): ``needs.width`` gets
    ``hidden_size=dim`` (FoX's gates, Inkling's ``r_proj``, DeBERTa's table and its EMD) and
    ``needs.vocab`` gets ``vocab_size`` (``complex-order``, which embeds token ids), unless the
    options give them. Where ``heads·head_dim`` is not ``dim`` (an explicit ``head_dim``:
    Qwen3-0.6B, Gemma), an encoding with only an input stage and no ``needs.width`` is built as
    one head of ``dim`` (it adds to or reads ``(B, L, dim)``).

    Raises:
        ValueError: a causal-only encoding in a bidirectional layer; an encoding with an input
            stage *and* a score-side stage and no ``hidden_size`` where
            ``heads·head_dim != dim`` (its absolute table would be of neither width); and
            what :func:`posenc.build` raises.
    """
    options = dict(options)
    cls = get_class(name)
    if cls.causal_only and not causal:
        raise ValueError(f"encoding {name!r} is causal only, and this layer attends both ways (an encoder)")
    heads, head_dim = _sizes(cls, name, heads, head_dim, dim)
    if cls.needs.width:
        options.setdefault("hidden_size", dim)
    if vocab_size is not None and cls.needs.vocab:
        options.setdefault("vocab_size", vocab_size)
    return build(name, heads=heads, head_dim=head_dim, max_len=max_len, causal=causal, **options)


def check_kv_heads(heads: int, kv_heads: int | None) -> int:
    """``kv_heads`` (None: ``heads``); ``ValueError`` naming both unless it divides ``heads``."""
    if kv_heads is None:
        return heads
    if not isinstance(kv_heads, int) or isinstance(kv_heads, bool) or kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"kv_heads must be a positive int dividing heads={heads} (grouped k/v), or None, got {kv_heads!r}"
        )
    return kv_heads


def _sizes(cls: type[PositionEncoding], name: str, heads: int, head_dim: int, dim: int) -> tuple[int, int]:
    """The ``(heads, head_dim)`` an encoding of class ``cls`` is built with in a layer of width ``dim``
    (one with ``needs.width`` is told ``dim`` as its ``hidden_size`` and keeps the layer's heads)."""
    if cls.stages & Stage.INPUT and heads * head_dim != dim and not cls.needs.width:
        if cls.stages != Stage.INPUT:
            raise ValueError(
                f"encoding {name!r} has an input stage and a score stage: it needs heads x head_dim = dim, "
                f"got {heads} x {head_dim} != {dim}"
            )
        return 1, dim
    return heads, head_dim


def layer_encoding(
    encoding: str | PositionEncoding,
    *,
    heads: int,
    head_dim: int,
    dim: int,
    causal: bool,
    max_len: int | None,
    options: dict,
    score_scale: float | None,
    softcap: float | None,
) -> PositionEncoding:
    """The layer's encoding: ``encoding`` built with ``options`` and the score settings
    (:meth:`PositionEncoding.set_scores`), or a built one checked against the layer. A built
    encoding keeps its own settings: a ``score_scale``/``softcap`` given with it must equal
    them (None: the encoding's), since it may serve other layers too."""
    if not isinstance(encoding, PositionEncoding):
        enc = build_for_layer(
            encoding, options, heads=heads, head_dim=head_dim, dim=dim, max_len=max_len, causal=causal
        )
        return enc.set_scores(scale=score_scale, softcap=softcap)
    if options:
        raise ValueError(f"options {sorted(options)} given with an already built encoding")
    heads, head_dim = _sizes(type(encoding), encoding.name, heads, head_dim, dim)
    if (encoding.heads, encoding.head_dim) != (heads, head_dim):
        raise ValueError(
            f"encoding built for heads={encoding.heads}, head_dim={encoding.head_dim}; "
            f"attention has heads={heads}, head_dim={head_dim}"
        )
    if encoding.causal != causal:
        raise ValueError(f"encoding built with causal={encoding.causal}, attention has causal={causal}")
    given_scores = (
        ("score_scale", score_setting("scale", score_scale)),
        ("softcap", score_setting("softcap", softcap)),
    )
    for name, given in given_scores:
        have = getattr(encoding, name)
        if given is not None and given != have:
            raise ValueError(
                f"{name}={given} given with an encoding built with {name}={have}; an encoding keeps its own "
                "(set it with enc.set_scores(...) before sharing it, or pass the encoding by name)"
            )
    return encoding


class LayerEncodings(list):
    """The distinct encoding instances of a stack (a list), with ``index[i]``: layer ``i``'s
    instance, and ``firsts``: the first instance built for each distinct spec, in layer order
    (where a model runs the input stages that act outside the layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.index: list[int] = []
        self.firsts: list[PositionEncoding] = []

    def of(self, layer: int) -> PositionEncoding:
        return self[self.index[layer]]


def layer_encodings(
    keys: list[Hashable], make: Callable[[int], PositionEncoding], share: bool | None = None
) -> LayerEncodings:
    """One encoding per layer. ``keys[i]``: layer ``i``'s spec (equal keys: the same encoding
    and options); ``make(i)``: a new encoding for layer ``i``.

    Layers with equal keys share the first instance when ``share`` says so (None: the
    encoding's ``needs.share_across_layers``, e.g. T5's bucket table) or when the encoding is
    only an input stage the model runs once; otherwise each gets its own instance, which takes
    the first one's ``needs.shared_modules`` (DeBERTa's relative table).
    """
    out, first = LayerEncodings(), {}
    for i, key in enumerate(keys):
        j = first.get(key)
        if j is not None:
            head = out[j]
            only_input = head.stages == Stage.INPUT and head.needs.input_at != "layer"
            if (head.needs.share_across_layers if share is None else share) or only_input:
                out.index.append(j)
                continue
        enc = make(i)
        if j is None:
            first[key] = len(out)
            out.firsts.append(enc)
        else:
            for name in enc.needs.shared_modules:  # e.g. a relative table shared by per-layer projections
                setattr(enc, name, getattr(out[j], name))
        out.index.append(len(out))
        out.append(enc)
    return out
