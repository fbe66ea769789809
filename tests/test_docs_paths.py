"""The documentation a user reads names no path of a development machine, and its pages stay short.

* No tracked text file under docs/, src/, examples/, scripts/, benchmarks/ or README.md names an
  absolute path of a development machine (``/work/...``, ``/tmp/runs...``, a home folder): a user
  cannot open it. Commands in the docs use relative paths (``runs/x``) or placeholders
  (``/data/wikitext-103``).
* Every Markdown page under docs/ (docs/studies/ included) is at most 600 lines.
* Every relative link between Markdown pages under docs/ resolves: the file exists, and a
  ``#anchor`` names one of its headings.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("docs", "src", "examples", "scripts", "benchmarks", "README.md")
MACHINE_PATH = re.compile(r"(/work/|/tmp/runs|/home/[a-z]|/root/|/Users/)")
MAX_LINES = 600
SKIP_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".ipynb_checkpoints"}


def _tracked(paths: tuple[str, ...]) -> list[Path]:
    """The files git tracks under ``paths`` (that still exist); without git, a walk that skips caches."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--", *paths], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout
        files = [ROOT / p for p in out.decode("utf-8", "surrogateescape").split("\0") if p]
    except (OSError, subprocess.SubprocessError):
        files = []
        for p in paths:
            top = ROOT / p
            if top.is_file():
                files.append(top)
            elif top.is_dir():
                files += [f for f in top.rglob("*") if f.is_file() and not SKIP_DIRS & set(f.relative_to(ROOT).parts)]
    return sorted(f for f in files if f.is_file())


def _text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data[:8192]:  # a binary file (figures, data)
        return None
    return data.decode("utf-8", errors="replace")


def _doc_pages() -> list[Path]:
    tracked = [p for p in _tracked(("docs",)) if p.suffix == ".md"]
    on_disk = sorted((ROOT / "docs").rglob("*.md"))  # pages not yet added to git count too
    return sorted(set(tracked) | set(on_disk))


def test_no_development_machine_paths():
    hits = []
    for path in sorted(set(_tracked(SCANNED)) | set(_doc_pages())):
        text = _text(path)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if MACHINE_PATH.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not hits, "absolute paths of a development machine (a user cannot open them):\n" + "\n".join(hits)


def test_doc_pages_are_at_most_600_lines():
    pages = _doc_pages()
    assert pages, "no Markdown pages under docs/"
    long = []
    for page in pages:
        n = len(page.read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES:
            long.append(f"{page.relative_to(ROOT)}: {n} lines (at most {MAX_LINES})")
    assert not long, "\n".join(long)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fence = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            a = _anchor(m.group(1))
            k = seen.get(a, 0)
            seen[a] = k + 1
            out.add(a if k == 0 else f"{a}-{k}")
    return out


LINK = re.compile(r"\]\(([^)\s]+?\.md)(#[^)\s]*)?\)|\]\((#[^)\s]+)\)")


@pytest.mark.parametrize("page", _doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_between_doc_pages_resolve(page):
    broken = []
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        for m in LINK.finditer(line):
            target, anchor, local = m.group(1), m.group(2), m.group(3)
            if target and re.match(r"[a-z]+://", target):
                continue
            dest = page if local else (page.parent / target).resolve()
            anchor = local or anchor
            if not dest.is_file():
                broken.append(f"{page.relative_to(ROOT)}:{n}: {target} does not exist")
            elif anchor and anchor[1:] not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}:{n}: {target or ''}{anchor} names no heading")
    assert not broken, "\n".join(broken)
