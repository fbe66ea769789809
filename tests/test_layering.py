"""The floors of ``src/posenc`` (DESIGN.md, "Floors"): no import circle, no long file, encodings below the layer.

The import graph is read with :mod:`ast`, imports inside functions included: a lazy import
that only exists to break a circle is still a circle (STYLE.md, "Avoid" 9).
"""

from __future__ import annotations

import ast
from pathlib import Path

import posenc

SRC = Path(posenc.__file__).parent
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = ("posenc", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _imports(name: str, path: Path) -> set[str]:
    """The ``posenc`` modules ``name`` imports, at any depth of its code.

    ``from PKG import X`` depends on the module ``PKG.X`` when there is one (Python imports it
    without reading ``PKG``'s own names), and on ``PKG`` itself otherwise. Importing a
    submodule loads its parent package first, but that holds for every module and is no
    circle, so it is not an edge.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                out.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in MODULES else target)
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_circle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _circles(graph) == [["a", "b", "c"]]


def test_no_import_circle():
    assert _circles(GRAPH) == []


def test_no_file_over_400_lines():
    long = {str(p.relative_to(SRC)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_encodings_stand_below_the_layer():
    """``encodings/`` serves the attention layer and the backends, so it imports none of them (nor anything above)."""
    above = (
        "attention",
        "backends",
        "kernels",
        "model",
        "config",
        "cache",
        "hf",
        "compare",
        "analysis",
        "bench",
        "extend",
    )
    above = tuple(f"posenc.{m}" for m in above)
    upward = {
        (name, target)
        for name, targets in GRAPH.items()
        if name.startswith("posenc.encodings")
        for target in targets
        if target == "posenc" or any(target == m or target.startswith(m + ".") for m in above)
    }
    assert upward == set()


def test_extend_imports_nothing_from_compare():
    """``compare --extend`` calls into ``posenc.extend``, never the other way round (issue 62)."""
    up = {
        m: sorted(d for d in GRAPH[m] if d.startswith("posenc.compare")) for m in GRAPH if m.startswith("posenc.extend")
    }
    assert {m: d for m, d in up.items() if d} == {}
