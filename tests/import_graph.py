"""The project's import graph, read from the source with ast: which of its own modules (and which outside
packages) each module imports, at module level and inside functions alike.

Imports under `if TYPE_CHECKING:` are kept apart: they never run, so they cannot make import order
matter or pull a package in at run time; they name types for annotations only.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "app", "widgets", "bench", "tools", "tests")


@dataclass(frozen=True)
class Edge:
    source: str
    target: str  # a project module, or an outside top-level package ("PySide6", "torch")
    line: int
    typing_only: bool


@dataclass
class Graph:
    modules: dict[str, Path]
    edges: dict[str, list[Edge]] = field(default_factory=dict)

    def runtime_targets(self, name: str) -> set[str]:
        return {e.target for e in self.edges.get(name, ()) if not e.typing_only}

    def reach(self, start: str, skip: frozenset[tuple[str, str]] = frozenset()) -> dict[str, list[str]]:
        """Everything `start` pulls in at run time, each with one chain of imports that leads there."""
        chains: dict[str, list[str]] = {start: [start]}
        todo = [start]
        while todo:
            here = todo.pop()
            for target in sorted(self.runtime_targets(here)):
                if target in chains or (here, target) in skip:
                    continue
                chains[target] = chains[here] + [target]
                if target in self.modules:
                    todo.append(target)
        return chains

    def circles(self) -> list[list[str]]:
        """Groups of more than one module that import each other, over run-time imports."""
        return circles({name: {t for t in self.runtime_targets(name) if t in self.modules} for name in self.modules})


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
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
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """The longest project module that `name` lies in, or the outside package's top-level name."""
    probe = name
    while probe:
        if probe in modules:
            return probe
        probe = probe.rpartition(".")[0]
    return name.partition(".")[0]


def file_edges(name: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    typing_nodes: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for stmt in node.body:
                typing_nodes.update(id(n) for n in ast.walk(stmt))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges: list[Edge] = []
    for node in ast.walk(tree):
        named: list[str] = []
        if isinstance(node, ast.Import):
            named = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            # `from pkg import submodule` names the submodule; `from mod import thing` names mod
            named = [f"{module}.{alias.name}" for alias in node.names]
        for full in named:
            target = _resolve(full, modules)
            if target and target != name:
                edges.append(Edge(name, target, node.lineno, id(node) in typing_nodes))
    return edges


def build(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> Graph:
    modules = {module_name(p, root): p for top in packages for p in sorted((root / top).rglob("*.py"))}
    graph = Graph(modules)
    for name, path in modules.items():
        graph.edges[name] = file_edges(name, path, modules)
    return graph


@cache
def project() -> Graph:
    return build()
