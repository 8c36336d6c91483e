"""The modules of `src/rollout` import each other without cycles.

The graph is built with `ast` from every `import` / `from ... import` of a
`rollout` module anywhere in a module: at the top, inside functions, and in
`if TYPE_CHECKING:` blocks alike (a cycle hidden in a function is still a
cycle in the design). An edge goes to the most specific module that exists:
`from rollout.store import sql` names `rollout.store.sql`, `from rollout.store
import open_store` names `rollout.store` (its `__init__`). Importing a
submodule also runs its package's `__init__`, but that implicit edge is left
out: otherwise every module would depend on its own package.

    HF_HUB_OFFLINE=1 .venv/bin/pytest tests/test_import_graph.py -q
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_files(src: Path = SRC) -> dict[str, Path]:
    """Module name -> file, for every module of the `rollout` package."""
    out = {}
    for path in sorted((src / "rollout").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imported_names(module: str, path: Path) -> set[str]:
    """Every dotted name an import statement of `module` may refer to."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from .x import y
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names.update(f"{target}.{alias.name}" for alias in node.names)  # a submodule, or a name in `target`
    return names


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Module -> the `rollout` modules it imports."""
    files = module_files(src)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        edges = set()
        for name in _imported_names(module, path):
            while name and name not in files:  # `rollout.x.func` -> `rollout.x`
                name = name.rpartition(".")[0]
            if name and name != module:
                edges.add(name)
        graph[module] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path a -> b -> ... -> a) per strongly connected component with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan; the package is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, component) for component in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first within the component)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def test_the_graph_sees_imports_everywhere(tmp_path):
    pkg = tmp_path / "rollout"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rollout.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from rollout.sub import c\n")
    (pkg / "sub" / "c.py").write_text("from ..a import thing\nimport rollout.sub\n")
    graph = import_graph(tmp_path)
    assert graph["rollout.a"] == {"rollout.b"}
    assert graph["rollout.b"] == {"rollout.sub.c"}
    assert graph["rollout.sub.c"] == {"rollout.a", "rollout.sub"}
    assert find_cycles(graph) == [["rollout.a", "rollout.b", "rollout.sub.c", "rollout.a"]]


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)
