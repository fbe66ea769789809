"""``torch.compile`` graph breaks of a whole :class:`~posenc.TransformerLM` per encoding.

``torch._dynamo.explain`` on a small model (vocab 64, D = 32, 2 layers, 2 heads, L = 16):
the number of graphs, the number of breaks and each distinct break reason with the
source line it comes from. A failing compile is a finding, reported in the row.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..model import TransformerLM

__all__ = ["graph_breaks", "explain_breaks"]


def explain_breaks(name: str) -> dict:
    """``{"encoding", "graphs", "breaks", "reasons"}`` for one encoding (``"error"`` if compiling fails)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    lm = TransformerLM(64, 32, 2, 2, encoding=name, max_len=32)
    tokens = torch.randint(0, 64, (2, 16))
    try:
        ex = torch._dynamo.explain(lm)(tokens)
    except Exception as e:  # noqa: BLE001 (reported, not hidden)
        return {
            "encoding": name,
            "graphs": None,
            "breaks": None,
            "reasons": [],
            "error": f"{type(e).__name__}: {e}"[:200],
        }
    reasons: list[str] = []
    for b in ex.break_reasons:
        where = b.user_stack[-1] if b.user_stack else None
        loc = f"{Path(where.filename).name}:{where.lineno}" if where is not None else "?"
        text = f"{loc}: {b.reason.splitlines()[0][:160]}"
        if text not in reasons:
            reasons.append(text)
    return {"encoding": name, "graphs": ex.graph_count, "breaks": ex.graph_break_count, "reasons": reasons}


def graph_breaks(names: list[str], progress: Callable[[str], None] | None = None) -> list[dict]:
    """:func:`explain_breaks` for each encoding."""
    out = []
    for n in names:
        if progress:
            progress(f"graph breaks {n}")
        out.append(explain_breaks(n))
    torch._dynamo.reset()
    return out
