"""The package's layers and the direction of its imports (docs/how-it-works.md, "The house").

Every ``import`` of a nanhunt module, also those inside functions, is an arrow from the importing
module's layer to the imported one's. Arrows go only downward (or within one package), and no
set of modules imports itself round a circle. Read from the source with ``ast``: nothing is
imported, so the test sees the lazy imports too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "nanhunt"

#: layer of each top-level module or folder of nanhunt; an import goes to a lower layer or stays
#: inside its own folder (the top-level modules of one layer may not import each other either)
LAYERS = {
    "_version": 0, "_optional": 0, "_paths": 0, "_patching": 0, "_waiting": 0, "errors": 0,
    "formats": 0, "trace": 0, "stats": 0, "fixspec": 0, "contract": 0,
    "capture": 1, "analyse": 1,
    "report": 2,
    "replay": 3,
    "experiment": 4, "precision": 4,
    "pipeline": 5, "distributed": 5,
    "cli": 6, "integrations": 6,
    "__init__": 7, "__main__": 7,
}

#: upward arrows that exist today and are being removed (the sentinel runs the analysis from
#: inside capture); a new one fails, and so does one of these once it is gone (delete it here)
KNOWN_UPWARD: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The nanhunt modules ``name`` imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:  # `import nanhunt.capture.x as y` -> the module
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("nanhunt"):
                out.add(t)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _where(name: str) -> tuple[str, int]:
    parts = name.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    return top, LAYERS[top]


def test_every_module_has_a_layer():
    assert {(m, _where(m)[0]) for m in MODULES if _where(m)[0] not in LAYERS} == set()


def test_imports_only_go_down():
    upward = set()
    for src, targets in GRAPH.items():
        top, layer = _where(src)
        for dst in targets:
            dtop, dlayer = _where(dst)
            if (dtop == top and top != "__init__") or dlayer == layer == 0:
                continue  # inside one folder, or between the core modules
            if dst == "nanhunt" or dlayer >= layer:
                upward.add((src, dst))
    assert upward - KNOWN_UPWARD == set(), "imports that go up or sideways"
    assert KNOWN_UPWARD - upward == set(), "fixed: remove them from KNOWN_UPWARD"


def test_no_import_cycles():
    # (the known upward arrows are left out: they close a circle through capture's __init__)
    # Tarjan's strongly connected components over the module graph
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v] - {dst for src, dst in KNOWN_UPWARD if src == v}:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert cycles == []


@pytest.mark.parametrize("top", ["analyse", "report", "trace", "errors", "formats"])
def test_the_analysis_and_the_reports_never_import_torch(top):
    # a saved report.json is diagnosed and rendered anywhere, without torch
    heavy = []
    for name, path in MODULES.items():
        if _where(name)[0] != top:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            heavy += [(name, n) for n in names if n == "torch" or n.startswith("torch.")]
    assert heavy == []
