"""While the models load a message is queued visibly and sent when they are ready (or cancelled); after
Ready the worker measures the costs again only while idle, and yields to a request at once."""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
from PySide6.QtCore import Qt

from app.ui import cost_refresh
from engine.errors import CostsInterrupted, ModelLoadError
from engine.settings import ModelSelection
from tests.test_app import FAKE_INFO, SCRIPT_TEXT, FakeEngine, make_window, settings  # noqa: F401  (fixtures)
from widgets.chat.prompt_box import QUEUED_TEXT


def slow_load(engine, release: threading.Event, fail: bool = False):
    def factory(_request, progress):
        progress(type("P", (), {"stage": "load", "fraction": 0.4, "message": "Loading fake-target"})())
        release.wait(10)
        if fail:
            raise ModelLoadError("fake-target: out of memory loading weights")
        return engine

    return factory


def test_a_message_sent_while_loading_is_queued_visibly_and_sent_when_ready(make_window, qtbot):
    release = threading.Event()
    engine = FakeEngine()
    w = make_window(factory=slow_load(engine, release), load=False)
    w.load_models(ModelSelection())
    qtbot.waitUntil(lambda: w.load_bar.value() == 40, timeout=5000)
    assert w.prompt.button.isEnabled() and w.prompt.button.text() == "Send"  # not silently dead
    w.prompt.edit.setFocus()
    w.prompt.set_text("Say hello")
    qtbot.keyClick(w.prompt.edit, Qt.Key.Key_Return)
    assert w.prompt.is_queued() and w.prompt.queued_label.isVisible() and w.prompt.queued_label.text() == QUEUED_TEXT
    assert w.prompt.text() == "Say hello" and w.prompt.edit.isReadOnly() and w.prompt.button.text() == "Cancel"
    assert engine.requests == []
    with qtbot.waitSignal(w.answer_finished, timeout=10000) as blocker:
        release.set()
    assert blocker.args[1].text == SCRIPT_TEXT
    assert [m.content for m in engine.requests[-1].messages][-1] == "Say hello"
    assert not w.prompt.is_queued() and w.prompt.text() == "" and not w.prompt.edit.isReadOnly()
    assert not w.prompt.queued_label.isVisible()


@pytest.mark.parametrize("how", ["button", "escape"])
def test_a_queued_message_can_be_cancelled_and_stays_in_the_box(make_window, qtbot, how):
    release = threading.Event()
    engine = FakeEngine()
    w = make_window(factory=slow_load(engine, release), load=False)
    w.load_models(ModelSelection())
    qtbot.waitUntil(lambda: w.load_bar.value() == 40, timeout=5000)
    assert w.send("not yet") is None and w.prompt.is_queued()
    if how == "button":
        qtbot.mouseClick(w.prompt.button, Qt.MouseButton.LeftButton)
    else:
        qtbot.keyClick(w.prompt.edit, Qt.Key.Key_Escape)
    assert not w.prompt.is_queued() and w.prompt.text() == "not yet" and not w.prompt.edit.isReadOnly()
    with qtbot.waitSignal(w.models_loaded, timeout=5000):
        release.set()
    qtbot.wait(100)
    assert engine.requests == [] and w.prompt.text() == "not yet"  # cancelled: nothing sent, nothing lost


def test_a_queued_message_goes_back_into_the_box_when_the_load_fails(make_window, qtbot, dialogs):
    release = threading.Event()
    w = make_window(factory=slow_load(FakeEngine(), release, fail=True), load=False)
    w.load_models(ModelSelection())
    qtbot.waitUntil(lambda: w.load_bar.value() == 40, timeout=5000)
    w.send("after the load")
    with qtbot.waitSignal(w.models_load_failed, timeout=5000):
        release.set()
    assert not w.prompt.is_queued() and w.prompt.text() == "after the load" and not w.prompt.edit.isReadOnly()


class CheckingEngine(FakeEngine):
    """A FakeEngine with costs to measure again: each pass takes `pass_s` in rounds of 10 ms."""

    def __init__(self, passes: int = 3, pass_s: float = 0.3, **kwargs) -> None:
        super().__init__(**kwargs)
        self.cost_check = type("Check", (), {"done": False})()
        self.info = replace(FAKE_INFO, target_ms=((1, 40.0), (2, 70.0)), draft_ms=50.0, costs_state="disturbed",
                            costs_note="the draft measured 125% of a target forward")
        self.passes_left = passes
        self.pass_s = pass_s
        self.events: list[str] = []
        self.generating = False

    def refresh_costs(self, interrupted) -> bool:
        assert not self.generating, "a pass ran while an answer was decoding"
        self.events.append("pass")
        end = time.perf_counter() + self.pass_s
        while time.perf_counter() < end:
            if interrupted():
                self.events.append("interrupted")
                raise CostsInterrupted()
            time.sleep(0.01)
        self.passes_left -= 1
        if self.passes_left:
            return False
        self.cost_check.done = True
        self.info = replace(self.info, draft_ms=24.0, costs_state="measured", costs_note="")
        return True

    def generate(self, request, cancel, progress=None):
        self.events.append("generate")
        return super().generate(request, cancel, progress)


def test_costs_are_measured_again_after_ready_when_idle_and_the_verdict_waits_for_them(make_window, qtbot,
                                                                                       monkeypatch):
    monkeypatch.setattr(cost_refresh, "IDLE_MS", 300)
    monkeypatch.setattr(cost_refresh, "GAP_MS", 10)
    engine = CheckingEngine(pass_s=0.05)
    w = make_window(engine)
    assert w.cost_label.text() == "draft cost: measuring again"
    with qtbot.waitSignal(w.worker.costs.updated, timeout=10000):
        pass
    qtbot.waitUntil(lambda: "of a forward" in w.cost_label.text(), timeout=5000)
    assert w.cost_label.text() == "The draft costs 60% of a forward" and w.info.costs_state == "measured"
    assert engine.events == ["pass"] * 3


def test_a_pass_in_progress_yields_to_a_message_at_once(make_window, qtbot, monkeypatch):
    monkeypatch.setattr(cost_refresh, "IDLE_MS", 100)
    monkeypatch.setattr(cost_refresh, "GAP_MS", 10)
    engine = CheckingEngine(passes=1, pass_s=30.0)  # a pass far longer than the test
    w = make_window(engine)
    qtbot.waitUntil(lambda: engine.events == ["pass"], timeout=5000)
    started = time.perf_counter()
    with qtbot.waitSignal(w.answer_finished, timeout=5000):
        w.send("hi")
    assert time.perf_counter() - started < 2.0
    assert engine.events[:3] == ["pass", "interrupted", "generate"]
    # Idle again: the dropped pass starts over, and the app closes without waiting for it.
    qtbot.waitUntil(lambda: engine.events.count("pass") == 2, timeout=5000)
    started = time.perf_counter()
    w.close()
    assert time.perf_counter() - started < 3.0 and engine.events[-1] == "interrupted"


def test_on_disturbed_costs_the_stats_line_and_status_bar_give_no_verdict(make_window, qtbot, monkeypatch):
    from engine.settings import GenerationSettings
    from engine.types import Decision
    from tests.test_app import script, send_with_enter

    monkeypatch.setattr(cost_refresh, "IDLE_MS", 60000)  # no pass during this test
    no_gain = Decision(0, None, "no_gain", acceptance=0.9, best_k=6, best_speedup=0.96)
    steps = [replace(s, decision=no_gain) for s in script()]
    engine = CheckingEngine(steps=steps)
    w = make_window(engine)
    w.panel.set_values(GenerationSettings())  # auto
    rid, _ = send_with_enter(qtbot, w, "hi")
    line, detail = w.chat.stats_text(rid), w.chat.stats_detail(rid)
    assert "the forward costs are still being measured" in line and "did not pay" not in line
    assert "standard decoding for now: the forward costs are still being measured" in detail.lower()
    assert "costs more than it saves" not in line + detail and "costs more than it saves" not in w.decision_label.text()
    assert w.decision_label.text() == "Standard decoding for now: the forward costs are still being measured"
    engine.info = replace(engine.info, costs_state="measured")  # settled: the verdict is back
    w.session.info = engine.info
    rid, _ = send_with_enter(qtbot, w, "again")
    assert "drafting did not pay" in w.chat.stats_text(rid) and "costs more than it saves" in w.chat.stats_detail(rid)
