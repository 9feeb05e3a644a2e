"""--settings FILE never rewrites a file that is not this app's own settings file, nor writes through a link to one."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.ui.settings import AppSettings
from engine.settings import ModelChoice, ModelSelection

ROOT = Path(__file__).resolve().parents[1]
PASSWD = "root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n"


def _use(path: Path) -> AppSettings:
    """What a session does to its settings file: read everything, change the models, write at exit."""
    s = AppSettings(path)
    s.models(), s.generation(), s.geometry(), s.theme()
    s.set_models(ModelSelection(target=ModelChoice.from_spec("some/model")))
    s.set_theme("dark")
    s.sync()
    return s


def _foreign(tmp_path: Path, kind: str) -> tuple[Path, Path]:
    """(the path given to --settings, the file whose bytes must not change)."""
    if kind == "text":
        victim = tmp_path / "notes.txt"
        victim.write_text("my notes\n" * 5000, encoding="utf-8")
        return victim, victim
    if kind == "binary":
        victim = tmp_path / "photo.ini"
        victim.write_bytes(bytes(range(256)) * 64)
        return victim, victim
    if kind == "link-to-passwd":
        victim = tmp_path / "passwd"
        victim.write_text(PASSWD, encoding="utf-8")
        link = tmp_path / "settings.ini"
        link.symlink_to(victim)
        return link, victim
    if kind == "other-ini":
        victim = tmp_path / "tool.ini"
        victim.write_text("[database]\nhost=localhost\n", encoding="utf-8")
        return victim, victim
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["text", "binary", "link-to-passwd", "other-ini"])
def test_a_foreign_file_is_left_byte_for_byte(tmp_path, kind):
    given, victim = _foreign(tmp_path, kind)
    before = victim.read_bytes()
    s = _use(given)
    assert s.refused and victim.read_bytes() == before
    assert given.is_symlink() == (kind == "link-to-passwd")


def test_a_dangling_link_is_never_written_through(tmp_path):
    link = tmp_path / "settings.ini"
    link.symlink_to(tmp_path / "elsewhere" / "new.ini")
    assert _use(link).refused and not (tmp_path / "elsewhere").exists()


def test_the_apps_own_file_is_still_read_and_written(tmp_path):
    path = tmp_path / "mine.ini"
    assert _use(path).refused is None
    again = AppSettings(path)
    assert again.refused is None and again.theme() == "dark" and again.models().target.value == "some/model"


def test_a_fifo_neither_hangs_nor_changes(tmp_path):
    fifo = tmp_path / "settings.ini"
    os.mkfifo(fifo)
    assert _use(fifo).refused == "not a plain file"


def test_the_app_says_so_in_one_line_and_starts(tmp_path):
    given, victim = _foreign(tmp_path, "link-to-passwd")
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "PYTHONPATH": str(ROOT),
           "SPECDEC_DATA_DIR": str(tmp_path / "data")}
    proc = subprocess.run([sys.executable, "-m", "app.main", "--demo", "--settings", str(given),
                           "--quit-after-ms", "300"], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if "not a SpecDec Studio settings file" in line]
    assert victim.read_text(encoding="utf-8") == PASSWD and given.is_symlink()
