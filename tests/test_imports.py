"""No import cycles between the gateway's modules (issue 20: "a module below never imports
one above"): every `import` of python/gateway — at the top, under `TYPE_CHECKING` or inside a
function — is an edge of the module graph, and the graph has no cycle but the ones allowed
below. A package's `__init__` re-exporting its own modules is not an edge back up from them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parent.parent / "python"

#: Cycles tolerated, each as the set of modules on it: none.
ALLOWED: Final[list[frozenset[str]]] = []


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The gateway modules `name` imports (the module itself for `from pkg import module`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in known:
                    yield sub
                elif source in known:
                    yield source


def _graph() -> dict[str, set[str]]:
    known = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        edges = set()
        for target in _imports(name, path, known):
            # A package's own `__init__` (re-exports) is not an edge back up from its modules.
            if target != name and not name.startswith(target + "."):
                edges.add(target)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walk_sees_the_imports_it_must() -> None:
    graph = _graph()
    assert "gateway.server" in graph and "gateway.app" in graph["gateway.server"]
    assert "gateway.batch.runner" in graph["gateway.batch.service"]
    # a lazy import inside a function counts too (the cluster module is imported on demand)
    assert "gateway.cluster.node" in graph["gateway.server"]


def test_no_import_cycles_between_modules() -> None:
    cycles = [c for c in _cycles(_graph()) if frozenset(c) not in ALLOWED]
    assert cycles == [], f"import cycles: {cycles}"


def test_a_cycle_is_found() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
