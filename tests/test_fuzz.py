"""The fuzzer's short form (fixed seed, about 200 cases, one process): 0 tracebacks, 0 hangs, 0 outside changes,
exits 0 or 2 only. The long form is run by hand: `nice -n 10 python -m tools.fuzz --cases 2000`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tools.fuzz.core import Outcome, World
from tools.fuzz.files import sentinel, tree_hash, with_outside_check

ROOT = Path(__file__).resolve().parents[1]


def test_the_short_form_finds_nothing(tmp_path):
    out = tmp_path / "fuzz.json"
    # One interpreter for every case: the cases call the entry points in process.
    proc = subprocess.run([sys.executable, "-m", "tools.fuzz", "--cases", "6", "--files", "3", "--crafted", "200",
                           "--processes", "0", "--seed", "2", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=170,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text(encoding="utf-8"))
    counts = result["counts"]
    assert result["cases"] >= 200
    assert not result["failures"], json.dumps(result["failures"][:5], indent=1)
    assert set(counts["exit_codes"]) <= {"0", "2"} and counts["outside_changes"] == 0 and not counts["problems"]
    kinds = {k.split(" (")[0] for k in counts["by_kind"]}
    assert {"conversations", "settings-foreign", "cache", "work", "config", "head"} <= kinds
    assert proc.returncode == 0, proc.stdout[-2000:]


def test_the_sentinel_sees_a_change_a_deletion_and_a_new_link(tmp_path):
    world = World(tmp_path, *([tmp_path] * 3), b"", *([tmp_path] * 5), {})
    folder = sentinel(world)
    for harm in (lambda: (folder / "victim.json").write_text("changed", encoding="utf-8"),
                 lambda: (folder / "passwd").unlink(),
                 lambda: (folder / "link").symlink_to("/etc/passwd")):
        before = tree_hash(folder)
        harm()
        o = with_outside_check(Outcome("x", [], "process", 0, "", "", 0.0), world, before, {})
        assert o.problems == ["outside change: the sentinel folder changed"]
