"""The per-call choice of :class:`posenc.Attention`: the backend a call runs (a mixin the layer
inherits: it reads only the layer's settings)."""

from __future__ import annotations

from .backends import canonical_backend, require_backend, select_backend

__all__ = ["MaskAndBackend"]


class MaskAndBackend:
    """:meth:`resolve_backend` of a layer with ``causal``, ``backend`` and ``encoding`` attributes."""

    def resolve_backend(
        self,
        backend: str | None,
        device_type: str,
        q_len: int | None = None,
        k_len: int | None = None,
        *,
        causal: bool | None = None,
        dropout: bool = False,
    ) -> str:
        """The backend a call runs: ``backend`` (or the layer's), ``"auto"`` resolved for
        ``device_type`` and ``q_len`` queries over ``k_len`` keys, causal or not (None: the
        layer's own ``causal``), with attention dropout or not (:func:`posenc.select_backend`)."""
        name = canonical_backend(backend or self.backend)
        if name == "auto":
            causal = self.causal if causal is None else causal
            return select_backend(self.encoding, device_type, q_len, k_len, causal=causal, dropout=dropout)
        return require_backend(self.encoding, name)
