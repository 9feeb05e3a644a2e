"""Measuring the forward costs again after Ready, on the worker thread, only while nothing else wants the engine.

A start with kept costs (or with costs that looked disturbed) leaves the engine a check to run
(Engine.refresh_costs, engine/decoding/cost_check.py). It runs one pass at a time once the worker has
been idle for IDLE_MS; a request for the worker (a message, a race, a sweep, a load) makes the pass
in progress stop at its next round (CostsInterrupted: the pass is dropped) and is served first, and
the idle wait starts again after it. So the check never runs while a person decodes, and delays a
request by at most one round of the measurement.
"""
from __future__ import annotations

import logging
import threading

from PySide6.QtCore import QObject, Qt, QTimer, Signal, Slot

from engine.errors import CostsInterrupted

log = logging.getLogger(__name__)

IDLE_MS = 3000  # the worker idle this long before a pass starts (after Ready, after each request)
GAP_MS = 200  # between two passes, so a request waiting in the queue is served first


class CostRefresh(QObject):
    """Lives on the worker's thread (a child of the EngineWorker); `engine()` is the engine in use."""

    updated = Signal(object)  # ModelInfo with the costs measured again (or their state changed)

    def __init__(self, worker: QObject, requests: tuple, closing: threading.Event, parent: QObject | None = None
                 ) -> None:
        """requests: the worker's request signals; closing: set when the app closes (a pass stops then too)."""
        super().__init__(parent)
        self._worker = worker
        self._closing = closing
        self._asked = 0  # requests emitted to the worker (counted on the emitting thread)
        self._seen = 0  # requests the worker has handled (counted on the worker thread, after each)
        self.passes = 0  # passes started, for tests and the log
        self.timer = QTimer(self)
        self.timer.setSingleShot(True)
        self.timer.timeout.connect(self._on_due)
        for signal in requests:
            # Direct: counted at once, so a pass in progress sees it. Queued after the worker's own
            # connection: runs once the worker has handled the request, and the idle wait restarts.
            signal.connect(self._on_asked, Qt.ConnectionType.DirectConnection)
            signal.connect(self._on_handled, Qt.ConnectionType.QueuedConnection)

    def pending(self) -> bool:
        """A request for the worker is waiting, or the app is closing (safe from any thread)."""
        return self._asked > self._seen or self._closing.is_set()

    def _on_asked(self, *_args) -> None:
        self._asked += 1

    @Slot(object)
    def _on_handled(self, *_args) -> None:
        self._seen += 1
        self.timer.start(IDLE_MS)

    @Slot()
    def _on_due(self) -> None:
        engine = getattr(self._worker, "engine", None)
        refresh = getattr(engine, "refresh_costs", None)
        check = getattr(engine, "cost_check", None)
        if refresh is None or check is None or getattr(check, "done", True) or self.pending():
            return
        self.passes += 1
        try:
            changed = refresh(self.pending)
        except CostsInterrupted:
            log.info("measuring the forward costs again: pass dropped for a request")
            return  # the request's own _on_handled restarts the wait
        except Exception as exc:  # advice only: the costs in use stay
            log.warning("could not measure the forward costs again: %s", exc)
            check.done = True
            return
        if changed:
            self.updated.emit(engine.info)
        if not check.done:
            self.timer.start(GAP_MS)
