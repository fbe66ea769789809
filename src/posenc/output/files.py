"""JSON, CSV and text files with one float policy, each written atomically.

Every JSON file posenc writes goes through :func:`clean`: NaN and ±inf become ``null``
(strict JSON has no spelling for them, and a reader must not take a missing value
for a number), tuples become lists, and floats keep their shortest round-trip form
unless ``digits`` rounds them to that many significant digits (values that came from
float32 tensors carry no more than 7).

Every file is written by :func:`atomic_write`: into a temporary file in the same folder,
flushed to disk, then renamed over the target (``os.replace``). A reader sees the old
file or the whole new one, never a part; a full or read-only disk leaves the old file (or
none) and no temporary, and the error is an :class:`OutputError` naming the path.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import secrets
import signal
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = [
    "OutputError",
    "atomic_write",
    "clean",
    "hold_ctrl_c",
    "write_bytes",
    "write_csv",
    "write_json",
    "write_text",
]


class OutputError(OSError, ValueError):
    """A file could not be written (full disk, read-only folder, ...): one sentence naming
    the path. An ``OSError`` (keeps ``errno``) and a ``ValueError`` (the tools' one-line
    error path)."""

    def __str__(self) -> str:
        return f"cannot write {str(self.filename)!r}: {self.strerror}"


def _error(path: Path, e: OSError) -> OutputError:
    if isinstance(e, OutputError):
        return e
    return OutputError(e.errno, e.strerror or str(e), str(path))


def _mkdir(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _error(folder, e) from None


@contextlib.contextmanager
def hold_ctrl_c() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that arrives during the block and raise it as
    ``KeyboardInterrupt`` when the block ends, so the file being written is whole; a second
    Ctrl-C interrupts at once. Only where Python's own handler is installed (the main
    thread, no handler of the caller's): elsewhere the block runs as it is."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    held: list[int] = []

    def hold(signum, frame):
        if held:  # the second: now
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        held.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        raise KeyboardInterrupt


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "w", **open_kw) -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing; on leaving the block without an
    error, flush it to disk and rename it to ``path``. On any error the temporary is removed
    and ``path`` is untouched. A Ctrl-C is held (:func:`hold_ctrl_c`) until the file is in
    place; a second one interrupts at once, as an error.

    Raises:
        OutputError: the file cannot be created, written or renamed (``errno`` kept).
    """
    with hold_ctrl_c():
        with _atomic_write(Path(path), mode, **open_kw) as f:
            yield f


@contextlib.contextmanager
def _atomic_write(path: Path, mode: str, **open_kw) -> Iterator[IO]:
    _mkdir(path.parent)
    # a hidden name that no tool writes, in the same folder (os.replace is atomic there);
    # O_EXCL: never through a link an attacker placed
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # umask applies
    except OSError as e:
        raise _error(path, e) from None
    done = False
    try:
        with os.fdopen(fd, mode, **open_kw) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        done = True
    except OSError as e:
        raise _error(path, e) from None
    finally:
        if not done:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically, creating the folder."""
    with atomic_write(path, "w", encoding="utf-8") as f:
        f.write(text)
    return Path(path)


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically, creating the folder."""
    with atomic_write(path, "wb") as f:
        f.write(data)
    return Path(path)


def clean(x: Any, digits: int | None = None) -> Any:
    """``x`` with NaN/inf floats as None, tuples as lists, floats rounded to ``digits`` significant digits."""
    if isinstance(x, float):
        if not math.isfinite(x):
            return None
        return float(f"{x:.{digits}g}") if digits else x
    if isinstance(x, dict):
        return {k: clean(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v, digits) for v in x]
    return x


def write_json(path: str | Path, data: Any, *, digits: int | None = None) -> Path:
    """Write ``clean(data, digits)`` as strict JSON (``allow_nan=False``), atomically, creating the folder."""
    text = json.dumps(clean(data, digits), indent=1, allow_nan=False) + "\n"  # before any file is touched
    return write_text(path, text)


def write_csv(path: str | Path, rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> Path | None:
    """One line per row (``columns``: default the first row's keys; others ignored), atomically.

    Lists become ``;``-joined numbers (6 significant digits); NaN/inf and None become empty
    cells, as in the JSON. Writes nothing for no rows and returns None.
    """
    if not rows:
        return None
    path = Path(path)
    cols = list(columns or rows[0])

    def cell(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return ";".join(f"{t:.6g}" if isinstance(t, float) else str(t) for t in v)
        if isinstance(v, float) and not math.isfinite(v):
            return ""
        return v

    with atomic_write(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: cell(r.get(k)) for k in cols})
    return path
