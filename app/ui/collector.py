"""Python's cycle collector runs on the GUI thread while the engine's worker thread lives.

A reference cycle can hold a window's Qt objects (a closed dialog, a window a test built), and
whichever thread collects the cycle destroys them. Destroying a widget, a timer or a QThread wrapper
off the GUI thread crashes Qt: CI died with SIGSEGV in the worker's `gc.collect()` after a load,
collecting two earlier windows. So while a worker lives (`acquire` … `release`), automatic collection
is off, a GUI-thread timer collects each generation when Python would have (its thresholds), and a
collection another thread asks for (`engine.garbage.collect_garbage`: freeing a replaced
pair before the next one loads) runs on the GUI thread while the asking thread waits.

After the PyQt recipe of turning automatic collection off and collecting from a GUI timer (Erik
Janssens' `GarbageCollector`), plus the request from another thread.
"""
from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from PySide6.QtCore import QCoreApplication, QObject, QThread, QTimer, Signal, Slot

from engine import garbage

log = logging.getLogger(__name__)

TICK_MS = 250  # how often the GUI thread looks at the allocation counts (a few microseconds each)
WAIT_S = 10.0  # the longest another thread waits for the GUI thread to collect for it


class GuiThreadCollector(QObject):
    """Collects garbage on the thread it lives on (the GUI thread); see the module's docstring."""

    _requested = Signal(object)  # a threading.Event, set once the collection it asked for is done

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._timer = QTimer(self)
        self._timer.setInterval(TICK_MS)
        self._timer.timeout.connect(self._tick)
        self._requested.connect(self._collect_for)  # queued when emitted from another thread
        self._waiting: set[threading.Event] = set()
        self._lock = threading.Lock()
        self._blocked = 0  # > 0 while the GUI thread waits for a worker (see blocked())
        self._users = 0
        self._was_enabled = True
        self._previous = None

    def acquire(self) -> None:
        """One more worker thread: from now on only the GUI thread collects."""
        self._users += 1
        if self._users == 1:
            self._was_enabled = gc.isenabled()
            gc.disable()
            self._previous = garbage.set_garbage_collector(self.collect)
            self._timer.start()

    def release(self) -> None:
        """One worker thread fewer; after the last, collection is Python's own again."""
        if self._users == 0:
            return
        self._users -= 1
        if self._users == 0:
            self._timer.stop()
            garbage.set_garbage_collector(self._previous)
            self._previous = None
            if self._was_enabled:
                gc.enable()

    def collect(self) -> None:
        """A full collection on the GUI thread; from another thread, it waits for the GUI thread.

        While the GUI thread waits for a worker (blocked()), or when it does not get to the request
        within WAIT_S, the caller goes on without it: the garbage is collected at a later tick.
        """
        if QThread.currentThread() is self.thread():
            gc.collect()
            return
        done = threading.Event()
        with self._lock:
            if self._blocked:
                return
            self._waiting.add(done)
        try:
            self._requested.emit(done)
            if not done.wait(WAIT_S):
                log.warning("the GUI thread did not collect garbage within %.0f s; going on without it", WAIT_S)
        finally:
            with self._lock:
                self._waiting.discard(done)

    @contextmanager
    def blocked(self) -> Iterator[None]:
        """The GUI thread waits for a worker inside: no thread waits for a collection meanwhile."""
        with self._lock:
            self._blocked += 1
            for done in self._waiting:
                done.set()
        try:
            yield
        finally:
            with self._lock:
                self._blocked -= 1

    @Slot(object)
    def _collect_for(self, done: threading.Event) -> None:
        if not done.is_set():
            gc.collect()
        done.set()

    @Slot()
    def _tick(self) -> None:
        # Python's rule: generation g is collected once its count passes its threshold; the count of
        # an older generation grows by one with each collection of the one below it.
        counts, thresholds = gc.get_count(), gc.get_threshold()
        for generation in (2, 1, 0):
            if thresholds[generation] and counts[generation] > thresholds[generation]:
                gc.collect(generation)
                return


_collector: GuiThreadCollector | None = None


def collector() -> GuiThreadCollector:
    """The process's collector, made on the GUI thread the first time a worker needs it."""
    global _collector
    if _collector is None:
        app = QCoreApplication.instance()
        if app is None or QThread.currentThread() is not app.thread():
            raise RuntimeError("the garbage collector is set up on the GUI thread, after the QApplication")
        _collector = GuiThreadCollector()
    return _collector
