"""An output folder belongs to one run at a time, and is checked before the work starts.

:class:`OutputFolder` (a context manager) is what ``posenc analyze`` and ``posenc bench``
hold for their whole run, the same mechanism as ``posenc compare``'s
:class:`~posenc.output.rundir.RunDir`: an exclusive ``fcntl`` lock on ``<out>/.lock``
(the kernel frees it when the process dies, so a killed run leaves no stale lock). Any
posenc tool that tries the same folder meanwhile is refused with one sentence naming the
lock. On entry it also checks that the folder can be created and written (a small file
written, flushed to disk and removed), so a read-only, full or misspelt ``--out`` is one
line before the work, not a traceback after it.

On leaving, it removes the ``.lock`` it created (a lock file that was already there stays)
and the folders it created if the run wrote nothing into them. The files themselves are
written atomically by :mod:`posenc.output.files`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

__all__ = ["LOCK", "OutputFolder", "OutputFolderError", "check_creatable"]

LOCK = ".lock"
_PROBE_BYTES = 4096  # written and flushed: a full disk refuses it (a 0-byte file would still fit)


class OutputFolderError(ValueError):
    """The output folder cannot be used as asked (one sentence naming the path)."""


def _why(e: OSError) -> str:
    if isinstance(e, PermissionError) or e.errno == errno.EROFS:
        return "permission denied (cannot create or write there)" if e.errno != errno.EROFS else "read-only file system"
    return e.strerror or str(e)


def _holder(fd: int) -> str:
    """The tool named in a held lock file (``"<pid> posenc compare"``), or ``"posenc process"``."""
    try:
        pid, _, tool = os.pread(fd, 200, 0).decode(errors="replace").strip().partition(" ")
    except OSError:
        return "posenc process"
    return f"{tool} (pid {pid})" if tool.startswith("posenc") and pid.isdigit() else "posenc process"


def check_creatable(folder: str | Path, flag: str, *, shown: str | Path | None = None) -> None:
    """Check, without creating anything, that ``folder`` is or can be made a writable folder.

    ``shown``: the path the message names after ``flag`` (default ``folder``; a file's
    path when ``folder`` is where that file goes).

    Raises:
        OutputFolderError: a part of the path is a file, or the nearest existing folder
            cannot be written.
    """
    p = Path(folder)
    name = f"{flag} {str(shown if shown is not None else p)!r}"
    here = p
    while not here.exists():
        if here.is_symlink():  # a dangling link: creating through it writes elsewhere
            raise OutputFolderError(f"{name}: {str(here)!r} is a broken symbolic link")
        if here.parent == here:
            break
        here = here.parent
    if here.exists() and not here.is_dir():
        where = "is a file, not a folder" if here == p else f"a parent of it, {str(here)!r}, is a file"
        raise OutputFolderError(f"{name}: {str(here)!r} {where}" if here == p else f"{name}: {where}")
    try:
        read_only = bool(os.statvfs(here).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        raise OutputFolderError(f"{name}: {str(here)!r} is on a read-only file system")
    if not os.access(here, os.W_OK | os.X_OK):
        raise OutputFolderError(f"{name}: permission denied (cannot create or write in {str(here)!r})")


class OutputFolder:
    """Exclusive use of an output folder for one run (a context manager).

    Args:
        path: the folder (created if missing, with its parents).
        tool: the command, for messages (``"posenc analyze"``).
        flag: the flag that named the folder, for messages.

    Raises:
        OutputFolderError: the folder cannot be created or written, or another process
            holds its lock.
    """

    def __init__(self, path: str | Path, *, tool: str = "posenc", flag: str = "--out") -> None:
        self.path, self.tool, self.flag = Path(path), tool, flag
        self._fd: int | None = None
        self._created: list[Path] = []  # folders this run made, innermost first
        self._made_lock = False

    error: type[OutputFolderError] = OutputFolderError  # what a refusal raises (a subclass may narrow it)

    def _fail(self, e: OSError) -> OutputFolderError:
        p = str(self.path)
        if isinstance(e, FileExistsError) or (isinstance(e, NotADirectoryError) and self.path.is_file()):
            return self.error(f"{self.flag} {p!r} exists and is not a folder")
        if isinstance(e, NotADirectoryError):
            return self.error(f"{self.flag} {p!r}: a parent of it is a file, not a folder")
        return self.error(f"{self.flag} {p!r} cannot be used: {_why(e)}")

    def __enter__(self) -> OutputFolder:
        try:
            self._make()
            self._probe()
            self._lock()
        except OSError as e:
            self._release()
            raise self._fail(e) from None
        except BaseException:
            self._release()
            raise
        return self

    def _make(self) -> None:
        missing = []
        here = self.path
        while not here.exists() and not here.is_symlink() and here.parent != here:
            missing.append(here)
            here = here.parent
        self.path.mkdir(parents=True, exist_ok=True)
        if not self.path.is_dir():
            raise FileExistsError(errno.EEXIST, "exists", str(self.path))
        self._created = missing  # innermost first

    def _probe(self) -> None:
        """Write a small file, flush it to disk and remove it: permission, read-only and a
        full disk all show here, before the work."""
        probe = self.path / f".posenc-probe-{secrets.token_hex(4)}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\0" * _PROBE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(probe)

    def _lock(self) -> None:
        import fcntl

        lock = self.path / LOCK
        for _ in range(10):  # the lock file may be removed by its holder between open and flock
            existed = os.path.lexists(lock)
            try:  # never through a link planted as .lock (truncating it would write elsewhere)
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise self.error(
                        f"{self.flag} {str(self.path)!r}: {str(lock)!r} is a symbolic link; remove it"
                    ) from None
                raise
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or device planted there
                os.close(fd)
                raise self.error(f"{self.flag} {str(self.path)!r}: {str(lock)!r} is not a regular file; remove it")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _holder(fd)
                os.close(fd)
                raise self.error(
                    f"{self.flag} {str(self.path)!r} is in use by another {holder} (it holds "
                    f"{str(lock)!r}); wait for it to finish, or choose another {self.flag}"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(lock, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._fd, self._made_lock = fd, not existed
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()} {self.tool}\n".encode())
                return
            os.close(fd)  # we locked a file its holder just removed: take the new one
        raise self.error(f"{self.flag} {str(self.path)!r}: could not take {str(lock)!r}")

    def _release(self) -> None:
        if self._fd is not None:
            import fcntl

            if self._made_lock:  # removed while still held: a process that opened it re-checks
                with contextlib.suppress(OSError):
                    os.unlink(self.path / LOCK)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
        for folder in self._created:  # folders this run made and left empty
            try:
                folder.rmdir()
            except OSError:
                break
        self._created = []

    def __exit__(self, *exc) -> None:
        self._release()
