"""One block's attention as data: :class:`LayerSpec`, the unit of per-layer configs and patterns.

It stands below both users: :class:`posenc.ModelConfig` holds a list of them and
:func:`posenc.layers` parses patterns into them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..fields import Int, check
from ..validate import check_args, score_setting

__all__ = ["SPEC_FIELDS", "LayerSpec"]

_SIZE = Int(1, optional=True)  # keys of a window, tokens of a chunk, k/v heads: None is off / the model's


@dataclass
class LayerSpec:
    """What one block's attention runs.

    Attributes:
        encoding: a registered encoding name.
        options: its options (``base``, ``num_buckets``, ...).
        window: sliding window of ``W`` keys, the query included (``j > i - W``); None: no window.
        chunk: attend only within aligned chunks of ``C`` tokens (``i // C == j // C``, Llama 4).
        sinks: one learned sink logit per head in the softmax (gpt-oss).
        kv_heads, score_scale, softcap: this layer's grouped k/v heads, score scale and
            logit soft-cap (:class:`posenc.Attention`); None = the model's
            (:class:`posenc.ModelConfig`), so a layer cannot turn the model's off.

    ``window`` and ``chunk`` become fields of the layer's :class:`~posenc.AttentionMask`;
    :func:`posenc.layers` builds lists of specs from a pattern (``"rope*3,nope"``).
    """

    # a size declares its range (posenc.fields); sinks is checked by its annotation, the scores
    # by the check Attention shares (posenc.validate.score_setting)
    encoding: str = "rope"
    options: dict[str, Any] = field(default_factory=dict)
    window: int | None = _SIZE.field(None)
    chunk: int | None = _SIZE.field(None)
    sinks: bool = False
    kv_heads: int | None = _SIZE.field(None)
    score_scale: float | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.encoding, str):
            raise TypeError(f"LayerSpec.encoding must be an encoding name (str), got {self.encoding!r}")
        if not isinstance(self.options, dict):
            raise TypeError(f"LayerSpec.options must be a dict, got {type(self.options).__name__}")
        self.options = dict(self.options)
        check(self, "LayerSpec.")  # window, chunk, kv_heads
        if not isinstance(self.sinks, bool):
            raise TypeError(f"LayerSpec.sinks must be a bool, got {self.sinks!r}")
        check_args("LayerSpec", LayerSpec, {"options": self.options})  # no NaN or infinite option
        for name in ("score_scale", "softcap"):
            setattr(self, name, score_setting(f"LayerSpec.{name}", getattr(self, name)))

    def key(self) -> tuple:
        """Layers with equal keys may share one encoding instance."""
        return (self.encoding, repr(sorted(self.options.items())))

    def describe(self) -> str:
        """The spec in pattern syntax (round-trips through :func:`posenc.layers`)."""
        args = [f"{k}={_fmt(v)}" for k, v in self.options.items()]
        args += [f"{k}={_fmt(getattr(self, k))}" for k in SPEC_FIELDS if getattr(self, k) not in (None, False)]
        return self.encoding + (f"({','.join(args)})" if args else "")


SPEC_FIELDS = (
    "window",
    "chunk",
    "sinks",
    "kv_heads",
    "score_scale",
    "softcap",
)  # LayerSpec fields a layer pattern may set


def _fmt(v: Any) -> str:
    """A value in pattern syntax."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "none"
    if isinstance(v, (dict, list)):
        return json.dumps(v, separators=(",", ":"))
    return str(v)
