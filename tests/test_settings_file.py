"""A hostile settings file: every stored value is validated, and the app always starts."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.core.demo import ScriptedEngine
from app.ui.settings import MAX_PANE_PIXELS, AppSettings
from app.ui.window import MainWindow
from app.ui.worker import running_threads
from engine.settings import K_RANGE, SEED_RANGE, ModelSelection
from widgets.settings_panel import DisplaySettings

ROOT = Path(__file__).resolve().parents[1]


def _json_value(text: str) -> str:
    # QSettings' INI escaping for a string value: quotes and backslashes escaped, the whole quoted.
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


HOSTILE = {
    "huge-ints": "[generation]\nsettings=" + _json_value(
        '{"seed": 3000000000, "k": 99999999999999999999999, "max_new_tokens": -5, "top_k": 1e400, '
        '"temperature": "nan", "top_p": -1, "mode": 7, "system_prompt": ["x"]}') + "\n"
                 "[window]\nsplitter=" + _json_value('{"sizes": [100000000000000000000, 5, 5]}') + "\n",
    "wrong-types": "[generation]\nsettings=" + _json_value('[1, 2, 3]') + "\n"
                   "[display]\nsettings=" + _json_value('{"colouring": "maybe", "show_rejected": 3}') + "\n"
                   "[window]\nview=" + _json_value('{"charts_visible": {"a": 1}}') + "\n"
                   "splitter=1, 2, 3\ngeometry=not bytes\n"
                   "[models]\nselection=" + _json_value(
                       '{"target": {"kind": "folder", "value": "a\\u0000b"}, "draft": 5, "device": "cuda:x", '
                       '"dtype": ["bf16"], "no_draft": "yes"}') + "\n",
    "deep-json": "[generation]\nsettings=" + _json_value("[" * 100_000) + "\n",
    "bad-geometry": "[window]\ngeometry=@ByteArray(" + "\\xff" * 100 + ")\n",
    "appearance": "[window]\nappearance=" + _json_value(
        '{"sidebar_width": 100000000000000000000, "theme": ["dark"], "markdown": {"a": 1}}') + "\n",
    "long-path": "[models]\nselection=" + _json_value(
        '{"target": {"kind": "folder", "value": "' + "a" * 10_000 + '"}}') + "\n",
}


def _write(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.ini"
    if name == "binary-junk":
        path.write_bytes(bytes(range(256)) * 16 + os.urandom(2048))
    else:
        path.write_text(HOSTILE[name], encoding="utf-8")
    return path


NAMES = [*HOSTILE, "binary-junk"]


@pytest.mark.parametrize("name", NAMES)
def test_every_stored_value_comes_back_valid(tmp_path, name):
    s = AppSettings(_write(tmp_path, name))
    g = s.generation()
    assert g == g.clamped() and K_RANGE[0] <= g.k <= K_RANGE[1] and SEED_RANGE[0] <= g.seed <= SEED_RANGE[1]
    assert isinstance(g.system_prompt, str)
    assert isinstance(s.display(), DisplaySettings)
    sel = s.models()
    assert isinstance(sel, ModelSelection) and "\x00" not in sel.target.value and len(sel.target.value) <= 4096
    sizes = s.splitter_sizes()
    assert sizes is None or all(0 <= x <= MAX_PANE_PIXELS for x in sizes)
    assert all(isinstance(v, bool) for v in s.panels().values())
    width = s.sidebar_width()
    assert width is None or 0 < width <= MAX_PANE_PIXELS
    assert s.theme() in ("system", "light", "dark") and isinstance(s.render_markdown(), bool)


@pytest.mark.parametrize("name", NAMES)
def test_the_window_always_starts(qtbot, tmp_path, name):
    w = MainWindow(engine_factory=lambda _req, _progress: ScriptedEngine(), settings=AppSettings(_write(tmp_path, name)))
    qtbot.addWidget(w)
    w.show()
    with qtbot.waitSignal(w.models_loaded, timeout=10000):
        w.load_models(w.selection)
    assert w.panel.values() == w.panel.values().clamped()
    assert all(0 <= x <= MAX_PANE_PIXELS for x in w.splitter.sizes() + w.outer.sizes())
    w.close()
    assert not running_threads()
    # What is written back on close is clean: the next start reads it without a single warning.
    again = AppSettings(tmp_path / f"{name}.ini")
    if name == "binary-junk":  # not a settings file of ours: never rewritten (tests/test_settings_foreign.py)
        assert again.refused
        return
    assert again.generation() == w.panel.values() and again.splitter_sizes() is not None


def test_demo_app_starts_and_quits_with_a_hostile_settings_file(tmp_path):
    path = tmp_path / "hostile.ini"
    path.write_text("".join(HOSTILE.values()) + "\n", encoding="utf-8")
    with open(path, "ab") as f:
        f.write(bytes(range(256)))  # and binary junk at the end
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "app.main", "--demo", "--settings", str(path), "--quit-after-ms", "500"],
                          env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr  # (a hang fails through the subprocess timeout, not a timed assert)
