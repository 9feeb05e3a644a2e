"""Layering contract: engine/ never imports Qt or the app; widgets/ never import torch, transformers or the app;
app/core, the CLI and the server never reach Qt, even through a chain of imports; no file is over 500 lines; the
window's controllers never reach into its private members."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.import_graph import build, project

ROOT = Path(__file__).resolve().parents[1]

ENGINE_FORBIDDEN = ("PySide6", "shiboken6", "pyqtgraph", "PyQt5", "PyQt6", "qtpy", "app", "widgets")
WIDGETS_FORBIDDEN = ("torch", "transformers", "accelerate", "bitsandbytes", "app")
WIDGETS_ALLOWED_ENGINE = ("engine.types", "engine.measure.stats", "engine.measure.explain", "engine.errors",
                          "engine.settings", "engine.limits", "engine.measure.check_types",
                          "engine.cpu_threads")  # cpu_threads: the standard library only


def imports(path: Path) -> list[tuple[int, str]]:
    """Every module an import statement names (function-level and TYPE_CHECKING imports included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against the file's own package
                package = path.relative_to(ROOT).parent.parts
                base = ".".join(package[: len(package) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            # `from engine import decoding` names engine.decoding
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def under(name: str, top: str) -> bool:
    return name == top or name.startswith(top + ".")


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_there_is_something_to_check():
    assert sources("engine") and sources("widgets")


@pytest.mark.parametrize("path", sources("engine"), ids=lambda p: str(p.relative_to(ROOT)))
def test_engine_never_imports_qt_or_the_app(path):
    bad = [f"{path.relative_to(ROOT)}:{line} imports {name}" for line, name in imports(path)
           if any(under(name, top) for top in ENGINE_FORBIDDEN)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("path", sources("widgets"), ids=lambda p: str(p.relative_to(ROOT)))
def test_widgets_never_import_torch_transformers_or_the_app(path):
    bad = []
    for line, name in imports(path):
        if any(under(name, top) for top in WIDGETS_FORBIDDEN):
            bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
        elif under(name, "engine") and name != "engine" and not any(under(name, a) for a in WIDGETS_ALLOWED_ENGINE):
            # `from engine.types import Step` also yields "engine.types.Step": fine, it is under engine.types.
            bad.append(f"{path.relative_to(ROOT)}:{line} imports {name} (only {', '.join(WIDGETS_ALLOWED_ENGINE)})")
    assert not bad, "\n".join(bad)


QT = ("PySide6", "shiboken6", "pyqtgraph", "PyQt5", "PyQt6", "qtpy")
# The one place the CLI may reach Qt: `sweep --png` renders the Tune tab's plots offscreen, loaded only then.
CLI_MAY_DRAW = frozenset({("app.cli.sweep", "widgets.tune.sweep_png")})


def _qt_free_app_modules() -> list[str]:
    names = project().modules
    return sorted(n for n in names if under(n, "app.core") or under(n, "app.cli") or under(n, "app.serve"))


@pytest.mark.parametrize("name", _qt_free_app_modules())
def test_the_app_cores_the_cli_and_the_server_never_reach_qt(name):
    """app/core is tested without a QApplication; the CLI and the server run on machines without a display.
    An import chain counts: a module that imports a module that imports Qt fails here, with its chain."""
    chains = project().reach(name, skip=CLI_MAY_DRAW)
    bad = [" -> ".join(chain) for target, chain in sorted(chains.items())
           if any(under(target, top) for top in QT + ("widgets", "app.ui", "app.main"))]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("name", sorted(n for n in project().modules if under(n, "widgets")))
def test_widgets_never_reach_torch_through_an_import_chain(name):
    chains = project().reach(name)
    bad = [" -> ".join(chain) for target, chain in sorted(chains.items())
           if any(under(target, top) for top in ("torch", "transformers", "accelerate", "bitsandbytes", "app"))]
    assert not bad, "\n".join(bad)


def test_the_transitive_check_follows_chains(tmp_path):
    for pkg in ("app/core", "app/ui"):
        (tmp_path / pkg).mkdir(parents=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "app" / "__init__.py").write_text("")
    (tmp_path / "app/core/a.py").write_text("def f():\n    from app.core import b\n")
    (tmp_path / "app/core/b.py").write_text("from app.ui import c\n")
    (tmp_path / "app/ui/c.py").write_text("import PySide6.QtCore\n")
    graph = build(tmp_path, ("app",))
    assert graph.reach("app.core.a")["PySide6"] == ["app.core.a", "app.core.b", "app.ui.c", "PySide6"]


def test_the_checker_catches_a_violation(tmp_path, monkeypatch):
    fake_root = tmp_path
    (fake_root / "widgets").mkdir()
    bad = fake_root / "widgets" / "bad.py"
    bad.write_text("import torch\nfrom engine.decoding import Engine\nfrom engine.models import store\n", encoding="utf-8")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", fake_root)
    names = [n for _, n in imports(bad)]
    assert "torch" in names and "engine.decoding" in names and "engine.models.store" in names


MAX_LINES = 500  # a file one can read in one sitting; past this it is two files


@pytest.mark.parametrize("package", ("engine", "app", "widgets"))
def test_no_file_is_longer_than_one_sitting(package):
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in sources(package)
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES]
    assert not long, f"over {MAX_LINES} lines, split them:\n" + "\n".join(long)


def private_window_uses(path: Path) -> list[str]:
    """`window._x` or `self._window._x`: a controller reaching into the window instead of taking what it needs."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else None
        if name in ("window", "_window"):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {name}.{node.attr}")
    return found


@pytest.mark.parametrize("path", [p for p in sources("app/ui") if p.name != "window.py"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_controllers_never_reach_into_the_window(path):
    bad = private_window_uses(path)
    assert not bad, "\n".join(bad)


def test_the_window_check_catches_a_reach(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    bad = tmp_path / "controller.py"
    bad.write_text("def f(window, self):\n    window._show_error('a', 'b')\n    self.window._closed\n"
                   "    self.window.chat\n", encoding="utf-8")
    assert sorted(u.split(" uses ")[1] for u in private_window_uses(bad)) == ["window._closed", "window._show_error"]


def test_the_engines_tests_run_where_qt_is_not_installed():
    """The GPU machine has no PySide6: the shared fixtures (conftest.py) must not need it for an engine test."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    code = ("import sys; sys.modules['PySide6'] = None\n"  # as if it were not installed
            "import pytest\n"
            "sys.exit(pytest.main(['-p', 'no:pytest-qt', '-p', 'no:cacheprovider', '-o', 'addopts=', '-q',"
            " 'tests/test_control.py::test_cheap_draft_and_high_acceptance_draft_long']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


def test_the_window_opens_without_importing_torch():
    """The window shows (and says it is loading) before torch's second of imports: its modules import no torch at
    module level; the engine's come with the first load."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    code = "import sys, app.ui.window; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]
