"""One figure style for every plot posenc draws.

* :func:`pyplot` — matplotlib on the Agg backend (files, no display) with posenc's style;
* :func:`save_figure` — a title plus a subtitle naming the run, tight layout, one dpi;
* :func:`readable_log_axis` — a log axis labelled densely enough that every plotted value
  can be read (all of 1..9 within a decade, 1-2-3-4-5-7 over two, 1-2-5 over four,
  decades beyond), in plain numbers;
* :func:`length_axis` — a log2 axis with a labelled tick at every given length;
* :func:`panel_grid` — a wrapped grid of per-item panels.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

from .files import atomic_write

__all__ = ["STYLE", "length_axis", "panel_grid", "pyplot", "readable_log_axis", "save_figure"]

# applied by pyplot(): font sizes that stay readable at the saved size
STYLE = {
    "figure.titlesize": 11,
    "axes.titlesize": 9,
    "axes.labelsize": 9,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "legend.fontsize": 7,
    "savefig.dpi": 120,
    # constrained layout keeps the title, colorbars and outside legends clear of the panels
    "figure.constrained_layout.use": True,
}
DPI = 120


def pyplot():
    """matplotlib's pyplot on the Agg backend, with :data:`STYLE`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(STYLE)
    return plt


def save_figure(fig, path: str | Path, *, title: str, subtitle: str | None = None, footer: str | None = None) -> Path:
    """Title the figure (``title``, then ``subtitle`` naming the run in smaller type), lay it
    out, save it as PNG (atomically: :func:`~posenc.output.files.atomic_write`) and close it.
    ``footer``: a note along the bottom edge.

    Raises:
        OutputError: the file cannot be written.
    """
    plt = pyplot()
    text = title if not subtitle else f"{title}\n{subtitle}"
    size = STYLE["figure.titlesize"] - (subtitle is not None)
    fig.suptitle(text, fontsize=size)
    if footer:  # a figure-level x label: the layout keeps it clear of the panels
        fig.supxlabel(footer, fontsize=7, x=0.01, ha="left", wrap=True)
    if fig.get_layout_engine() is None:  # a figure made before pyplot() set the style
        fig.tight_layout()
    path = Path(path)
    try:
        with atomic_write(path, "wb") as f:  # the whole PNG or none: never a 0-byte file
            fig.savefig(f, dpi=DPI, format=path.suffix.lstrip(".").lower() or "png")
    finally:
        plt.close(fig)
    return path


def readable_log_axis(ax, values: Iterable[float], axis: str = "y") -> None:
    """A log axis whose labels let every plotted value be read, in plain numbers.

    Ticks per decade follow the span of the finite positive ``values``: 1..9 within about
    one decade, 1-2-3-4-5-7 up to 1.5, 1-2-5 up to 4, one per decade beyond (minor ticks
    unlabelled): up to 1.5 decades a value at most doubles between two labels, up to 4 it
    grows at most 2.5×.
    """
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    which = ax.yaxis if axis == "y" else ax.xaxis
    (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
    vals = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not vals:
        return
    decades = math.log10(max(vals)) - math.log10(min(vals))
    if decades <= 0.7:
        subs = (1, 1.5, 2, 3, 4, 5, 6, 7, 8, 9)
    elif decades <= 1.5:
        subs = (1, 2, 3, 4, 5, 7)
    elif decades <= 4:
        subs = (1, 2, 5)
    else:
        subs = (1.0,)
    which.set_major_locator(LogLocator(base=10, subs=subs, numticks=100))
    which.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    which.set_minor_formatter(NullFormatter())


def length_axis(ax, lengths: Iterable[int], axis: str = "x") -> None:
    """A log2 axis with one labelled tick at each of ``lengths`` (and no minor ticks)."""
    from matplotlib.ticker import NullLocator

    lens = sorted(set(lengths))
    if axis == "x":
        ax.set_xscale("log", base=2)
        ax.set_xticks(lens, [str(n) for n in lens])
        ax.xaxis.set_minor_locator(NullLocator())
    else:
        ax.set_yscale("log", base=2)
        ax.set_yticks(lens, [str(n) for n in lens])
        ax.yaxis.set_minor_locator(NullLocator())


def panel_grid(n_items: int, per_item: int, items_per_row: int, size=(3.2, 3.0)):
    """A figure with ``per_item`` side-by-side panels for each of ``n_items``, wrapped.

    Returns ``(fig, axes_of)`` where ``axes_of(k)`` is the list of item ``k``'s panels;
    unused panels are hidden.
    """
    plt = pyplot()
    n_items = max(n_items, 1)
    cols = per_item * min(items_per_row, n_items)
    rows = math.ceil(n_items / items_per_row)
    fig, axes = plt.subplots(rows, cols, figsize=(size[0] * cols, size[1] * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n_items * per_item :]:
        ax.set_visible(False)

    def axes_of(k: int):
        return flat[k * per_item : (k + 1) * per_item]

    return fig, axes_of
