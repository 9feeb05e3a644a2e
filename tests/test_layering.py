"""Layering contract: engine/ never imports Qt or the app; widgets/ never import torch, transformers or the app;
the session and the CLI in app/ never import Qt."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ENGINE_FORBIDDEN = ("PySide6", "shiboken6", "pyqtgraph", "PyQt5", "PyQt6", "qtpy", "app", "widgets")
WIDGETS_FORBIDDEN = ("torch", "transformers", "accelerate", "bitsandbytes", "app")
WIDGETS_ALLOWED_ENGINE = ("engine.types", "engine.measure.stats", "engine.measure.explain", "engine.errors",
                          "engine.settings", "engine.limits", "engine.measure.check_types")


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


QT_FREE_APP = (
    "app/session.py", "app/export.py", "app/cli.py", "app/cli_options.py", "app/cli_sweep.py",
    "app/cli_cache.py", "app/cli_distill.py", "app/race_logic.py", "app/cli_check.py",
)


@pytest.mark.parametrize("name", QT_FREE_APP)
def test_the_session_and_the_cli_never_import_qt(name):
    """The session is tested without a QApplication and the CLI runs on machines without a display."""
    path = ROOT / name
    bad = [f"{name}:{line} imports {mod}" for line, mod in imports(path)
           if any(under(mod, top) for top in ("PySide6", "shiboken6", "pyqtgraph", "widgets", "app.window",
                                               "app.worker", "app.race", "app.settings", "app.main"))
           and not under(mod, "app.race_logic")]
    assert not bad, "\n".join(bad)


def test_the_checker_catches_a_violation(tmp_path, monkeypatch):
    fake_root = tmp_path
    (fake_root / "widgets").mkdir()
    bad = fake_root / "widgets" / "bad.py"
    bad.write_text("import torch\nfrom engine.decoding import Engine\nfrom engine.models import store\n", encoding="utf-8")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", fake_root)
    names = [n for _, n in imports(bad)]
    assert "torch" in names and "engine.decoding" in names and "engine.models.store" in names
