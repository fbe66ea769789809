"""A run folder (``posenc compare``'s, ``posenc extend``'s) belongs to one run and one process at a time.

* :func:`default_out` names a new folder ``runs/<timestamp>-<random>``: two runs started in
  the same second never share one.
* :class:`RunDir` takes the folder as every posenc tool takes its output folder
  (:class:`posenc.output.OutputFolder`: created, checked writable before the work, an
  exclusive ``fcntl`` lock on ``<out>/.lock`` for the whole run, which the kernel frees
  when the process dies, so a killed run never leaves a stale lock), refuses a non-empty folder unless the run resumes or
  overwrites, and with ``overwrite`` removes what an earlier run of the same tool wrote there
  and nothing else: the paths its manifest lists (:mod:`posenc.output.manifest`). Every
  path a run writes is listed there before it is written; a file the run would replace
  that no manifest lists is not replaced (refused), and no path is written through a
  symbolic link out of the folder. A run that fails before it has anything worth
  resuming removes what it wrote (:meth:`RunDir.discard`), so the corrected rerun finds
  the folder as it was.

Errors are :class:`RunDirError` (a ``ValueError``), one sentence naming the path.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from .folder import LOCK, OutputFolder, OutputFolderError
from .manifest import MANIFEST, Manifest

__all__ = ["RunDir", "RunDirError", "default_out", "is_locked"]


class RunDirError(OutputFolderError):
    """The run folder cannot be used as asked."""


def default_out(root: str = "runs") -> str:
    """``runs/<timestamp>-<6 hex>``: unique even for runs started in the same second."""
    return f"{root}/{time.strftime('%Y-%m-%dT%H-%M-%S')}-{secrets.token_hex(3)}"


class RunDir(OutputFolder):
    """Exclusive use of a run folder (a context manager): an :class:`~posenc.output.OutputFolder`
    (created, probed writable and locked on ``<out>/.lock`` before the work, as ``analyze``
    and ``bench`` hold theirs) that also claims the folder for one comparison.

    Args:
        path: the folder (created if missing).
        resume: continue the run already there.
        overwrite: remove what an earlier run of the same tool listed in the folder's manifest first.
        writes: the paths (relative to ``path``) this run will write; recorded in the
            manifest before anything is written. With ``overwrite``, one that exists and
            no manifest lists is not ours to replace: refused.
        tool: the command (``"posenc compare"``, ``"posenc extend"``), recorded in the manifest
            and in the lock; ``resume`` and ``overwrite`` refuse a folder another tool wrote.

    Raises:
        RunDirError: the folder cannot be created or written, another process holds it,
            it is not empty and neither ``resume`` nor ``overwrite`` was given, another
            tool wrote it, or ``overwrite`` would replace a file no run listed.
    """

    error = RunDirError

    def __init__(
        self,
        path: str | Path,
        *,
        resume: bool = False,
        overwrite: bool = False,
        writes: Iterable[str] = (),
        tool: str = "posenc compare",
    ) -> None:
        if resume and overwrite:
            raise RunDirError("--resume and --overwrite exclude each other: continue the run, or start it over")
        super().__init__(path, tool=tool, flag="--out")
        self.resume, self.overwrite, self.writes = resume, overwrite, list(writes)
        self.manifest = Manifest(self.path, tool=tool)

    def __enter__(self) -> RunDir:
        super().__enter__()  # the folder made, probed and locked (OutputFolder), or RunDirError
        try:
            self._claim()
        except BaseException:  # refused: only what this run made goes (a lock file, a folder left empty)
            self.__exit__(None, None, None)
            raise
        return self

    def _claim(self) -> None:
        p = self.path
        entries = sorted(e.name for e in p.iterdir() if e.name != LOCK)
        if entries == [MANIFEST] and not _lists_anything(p):  # a run's manifest, its files all gone
            entries = []
        links = sorted({str(p / d) for w in self.writes for d in _folders(w) if (p / d).is_symlink()})
        if links:
            raise RunDirError(
                f"--out {str(p)!r}: {', '.join(links)} is a symbolic link; a run writes only inside --out: "
                "replace it with a folder, or choose another --out"
            )
        if self.resume:
            if not (p / "config.json").is_file():
                raise RunDirError(f"--resume: {str(p / 'config.json')!r} not found (is this a run folder?)")
            self.manifest = self._read_manifest() or self.manifest
        elif self.overwrite:
            self.manifest = self._read_manifest() or self.manifest
            theirs = [w for w in self.writes if os.path.lexists(p / w) and not (p / w).is_dir()
                      and w not in self.manifest.written]  # fmt: skip
            if theirs:
                shown = ", ".join(theirs[:5]) + (", ..." if len(theirs) > 5 else "")
                raise RunDirError(
                    f"--overwrite: --out {str(p)!r} holds {shown}, which this run would replace and no "
                    f"comparison listed as its own ({MANIFEST}: --overwrite removes only what a comparison "
                    "wrote); move or delete them yourself, or choose another --out"
                )
            self.manifest.remove_listed()
        elif entries:
            shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
            raise RunDirError(
                f"--out {str(p)!r} is not empty ({shown}); continue that run with --resume, "
                "start it over with --overwrite, or choose another --out"
            )
        self.manifest.record(*(p / w for w in self.writes))

    def _read_manifest(self) -> Manifest | None:
        try:
            m = Manifest.read(self.path)
        except ValueError as e:
            raise RunDirError(f"--out {str(self.path)!r}: {e}") from None
        if m is None:
            return None
        owner = m.tool or _legacy_tool(self.path)
        if owner != self.tool:
            flag = "--resume" if self.resume else "--overwrite"
            raise RunDirError(
                f"{flag}: --out {str(self.path)!r} holds a {owner} run ({MANIFEST}); {self.tool} {flag} never "
                f"touches another tool's files: choose another --out"
            )
        m.tool = self.tool
        return m

    def _listing(self) -> set[str]:
        """The names at the top of the folder and in ``checkpoints/`` (relative paths)."""
        names = {e.name for e in self.path.iterdir()}
        ckpt = self.path / "checkpoints"
        if ckpt.is_dir() and not ckpt.is_symlink():
            names |= {f"checkpoints/{e.name}" for e in ckpt.iterdir()}
        return names - {LOCK, MANIFEST}

    def record(self, *paths: str | Path) -> None:
        """List ``paths`` (inside the folder) in the manifest, before writing them."""
        self.manifest.record(*paths)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Around the writing of the output files: whatever appears in the folder meanwhile is
        listed too (a file the writers add that :data:`OUTPUTS` does not name yet)."""
        before = self._listing()
        try:
            yield
        finally:
            new = sorted(self._listing() - before)
            if new:
                self.manifest.record(*(self.path / n for n in new))

    def finish(self) -> None:
        """After the last write: drop the entries this run recorded and did not write."""
        self.manifest.prune()

    def discard(self) -> None:
        """Remove what this run wrote (its manifest's entries) and the manifest; on leaving,
        the lock file and the folder go too if this run created them and they are empty then
        (:class:`~posenc.output.OutputFolder`). For a run that failed before it wrote anything
        worth resuming: the rerun finds the folder as it was."""
        self.manifest.remove_listed()
        (self.path / MANIFEST).unlink(missing_ok=True)


def is_locked(path: str | Path) -> bool:
    """Whether a running comparison holds the folder ``path`` (its ``.lock``)."""
    import fcntl

    try:
        fd = os.open(Path(path) / LOCK, os.O_RDONLY | os.O_NONBLOCK)  # (a FIFO planted there must not block)
    except OSError:
        return False  # no lock file (or unreadable): no comparison ran there since
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def _legacy_tool(path: Path) -> str:
    """The tool that wrote a manifest without a ``tool`` (posenc <= 222d208, where compare and
    extend both wrote one): extend's config.json has ``methods`` and ``lengths``."""
    import json

    try:
        d = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return "posenc compare"
    return "posenc extend" if isinstance(d, dict) and {"methods", "lengths"} <= set(d) else "posenc compare"


def _lists_anything(path: Path) -> bool:
    """Whether the manifest in ``path`` lists a path that exists (a damaged one: yes, to be safe)."""
    try:
        m = Manifest.read(path)
    except ValueError:
        return True
    return m is not None and any(os.path.lexists(path / w) for w in m.written)


def _folders(rel: str) -> list[str]:
    """The folders on the way to ``rel`` (``"a/b/c"`` -> ``["a", "a/b"]``)."""
    parts = rel.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]
