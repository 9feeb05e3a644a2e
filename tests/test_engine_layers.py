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

from pathlib import Path

from tests.import_graph import build, circles, file_edges

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
    return build(ROOT, ("engine",)).modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported engine module, line, under TYPE_CHECKING) for every import in the file."""
    return [(e.target, e.line, e.typing_only) for e in file_edges(name, path, modules) if e.target in modules]


def _layer(name: str) -> int:
    best, rank = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank >= 0, f"{name} belongs to no layer: add it to LAYERS"
    return rank


def _graph() -> dict[str, list[tuple[str, int, bool]]]:
    graph = build(ROOT, ("engine",))
    return {name: [(e.target, e.line, e.typing_only) for e in edges if e.target in graph.modules]
            for name, edges in graph.edges.items()}


def test_every_engine_module_has_a_layer():
    for name in _modules():
        _layer(name)


def test_no_import_in_engine_points_upward():
    upward = [f"{name}:{line} imports {dep} ({LAYERS[_layer(dep)][0]} is above {LAYERS[_layer(name)][0]})"
              for name, deps in _graph().items() for dep, line, _ in deps if _layer(dep) > _layer(name)]
    assert upward == []


_circles = circles


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
