"""Which keys each query may see: one mask description for every backend.

Masks are by *index*, not by position: query ``t`` of a call is key ``offset + t``
(``offset`` keys — cached tokens or a Transformer-XL memory — come before the first
query). Positions only feed the encoding, so left padding, shifted or randomized
positions change nothing here.

Windows, chunks and sink tokens restrict causal (or bidirectional) attention further.
With ``i`` the stream index of a query and ``j`` of a key (key slot ``s`` holds stream
index ``key_start + s``; a rolling KV cache that dropped old keys sets ``key_start``)::

    causal        j <= i
    window W      i - j < W               (causal: the W keys i-W+1 .. i, the query included)
                  |i - j| < W             (bidirectional: 2W - 1 keys)
    chunk C       i // C == j // C        (Llama 4: aligned chunks of C tokens)
    sink tokens S j < S  overrides window and chunk (StreamingLLM keeps the first S
                  tokens visible), never causality
    selected      sel[i, j]               (DeepSeek Sparse Attention: the keys an indexer's
                  top-k chose for each query; on top of every rule above)

as HF ``masking_utils`` (``sliding_window_overlay``: ``kv > q - W``; ``chunked_overlay``:
``kv // C == q // C``) and Gemma 3 / gpt-oss / Mistral / Llama 4 define them.

An :class:`AttentionMask` is the only place a backend learns what is masked. It
answers the three questions the backends ask:

* :meth:`AttentionMask.dense` — a bool tensor for a block of queries and keys
  (``sdpa``'s ``attn_mask``, the materialising backends' ``masked_fill``);
* :meth:`AttentionMask.key_range` and :meth:`AttentionMask.narrow` — the keys a block of
  queries can see, and the mask of that block (block skipping on the CPU backends);
* :meth:`AttentionMask.mask_mod` — the same rule as a FlexAttention ``mask_mod``.

A new kind of mask (a sliding window, chunks, packed documents, sinks) is one field
here and one clause in each of those methods; no backend changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = ["AttentionMask", "MaskMod", "in_query_blocks"]

# FlexAttention's mask_mod signature: (b, h, q_idx, kv_idx) -> bool tensor
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class AttentionMask:
    """What a call's queries may attend to.

    Attributes:
        causal: query ``t`` sees keys ``0 .. offset + t`` only.
        offset: index of the first query among the keys (``Lk - Lq`` when the keys are
            earlier tokens followed by this call's tokens).
        key_padding: ``(B, Lk)`` bool, True = a real key; None = every key is real.
        window: sliding window of ``W`` keys (see the module docstring); None: no window.
        chunk: aligned chunks of ``C`` tokens; None: no chunks.
        sink_tokens: the first ``S`` tokens of the stream stay visible through a window
            or chunk (StreamingLLM); 0: none.
        key_start: stream index of key slot 0 (keys a rolling cache dropped come before it).
        documents: ``(B|1, Lk)`` int64, the document of every key (packed sequences):
            query ``t`` is key ``offset + t`` and sees only keys of its own document.
            None = one document per row. Ids need only differ between neighbouring
            documents (:func:`posenc.positions.documents_from_positions` numbers them 0, 1, ...).
        query_documents: ``(B|1, ≥Lq)`` int64, the documents of the queries when they are
            not keys of this mask (a block cut by :meth:`narrow`); None = read them from
            ``documents`` at ``offset``.
        selected: ``(B|1, ≥Lq, Lk)`` bool, True where query ``t`` (row ``t``) may see key slot ``s``
            (column ``s``) by a content-based selection: DeepSeek Sparse Attention's top-k keys
            per query (HF ``DeepseekV32Indexer``, Mistral Large 4's ``MistralLarge4TextIndexer``),
            joined with every other rule; None = no selection.
        checked_keys: key slots ``0 .. checked_keys - 1`` were checked for NaN and infinities
            when a cache wrote them, and the caller adds what that check found to the output
            (:mod:`posenc.hf.keys`); the backends' non-finite rule
            (:func:`posenc.kernels.flash.propagate_nonfinite`) reads only the later ones. 0: all.
        checked_queries: the same cache's check read the queries too (one host read for the
            call's new rows): with every key checked, the backends read nothing.

    A query row that sees no key at all (a fully padded row) gets a zero output on every
    backend; :attr:`may_hide_rows` says when that can happen.
    """

    causal: bool = True
    offset: int = 0
    key_padding: Tensor | None = None
    window: int | None = None
    chunk: int | None = None
    sink_tokens: int = 0
    key_start: int = 0
    documents: Tensor | None = None
    query_documents: Tensor | None = None
    checked_keys: int = 0
    selected: Tensor | None = None
    checked_queries: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.offset, int) or self.offset < 0:
            raise ValueError(f"offset must be an int >= 0, got {self.offset!r}")
        for name in ("window", "chunk"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        for name in ("sink_tokens", "key_start", "checked_keys"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if not isinstance(self.checked_queries, bool):
            raise ValueError(f"checked_queries must be a bool, got {self.checked_queries!r}")
        kpm = self.key_padding
        if kpm is not None and (not isinstance(kpm, Tensor) or kpm.dtype != torch.bool or kpm.dim() != 2):
            raise ValueError(
                f"key_padding_mask must be a bool tensor of shape (B, Lk), got "
                f"{getattr(kpm, 'dtype', type(kpm).__name__)} {tuple(getattr(kpm, 'shape', ()))}"
            )
        for name in ("documents", "query_documents"):
            ids = getattr(self, name)
            if ids is not None and (
                not isinstance(ids, Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() != 2
            ):
                raise ValueError(
                    f"{name} must be an integer tensor of shape (B, Lk) (a document id per token), got "
                    f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}"
                )

        sel = self.selected
        if sel is not None and (not isinstance(sel, Tensor) or sel.dtype != torch.bool or sel.dim() != 3):
            raise ValueError(
                f"selected must be a bool tensor of shape (B, Lq, Lk) (the keys each query may see), got "
                f"{getattr(sel, 'dtype', type(sel).__name__)} {tuple(getattr(sel, 'shape', ()))}"
            )

    def check(self, batch: int, q_len: int, k_len: int) -> None:
        """Raise ``ValueError`` if this mask does not fit a call of ``batch`` rows, ``q_len`` queries, ``k_len`` keys."""
        kpm = self.key_padding
        if kpm is not None and (kpm.shape[-1] != k_len or kpm.shape[0] not in (1, batch)):
            raise ValueError(
                f"key_padding_mask must be bool of shape (B, {k_len}) (B = {batch}), got {kpm.dtype} {tuple(kpm.shape)}"
            )
        if self.causal and self.offset + q_len > k_len:
            raise ValueError(f"causal mask: offset {self.offset} + {q_len} queries > {k_len} keys")
        doc = self.documents
        if doc is not None:
            if doc.shape[-1] != k_len or doc.shape[0] not in (1, batch):
                raise ValueError(f"document_ids must have shape (B, {k_len}) (B = {batch}), got {tuple(doc.shape)}")
            if self.query_documents is None and self.offset + q_len > k_len:
                raise ValueError(f"document_ids: offset {self.offset} + {q_len} queries > {k_len} keys")
        sel = self.selected
        if sel is not None and (sel.shape[0] not in (1, batch) or sel.shape[1] < q_len or sel.shape[2] != k_len):
            raise ValueError(f"selected must have shape (B, {q_len}, {k_len}) (B = {batch}), got {tuple(sel.shape)}")

    # ------------------------------------------------------------------ properties
    @property
    def batched(self) -> bool:
        """The mask differs between batch rows."""
        return self.key_padding is not None or self.documents is not None or self.selected is not None

    @property
    def may_hide_rows(self) -> bool:
        """Some query row may see no key at all (its output is then 0)."""
        return self.key_padding is not None or self.selected is not None

    @property
    def limited(self) -> bool:
        """A window or chunks hide some keys that causality alone would show."""
        return self.window is not None or self.chunk is not None

    def is_causal_square(self, q_len: int, k_len: int) -> bool:
        """Exactly the lower triangle of a square score matrix (SDPA's ``is_causal=True``)."""
        return (
            self.causal
            and self.key_padding is None
            and self.documents is None
            and self.selected is None
            and not self.limited
            and self.offset == 0
            and q_len == k_len
        )

    def hides_nothing(self, q_len: int, k_len: int) -> bool:
        """Every query sees every key."""
        causal_free = not self.causal or (self.offset + q_len == k_len and q_len == 1)
        hidden = self.key_padding is not None or self.documents is not None or self.selected is not None
        return causal_free and not hidden and not self.limited

    def visible(self, i: Tensor, j: Tensor) -> Tensor:
        """True where stream index ``i`` (a query) sees stream index ``j`` (a key), padding aside.

        Broadcasting int tensors: ``(Lq, 1)`` and ``(1, Lk)`` give ``(Lq, Lk)``; FlexAttention's
        scalar index tensors give a scalar.
        """
        keep = j <= i if self.causal else (i - j) == (i - j)
        near = None
        if self.window is not None:
            near = (i - j < self.window) if self.causal else (i - j).abs() < self.window
        if self.chunk is not None:
            c = self.chunk
            same = torch.div(i, c, rounding_mode="floor") == torch.div(j, c, rounding_mode="floor")
            near = same if near is None else near & same
        if near is not None:
            if self.sink_tokens:
                near = near | (j < self.sink_tokens)
            keep = keep & near
        return keep

    def _query_docs(self) -> Tensor:
        """``(B|1, ≥Lq)``: the document of each query (``documents`` must be set)."""
        if self.query_documents is not None:
            return self.query_documents
        return self.documents[:, self.offset :]

    # ------------------------------------------------------------------ blocks
    def key_range(self, q_start: int, q_end: int, k_len: int) -> tuple[int, int]:
        """``(k_start, k_end)``: the keys queries ``[q_start, q_end)`` can see lie in this range."""
        lo, hi = 0, k_len
        first, last = self.offset + q_start, self.offset + q_end - 1  # the queries, as key slots
        if self.causal:
            hi = min(hi, last + 1)
        if self.window is not None:
            lo = max(lo, first - self.window + 1)
            if not self.causal:
                hi = min(hi, last + self.window)
        if self.chunk is not None:
            c, ks = self.chunk, self.key_start
            lo = max(lo, (ks + first) // c * c - ks)
            hi = min(hi, ((ks + last) // c + 1) * c - ks)
        if self.limited and self.sink_tokens > self.key_start:
            lo = 0  # sink keys stay visible (one run: the keys between are read, and masked)
        return lo, max(lo, hi)

    def query_block(self, rows: int, least: int = 64) -> int:
        """Query rows per block for the blocked backends: ``rows``, or fewer with a window or
        chunk (about the span, at least ``least``), so a block reads ``O(W)`` keys, not ``O(rows)``."""
        span = [n for n in (self.window, self.chunk) if n is not None]
        return min(rows, max(least, min(span))) if span else rows

    def narrow(self, q_start: int, k_start: int, k_end: int) -> AttentionMask:
        """The mask of the block of queries from ``q_start`` against keys ``[k_start, k_end)``."""
        kpm, doc, sel = self.key_padding, self.documents, self.selected
        return replace(
            self,
            offset=self.offset + q_start - k_start,
            key_padding=None if kpm is None else kpm[:, k_start:k_end],
            key_start=self.key_start + k_start,
            documents=None if doc is None else doc[:, k_start:k_end],
            query_documents=None if doc is None else self._query_docs()[:, q_start:],
            checked_keys=max(0, min(self.checked_keys, k_end) - k_start),
            selected=None if sel is None else sel[:, q_start:, k_start:k_end],
        )

    def dense(self, q_len: int, k_len: int, device=None) -> Tensor | None:
        """``(B|1, 1, Lq, Lk)`` bool, True = attend; None when nothing is hidden."""
        if self.hides_nothing(q_len, k_len):
            return None
        mask = None
        if self.causal or self.limited:
            i = torch.arange(q_len, device=device).unsqueeze(-1) + (self.key_start + self.offset)  # (Lq, 1)
            j = torch.arange(k_len, device=device) + self.key_start  # (Lk,)
            mask = self.visible(i, j)[None, None]  # (1, 1, Lq, Lk)
        if self.key_padding is not None:
            pad = self.key_padding[:, None, None, :]  # (B, 1, 1, Lk)
            mask = pad if mask is None else mask & pad
        if self.documents is not None:
            qd = self._query_docs()[:, None, :q_len, None]  # (B|1, 1, Lq, 1)
            same = qd == self.documents[:, None, None, :k_len]  # (B|1, 1, Lq, Lk)
            mask = same if mask is None else mask & same
        if self.selected is not None:
            sel = self.selected[:, None, :q_len, :k_len]  # (B|1, 1, Lq, Lk)
            mask = sel if mask is None else mask & sel
        return mask

    def mask_mod(self) -> MaskMod | None:
        """The rule as a FlexAttention ``mask_mod`` ``(b, h, q_idx, kv_idx) -> bool``; None when nothing is hidden."""
        if not self.causal and not self.batched and not self.limited:
            return None
        q0, k0, kpm, doc, sel = (
            self.key_start + self.offset,
            self.key_start,
            self.key_padding,
            self.documents,
            self.selected,
        )
        qdoc = None if doc is None else self._query_docs()

        def mod(b, h, q_idx, kv_idx):
            keep = self.visible(q_idx + q0, kv_idx + k0)
            if kpm is not None:
                keep = keep & kpm[b if kpm.shape[0] > 1 else 0, kv_idx]
            if doc is not None:
                keep = keep & (qdoc[b if qdoc.shape[0] > 1 else 0, q_idx] == doc[b if doc.shape[0] > 1 else 0, kv_idx])
            if sel is not None:
                keep = keep & sel[b if sel.shape[0] > 1 else 0, q_idx, kv_idx]
            return keep

        return mod


def in_query_blocks(
    block, c: int, recompute: bool, q, k, v, q_pos, k_pos, mask: AttentionMask, scores: int | None = None, ctx=None
) -> Tensor:
    """Run ``block`` on query rows ``[s, s + c)`` against only the keys the mask lets them see.

    ``block`` takes ``(q, k, v, q_pos, k_pos, mask, ctx)`` of one block (``ctx``: the call's
    :class:`~posenc.Context` narrowed to the block, or None); ``recompute``: checkpoint each block (its scores
    are rebuilt in backward). A window or chunk shrinks ``c`` (:meth:`AttentionMask.query_block`).
    ``scores``: also keep each block's ``rows × keys`` at most this (at least 8 rows), so
    that every block of a long causal call allocates score tensors of about one size.
    Blocks whose sizes grow with the key count leave the C allocator's heap fragmented
    (each block's tensors no longer fit where the previous block's were freed): CoPE's
    ``chunked`` fwd+bwd at L = 8192 peaked at 9.2 GiB resident for about 1 GiB of live
    tensors. The blocked backends of :mod:`posenc.attend.backends` run through it.
    """
    (Lq, Lk), c = (q.shape[2], k.shape[2]), mask.query_block(c)
    if Lq <= c and (scores is None or Lq * Lk <= scores):
        return block(q, k, v, q_pos, k_pos, mask, ctx)
    outs = []
    e = 0
    while e < Lq:
        s = e
        e = min(s + c, Lq)
        if scores is not None:
            ks, ke = mask.key_range(s, e, Lk)
            e = min(e, s + max(8, scores // max(ke - ks, 1)))
        ks, ke = mask.key_range(s, e, Lk)
        bctx = None if ctx is None else ctx.block(slice(s, e), slice(ks, ke))
        args = (
            q[:, :, s:e],
            k[:, :, ks:ke],
            v[:, :, ks:ke],
            q_pos[:, s:e],
            k_pos[:, ks:ke],
            mask.narrow(s, ks, ke),
            bctx,
        )
        outs.append(checkpoint(block, *args, use_reentrant=False) if recompute else block(*args))
    return torch.cat(outs, dim=2)  # (B, H, Lq, Dh)
