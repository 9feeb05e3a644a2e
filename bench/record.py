"""The one layout of bench/results: the bench record that `specdec-studio bench --json` writes.

{"config": what ran and where, "runs": one object per timed run (may be empty), "summary": the figures}.
Scripts that measure something other than decoding runs (memory peaks, plans, start times) keep
their figures under "summary", so every results file reads the same way.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def write_record(path: Path, config: dict[str, Any], summary: Any, runs: Sequence[dict[str, Any]] = ()) -> None:
    """Writes one bench record as JSON (parent folders created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"config": config, "runs": list(runs), "summary": summary}
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False, default=str) + "\n", encoding="utf-8")


def read_record(path: Path) -> dict[str, Any]:
    """Reads a bench record (as written by `bench --json` or write_record)."""
    return json.loads(path.read_text(encoding="utf-8"))
