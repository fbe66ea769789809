"""HF transformers v5 ``rope_parameters`` read into posenc options, never a silent default.

Version 5 moved ``rope_scaling`` to ``rope_parameters`` and ``rope_theta`` inside it, and
lets the dict come in three shapes:

* flat: ``{"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, …}`` (Llama, Qwen, Mistral);
* per layer type: ``{"full_attention": {…}, "sliding_attention": {…}}`` (Gemma 3/4, ModernBERT);
* per label: ``{"main": {…}, "compress": {…}}`` (DeepSeek-V4).

:func:`rope_options` returns posenc ``rope``/``mrope`` options per layer type or label
(``None`` for a flat dict): ``base`` (``rope_theta``), ``partial_rotary_factor``,
``rope_scaling`` (the rest, HF's dict, for a type other than ``default``), and
``mrope_section``/``mrope_interleaved``. An unknown ``rope_type``, a key the type does not
read, or a missing ``rope_theta`` is a ``ValueError`` naming the key and the allowed values:
a tool that falls back to ``rope_theta = 10000`` runs another model without a word
(DeepSpeed #8341).
"""

from __future__ import annotations

from ..encodings.rope_scaling import ROPE_REGISTRY, ROPE_TYPES

__all__ = ["rope_options", "rope_options_for"]

_OPTION_KEYS = {"rope_theta": "base", "partial_rotary_factor": "partial_rotary_factor"}
_MROPE_KEYS = ("mrope_section", "mrope_interleaved")
_FLAT_KEYS = {"rope_type", "type", *_OPTION_KEYS, *_MROPE_KEYS}


def _is_nested(params: dict) -> bool:
    """Per layer type or label: every value a dict (or ``None``, a layer type without RoPE)."""
    return (
        bool(params)
        and not (_FLAT_KEYS & set(params))
        and all(v is None or isinstance(v, dict) for v in params.values())
    )


def _options(entry: dict, where: str) -> dict:
    """posenc options for one flat ``rope_parameters`` dict; ``where`` names it in errors."""
    s = dict(entry)
    kind = s.pop("rope_type", None) or s.pop("type", None) or "default"
    s.pop("type", None)
    if kind == "dynamic" and s.get("alpha"):  # HunYuan: "dynamic" with a fixed alpha (HF renames it so too)
        kind = "ntk_alpha"
    if kind not in ROPE_REGISTRY:
        raise ValueError(f"{where}: rope_type {kind!r} is not one of {list(ROPE_TYPES)}")
    if s.get("rope_theta") is None:
        raise ValueError(
            f"{where} has no 'rope_theta' (rope_type {kind!r}); posenc does not guess a base: "
            "set rope_parameters['rope_theta'] (HF v5 keeps it there, not on the config)"
        )
    theta = s.pop("rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 1:
        raise ValueError(f"{where}: rope_theta must be a number > 1, got {theta!r}")
    out: dict = {"base": float(theta)}
    if "partial_rotary_factor" in s:
        out["partial_rotary_factor"] = s.pop("partial_rotary_factor")
    for key in _MROPE_KEYS:
        if key in s:
            out[key] = s.pop(key)
    valid = ROPE_REGISTRY[kind].keys
    unknown = sorted(set(s) - valid)
    if unknown:
        raise ValueError(
            f"{where}: key(s) {unknown} are not read by rope_type {kind!r}; valid: "
            f"{sorted(valid | _FLAT_KEYS - {'type'})}"
        )
    if kind != "default":
        out["rope_scaling"] = {"rope_type": kind, **s}
    return out


def _params_of(config) -> dict | None:
    """``rope_parameters`` of a dict or an HF config (v4 configs: ``rope_scaling`` + ``rope_theta``)."""
    if config is None or isinstance(config, dict):
        return config
    params = getattr(config, "rope_parameters", None)
    if params is not None:
        return params
    legacy, theta = getattr(config, "rope_scaling", None), getattr(config, "rope_theta", None)
    if legacy is None and theta is None:
        return None
    return {**(legacy or {}), **({"rope_theta": theta} if theta is not None else {})}


def rope_options(config) -> dict[str | None, dict | None]:
    """posenc options from HF ``rope_parameters`` (a dict, or a config that holds one).

    Returns:
        ``{None: options}`` for a flat dict; ``{layer_type_or_label: options}`` for a nested
        one (``None`` options for a layer type without RoPE); ``{}`` when the config has no
        RoPE parameters at all (GPT-2).

    Raises:
        ValueError: an unknown ``rope_type``, a key its type does not read, or a missing or
            bad ``rope_theta``, naming the layer type or label.
        TypeError: ``rope_parameters`` that is not a dict.
    """
    params = _params_of(config)
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise TypeError(f"rope_parameters must be a dict, got {type(params).__name__}: {params!r}")
    if _is_nested(params):
        return {k: None if v is None else _options(v, f"rope_parameters[{k!r}]") for k, v in params.items()}
    return {None: _options(params, "rope_parameters")}


def rope_options_for(config, layer_type: str | None = None) -> dict:
    """The options of one layer type or label (a flat dict serves every layer type).

    Raises:
        ValueError: ``layer_type`` not among a nested dict's keys (or ``None`` for one), or
            any error of :func:`rope_options`.
    """
    by_type = rope_options(config)
    if not by_type:
        return {}
    if None in by_type:
        return by_type[None]
    if layer_type not in by_type:
        raise ValueError(f"rope_parameters is keyed by {sorted(by_type)}; got layer type {layer_type!r}")
    return by_type[layer_type] or {}
