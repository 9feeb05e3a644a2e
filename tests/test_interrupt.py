"""Ctrl+C at any moment of the start (inside any import): one line, exit 130, no traceback."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Runs `python -m app.main ARGS` and sends itself SIGINT the moment MODULE starts being imported:
# the same moment every time, however loaded the machine is (a sleep before kill would not be).
_CHILD = textwrap.dedent("""
    import os, runpy, signal, sys
    module, args = sys.argv[1], sys.argv[2:]
    def hook(event, details):
        if event == "import" and details[0] == module:
            os.kill(os.getpid(), signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as an interactive start has it
    sys.addaudithook(hook)
    sys.argv = ["specdec-studio", *args]
    runpy.run_module("app.main", run_name="__main__", alter_sys=True)
""")


@pytest.mark.parametrize("module", ["engine.settings", "app.cli", "engine.models.loader", "torch", "transformers"])
def test_ctrl_c_while_generate_starts_is_one_line(tiny_pair, tmp_path, module):
    args = ["generate", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--device", "cpu",
            "--prompt", "hi", "--max-new-tokens", "2"]
    proc = subprocess.run([sys.executable, "-c", _CHILD, module, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "SPECDEC_CACHE_DIR": str(tmp_path / "cache")},
                          timeout=300)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines() == ["specdec-studio: interrupted"], proc.stderr


def test_ctrl_c_while_the_app_starts_is_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "QT_QPA_PLATFORM": "offscreen",
           "SPECDEC_DATA_DIR": str(tmp_path / "data")}
    proc = subprocess.run([sys.executable, "-c", _CHILD, "PySide6.QtWidgets", "--demo", "--settings",
                           str(tmp_path / "s.ini"), "--quit-after-ms", "300"],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines() == ["specdec-studio: interrupted"], proc.stderr
