"""The training-free extension methods: one setting per method, and which layers take it.

A method changes only how positions enter attention. Its setting is chosen for the longest
evaluated length ``L_max`` from the training length ``L`` (both in tokens), ``s = L_max / L``,
``w = L / 2``:

============  ==================================================  ============================
method        options                                             after
============  ==================================================  ============================
none          the trained model as it is
linear        ``rope_scaling`` linear, factor ``s``                Chen et al. 2023 (PI)
ntk           ``base · s^(Dr/(Dr-2))``                             bloc97 2023 ("NTK-aware")
dynamic       ``rope_scaling`` dynamic, factor 1: NTK with         Peng et al. 2024, §3.3
              ``s' = max(1, l'/L)`` of the current length ``l'``
yarn          ``rope_scaling`` yarn, factor ``s``, original ``L``  Peng et al. 2024 (HF defaults)
longrope      ``rope_scaling`` longrope, factor ``s``, the         Ding et al. 2024
              model's own searched factors (n/a without them)
rerope        window ``w``, log-n with base ``L``                  Su 2023 (bojone/rerope)
leaky-rerope  window ``w``, factor ``k = ⌈(L_max - w)/(L - w)⌉``  bojone/rerope
self-extend   window ``W = w``, group ``G = ⌈(L_max - W)/(L - W)⌉`` Jin et al. 2024: the largest
                                                                  distance ``W + (L_max - W)/G``
                                                                  stays within ``L``
dca           chunk ``c = ⌊3L/4⌋``, local window ``⌊L/16⌋``        An et al. 2024 (ChunkLlama's
                                                                  ``replace_with_chunkllama``)
sink-window   4 sink tokens and a window of ``L - 4``: a cache     Xiao et al. 2024
              policy, positions counted inside the cache           (StreamingLLM)
============  ==================================================  ============================

(``k`` and ``G`` are at least 2.) Which encodings a method applies to is decided by the
encoding's class (:func:`applies`): every method but ``sink-window`` is defined on rotary
embeddings (:class:`~posenc.encodings.rotary.Rotary` and its subclasses); HF's scalings on the
classes that compute RoPE's frequencies as HF does (RoPE, M-RoPE: not xPos, whose decay is
its own); ReRoPE, Self-Extend and DCA on ``rope``, whose layers they make ``rope-extension``, a
class of its own (:func:`method_classes`), and on ``rope-extension`` itself.
``posenc compare --extend`` runs :data:`EXTEND_METHODS`, ``posenc extend`` all of :data:`METHODS`.
"""

from __future__ import annotations

import dataclasses
import math

from ..encodings.mrope import MRoPE
from ..encodings.rope_extended import RoPEExtension
from ..encodings.rotary import RoPE, RoPEValue, Rotary
from ..model import TransformerLM
from ..registry import available, get_class

__all__ = [
    "EXTEND_METHODS",
    "METHODS",
    "SINKS",
    "applies",
    "describe",
    "method_classes",
    "method_options",
    "with_options",
]

# the methods posenc compare --extend may list (its trained models, through its own evaluation)
EXTEND_METHODS = ("none", "linear", "ntk", "dynamic", "yarn", "rerope", "leaky-rerope", "self-extend", "dca")
# every method posenc extend runs: compare's, plus LongRoPE (where the model has its searched
# factors) and StreamingLLM's sink + window cache (a cache policy, not an option)
METHODS = (*EXTEND_METHODS, "longrope", "sink-window")
SINKS = 4  # StreamingLLM's attention sinks (Xiao et al. 2024, §3.2: four initial tokens)
_SCALINGS = ("linear", "dynamic", "yarn", "longrope")  # HF's rope_scaling types
_EXTENSIONS = ("rerope", "leaky-rerope", "self-extend", "dca")  # posenc's rope_extension (the rope-extension class)


def method_options(
    method: str,
    *,
    train_tokens: int,
    longest_tokens: int,
    base: float | None = None,
    rotary_dim: int | None = None,
    longrope: dict | None = None,
) -> dict:
    """The encoding options that apply ``method`` to a RoPE model trained at ``train_tokens``
    for lengths up to ``longest_tokens`` (see the module docstring). ``longrope``: the
    model's ``short_factor``/``long_factor`` (LongRoPE searches them per model; none: not
    applicable). ``sink-window``: ``{"sinks": 4, "window": train_tokens - 4}``, the cache of
    StreamingLLM filled to the training length.

    Raises:
        ValueError: an unknown method, ``longrope`` without factors, or a rotary method
            without ``base``/``rotary_dim``.
    """
    if method not in METHODS:
        raise ValueError(f"extension method must be one of {METHODS}, got {method!r}")
    if not isinstance(train_tokens, int) or isinstance(train_tokens, bool) or train_tokens < 2:
        raise ValueError(f"train_tokens must be an int >= 2, got {train_tokens!r}")
    L, s = train_tokens, max(1.0, longest_tokens / train_tokens)
    if method == "sink-window":
        sinks = min(SINKS, L // 2)
        return {"sinks": sinks, "window": L - sinks}
    if method == "longrope":
        if not longrope or not {"short_factor", "long_factor"} <= set(longrope):
            raise ValueError("longrope needs the model's searched short_factor/long_factor; this model has none")
        return {"rope_scaling": {"rope_type": "longrope", "factor": s, "original_max_position_embeddings": L,
                                 "short_factor": list(longrope["short_factor"]),
                                 "long_factor": list(longrope["long_factor"])}}  # fmt: skip
    if method == "ntk" and (base is None or rotary_dim is None):
        raise ValueError("ntk needs the model's RoPE base and rotary_dim")
    w = max(1, L // 2)
    far = max(2, math.ceil((longest_tokens - w) / (L - w))) if L > w else 2
    if method == "ntk":
        return {"base": base * s ** (rotary_dim / (rotary_dim - 2))}
    return {
        "none": {},
        "linear": {"rope_scaling": {"rope_type": "linear", "factor": s}},
        "dynamic": {"rope_scaling": {"rope_type": "dynamic", "factor": 1.0, "original_max_position_embeddings": L}},
        "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": s, "original_max_position_embeddings": L}},
        "rerope": {"rope_extension": {"type": "rerope", "window": w, "scale_base": L}},
        "leaky-rerope": {"rope_extension": {"type": "leaky-rerope", "window": w, "factor": far, "scale_base": L}},
        "self-extend": {"rope_extension": {"type": "self-extend", "window": w, "group_size": far}},
        # ChunkLlama: chunk_size = pretraining_length * 3 // 4, local_window = pretraining_length // 16
        "dca": {"rope_extension": {"type": "dca", "chunk_size": L * 3 // 4, "local_size": L // 16}},
    }[method]


def applies(method: str, encoding: str) -> bool:
    """``method`` is defined on the class of ``encoding`` (see the module docstring); a layer
    pattern or preset (not one registered class) takes none but ``sink-window``."""
    if method not in METHODS:
        raise ValueError(f"extension method must be one of {METHODS}, got {method!r}")
    if method == "sink-window":
        return True  # a cache policy: positions counted inside the cache, any encoding
    if encoding not in available():
        return False
    cls = get_class(encoding)
    if not issubclass(cls, Rotary):
        return False
    if method in _SCALINGS:
        return cls in (RoPE, RoPEValue, MRoPE)
    if method in _EXTENSIONS:
        return cls in (RoPE, RoPEExtension)
    return True  # none (the baseline row of a rotary model) and ntk (its base)


def method_classes(method: str) -> dict[str, str]:
    """The registered encodings ``method`` turns a layer's encoding into, ``{old: new}``: ReRoPE,
    Leaky ReRoPE, Self-Extend and DCA make ``rope`` layers ``rope-extension`` (their ``q·k`` term
    replaces the rotation: a class of its own); the other methods keep every class."""
    if method not in METHODS:
        raise ValueError(f"extension method must be one of {METHODS}, got {method!r}")
    return {"rope": "rope-extension"} if method in _EXTENSIONS else {}


def with_options(model: TransformerLM, rename: dict[str, str] | None = None, **options) -> TransformerLM:
    """A copy of ``model`` (same weights, same device, eval mode) whose encodings take ``options``
    on top of their own, a layer whose encoding is a key of ``rename`` being built as the value
    instead, e.g. ``with_options(lm, rename={"rope": "rope-extension"}, rope_extension={"type":
    "rerope", "window": 32})`` (:func:`method_classes` gives a method's ``rename``)."""
    cfg, rename = model.config, rename or {}
    if cfg.layers is not None:
        layers = [
            dataclasses.replace(s, encoding=rename.get(s.encoding, s.encoding), options={**s.options, **options})
            for s in cfg.layers
        ]
        cfg = dataclasses.replace(cfg, layers=layers)
    else:
        cfg = dataclasses.replace(
            cfg, encoding=rename.get(cfg.encoding, cfg.encoding), options={**cfg.options, **options}
        )
    p = next(model.parameters())
    new = TransformerLM(config=cfg).to(device=p.device, dtype=p.dtype)
    new.load_state_dict(model.state_dict())
    return new.eval()


def describe(method: str, opts: dict) -> str:
    """A short description of a method's setting (``"factor 4, original 64"``)."""
    if method == "sink-window":
        return f"sinks {opts['sinks']}, window {opts['window']}"
    if not opts:
        return "as trained"
    if "base" in opts and len(opts) == 1:
        return f"base {opts['base']:.4g}"
    d = dict(opts.get("rope_scaling") or opts.get("rope_extension") or {})
    kind = d.pop("rope_type", None) or d.pop("type", None)
    d.pop("short_factor", None), d.pop("long_factor", None)
    shown = ", ".join(f"{k.replace('original_max_position_embeddings', 'original')} {v:g}" for k, v in d.items())
    return shown or kind or method
