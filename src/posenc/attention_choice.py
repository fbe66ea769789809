"""The per-call choices of :class:`posenc.Attention`: the :class:`~posenc.AttentionMask` of a
call and the backend it runs (a mixin the layer inherits: these read only its settings)."""

from __future__ import annotations

from torch import Tensor

from .backends import canonical_backend, require_backend, select_backend
from .mask import AttentionMask

__all__ = ["MaskAndBackend"]


class MaskAndBackend:
    """:meth:`mask_for` and :meth:`resolve_backend` of a layer with ``causal``, ``window``,
    ``chunk``, ``backend`` and ``encoding`` attributes."""

    def mask_for(
        self, q_len: int, k_len: int, key_padding_mask: Tensor | None = None, document_ids: Tensor | None = None
    ) -> AttentionMask:
        """The :class:`~posenc.AttentionMask` of a call with ``q_len`` queries, the last of ``k_len`` keys.

        Raises:
            ValueError: ``document_ids`` with cached or memory keys (``k_len != q_len``), or
                not an integer ``(B|1, q_len)`` tensor.
        """
        if document_ids is not None and k_len != q_len:
            raise ValueError(
                f"document_ids (packed sequences) need every key in this call: got {k_len - q_len} cached or memory "
                "keys; pack documents without a cache or memory"
            )
        return AttentionMask(
            causal=self.causal,
            offset=k_len - q_len,
            key_padding=key_padding_mask,
            documents=document_ids,
            window=self.window,
            chunk=self.chunk,
        )

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
