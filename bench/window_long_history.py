"""UI-thread gaps and memory with a long history: 100 saved conversations of 100 long messages (prints figures).

Run through bench/window_responsiveness.py (`--only history`), or alone: python bench/window_long_history.py.
"""
from __future__ import annotations

import gc
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("SPECDEC_DATA_DIR", tempfile.mkdtemp(prefix="specdec-bench-"))

PROBE_MS = 5  # the UI-thread timer whose gaps we measure
SCROLL_STEP_PX = 90  # one wheel notch, roughly
SCROLL_EVERY_MS = 16  # a scroll step per frame
OPEN_CYCLES = 6  # conversations opened (and scrolled through) one after another, for the memory figure


def long_answer(tokens: int = 500) -> str:
    """The demo answer repeated until it has at least `tokens` pieces, then cut to exactly that many."""
    from app.core.demo import DEMO_ANSWER, split_tokens

    pieces: list[str] = []
    while len(pieces) < tokens:
        pieces += split_tokens(DEMO_ANSWER + "\n\n")
    return "".join(pieces[:tokens])


def rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


class Probe:
    """A 5 ms timer on the UI thread; a late tick is a stall a person would feel."""

    def __init__(self) -> None:
        from PySide6.QtCore import QElapsedTimer, Qt, QTimer

        self.gaps: list[float] = []
        # The UI thread's own CPU time in each gap: on a loaded machine a gap is mostly waiting for a
        # core, and this says how much of it was our work.
        self.cpu: list[float] = []
        self._last_cpu = 0.0
        self._clock = QElapsedTimer()
        self._timer = QTimer()
        self._timer.setTimerType(Qt.TimerType.PreciseTimer)
        self._timer.setInterval(PROBE_MS)
        self._timer.timeout.connect(self._tick)
        self._last = 0

    def start(self) -> None:
        self.gaps.clear()
        self._last_cpu = time.thread_time()
        self._clock.start()
        self._last = self._clock.nsecsElapsed()
        self._timer.start()

    def stop(self) -> list[float]:
        self._timer.stop()
        return list(self.gaps)  # the first gap includes the call that started the work: it counts too

    def _tick(self) -> None:
        now = self._clock.nsecsElapsed()
        self.gaps.append((now - self._last) / 1e6)
        self._last = now
        cpu = time.thread_time()
        self.cpu.append((cpu - self._last_cpu) * 1000)
        self._last_cpu = cpu


def run_history(conversations: int, messages: int, target_ms: float) -> bool:
    import numpy as np
    import shiboken6
    from PySide6.QtCore import QEvent, QEventLoop, QTimer
    from PySide6.QtWidgets import QApplication

    from app.core.conversations import INDEX_NAME, ConversationStore, default_folder
    from app.core.demo import ScriptedEngine, demo_conversations
    from app.ui.settings import AppSettings
    from app.ui.window import MainWindow
    from engine.settings import ModelSelection
    from widgets.palette import load_stylesheet

    app = QApplication.instance() or QApplication(["ui_history"])
    app.setStyle("Fusion")
    app.setStyleSheet(load_stylesheet())

    def spin(condition, timeout_s: float) -> bool:
        deadline = time.perf_counter() + timeout_s
        while not condition() and time.perf_counter() < deadline:
            app.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 20)
            # What app.exec() does between turns and processEvents() does not: delete the widgets of
            # the conversation closed (deleteLater). Without it memory would seem to grow per open.
            app.sendPostedEvents(None, QEvent.Type.DeferredDelete)
            time.sleep(0.001)
        return condition()

    folder = default_folder()
    t0 = time.perf_counter()
    ids = demo_conversations(ConversationStore(folder), conversations, turns=messages, answer=long_answer())
    size = sum(p.stat().st_size for p in folder.glob("*.json")) / 2**20
    print(f"[history] wrote {conversations} conversations × {messages} messages ({size:.0f} MiB of JSON) in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    (folder / INDEX_NAME).unlink()
    t0 = time.perf_counter()
    ConversationStore(folder).list()
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    ConversationStore(folder).list()
    warm = time.perf_counter() - t0
    print(f"    listing: {cold * 1000:.0f} ms without the index (every file read), {warm * 1000:.1f} ms with it",
          flush=True)

    t0 = time.perf_counter()
    window = MainWindow(engine_factory=lambda _r, _p: ScriptedEngine(delay_s=0.0),
                        settings=AppSettings(Path(tempfile.mkdtemp()) / "bench.ini"))
    window.resize(1480, 900)
    window.show()
    spin(lambda: False, 0.2)
    start_s = time.perf_counter() - t0
    listed = len(window.sidebar.ids())
    window.load_models(ModelSelection())
    spin(lambda: window.info is not None, 30)
    probe = Probe()
    ok = listed == conversations

    def all_rendered() -> bool:
        chat = window.chat
        return not chat.is_loading() and all(chat.markdown_view(r) is not None and chat.markdown_view(r).is_complete()
                                             for r in chat.answer_ids())

    def open_and_scroll(conversation_id: str) -> tuple[float, float, float, int]:
        """(max gap while opening, seconds until every answer is rendered, max gap while scrolling, answers)."""
        probe.start()
        t = time.perf_counter()
        window.sidebar.selected.emit(conversation_id)
        spin(all_rendered, 120)
        opened = time.perf_counter() - t
        spin(lambda: False, 0.2)
        opening = probe.stop()
        bar = window.chat.verticalScrollBar()
        bar.setValue(0)
        spin(lambda: False, 0.1)
        probe.start()
        timer = QTimer()
        timer.setInterval(SCROLL_EVERY_MS)
        timer.timeout.connect(lambda: bar.setValue(bar.value() + SCROLL_STEP_PX))
        timer.start()
        spin(lambda: bar.value() >= bar.maximum(), 120)
        timer.stop()
        spin(lambda: False, 0.1)
        scrolling = probe.stop()
        first_gaps.append(opening[0] if opening else 0.0)  # the open call itself
        return max(opening, default=0.0), opened, max(scrolling, default=0.0), len(window.chat.answer_ids())

    first_gaps: list[float] = []
    open_gap, opened_s, scroll_gap, answers = open_and_scroll(ids[0])
    ok &= answers == messages // 2
    print(f"    start with {listed} conversations in the sidebar: {start_s * 1000:.0f} ms", flush=True)
    print(f"    open a {messages}-message conversation: every answer rendered after {opened_s:.2f} s; "
          f"max UI gap {open_gap:.1f} ms", flush=True)
    print(f"    scroll it top to bottom ({SCROLL_STEP_PX} px every {SCROLL_EVERY_MS} ms): max UI gap {scroll_gap:.1f} ms",
          flush=True)
    probe.cpu.clear()
    gc.collect()
    memory = [rss_mib()]
    gaps = [open_gap, scroll_gap]
    cycles = []
    for i in range(OPEN_CYCLES):
        g_open, _, g_scroll, _ = open_and_scroll(ids[1 + i % 2])
        gaps += [g_open, g_scroll]
        cycles.append(f"{g_open:.0f}/{g_scroll:.0f}")
        gc.collect()
        memory.append(rss_mib())
    growth = memory[-1] - memory[1]
    print(f"    memory after each of {OPEN_CYCLES} more opens (two conversations in turn): "
          + ", ".join(f"{m:.0f}" for m in memory) + f" MiB (growth after the second open: {growth:+.0f} MiB); "
          f"max gap open/scroll per cycle: {', '.join(cycles)} ms; of which the open call itself (read, "
          f"parse, swap the list): {', '.join(f'{g:.0f}' for g in first_gaps)} ms", flush=True)
    worst = float(np.max(gaps))
    print(f"    UI-thread CPU time in any one gap over the repeated opens: at most {max(probe.cpu):.1f} ms "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs: the rest of a gap is waiting for a core)",
          flush=True)
    passed = ok and worst < target_ms and growth < 50
    print(f"[history] max UI gap {worst:.1f} ms over {1 + OPEN_CYCLES} opens and scrolls; "
          f"{'PASS' if passed else 'FAIL'} (target < {target_ms:.0f} ms, memory flat within 50 MiB)", flush=True)
    window.close()
    shiboken6.delete(window)
    gc.collect()
    return passed


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--conversations", type=int, default=100)
    p.add_argument("--messages", type=int, default=100)
    a = p.parse_args()
    sys.exit(0 if run_history(a.conversations, a.messages, 50.0) else 1)
