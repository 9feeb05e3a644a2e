"""The window while a long prompt is read: a progress line in the answer's bubble and the status bar within a
second of Send, and Stop / Esc that end the run during it; the worker carries a real engine's progress."""
from __future__ import annotations

import time

import pytest
from PySide6.QtCore import Qt

from app.ui.worker import WorkerHost
from engine.decoding import prefill
from engine.loadspec import LoadSpec
from engine.types import GenerationRequest, PrefillProgress
from tests.engine_fixtures import tiny_engine
from tests.test_app import FakeEngine, make_window, settings  # noqa: F401  (fixtures)


def _slow_prompt(total: int = 4449, chunk: int = 300, chunk_s: float = 0.05) -> FakeEngine:
    engine = FakeEngine()
    engine.prefill = (total, chunk, chunk_s)
    return engine


def test_the_bubble_and_the_status_bar_say_how_far_the_prompt_is_read(make_window, qtbot):
    w = make_window(_slow_prompt())
    t0 = time.perf_counter()
    rid = w.send("a long paste")
    qtbot.waitUntil(lambda: w.chat.progress_text(rid).startswith("Reading the prompt: "), timeout=1000)
    assert time.perf_counter() - t0 < 1.0
    qtbot.waitUntil(lambda: "2,100 / 4,449 tokens" in w.chat.progress_text(rid), timeout=5000)
    assert w.chat.progress_text(rid) == "Reading the prompt: 2,100 / 4,449 tokens"
    assert w.status.load_label.text() == "Reading the prompt: 2,100 / 4,449 tokens"
    with qtbot.waitSignal(w.answer_finished, timeout=10000):
        pass
    # The answer came: the line is gone from the bubble and the status bar, the stats line says when it began.
    assert w.chat.progress_text(rid) == "" and w.status.load_label.text() == ""
    assert "first token" in w.chat.stats_text(rid)


@pytest.mark.parametrize("how", ["button", "escape"])
def test_stop_during_the_prompt_ends_the_run_within_a_second(make_window, qtbot, how):
    w = make_window(_slow_prompt(chunk=100, chunk_s=0.2))
    rid = w.send("a long paste")
    qtbot.waitUntil(lambda: "/ 4,449 tokens" in w.chat.progress_text(rid), timeout=2000)
    assert w.prompt.button.text() == "Stop"
    with qtbot.waitSignal(w.answer_finished, timeout=1000) as blocker:
        if how == "button":
            qtbot.mouseClick(w.prompt.button, Qt.MouseButton.LeftButton)
        else:
            w.prompt.edit.setFocus()
            qtbot.keyClick(w.prompt.edit, Qt.Key.Key_Escape)
    summary = blocker.args[1]
    assert summary.stop_reason == "cancelled" and summary.new_tokens == 0
    assert w.chat.progress_text(rid) == "" and w.status.load_label.text() == ""
    assert w.prompt.button.text() == "Send" and w.active_request is None


def test_the_worker_carries_a_real_engines_progress(tiny_pair, qtbot, no_dangling_threads, monkeypatch):
    monkeypatch.setattr(prefill, "CHUNK_S", 1e-9)  # chunks of MIN_CHUNK tokens
    engine = tiny_engine(*tiny_pair)
    host = WorkerHost(lambda _r, _p: engine)
    try:
        loaded: list[object] = []
        host.worker.load_finished.connect(loaded.append)
        host.worker.load_requested.emit(LoadSpec())
        qtbot.waitUntil(lambda: bool(loaded), timeout=5000)
        events: list[tuple[int, PrefillProgress]] = []
        done: list[object] = []
        host.worker.prefill_progress.connect(lambda rid, p: events.append((rid, p)))
        host.worker.generation_finished.connect(lambda rid, s: done.append(s))
        prompt = "def add(a, b): return a + b. The quick brown fox jumps over the lazy dog. " * 5
        host.worker.generate_requested.emit(GenerationRequest(prompt=prompt, mode="standard", max_new_tokens=4,
                                                              request_id=3))
        qtbot.waitUntil(lambda: bool(done), timeout=10000)
        assert {rid for rid, _ in events} == {3}
        target = [p.done for _, p in events if p.part == "target"]
        assert target[0] == 0 and target[-1] == done[0].prompt_tokens - 1 and target == sorted(target)
        assert len(target) > 5
    finally:
        assert host.shutdown()
