"""The one per-layer encoding builder: which layers share an encoding instance, which share tables.

:class:`posenc.TransformerLM` and ``posenc.hf`` both build a stack's encodings here, so
the two agree on what is shared.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from .base import PositionEncoding, Stage

__all__ = ["LayerEncodings", "layer_encodings"]


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
