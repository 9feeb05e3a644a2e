"""engine/ is built in layers, each importing only its own layer and those below, with no import circles.

The order, lowest first (a module belongs to the longest prefix that names it):
  base      engine.errors, engine.limits, engine.types, engine.loadspec, engine.settings, engine.garbage
  maths     engine.measure.stats, engine.measure.costmodel: summaries and the cost model, pure sums over
            engine types, which the loop and the K controller read as much as the benchmarks do
  models    engine.models: sources, the cache, conversion, memory plans, precisions, loading weights
  runners   engine.runners: forwards over loaded models (eager, CUDA graphs, oneDNN, llama.cpp)
  heads     engine.heads: the draft head, its runner and its training
  decoding  engine.decoding: proposers, verification, the K controller, the loop and its Engine
  measure   engine.measure: bench, sweep and experiments on a loaded Engine
  assemble  engine.assemble: one LoadSpec -> a ready Engine (the only module that knows every layer)

Every import counts, at module level and inside functions alike. Imports under `if TYPE_CHECKING:`
are not followed for circles: they never run, so they cannot make import order matter; they name a
type for annotations only (the loop's Generation names the Engine that runs it). They must still
respect the layers.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("engine.errors", "engine.limits", "engine.types", "engine.loadspec", "engine.settings",
              "engine.garbage", "engine")),
    ("maths", ("engine.measure.stats", "engine.measure.costmodel")),
    ("models", ("engine.models",)),
    ("runners", ("engine.runners",)),
    ("heads", ("engine.heads",)),
    ("decoding", ("engine.decoding",)),
    ("measure", ("engine.measure",)),
    ("assemble", ("engine.assemble",)),
    ("serving", ("engine.serving",)),  # the server's scheduler: owns an engine and its request queue
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / "engine").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported engine module, line, under TYPE_CHECKING) for every import in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[str, int, bool]] = []

    def target(module: str, names: list[str]) -> list[str]:
        hits = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules]  # `from pkg import submodule`
        rest = len(hits) < len(names)
        return hits + ([module] if rest and module in modules else [])

    def visit(node: ast.AST, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit_stmt(stmt, True)
                for stmt in child.orelse:
                    visit_stmt(stmt, typing_only)
                continue
            visit_stmt(child, typing_only)

    def visit_stmt(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("engine"):
                    out.extend((m, node.lineno, typing_only) for m in target(alias.name, []) or [alias.name])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "engine" or module.startswith("engine."):
                out.extend((m, node.lineno, typing_only) for m in target(module, [a.name for a in node.names]))
        visit(node, typing_only)

    visit(ast.parse(path.read_text()), False)
    return [(m, line, t) for m, line, t in out if m in modules and m != name]


def _layer(name: str) -> int:
    best, rank = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank >= 0, f"{name} belongs to no layer: add it to LAYERS"
    return rank


def _graph() -> dict[str, list[tuple[str, int, bool]]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_engine_module_has_a_layer():
    for name in _modules():
        _layer(name)


def test_no_import_in_engine_points_upward():
    upward = [f"{name}:{line} imports {dep} ({LAYERS[_layer(dep)][0]} is above {LAYERS[_layer(name)][0]})"
              for name, deps in _graph().items() for dep, line, _ in deps if _layer(dep) > _layer(name)]
    assert upward == []


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
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
            strong(v)
    return found


def test_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_in_engine():
    graph = {name: {dep for dep, _, typing_only in deps if not typing_only} for name, deps in _graph().items()}
    assert _circles(graph) == []


def test_imports_inside_functions_and_type_checking_are_read(tmp_path):
    """A function-level import is an edge (else the circle test could not fail for one); a
    TYPE_CHECKING import is marked as one."""
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.types import Step\n"
                    "def f():\n    from engine.decoding import loop\n    import engine.limits\n")
    modules = {"engine.x.m": path, "engine.types": path, "engine.decoding.loop": path, "engine.decoding": path,
               "engine.limits": path}
    assert sorted(_imports("engine.x.m", path, modules)) == [
        ("engine.decoding.loop", 5, False), ("engine.limits", 6, False), ("engine.types", 3, True)]
