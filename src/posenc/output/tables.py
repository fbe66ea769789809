"""One table, two renderings: a rich table on the console and Markdown for files."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Column", "Table", "fmt_cell", "make_console"]


def fmt_cell(v: Any) -> str:
    """A cell as text: None empty, floats to 4 decimals (scientific when tiny or huge), the rest ``str``."""
    if v is None:
        return ""
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            return str(v)
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e4):
            return f"{v:.2e}"
        return f"{v:.4f}"
    return str(v)


@dataclass(frozen=True)
class Column:
    """A column: its header, alignment (``"left"`` or ``"right"``), and whether Markdown shows
    its cells as ``code`` (names of encodings)."""

    name: str
    align: str = "left"
    code: bool = False

    def __post_init__(self) -> None:
        if self.align not in ("left", "right"):
            raise ValueError(f"align must be 'left' or 'right', got {self.align!r}")


class Table:
    """Rows under columns, printed with rich or written as Markdown from the same cells.

    Args:
        columns: :class:`Column` s, or headers (``str``): right-aligned when every cell
            below is a number.
        rows: one sequence of cells per row (formatted by :func:`fmt_cell`).
        title: a line above the table.
        notes: lines printed (and written) below it, each as ``note: ...``.
    """

    def __init__(
        self, columns: Sequence[str | Column], rows: Sequence[Sequence[Any]], *, title: str = "", notes=()
    ) -> None:
        def numeric(k: int) -> bool:
            cells = [r[k] for r in rows if k < len(r) and r[k] not in (None, "")]
            return bool(cells) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in cells)

        self.columns = [
            c if isinstance(c, Column) else Column(c, "right" if numeric(k) else "left") for k, c in enumerate(columns)
        ]
        self.rows = [[fmt_cell(v) for v in r] for r in rows]
        for r in self.rows:
            if len(r) != len(self.columns):
                raise ValueError(f"a row has {len(r)} cells for {len(self.columns)} columns: {r}")
        self.title, self.notes = title, list(notes)

    def markdown(self) -> str:
        """The table as GitHub Markdown (title and notes as paragraphs), ending in a newline."""

        def cell(c: Column, v: str) -> str:
            v = v.replace("|", "\\|")
            return f"`{v}`" if c.code and v else v

        lines = [self.title, ""] if self.title else []
        lines.append("| " + " | ".join(c.name for c in self.columns) + " |")
        lines.append("|" + "|".join("---:" if c.align == "right" else "---" for c in self.columns) + "|")
        lines += ["| " + " | ".join(cell(c, v) for c, v in zip(self.columns, r)) + " |" for r in self.rows]
        if self.notes:
            lines += [""] + [f"note: {n}  " for n in self.notes]
        return "\n".join(lines) + "\n"

    def print(self, console=None) -> None:
        """Print with rich: the terminal's width on a terminal, 200 columns into a file or pipe."""
        from rich.table import Table as RichTable
        from rich.text import Text

        console = console or make_console()
        t = RichTable(title=self.title or None)
        for c in self.columns:
            t.add_column(c.name, justify=c.align)
        for r in self.rows:
            t.add_row(*(Text(v) for v in r))  # as text: no rich markup in names like [x]
        console.print(t)
        for n in self.notes:
            console.print(f"note: {n}", markup=False, highlight=False)


def make_console(file=None):
    """A rich console: the terminal's width on a terminal, 200 columns otherwise (no wrapping in logs)."""
    from rich.console import Console

    f = file or sys.stdout
    return Console(file=file, width=None if f.isatty() else 200)
