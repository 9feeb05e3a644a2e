"""The window shows streamed tokens in batches: a burst of signals is one view update, and no token is lost."""
from __future__ import annotations

import threading
import time

import pytest

from app.core.demo import DEMO_ANSWER, DEMO_INFO, scripted_steps
from app.ui.chat import VIEW_INTERVAL_MS
from app.ui.settings import AppSettings
from app.ui.window import MainWindow
from engine.measure.stats import summarize
from engine.settings import GenerationSettings, ModelSelection
from engine.types import GenerationRequest, Step

TEXT = (DEMO_ANSWER + "\n\n") * 4


class _Held:
    """A generation that yields nothing until released: the test plays the worker's step signals itself."""

    def __init__(self, steps: list[Step], release: threading.Event) -> None:
        self.steps, self.release, self.summary = steps, release, None

    def __iter__(self) -> _Held:
        return self

    def __next__(self) -> Step:
        self.release.wait(10)
        self.summary = summarize(self.steps, mode="standard", k=0, prompt_tokens=4, seconds=1.0, stop_reason="eos")
        raise StopIteration


class HeldEngine:
    info = DEMO_INFO

    def __init__(self, steps: list[Step]) -> None:
        self.steps = steps
        self.release = threading.Event()

    def generate(self, request: GenerationRequest, cancel: threading.Event, progress=None) -> _Held:
        return _Held(self.steps, self.release)


@pytest.fixture
def window(qtbot, tmp_path, no_dangling_threads):
    steps = scripted_steps(TEXT, mode="standard")
    engine = HeldEngine(steps)
    w = MainWindow(engine_factory=lambda _r, _p: engine, settings=AppSettings(tmp_path / "ui.ini"))
    qtbot.addWidget(w)
    w.show()
    with qtbot.waitSignal(w.models_loaded, timeout=5000):
        w.load_models(ModelSelection())
    w.panel.set_values(GenerationSettings(mode="standard", max_new_tokens=4096))
    yield w, engine
    engine.release.set()
    w.close()


def _count_updates(window, monkeypatch) -> list[int]:
    """Steps per call of the chat's append_steps (what the controller hands the view)."""
    calls: list[int] = []
    real = window.chat.append_steps

    def counting(request_id, steps):
        calls.append(len(steps))
        real(request_id, steps)

    monkeypatch.setattr(window.chat, "append_steps", counting)
    return calls


def test_a_burst_of_500_tokens_is_one_view_update_with_the_same_text(window, qtbot, monkeypatch):
    w, engine = window
    steps = engine.steps
    assert len(steps) >= 500  # one token a step: 500+ signals
    calls = _count_updates(w, monkeypatch)
    rid = w.send("Explain quicksort")
    qtbot.waitUntil(lambda: w.session.active_request == rid, timeout=5000)
    for step in steps:  # as the worker would, one signal per token (a slow CPU)
        w.worker.steps.emit(rid, (step,))
    assert calls == []  # nothing relayouts per token
    qtbot.waitUntil(lambda: sum(calls) == len(steps), timeout=2000)
    assert len(calls) == 1
    with qtbot.waitSignal(w.answer_finished, timeout=5000):
        engine.release.set()
    view = w.chat.token_view(rid)
    assert view.committed_text() == TEXT == "".join(s.text for s in steps)
    assert len(view.tokens()) == len(steps)


def test_tokens_arriving_over_time_are_shown_a_dozen_times_a_second(window, qtbot, monkeypatch):
    w, engine = window
    steps = engine.steps[:120]
    calls = _count_updates(w, monkeypatch)
    rid = w.send("Explain quicksort")
    qtbot.waitUntil(lambda: w.session.active_request == rid, timeout=5000)
    started = time.perf_counter()
    for step in steps:  # ~200 tok/s, one signal each
        w.worker.steps.emit(rid, (step,))
        qtbot.wait(5)
    elapsed = time.perf_counter() - started
    with qtbot.waitSignal(w.answer_finished, timeout=5000):
        engine.release.set()
    assert sum(calls) == len(steps)  # the finish shows what the timer had not yet
    assert len(calls) <= elapsed * 1000 / VIEW_INTERVAL_MS + 2 < len(steps) / 4
    assert w.chat.token_view(rid).committed_text() == "".join(s.text for s in steps)


def test_charts_redraw_less_often_where_a_redraw_costs_more(qtbot, monkeypatch):
    """The charts' timer keeps their redraws under CPU_SHARE of a core, measured on the UI thread's clock."""
    from widgets import charts as charts_mod

    charts = charts_mod.LiveCharts(refresh_hz=15)
    qtbot.addWidget(charts)
    fastest = charts.refresh_interval_ms()
    steps = scripted_steps(TEXT, k=4)
    real = charts.refresh

    def costly() -> None:  # a machine where a redraw takes 12 ms of CPU
        real()
        until = time.thread_time() + 0.012
        while time.thread_time() < until:
            pass

    monkeypatch.setattr(charts, "refresh", costly)
    for i in range(12):
        charts.push_steps(steps[i * 4:(i + 1) * 4])
        charts._on_timer()
    slow = charts.refresh_interval_ms()
    assert slow >= 0.9 * 12 / charts_mod.CPU_SHARE and slow <= charts_mod.SLOWEST_REFRESH_MS
    monkeypatch.setattr(charts, "refresh", real)
    for i in range(12, 40):  # cheap again (a few ms at most here): back towards the fastest rate
        charts.push_steps(steps[i * 4:(i + 1) * 4])
        charts._on_timer()
    assert charts.refresh_interval_ms() < slow
    assert fastest == round(1000 / 15)
