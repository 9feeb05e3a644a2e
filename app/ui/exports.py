"""File ▸ Export: the session's answers and their decoding steps as CSV, asking for a file when none is given."""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from app.core.export import write_session_csv, write_trace_csv
from app.ui.notices import Notices

log = logging.getLogger(__name__)


class SessionExporter:
    """`records` gives the session's answers at the moment of export; `races` and `sweeps` its race repeats and
    sweep runs (the session CSV has a row for each run of them too)."""

    def __init__(self, records: Callable[[], Sequence], notices: Notices, *, races: Callable[[], Sequence] = tuple,
                 sweeps: Callable[[], Sequence] = tuple) -> None:
        self._records = records
        self._notices = notices
        self._races = races
        self._sweeps = sweeps

    def export_session(self, path: str | None = None) -> bool:
        """Writes one row per answer, race run and sweep run; asks for a file when `path` is None. False if
        nothing was written."""
        races, sweeps = tuple(self._races()), tuple(self._sweeps())
        return self._export(path, "Export session CSV", "specdec-session.csv",
                            lambda p, records: write_session_csv(p, records, races, sweeps), bool(races or sweeps))

    def export_trace(self, path: str | None = None) -> bool:
        """Writes one row per decoding step of every answer."""
        return self._export(path, "Export step trace CSV", "specdec-steps.csv", write_trace_csv)

    def _export(self, path: str | None, title: str, default_name: str, write, more: bool = False) -> bool:
        records = self._records()
        if not records and not more:
            self._notices.info(title, "Nothing to export yet: generate an answer first.")
            return False
        if path is None:
            path = self._notices.save_path(title, str(Path.home() / default_name), "CSV files (*.csv);;All files (*)")
            if not path:
                return False
        try:
            rows = write(path, records)
        except OSError as e:
            log.warning("export to %s failed: %s", path, e)
            self._notices.error("Export failed", f"Could not write {path}: {e.strerror or e}. The session is kept; "
                                                 "choose another location.")
            return False
        self._notices.note(f"Exported {rows} rows to {path}")
        return True
