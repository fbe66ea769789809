"""What one attention call hands the score side of its encoding: :class:`Context`.

A stage method reads what it needs from the context instead of the layer and the
backends asking it, flag by flag, what to pass (posenc's third-round interface)::

    ctx.q_pos, ctx.k_pos     # (B|1, Lq[, A]), (B|1, Lk[, A]) int64: the call's positions
    ctx.x                    # (B, Lq, D): the layer input rows of the queries (after the input stage), or None
    ctx.q_state, ctx.k_state # {name: (B, *, Lq|Lk, ...)}: what the encoding's read_input computed from
                             #   the layer input, per query and per key (cached keys included)
    ctx.mask                 # (B|1, 1, Lq, Lk) bool, True = attend; None: nothing hidden
    ctx.qk                   # (B, H, Lq, Lk) the plain q·kᵀ where the score sum computed it, else None
    ctx.qk_proj              # the layer's (W_Q, W_K), for an encoding that projects its own tables
    ctx.tables               # a Tables memo shared by every layer of one model call

A blocked backend hands each block of query rows the context of that block
(:meth:`Context.block`). An encoding that reads the hidden state implements
:meth:`posenc.PositionEncoding.read_input`; its result comes back here as ``q_state`` /
``k_state``, and the KV cache keeps ``k_state`` beside the keys.

This module imports nothing from posenc: it is on the ground floor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from torch import Tensor

__all__ = ["Context", "InputRead", "Tables"]


class InputRead(NamedTuple):
    """What :meth:`posenc.PositionEncoding.read_input` returns for the tokens a call adds.

    ``k``, ``v``: ``(B, Hkv, L, Dh)``, the projected keys and values, possibly transformed
    (Inkling's short convolutions); ``state``: ``{name: (B, *, L, ...)}`` per token, the
    token axis on dim 2 (FoX's cumulative log forget gate); the queries read the rows of
    the query tokens and the KV cache keeps the rest beside the keys; ``carry``: the
    encoding's running state for the next call of a cache (the last raw keys a
    convolution reads), or None.
    """

    k: Tensor
    v: Tensor
    state: dict[str, Tensor]
    carry: Any = None


class Tables:
    """Position tables computed once per model call and shared by the layers that ask for them.

    ``tables.get(key, make)`` returns the value stored under ``key`` or stores ``make()``.
    A key holds the tensors it is computed from (positions) by identity, so a table made
    for one call's positions is never read for another's; the memo lives as long as the
    call (:class:`posenc.TransformerLM` makes one per forward).
    """

    def __init__(self) -> None:
        self._memo: dict[tuple, tuple[tuple, Any]] = {}
        self.hits = 0  # lookups answered from the memo (for tests and benchmarks)

    def get(self, owner: object, name: str, inputs: tuple[Tensor, ...], make: Callable[[], Any]) -> Any:
        """The table ``name`` of ``owner`` for ``inputs`` (tensors compared by identity)."""
        key = (id(owner), name, *(id(t) for t in inputs))
        hit = self._memo.get(key)
        if hit is not None and hit[0][0] is owner and all(a is b for a, b in zip(hit[0][1:], inputs)):
            self.hits += 1
            return hit[1]
        value = make()
        self._memo[key] = ((owner, *inputs), value)  # keeps the inputs alive: their ids stay unique
        return value


def table(ctx: Context | None, owner: object, name: str, inputs: tuple[Tensor, ...], make: Callable[[], Any]) -> Any:
    """``make()``, through the context's :class:`Tables` memo when the call has one."""
    if ctx is None or ctx.tables is None:
        return make()
    return ctx.tables.get(owner, name, inputs, make)


def _rows(t: Tensor | None, rows: slice, dim: int) -> Tensor | None:
    if t is None:
        return t
    return t.narrow(dim, rows.start, rows.stop - rows.start)


@dataclass(eq=False)
class Context:
    """One attention call, as the score side of an encoding sees it (see the module docstring)."""

    q_pos: Tensor
    k_pos: Tensor
    x: Tensor | None = None
    q_state: dict[str, Tensor] = field(default_factory=dict)
    k_state: dict[str, Tensor] = field(default_factory=dict)
    mask: Tensor | None = None
    qk: Tensor | None = None
    qk_proj: tuple | None = None
    tables: Tables | None = None

    def block(self, rows: slice, keys: slice) -> Context:
        """The context of query rows ``rows`` against keys ``keys`` (``mask``/``qk`` are set per block
        by the score sum, so they are dropped)."""
        return replace(
            self,
            q_pos=_rows(self.q_pos, rows, 1),
            k_pos=_rows(self.k_pos, keys, 1),
            x=_rows(self.x, rows, 1),
            q_state={n: _rows(t, rows, 2) for n, t in self.q_state.items()},
            k_state={n: _rows(t, keys, 2) for n, t in self.k_state.items()},
            mask=None,
            qk=None,
        )

    def need(self, what: str, encoding: str) -> Any:
        """``getattr(self, what)`` or a ``ValueError`` saying that ``encoding`` needs it."""
        value = getattr(self, what)
        if value is None or (isinstance(value, dict) and not value):
            raise ValueError(
                f"encoding {encoding!r} reads ctx.{what} (the layer's call context); call it through "
                "posenc.Attention, or pass ctx=posenc.Context(...) with it"
            )
        return value


def positions_context(q_pos: Tensor, k_pos: Tensor, ctx: Context | None) -> Context:
    """``ctx``, or a bare context of these positions for a direct stage call."""
    return Context(q_pos, k_pos) if ctx is None else ctx
