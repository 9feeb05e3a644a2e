"""No import circles anywhere in the project: every module can be imported on its own, in any order."""
from __future__ import annotations

from tests.import_graph import build, project


def test_there_are_no_import_circles():
    circles = project().circles()
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(group) for group in circles)


def test_the_circle_finder_finds_one(tmp_path):
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__init__.py").write_text("")
    (tmp_path / "app" / "a.py").write_text("from app import b\n")
    (tmp_path / "app" / "b.py").write_text("def later():\n    import app.a\n")
    (tmp_path / "app" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import app.a\n")
    assert build(tmp_path, ("app",)).circles() == [["app.a", "app.b"]]
