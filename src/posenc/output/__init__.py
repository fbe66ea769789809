"""What posenc's tools write: tables, JSON/CSV files and figures, one way each.

``posenc compare``, ``posenc analyze`` and ``posenc bench`` all use it:

* :class:`Table` — rows under :class:`Column` s; ``.print()`` with rich on the console,
  ``.markdown()`` for ``table.md`` / ``RESULTS.md``, from the same cells;
* :func:`write_json` — strict JSON with one float policy (:func:`clean`: NaN/inf → null);
  :func:`write_csv` — the same rows as CSV; :func:`write_text`; every file written
  atomically (:func:`atomic_write`: a temporary beside it, then ``os.replace``), a failure
  an :class:`OutputError` naming the path;
* :class:`OutputFolder` — a run's exclusive hold on its output folder (``<out>/.lock``),
  checked creatable and writable before the work;
* :func:`pyplot`, :func:`save_figure` (title + a subtitle naming the run),
  :func:`readable_log_axis`, :func:`length_axis`, :func:`panel_grid` — one figure style.
"""

from .figures import STYLE, length_axis, panel_grid, pyplot, readable_log_axis, save_figure
from .files import OutputError, atomic_write, clean, write_bytes, write_csv, write_json, write_text
from .folder import OutputFolder, OutputFolderError, check_creatable
from .tables import Column, Table, fmt_cell, make_console

__all__ = [
    "STYLE",
    "Column",
    "OutputError",
    "OutputFolder",
    "OutputFolderError",
    "Table",
    "atomic_write",
    "check_creatable",
    "clean",
    "fmt_cell",
    "length_axis",
    "make_console",
    "panel_grid",
    "pyplot",
    "readable_log_axis",
    "save_figure",
    "write_bytes",
    "write_csv",
    "write_json",
    "write_text",
]
