"""What a model keeps between calls: KV caches, input-stage history, segment memory.

* :class:`KVCache` — keys, values and key positions of one attention layer, written by
  index (decoding: each call with ``cache=`` appends and advances).
* :class:`InputHistory` — the last inputs of an input stage that reads preceding tokens
  (an encoding's ``input_context``, e.g. a causal convolution's ``k - 1``), so that
  decoding token by token equals the full forward.
* :class:`ModelCache` — one :class:`KVCache` per layer, plus the history of input stages
  the model runs outside the layers.
* Transformer-XL's segment memory is a cache policy too: :mod:`posenc.layer.memory`.
* :class:`WindowKVCache` — a cache that keeps only some keys: the last ``W - 1`` for a
  sliding-window or chunked layer (a rolling cache, ``O(W)`` memory, equal to the full
  forward), or the first ``S`` plus the last ``W - 1`` with positions counted inside the
  cache (:class:`SinkWindow`, StreamingLLM).

Every layer cache answers the same questions (:meth:`KVCache.key_rows`, :meth:`KVCache.update`,
:attr:`KVCache.stores_keys`, :meth:`KVCache.mask_fields`, :meth:`KVCache.select_keys`), so the
layer has one path for all of them. Which keys a cache stores (rotated, or raw for encodings
with ``cache_raw_keys``) and how long the input history and the memory are, the encodings
declare (see :class:`posenc.PositionEncoding`); nothing here knows an encoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..base import PositionEncoding, Stage
from ..validate import check_args, check_memory

__all__ = [
    "CachePolicy",
    "layer_cache",
    "KVCache",
    "InputHistory",
    "ModelCache",
    "cat_positions",
    "document_spans",
    "run_input_stage",
]


def cat_positions(a: Tensor, b: Tensor) -> Tensor:
    """``(B|1, La[, A])`` and ``(B|1, Lb[, A])`` -> ``(B|1, La + Lb[, A])``, broadcasting the batch."""
    n = max(a.shape[0], b.shape[0])
    return torch.cat((a.expand(n, *a.shape[1:]), b.expand(n, *b.shape[1:])), dim=1)


class InputHistory:
    """The last ``size`` inputs ``(B, ≤size, D)`` of an input stage and their positions."""

    def __init__(self, size: int):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be an int >= 1, got {size!r}")
        self.size = size
        self.x: Tensor | None = None
        self.pos: Tensor | None = None

    def reset(self) -> None:
        self.x = self.pos = None

    def embed(self, enc: PositionEncoding, x: Tensor, pos: Tensor) -> Tensor:
        """``enc.embed`` over the kept inputs followed by ``x``; the rows of ``x`` come back.

        ``x`` ``(B, L, D)``, ``pos`` ``(B|1, L)``. Keeps the last ``size`` inputs for the next call.
        """
        if self.x is None:
            xa, pa, n = x, pos, 0
        else:
            if self.x.shape[0] != x.shape[0]:
                raise ValueError(f"input history was made for batch size {self.x.shape[0]}, got {x.shape[0]}")
            n = self.x.shape[1]
            xa, pa = torch.cat((self.x.to(x.dtype), x), dim=1), cat_positions(self.pos, pos)  # (B, n + L, D)
        out = enc.embed(xa, pa)[:, n:]
        self.x, self.pos = xa[:, -self.size :].detach(), pa[:, -self.size :]
        return out


def run_input_stage(
    enc: PositionEncoding, x: Tensor, pos: Tensor, history: InputHistory | None, documents: Tensor | None = None
) -> Tensor:
    """``enc.embed(x, pos)``, through ``history`` when decoding with a cache.

    ``documents`` ``(B|1, L)`` (packed sequences, no cache): the stage runs on each run of
    equal ids of each row on its own, so a stage that reads neighbouring inputs (a
    convolution) never reads across a document boundary.
    """
    if documents is not None:  # (posenc.layer.call.make_call refuses documents with a cache)
        return _per_document(enc, x, pos, documents)
    return enc.embed(x, pos) if history is None else history.embed(enc, x, pos)


def document_spans(ids: Tensor) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: the runs of equal values of the 1-D ``ids``, in order."""
    starts = torch.nonzero(torch.diff(ids, prepend=ids[:1] - 1)).flatten().tolist()
    return list(zip(starts, [*starts[1:], ids.shape[0]]))


def _per_document(enc: PositionEncoding, x: Tensor, pos: Tensor, documents: Tensor) -> Tensor:
    rows = []
    for b in range(x.shape[0]):
        pb, db = min(b, pos.shape[0] - 1), min(b, documents.shape[0] - 1)
        spans = document_spans(documents[db])
        rows.append(torch.cat([enc.embed(x[b : b + 1, s:e], pos[pb : pb + 1, s:e]) for s, e in spans], dim=1))
    return torch.cat(rows, dim=0)  # (B, L, D)


class CachePolicy:
    """What every layer cache answers, so the layer has one path for all of them (defaults: a
    cache of every key, written by ``update``; :class:`KVCache`, :class:`WindowKVCache`,
    :class:`posenc.layer.memory.LayerMemory`)."""

    reassigns_positions = False  # positions of cached keys are those they were written with
    room: int | None = None  # tokens one call may add and still equal token-by-token decoding (None: any)
    stores_keys = True  # keys and values are written by update() (a memory keeps rows instead)
    selects_keys = False  # keys a per-token mask covers are all kept (select_keys is the identity)

    def key_rows(self, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        """The layer input rows the keys of this call are projected from, and their positions:
        those of the new tokens (``x`` ``(B, L, D)``, ``pos``); the cached keys come from ``update``."""
        return x, pos

    def mask_fields(self, k_len: int) -> dict:
        """:class:`~posenc.AttentionMask` fields of a call that attends to ``k_len`` keys of this cache."""
        return {}

    def select_keys(self, t: Tensor) -> Tensor:
        """The columns of a per-token ``(B, length)`` tensor (a key padding mask) this cache still holds."""
        return t


class KVCache(CachePolicy, nn.Module):
    """Keys, values and key positions of past tokens for one attention layer.

    Shapes: ``k, v``: ``(B, H, Lmax, Dh)``; ``pos``: ``(B, Lmax)``, or ``(B, Lmax, A)`` for an
    encoding that reads ``axes = A > 1`` coordinates per position. The keys are stored
    after ``rotate`` unless the encoding sets ``cache_raw_keys`` (then before, and the
    whole cache is rotated again at each step). ``inputs`` is the history of the layer's
    own input stage, if it reads preceding inputs.
    """

    def __init__(
        self, batch_size: int, max_len: int, heads: int, head_dim: int, *, dtype=None, device=None, axes: int = 1
    ):
        super().__init__()
        check_args("KVCache", KVCache.__init__, {"batch_size": batch_size, "max_len": max_len, "axes": axes})
        if batch_size < 1 or max_len < 1:
            raise ValueError(f"batch_size and max_len must be >= 1, got {batch_size}, {max_len}")
        element = torch.empty(0, dtype=dtype).element_size()
        check_memory("KVCache", batch_size * max_len * (2 * heads * head_dim * element + axes * 8), device)
        shape = (batch_size, heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        pos_shape = (batch_size, max_len) if axes == 1 else (batch_size, max_len, axes)
        self.register_buffer("pos", torch.zeros(pos_shape, dtype=torch.long, device=device), persistent=False)
        self.length = 0
        self.inputs: InputHistory | None = None
        self.state: dict[str, Tensor] = {}  # the encoding's per-key state (read_input), token axis 2
        self.carry = None  # the encoding's running state between calls (read_input)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def reset(self) -> None:
        self.length = 0
        self.state, self.carry = {}, None
        if self.inputs is not None:
            self.inputs.reset()

    def update_state(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """After :meth:`update`: write the new keys' per-key ``state`` ``{name: (B, *, L, ...)}``
        by index, as the keys (one ``max_len`` buffer per name, made on first use), and return
        it for every key :meth:`update` returned (the new rows keep their graph)."""
        if not state:
            return {}
        end = self.length
        start = end - next(iter(state.values())).shape[2]
        out = {}
        for n, t in state.items():
            buf = self.state.get(n)
            if buf is None or buf.shape[:2] != t.shape[:2] or buf.shape[3:] != t.shape[3:] or buf.dtype != t.dtype:
                buf = self.state[n] = t.new_zeros(*t.shape[:2], self.max_len, *t.shape[3:])
            buf[:, :, start:end] = t.detach()
            out[n] = buf[:, :, :end] if not t.requires_grad else torch.cat((buf[:, :, :start], t), 2)
        return out

    def update(self, k: Tensor, v: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Append ``k, v`` ``(B, H, L, Dh)`` at ``pos`` ``(B|1, L[, A])``; return all cached so far."""
        B, _, L, _ = k.shape
        start, end = self.length, self.length + L
        if B != self.k.shape[0]:
            raise ValueError(f"cache was made for batch size {self.k.shape[0]}, got {B}")
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {start} cached + {L} new > max_len={self.max_len}")
        self.k[:, :, start:end] = k.to(self.k.dtype)
        self.v[:, :, start:end] = v.to(self.v.dtype)
        self.pos[:, start:end] = pos.expand(B, *pos.shape[1:])
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end], self.pos[:, :end]


@dataclass(frozen=True)
class SinkWindow:
    """StreamingLLM's cache policy (Xiao et al., "Efficient Streaming Language Models with
    Attention Sinks", ICLR 2024): keep the first ``sinks`` tokens and a window of recent ones.

    A query sees the ``sinks`` first tokens and the last ``window`` tokens, itself included
    (the authors' ``start_size = sinks``, ``recent_size = window - 1``). Positions are
    counted *inside the cache* (the authors' ``pos_shift``): the kept keys sit at ``0 .. n-1``,
    the query after them, so positions stay below ``sinks + window``; keys are kept before
    the q/k stage and rotated at their cache position at every step. A call of several
    tokens equals feeding them one at a time (:meth:`posenc.Attention.attend` cuts it where
    keys would be evicted), as the authors' evaluation decodes.
    """

    sinks: int = 4
    window: int = 1024

    def __post_init__(self) -> None:
        if not isinstance(self.sinks, int) or isinstance(self.sinks, bool) or self.sinks < 0:
            raise ValueError(f"SinkWindow.sinks must be an int >= 0, got {self.sinks!r}")
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
            raise ValueError(f"SinkWindow.window must be an int >= 1, got {self.window!r}")


class WindowKVCache(KVCache):
    """A KV cache that keeps the first ``keep_first`` and the last ``keep_last`` keys of the stream.

    ``length`` counts every token seen (the next default position). Memory is
    ``O(keep_first + keep_last)`` whatever the stream length. Each :meth:`update` returns
    the kept keys followed by the new ones, in stream order.

    Args:
        keep_last: recent keys kept for the next call (``W - 1`` for a window of ``W``).
        keep_first: first keys kept for good (StreamingLLM's sinks).
        policy: a :class:`SinkWindow` (positions counted inside the cache, sink-token mask);
            None: a rolling cache (positions and the mask as in the full forward).
    """

    def __init__(
        self,
        batch_size: int,
        heads: int,
        head_dim: int,
        *,
        keep_last: int,
        keep_first: int = 0,
        policy=None,
        dtype=None,
        device=None,
    ):
        nn.Module.__init__(self)
        given = {"batch_size": batch_size, "keep_last": keep_last, "keep_first": keep_first}
        check_args("WindowKVCache", WindowKVCache.__init__, given)
        if batch_size < 1 or keep_last < 0 or keep_first < 0:
            raise ValueError(
                f"batch_size must be >= 1 and keep_last/keep_first >= 0, got {batch_size}, {keep_last}, {keep_first}"
            )
        self.batch_size, self.keep_last, self.keep_first, self.policy = batch_size, keep_last, keep_first, policy
        empty = torch.zeros(batch_size, heads, 0, head_dim, dtype=dtype, device=device)
        self.k, self.v = empty, empty.clone()
        self.pos = torch.zeros(batch_size, 0, dtype=torch.long, device=device)
        self.index = torch.zeros(0, dtype=torch.long)  # stream index of each kept key
        self.held = self.index  # stream index of each key the last update returned
        self.length = 0
        self.inputs: InputHistory | None = None
        self.state, self.carry = {}, None
        self._keep = None  # which of the keys the last update returned it kept

    @property
    def max_len(self) -> int:
        return self.keep_first + self.keep_last

    def reset(self) -> None:
        super().reset()
        self.k, self.v, self.pos = self.k[:, :, :0], self.v[:, :, :0], self.pos[:, :0]
        self.index = self.held = self.index[:0]

    selects_keys = True

    @property
    def reassigns_positions(self) -> bool:
        return self.policy is not None

    @property
    def room(self) -> int | None:
        """With a :class:`SinkWindow`: the tokens the next call may take while every query of it
        still sees every kept key at the position token-by-token decoding gives it (none is
        evicted within the call): ``keep_first + keep_last + 1 - kept``, at least 1. None
        for a rolling cache, whose positions do not depend on what it keeps."""
        return None if self.policy is None else self.keep_first + self.keep_last + 1 - self.k.shape[2]

    def update(self, k: Tensor, v: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Append ``k, v`` ``(B, H, L, Dh)`` at ``pos`` ``(B|1, L)``; return the kept keys and these.

        The returned positions are the stream positions, or with a :class:`SinkWindow` the
        cache positions ``0 .. n-1``."""
        B, _, L, _ = k.shape
        if B != self.batch_size:
            raise ValueError(f"cache was made for batch size {self.batch_size}, got {B}")
        if pos.dim() != 2:
            raise ValueError(f"a windowed KV cache takes positions of shape (B, L), got {tuple(pos.shape)}")
        k_all = torch.cat((self.k, k.to(self.k.dtype)), 2)  # (B, H, n, Dh)
        v_all = torch.cat((self.v, v.to(self.v.dtype)), 2)
        p_all = torch.cat((self.pos, pos.expand(B, -1)), 1)  # (B, n)
        n = k_all.shape[2]
        self.held = torch.cat((self.index, torch.arange(self.length, self.length + L)))  # (n,)
        first = min(self.keep_first, n)  # the sinks come first among the held keys
        keep = torch.cat((torch.arange(first), torch.arange(max(first, n - self.keep_last), n)))
        self.index = self.held[keep]
        keep = keep.to(k.device)
        self.k, self.v, self.pos = k_all[:, :, keep], v_all[:, :, keep], p_all[:, keep]
        self._keep = keep
        self.length += L
        if self.policy is not None:
            p_all = torch.arange(n, device=k.device).expand(B, n)
        return k_all, v_all, p_all

    def update_state(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        if not state:
            return {}
        out = {n: torch.cat((self.state[n].to(t.dtype), t), 2) if n in self.state else t for n, t in state.items()}
        self.state = {n: t[:, :, self._keep].detach() for n, t in out.items()}
        return out

    def mask_fields(self, k_len: int) -> dict:
        if self.policy is not None:
            return {"window": self.policy.window, "sink_tokens": self.policy.sinks}
        return {"key_start": self.length - k_len}

    def select_keys(self, t: Tensor) -> Tensor:
        if t.shape[-1] != self.length:
            raise ValueError(f"a per-token mask must cover all {self.length} tokens seen, got {t.shape[-1]}")
        return t[:, self.held.to(t.device)]


@dataclass
class ModelCache:
    """One :class:`KVCache` per layer; ``length`` tokens are cached so far.

    ``inputs[i]``: the history of the input stage the model runs before block ``i`` (or
    on the token ids, ``i = 0``), for stages that read preceding inputs.
    """

    layers: list[KVCache]
    inputs: dict[int, InputHistory] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return self.layers[0].length

    @property
    def max_len(self) -> int:
        return self.layers[0].max_len

    def reset(self) -> None:
        for c in self.layers:
            c.reset()
        for h in self.inputs.values():
            h.reset()


def layer_cache(
    enc: PositionEncoding, batch_size: int, max_len: int, heads: int, head_dim: int, *,
    window: int | None, chunk: int | None, causal: bool, policy=None, dtype=None, device=None,
) -> KVCache:  # fmt: skip
    """The empty cache of one attention layer (:meth:`posenc.Attention.init_cache`): a rolling
    :class:`WindowKVCache` for a causal layer with a ``window``/``chunk``, StreamingLLM's
    with ``policy=SinkWindow(...)``, else a :class:`KVCache` of ``max_len`` tokens."""
    kw = {"dtype": dtype, "device": device}
    if policy is not None:
        if not isinstance(policy, SinkWindow):
            raise TypeError(f"policy must be a posenc.SinkWindow or None, got {type(policy).__name__}")
        if window is not None or chunk is not None or not causal:
            raise ValueError("a SinkWindow cache is for causal layers without their own window or chunk")
        if enc.stages & Stage.INPUT or enc.needs.axes != 1:
            raise ValueError(
                f"encoding {enc.name!r} cannot have its positions re-assigned in the cache "
                "(an input stage or several axes); SinkWindow needs q/k, score or bias stages"
            )
        keep = {"keep_first": policy.sinks, "keep_last": policy.window - 1, "policy": policy}
        return WindowKVCache(batch_size, heads, head_dim, **keep, **kw)
    span = [n for n in (window, chunk) if n is not None]
    if span and causal and enc.needs.axes == 1:
        return WindowKVCache(batch_size, heads, head_dim, keep_last=min(span) - 1, **kw)
    return KVCache(batch_size, max_len, heads, head_dim, axes=enc.needs.axes, **kw)
