"""A comparison's run folder belongs to one config and one process at a time.

* :func:`default_out` names a new folder ``runs/<timestamp>-<random>``: two runs started in
  the same second never share one.
* :class:`RunDir` takes the folder: it creates it, holds an exclusive ``fcntl`` lock on
  ``<out>/.lock`` for the whole run (the kernel frees it when the process dies, so a killed
  run never leaves a stale lock), refuses a non-empty folder unless the run resumes or
  overwrites, and with ``overwrite`` removes what an earlier comparison wrote there
  (and nothing else).
* :func:`check_checkpoint` refuses a checkpoint written under another config: every
  checkpoint and ``results.json`` records :meth:`CompareConfig.fingerprint`.

Errors are :class:`RunDirError` (a ``ValueError``), one sentence naming the path.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from .config import CompareConfig

__all__ = ["RunDir", "RunDirError", "default_out", "check_checkpoint", "OUTPUTS"]

# what a comparison writes into its folder: --overwrite removes exactly these
OUTPUTS = (
    "config.json",
    "results.json",
    "results.csv",
    "table.md",
    "report.md",
    "extrapolation.png",
    "per_position.png",
    "passkey.png",
    "checkpoints",
)
LOCK = ".lock"


class RunDirError(ValueError):
    """The run folder cannot be used as asked."""


def default_out(root: str = "runs") -> str:
    """``runs/<timestamp>-<6 hex>``: unique even for runs started in the same second."""
    return f"{root}/{time.strftime('%Y-%m-%dT%H-%M-%S')}-{secrets.token_hex(3)}"


class RunDir:
    """Exclusive use of a run folder (a context manager).

    Args:
        path: the folder (created if missing).
        resume: continue the run already there.
        overwrite: remove an earlier comparison's outputs and checkpoints first.

    Raises:
        RunDirError: the folder cannot be created or written, another process holds it,
            or it is not empty and neither ``resume`` nor ``overwrite`` was given.
    """

    def __init__(self, path: str | Path, *, resume: bool = False, overwrite: bool = False) -> None:
        if resume and overwrite:
            raise RunDirError("--resume and --overwrite exclude each other: continue the run, or start it over")
        self.path, self.resume, self.overwrite = Path(path), resume, overwrite
        self._fd: int | None = None

    def __enter__(self) -> RunDir:
        import fcntl

        p = self.path
        try:
            p.mkdir(parents=True, exist_ok=True)
            fd = os.open(p / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except FileExistsError:
            raise RunDirError(f"--out {str(p)!r} exists and is not a folder") from None
        except NotADirectoryError:
            raise RunDirError(f"--out {str(p)!r}: a parent of it is a file, not a folder") from None
        except PermissionError:
            raise RunDirError(f"--out {str(p)!r}: permission denied (cannot create or write there)") from None
        except OSError as e:
            raise RunDirError(f"--out {str(p)!r} cannot be used: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise RunDirError(
                f"--out {str(p)!r} is in use by another posenc compare (it holds {str(p / LOCK)!r}); "
                "wait for it to finish, or choose another --out"
            ) from None
        self._fd = fd
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            self._claim()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _claim(self) -> None:
        entries = sorted(e.name for e in self.path.iterdir() if e.name != LOCK)
        if self.resume:
            if not (self.path / "config.json").is_file():
                raise RunDirError(f"--resume: {str(self.path / 'config.json')!r} not found (is this a run folder?)")
            return
        if self.overwrite:
            for name in OUTPUTS:
                target = self.path / name
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                elif target.exists() or target.is_symlink():
                    target.unlink()
            return
        if entries:
            shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
            raise RunDirError(
                f"--out {str(self.path)!r} is not empty ({shown}); continue that run with --resume, "
                "start it over with --overwrite, or choose another --out"
            )

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            import fcntl

            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def check_checkpoint(path: Path, extra: dict[str, Any], cfg: CompareConfig) -> None:
    """Raise :class:`RunDirError` when the checkpoint at ``path`` was written under another config."""
    saved = extra.get("fingerprint")
    if saved == cfg.fingerprint():
        return
    old = extra.get("compare_config")
    fields = cfg.differing_fields(old) if isinstance(old, dict) else []
    diff = ", ".join(f"{f}: {old.get(f)!r} -> {getattr(cfg, f, None)!r}" for f in fields[:6]) if fields else ""
    raise RunDirError(
        f"--resume: checkpoint {str(path)!r} was written under another config"
        + (f" ({diff})" if diff else " (no fingerprint: written by an older posenc)")
        + "; a run folder belongs to one config: start it over with --overwrite, or use another --out"
    )
