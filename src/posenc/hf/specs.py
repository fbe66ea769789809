"""Per-layer specs of a converted model: ``{"encoding", "options", "window", "chunk", "sinks"}``.

``config.posenc_layers`` holds one per layer. ``window``/``chunk``/``sinks`` are posenc's own
per-layer attention (a :class:`posenc.LayerSpec`, a ``gemma3``/``irope``/``gpt-oss`` preset):
they restrict the layer on top of whatever the HF model's own mask already does (its
``sliding_window``/``layer_types``, which HF's mask functions hand the adapter).
"""

from __future__ import annotations

from ..layer.spec import LayerSpec
from ..patterns import is_pattern, layers
from ..registry import get_class, options_of
from .rope_config import rope_options_for

__all__ = ["check_layers", "check_share", "layer_specs", "default_specs"]

_EXTRA = ("window", "chunk", "sinks")
_MODEL_FIELDS = ("kv_heads", "score_scale", "softcap")  # LayerSpec fields the HF model fixes


def check_layers(specs, depth: int) -> list[dict]:
    """Validate ``posenc_layers``: ``depth`` dicts ``{"encoding": registered name, "options": dict}``
    with optional ``window``/``chunk`` (int >= 1) and ``sinks`` (bool).

    Raises:
        ValueError: a wrong count, a malformed spec, an unknown encoding or a bad field.
    """
    if not isinstance(specs, (list, tuple)) or len(specs) != depth:
        n = len(specs) if isinstance(specs, (list, tuple)) else type(specs).__name__
        raise ValueError(f"posenc_layers must list one spec per layer ({depth}), got {n}")
    out = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict) or not isinstance(spec.get("encoding"), str):
            raise ValueError(f"posenc_layers[{i}] must be {{'encoding': name, 'options': {{...}}}}, got {spec!r}")
        get_class(spec["encoding"])  # ValueError naming the registered encodings
        options = spec.get("options") or {}
        if not isinstance(options, dict):
            raise ValueError(f"posenc_layers[{i}]['options'] must be a dict, got {options!r}")
        unknown = sorted(set(spec) - {"encoding", "options", *_EXTRA})
        if unknown:
            raise ValueError(f"posenc_layers[{i}] has unknown key(s) {unknown}; valid: encoding, options, {_EXTRA}")
        entry = {"encoding": spec["encoding"], "options": dict(options)}
        for name in ("window", "chunk"):
            v = spec.get(name)
            if v is not None:
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"posenc_layers[{i}]['{name}'] must be a positive int or None, got {v!r}")
                entry[name] = v
        sinks = spec.get("sinks", False)
        if not isinstance(sinks, bool):
            raise ValueError(f"posenc_layers[{i}]['sinks'] must be a bool, got {sinks!r}")
        if sinks:
            entry["sinks"] = True
        out.append(entry)
    return out


def _defaults(name: str, config, family, layer_type: str | None = None) -> dict:
    """Options the model's own config implies: RoPE's base, partial rotary and scaling, read from
    HF's ``rope_parameters`` (flat, per layer type or per label) by :func:`rope_options_for`,
    which raises rather than fall back to a default base."""
    if not family.rotary_off or name not in ("rope", "xpos", "mrope", "lerope"):
        return {}
    source, params = config, getattr(config, "rope_parameters", None)
    if family.rope_elsewhere and isinstance(params, dict):  # (keys the model reads for something else)
        source = {k: v for k, v in params.items() if k not in family.rope_elsewhere}
    out = dict(rope_options_for(source, layer_type))
    if family.rotary_part:  # MLA: the decoupled rotary part only (moved to the front of each head)
        out["partial_rotary_factor"] = family.rotary_factor(config)
    elif not family.partial_rotary and "rope_scaling" not in out:
        out.pop("partial_rotary_factor", None)  # HF Llama's default RoPE turns the whole head
    if family.layout != "half":
        out["layout"] = family.layout
    if name == "xpos":
        return {"base": out["base"]} if "base" in out else {}
    if name in ("rope", "lerope"):
        for key in ("mrope_section", "mrope_interleaved"):
            out.pop(key, None)
    return out


def layer_specs(encoding, options: dict, depth: int, config, family) -> list[dict]:
    """One spec ``{"encoding": name, "options": {...}}`` per layer (plus ``window``/``chunk``/
    ``sinks`` where a :class:`posenc.LayerSpec` or pattern sets them).

    ``encoding``: a name for every layer, a :func:`posenc.layers` pattern or preset
    (``"rope*3,nope"``, ``"gemma3"``, repeated to ``depth``), or a list of ``depth`` entries, each
    a name, a ``(name, options)`` pair, a spec dict or a :class:`posenc.LayerSpec`. ``options``
    apply to every layer, then the per-layer options; options the model's config implies (RoPE
    base and scaling, per ``config.layer_types``) come first, so explicit ones win.

    Raises:
        ValueError: a list of the wrong length, ``options`` some layer's encoding does not take.
        TypeError: an entry of another type.
    """
    if isinstance(encoding, str) and is_pattern(encoding):
        entries = layers(encoding, depth)
    elif isinstance(encoding, str):
        entries = [encoding] * depth
    elif isinstance(encoding, (list, tuple)):
        if len(encoding) != depth:
            raise ValueError(f"encoding lists {len(encoding)} layers, the model has {depth}")
        entries = list(encoding)
    else:
        raise TypeError(f"encoding must be a name or a list of one per layer, got {type(encoding).__name__}")
    specs = []
    config = family.text_config(config)
    layer_types = getattr(config, "layer_types", None) or [None] * depth
    for i, e in enumerate(entries):
        extra: dict = {}
        if isinstance(e, str):
            name, own = e, {}
        elif isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], dict):
            name, own = e
        elif isinstance(e, dict) and isinstance(e.get("encoding"), str):
            name, own = e["encoding"], dict(e.get("options") or {})
            extra = {k: e[k] for k in _EXTRA if e.get(k) not in (None, False)}
        elif isinstance(e, LayerSpec):
            fixed = [k for k in _MODEL_FIELDS if getattr(e, k, None) is not None]
            if fixed:
                raise ValueError(
                    f"layer {i} ({e.describe()}) sets {fixed}; in a Hugging Face model the model's own attention "
                    "decides these (its key heads, scaling and soft-capping): leave them out"
                )
            name, own = e.encoding, dict(e.options)
            extra = {k: getattr(e, k) for k in _EXTRA if getattr(e, k) not in (None, False)}
        else:
            raise TypeError(f"encoding[{i}] must be a name, (name, options), a spec dict or a LayerSpec, got {e!r}")
        valid = options_of(get_class(name))
        bad = sorted(set(options) - set(valid))
        if bad:
            raise ValueError(f"option(s) {bad} do not apply to layer {i}'s encoding {name!r}; valid: {valid}")
        defaults = {k: v for k, v in _defaults(name, config, family, layer_types[i]).items() if k in valid}
        specs.append({"encoding": name, "options": {**defaults, **options, **own}, **extra})
    return check_layers(specs, depth)


def default_specs(config, family, depth: int) -> list[dict]:
    """The specs that reproduce the stock model: its RoPE from the config, GPT-2's learned table, or
    Inkling-2's relative bias (:func:`inkling_specs`)."""
    if family.default == "gpt2":
        return [{"encoding": "learned", "options": {}}] + [{"encoding": "nope", "options": {}}] * (depth - 1)
    if family.default == "inkling":
        return inkling_specs(family.text_config(config), depth)
    rotates = family.rotates(config, depth)
    if all(rotates):
        return layer_specs(family.default, {}, depth, config, family)
    return layer_specs([family.default if r else "nope" for r in rotates], {}, depth, config, family)


def inkling_specs(config, depth: int) -> list[dict]:
    """Inkling-2's scheme per ``config.layer_types``: ``inkling`` on ``"hybrid_sliding"`` layers
    (``E`` = the window), ``inkling-temperature`` on full ones (``E = rel_extent``, τ from
    ``log_scaling_*``); relative states clipped at ``rel_l2_clip_threshold``, scores by ``Dh^-1/2``,
    no short convolutions (HF's key/value projections run their own).

    Raises:
        ValueError: sliding layers with other head sizes than the full ones (posenc sizes the
            encodings of every layer alike).
    """
    sizes = [(config.num_attention_heads, config.head_dim), (config.swa_num_attention_heads, config.swa_head_dim)]
    if sizes[0] != sizes[1]:
        raise ValueError(
            f"Inkling-2 with sliding-layer heads {sizes[1]} unlike the full layers' {sizes[0]}: not covered"
        )
    common = {"d_rel": config.d_rel, "hidden_size": config.hidden_size, "rel_clip": config.rel_l2_clip_threshold}
    common["sqrt_scale"] = True
    full = {"log_scaling_n_floor": config.log_scaling_n_floor, "log_scaling_alpha": config.log_scaling_alpha}
    specs = []
    for kind in config.layer_types[:depth]:
        if kind == "hybrid_sliding":
            specs.append({"encoding": "inkling", "options": {**common, "rel_extent": config.sliding_window_size}})
        else:
            options = {**common, "rel_extent": config.rel_extent, **full}
            specs.append({"encoding": "inkling-temperature", "options": options})
    return check_layers(specs, depth)


def check_share(share) -> None:
    """``share`` is None, True or False (``"yes"`` is not true: it is refused).

    Raises:
        TypeError: anything else, named.
    """
    if share is not None and not isinstance(share, bool):
        raise TypeError(f"share (posenc_share) must be True, False or None, got {share!r}")
