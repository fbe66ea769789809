"""What each method of a ``posenc extend`` run ran with, written where its numbers are.

A long-context score is a property of checkpoint × RoPE configuration × engine, so every run
records, per method: θ (``rope_theta``), ``rope_type``, the scaling factor and the original
length it scales from, the attention factor (the temperature HF's ``yarn``/``longrope`` put on
cos/sin, computed as HF does by :func:`posenc.encodings.rope_scaling.rope_parameters`), the
window and group sizes of ReRoPE / Self-Extend / the sink cache, and the run's dtype and
device; and once, the versions of posenc, transformers and torch. ``config.json``,
``results.json`` and the head of ``report.md`` carry it (``posenc_extend.json`` for ``--save``).
"""

from __future__ import annotations

import platform
from typing import Any

from .methods import applies, method_options

__all__ = ["method_record", "run_record", "versions", "describe_record"]


def versions() -> dict[str, str | None]:
    """``{"posenc", "transformers", "torch", "python"}`` versions (None: not installed)."""
    import torch

    from .. import __version__

    try:
        import transformers

        hf = transformers.__version__
    except ImportError:
        hf = None
    return {"posenc": __version__, "transformers": hf, "torch": torch.__version__,
            "python": platform.python_version()}  # fmt: skip


def _own(subject, method: str) -> dict:
    """The options of the first layer ``method`` applies to (the model's own RoPE)."""
    for s in subject.specs:
        if applies(method, s["encoding"]) and s["encoding"] != "nope":
            return dict(s["options"])
    return {}


def _attention_factor(scaling: dict, *, dim: int, base: float, train_len: int, length: int) -> float:
    from ..encodings.rope_scaling import rope_parameters

    _, factor = rope_parameters(scaling, dim=dim, base=base, max_len=train_len, seq_len=length)
    return float(factor)


def method_record(subject, method: str, longest: int, *, dtype: str, device: str) -> dict[str, Any]:
    """What ``method`` set for lengths up to ``longest`` runs with on ``subject`` (see the module
    docstring); ``{"applicable": False, "why": ...}`` where it does not apply."""
    rec: dict[str, Any] = {"dtype": str(dtype), "device": str(device)}
    if method == "sink-window":
        opts = method_options(method, train_tokens=subject.train_len, longest_tokens=longest)
        own = _own(subject, "none")
        return {"rope_theta": own.get("base", subject.rope.get("base")), "rope_type": _type(own.get("rope_scaling")),
                "sinks": opts["sinks"], "window": opts["window"], **rec}  # fmt: skip
    if method != "none" and not any(applies(method, s["encoding"]) for s in subject.specs):
        return {"applicable": False, "why": "no layer's encoding takes it", **rec}
    try:
        opts = {} if method == "none" else method_options(
            method, train_tokens=subject.train_len, longest_tokens=longest, **subject.rope)  # fmt: skip
    except ValueError as e:
        return {"applicable": False, "why": str(e), **rec}
    own = _own(subject, method)
    if not own and "base" not in subject.rope:
        return {"rope_type": None, "note": "no rotary layer: the model's positions as trained", **rec}
    theta = float(opts.get("base", own.get("base", subject.rope.get("base", 10000.0))))
    ext = opts.get("rope_extension")
    scaling = None if ext else opts.get("rope_scaling", own.get("rope_scaling"))
    # (ReRoPE / Self-Extend keep RoPE's default frequencies: the extension is what changes)
    out: dict[str, Any] = {"rope_theta": theta, "rope_type": _type(scaling)}
    if ext:
        out.update({"extension": ext["type"], **{k: v for k, v in ext.items() if k != "type"}})
    if scaling:
        out["factor"] = scaling.get("factor")
        out["original_max_position_embeddings"] = scaling.get("original_max_position_embeddings", subject.train_len)
    dim = subject.rope.get("rotary_dim")
    if scaling and dim:
        out["attention_factor"] = _attention_factor(scaling, dim=dim, base=theta, train_len=subject.train_len,
                                                    length=longest)  # fmt: skip
    else:
        out["attention_factor"] = 1.0
    if "partial_rotary_factor" in own:
        out["partial_rotary_factor"] = own["partial_rotary_factor"]
    return {**out, **rec}


def _type(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type") or "default"


def run_record(subject, methods, longest: int, *, dtype: str, device: str) -> dict[str, dict]:
    """``{method: method_record(...)}`` for every method of a run."""
    return {m: method_record(subject, m, longest, dtype=dtype, device=device) for m in methods}


def describe_record(rec: dict[str, Any]) -> str:
    """One line: ``θ 10000, rope_type yarn, factor 4, original 32, attention factor 1.13863``."""
    if rec.get("applicable") is False:
        return f"n/a ({rec.get('why')})"
    names = {"rope_theta": "θ", "original_max_position_embeddings": "original", "attention_factor":
             "attention factor", "group_size": "group", "scale_base": "log-n base"}  # fmt: skip
    parts = []
    for k, v in rec.items():
        if k in ("dtype", "device", "note") or v is None:
            continue
        v = f"{v:.6g}" if isinstance(v, float) else v
        parts.append(f"{names.get(k, k)} {v}")
    return ", ".join(parts)
