"""What a run (``posenc compare``, ``posenc extend``) wrote into its run folder: ``<out>/.posenc-manifest.json``.

``--overwrite`` removes only what a manifest lists, so a folder shared with other files
loses none of them. A run records every path *before* writing it (a run killed half-way
still lists what it left) and, when it ends, drops the entries it did not write after all
(:meth:`Manifest.prune`). The file is JSON, ``{"written": ["config.json",
"checkpoints/rope.pt", ...], "tool": "posenc compare"}``, paths relative to the folder, and
the tool that wrote them (``posenc compare`` or ``posenc extend``): one tool's ``--overwrite``
never removes another's files. It is rewritten atomically on every change.

A manifest is data from disk, so it is not trusted: an entry that is absolute, climbs out
(``..``), names the lock or the manifest itself, or leads out of the folder through a
symbolic link is ignored, never removed. Files are unlinked (a symbolic link is removed,
not what it points to); folders are removed only when empty.
"""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath

from .files import write_text

__all__ = ["MANIFEST", "Manifest"]

MANIFEST = ".posenc-manifest.json"
_NEVER = {MANIFEST, ".lock"}


class Manifest:
    """The paths (relative, ``/``-separated) a comparison wrote into ``root``."""

    def __init__(self, root: str | Path, written: list[str] | None = None, tool: str | None = None) -> None:
        self.root = Path(root)
        self.written: list[str] = [p for p in dict.fromkeys(written or []) if _safe(p)]
        self.tool = tool  # the command that wrote the files; None in a manifest of posenc <= 222d208

    @classmethod
    def read(cls, root: str | Path) -> Manifest | None:
        """The manifest of ``root``; None when there is none. A damaged one is a ``ValueError``."""
        path = Path(root) / MANIFEST
        if not path.exists():
            return None
        try:
            if not path.is_file():  # a folder, a FIFO (reading it would block): not a manifest
                raise TypeError
            d = json.loads(path.read_text())
            written, tool = d["written"], d.get("tool")
            if not isinstance(written, list) or not all(isinstance(p, str) for p in written):
                raise TypeError
            if tool is not None and not isinstance(tool, str):
                raise TypeError
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
            raise ValueError(
                f"{str(path)!r} is damaged (not the list of files a comparison wrote); "
                "remove the run's files yourself and delete it, or choose another --out"
            ) from None
        return cls(root, written, tool)

    def relative(self, path: str | Path) -> str:
        """``path`` (absolute, or relative to the working folder) relative to the root."""
        rel = os.path.relpath(os.path.abspath(path), os.path.abspath(self.root))
        rel = PurePosixPath(Path(rel).as_posix()).as_posix()
        if not _safe(rel):
            raise ValueError(f"{str(path)!r} is not inside the run folder {str(self.root)!r}")
        return rel

    def lists(self, path: str | Path) -> bool:
        return self.relative(path) in self.written

    def record(self, *paths: str | Path) -> None:
        """Add ``paths`` (files or folders inside the root) and write the manifest."""
        new = [r for r in (self.relative(p) for p in paths) if r not in self.written]
        if new:
            self.written += new
            self.save()

    def prune(self) -> None:
        """Drop the entries that do not exist (recorded, then not written)."""
        kept = [p for p in self.written if os.path.lexists(self.root / p)]
        if kept != self.written:
            self.written = kept
            self.save()

    def save(self) -> None:
        # atomically, through a fresh O_EXCL temporary: never through a link planted in the folder
        d = {"written": self.written, **({"tool": self.tool} if self.tool else {})}
        write_text(self.root / MANIFEST, json.dumps(d, indent=1) + "\n")

    def remove_listed(self) -> list[str]:
        """Remove every listed file that still exists, then every listed folder left empty;
        return what was removed. Nothing unlisted is touched."""
        removed, folders = [], []
        for rel in self.written:
            target = self.root / rel
            if not _inside(self.root, target):
                continue
            if target.is_dir() and not target.is_symlink():
                folders.append(rel)
            elif os.path.lexists(target):
                target.unlink()
                removed.append(rel)
        for rel in sorted(folders, key=lambda r: -r.count("/")):  # the deepest first
            try:
                (self.root / rel).rmdir()
                removed.append(rel)
            except OSError:  # not empty: it holds files no comparison listed
                pass
        self.written = [p for p in self.written if p not in removed]
        return removed


def _safe(rel: str) -> bool:
    p = PurePosixPath(rel)
    return (
        bool(rel)
        and not p.is_absolute()
        and "\\" not in rel
        and "\x00" not in rel
        and all(part not in ("", ".", "..") for part in p.parts)
        and rel not in _NEVER
    )


def _inside(root: Path, target: Path) -> bool:
    """``target``'s folder, links resolved, is ``root`` or under it (the name itself may be a link)."""
    base = os.path.realpath(root)
    parent = os.path.realpath(target.parent)
    return os.path.commonpath([base, parent]) == base
