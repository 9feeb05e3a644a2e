"""App tests: the real MainWindow and worker thread, driven with pytest-qt against a scripted FakeEngine."""
from __future__ import annotations

import csv
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QTextCursor

from app.core.export import SESSION_COLUMNS, TRACE_COLUMNS
from app.ui.settings import AppSettings
from app.ui.window import MainWindow
from app.ui.worker import (
    EngineWorker,
    WorkerHost,
    default_engine_factory,
    running_threads,
)
from engine.errors import GenerationError
from engine.limits import K_AUTO
from engine.loadspec import LoadSpec
from engine.measure.stats import summarize
from engine.settings import GenerationSettings, ModelChoice, ModelSelection
from engine.types import GenerationRequest, Message, ModelInfo, PrefillProgress, Step, Summary, TokenView
from widgets.model_dialog import ModelDialog
from widgets.palette import current_palette
from widgets.settings_panel import DisplaySettings
from widgets.stats_line import format_stats_line, format_stats_plain

FAKE_INFO = ModelInfo(target_name="fake-target", draft_name="fake-draft", device="cpu", dtype="float32",
                      fast_path="eager", vocab_size=100)


# --------------------------------------------------------------------------- the fake engine

def spec_step(index: int, accepted: list[str], rejected: list[str], added: str, total_before: int,
              stop_reason=None) -> Step:
    """A speculative Step: accepted + rejected drafts, then a correction (or a bonus when none was rejected)."""
    k = len(accepted) + len(rejected)
    tokens = [TokenView(10 * index + i, t, "accepted", index, i, 0.8, 0.9, 1.0, "draft") for i, t in enumerate(accepted)]
    tokens += [TokenView(10 * index + len(accepted) + j, t, "rejected", index, len(accepted) + j, 0.6, 0.1, 0.17, "draft")
               for j, t in enumerate(rejected)]
    status = "corrected" if rejected else "bonus"
    tokens.append(TokenView(10 * index + 9, added, status, index, None, None, 0.7, None, None))
    new = len(accepted) + 1
    return Step(index=index, mode="speculative", proposed=tuple(range(k)), proposed_q=(0.8,) * k,
                proposed_p=(0.9,) * k, sources=("draft",) * k, accepted=len(accepted), added=10 * index + 9,
                added_status=status, tokens=tuple(tokens), text="".join(accepted) + added, new_tokens=new,
                total_tokens=total_before + new, draft_ms=2.0, verify_ms=8.0, elapsed_s=(index + 1) * 0.01,
                stop_reason=stop_reason)


def script() -> list[Step]:
    """'Hello world, 你好!\\nx = 1' in three steps: a correction, a bonus, a correction."""
    return [
        spec_step(0, ["Hello", " world"], [" foo", " bar"], ",", 0),
        spec_step(1, [" 你好", "!"], [], "\n", 3),
        spec_step(2, ["x"], [" y"], " = 1", 6, stop_reason="eos"),
    ]


SCRIPT_TEXT = "Hello world, 你好!\nx = 1"
SCRIPT_STATUSES = ["accepted", "accepted", "rejected", "rejected", "corrected",
                   "accepted", "accepted", "bonus", "accepted", "rejected", "corrected"]


class FakeGeneration(Iterator[Step]):
    def __init__(self, steps: list[Step], request: GenerationRequest, cancel: threading.Event,
                 delay_s: float, fail_at: int | None, error: BaseException | None,
                 prefill: tuple[int, int, float] = (0, 0, 0.0), progress=None) -> None:
        self.summary: Summary | None = None
        self._it = self._run(steps, request, cancel, delay_s, fail_at, error, prefill, progress)

    def __next__(self) -> Step:
        return next(self._it)

    def _run(self, steps, request, cancel, delay_s, fail_at, error, prefill, progress) -> Iterator[Step]:
        out: list[Step] = []
        stop = "eos"
        t0 = time.perf_counter()
        total, chunk, chunk_s = prefill  # a prompt of `total` tokens read `chunk` at a time, chunk_s each
        for done in [*range(0, total, chunk or 1), total] if total else []:
            if progress is not None:
                progress(PrefillProgress("target", done, total))
            if done < total and cancel.wait(chunk_s):
                steps = []  # stopped while the prompt was read: no step at all
                stop = "cancelled"
                break
        for i, step in enumerate(steps):
            if cancel.wait(delay_s) if delay_s else cancel.is_set():
                stop = "cancelled"
                break
            if fail_at == i:
                raise error or GenerationError("scripted failure")
            out.append(step)
            yield step
        self.summary = summarize(out, mode=request.mode, k=request.k, prompt_tokens=7,
                                 seconds=max(time.perf_counter() - t0, 1e-3), stop_reason=stop)


class FakeEngine:
    """Engine-like: yields scripted Steps with a delay each; records every request it gets."""

    def __init__(self, steps: list[Step] | None = None, *, delay_s: float = 0.0, fail_at: int | None = None,
                 error: BaseException | None = None, info: ModelInfo = FAKE_INFO) -> None:
        self.steps = steps if steps is not None else script()
        self.delay_s = delay_s
        self.fail_at = fail_at
        self.error = error
        self.info = info
        self.requests: list[GenerationRequest] = []
        self.prefill: tuple[int, int, float] = (0, 0, 0.0)  # (prompt tokens, per chunk, seconds per chunk)

    def generate(self, request: GenerationRequest, cancel: threading.Event, progress=None) -> FakeGeneration:
        self.requests.append(request)
        return FakeGeneration(self.steps, request, cancel, self.delay_s, self.fail_at, self.error,
                              self.prefill, progress)


def long_script(n: int = 400) -> list[Step]:
    steps, total = [], 0
    for i in range(n):
        steps.append(spec_step(i, ["a", "b"], ["c"], "d", total))
        total += 3
    return steps


# --------------------------------------------------------------------------- fixtures

@pytest.fixture
def settings(tmp_path) -> AppSettings:
    return AppSettings(tmp_path / "settings.ini")


@pytest.fixture
def make_window(qtbot, settings, no_dangling_threads):
    windows: list[MainWindow] = []

    def make(engine=None, *, factory=None, load: bool = True, app_settings: AppSettings | None = None) -> MainWindow:
        engine = engine if engine is not None else FakeEngine()
        w = MainWindow(engine_factory=factory or (lambda _req, _progress: engine),
                       settings=app_settings or settings)
        qtbot.addWidget(w)
        w.show()
        windows.append(w)
        if load:
            with qtbot.waitSignal(w.models_loaded, timeout=5000):
                w.load_models(ModelSelection())
        return w

    yield make
    for w in windows:
        w.close()  # closeEvent stops generation and joins the worker thread


def send_with_enter(qtbot, window: MainWindow, text: str) -> tuple[int, Summary]:
    window.prompt.edit.setFocus()
    window.prompt.set_text(text)
    with qtbot.waitSignal(window.answer_finished, timeout=10000) as blocker:
        qtbot.keyClick(window.prompt.edit, Qt.Key.Key_Return)
    rid, summary = blocker.args
    qtbot.waitUntil(lambda: window.active_request is None)
    return rid, summary


def background_at(view, position: int):
    cursor = QTextCursor(view.document())
    cursor.setPosition(position + 1)  # the format of the character before the cursor
    return cursor.charFormat().background().color()


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, encoding="utf-8-sig", newline="") as f:
        return list(csv.DictReader(f))


# --------------------------------------------------------------------------- the main flow

def test_send_streams_coloured_tokens_stats_charts_and_csv(make_window, qtbot, tmp_path):
    engine = FakeEngine(delay_s=0.01)
    w = make_window(engine)
    assert w.windowTitle() == "SpecDec Studio"
    assert w.prompt.button.isEnabled()
    w.panel.set_values(GenerationSettings(mode="speculative", k=5, proposer="draft"))  # the default is auto

    rid, summary = send_with_enter(qtbot, w, "Say hello")
    assert summary.text == SCRIPT_TEXT and summary.stop_reason == "eos"
    assert w.prompt.text() == ""  # Enter sent and cleared the box

    # Colours: every shown token has its status' palette background, in order.
    view = w.chat.token_view(rid)
    spans = view.token_spans()
    # Rejected drafts are not in the text: a mark stands where each step's drafts were rejected.
    assert [s for _, _, s in spans] == [s for s in SCRIPT_STATUSES if s != "rejected"]
    assert view.toPlainText() == SCRIPT_TEXT and len(view.mark_positions()) == 2
    palette = current_palette()
    text = view.toPlainText()
    for start, _end, status in spans:
        if text[start] == "\n":
            continue  # a paragraph break carries no character format of its own
        expected = palette.ghost_colours(status) if status == "rejected" else palette.colours(status)
        assert background_at(view, start).rgb() == expected.background.rgb(), status
    assert view.committed_text() == SCRIPT_TEXT

    # The stats line is the widget formatter's line for this summary and request.
    request = engine.requests[-1]
    # Plain words under the answer; every figure (mode, K, time split) in its tooltip.
    assert w.chat.stats_text(rid) == format_stats_plain(summary, request)
    assert "of drafted tokens accepted" in w.chat.stats_text(rid) and "K=" not in w.chat.stats_text(rid)
    assert w.chat.stats_detail(rid) == format_stats_line(summary, request)
    assert "speculative" in w.chat.stats_detail(rid) and "K=5" in w.chat.stats_detail(rid)

    # Charts got every step.
    series = w.charts.series()
    assert list(series["k"]) == [4, 2, 2]
    assert list(series["accepted"]) == [2, 2, 1]
    assert list(series["position_acceptance"]) == pytest.approx([100.0, 2 / 3 * 100, 0.0, 0.0])

    # The request carried the system prompt and the user turn; the answer joined the history.
    assert request.messages == (Message("system", "You are a helpful assistant."), Message("user", "Say hello"))
    assert request.request_id == rid
    assert w.history() == [Message("user", "Say hello"), Message("assistant", SCRIPT_TEXT)]

    # Session CSV: one row, every Summary field, the settings, the models.
    path = tmp_path / "session.csv"
    assert w.export_session(str(path))
    assert path.read_bytes().startswith(b"\xef\xbb\xbf")  # BOM: Excel reads it as UTF-8
    rows = read_csv(path)
    assert len(rows) == 1 and tuple(rows[0]) == SESSION_COLUMNS
    row = rows[0]
    assert row["text"] == SCRIPT_TEXT  # newline and Chinese survive quoting
    assert row["request_id"] == str(rid)
    assert row["new_tokens"] == "8" and row["drafted"] == "8" and row["accepted"] == "5"
    assert row["accepted_length_histogram"] == "0;1;2;0;0;0"  # steps that accepted 0..K drafts
    assert [float(x) for x in row["per_position_acceptance"].split(";")] == pytest.approx([1.0, 2 / 3, 0, 0, 0])
    assert row["mode"] == "speculative" and row["request_k"] == "5" and row["proposer"] == "draft"
    assert row["temperature"] == "0.0" and row["top_p"] == "1.0" and row["max_new_tokens"] == "512"
    assert row["target_model"] == "fake-target" and row["draft_model"] == "fake-draft"
    assert row["device"] == "cpu" and row["dtype"] == "float32" and row["stop_reason"] == "eos"
    assert "T" in row["timestamp"]

    trace = tmp_path / "trace.csv"
    assert w.export_trace(str(trace))
    steps = read_csv(trace)
    assert tuple(steps[0]) == TRACE_COLUMNS
    assert [(s["step"], s["proposed"], s["accepted"], s["added_status"], s["new_tokens"]) for s in steps] == [
        ("0", "4", "2", "corrected", "3"), ("1", "2", "2", "bonus", "3"), ("2", "2", "1", "corrected", "2")]
    assert "".join(s["text"] for s in steps) == SCRIPT_TEXT


def test_multi_turn_history_is_sent_with_each_request(make_window, qtbot):
    engine = FakeEngine()
    w = make_window(engine)
    w.panel.set_values(GenerationSettings(system_prompt=""))
    send_with_enter(qtbot, w, "first")
    send_with_enter(qtbot, w, "second")
    assert engine.requests[-1].messages == (
        Message("user", "first"), Message("assistant", SCRIPT_TEXT), Message("user", "second"))


def test_the_default_is_auto_mode_with_k_chosen_per_step(make_window, qtbot):
    engine = FakeEngine()
    w = make_window(engine)
    w.panel.set_values(GenerationSettings())
    assert w.panel.k.text() == "auto" and not w.panel.k.isEnabled() and w.panel.proposer.isEnabled()
    send_with_enter(qtbot, w, "hi")
    r = engine.requests[-1]
    assert (r.mode, r.k, r.proposer) == ("auto", K_AUTO, "draft+ngram")


def test_exports_carry_the_k_chosen_the_reason_and_the_time_split(tmp_path):
    from dataclasses import replace

    from app.core.export import AnswerRecord, write_session_csv, write_trace_csv
    from engine.types import Decision

    decision = Decision(3, "draft", "best", 0.8, 1.3, 3, 1.3)
    steps = [replace(s, decision=decision, overhead_ms=0.25) for s in script()]
    summary = summarize(steps, mode="auto", k=K_AUTO, prompt_tokens=4, seconds=1.0, stop_reason="eos", prefill_s=0.1)
    record = AnswerRecord(GenerationRequest(mode="auto", k=K_AUTO), summary, FAKE_INFO, "now", tuple(steps))
    write_session_csv(tmp_path / "s.csv", [record])
    write_trace_csv(tmp_path / "t.csv", [record])
    [row] = read_csv(tmp_path / "s.csv")
    assert (row["request_mode"], row["request_k"], row["decision_k"], row["decision_reason"]) == ("auto", "auto", "3", "best")
    assert float(row["prefill_s"]) == 0.1 and float(row["draft_s"]) == pytest.approx(0.006)
    assert float(row["overhead_s"]) == pytest.approx(1.0 - 0.1 - 0.006 - 0.024)
    trace = read_csv(tmp_path / "t.csv")
    assert [(t["k_chosen"], t["k_reason"], t["overhead_ms"]) for t in trace] == [("3", "best", "0.25")] * 3


def test_settings_reach_the_request(make_window, qtbot):
    engine = FakeEngine()
    w = make_window(engine)
    w.panel.set_values(GenerationSettings(mode="speculative", k=9, temperature=0.7, top_k=40, top_p=0.9, seed=3,
                                          max_new_tokens=77, proposer="ngram"))
    send_with_enter(qtbot, w, "hi")
    r = engine.requests[-1]
    assert (r.mode, r.k, r.proposer, r.max_new_tokens) == ("speculative", 9, "ngram", 77)
    assert (r.sampling.temperature, r.sampling.top_k, r.sampling.top_p, r.sampling.seed) == (0.7, 40, 0.9, 3)


def test_shift_enter_inserts_a_newline_and_empty_text_is_not_sent(make_window, qtbot):
    engine = FakeEngine()
    w = make_window(engine)
    w.prompt.edit.setFocus()
    qtbot.keyClicks(w.prompt.edit, "line one")
    qtbot.keyClick(w.prompt.edit, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(w.prompt.edit, "line two")
    assert w.prompt.text() == "line one\nline two"
    assert w.active_request is None
    w.prompt.set_text("   ")
    qtbot.keyClick(w.prompt.edit, Qt.Key.Key_Return)
    assert w.active_request is None and not engine.requests


def test_regenerate_replaces_the_last_answer(make_window, qtbot):
    engine = FakeEngine()
    w = make_window(engine)
    first, _ = send_with_enter(qtbot, w, "question")
    count = w.chat.message_count()
    assert w.chat.regenerate_visible(first)
    # At T = 0 the answer would repeat: Regenerate first says so in the chat and offers to raise T.
    assert w.regenerate() is None and w.active_request is None
    hint = w.chat.hint()
    assert hint is not None and "same answer" in hint.plain_text()
    with qtbot.waitSignal(w.answer_finished, timeout=5000) as blocker:
        hint.buttons[1].click()  # "Regenerate at T = 0"
    second = blocker.args[0]
    assert second != first and w.chat.hint() is None
    assert engine.requests[-1].sampling.temperature == 0
    qtbot.waitUntil(lambda: w.active_request is None)
    assert engine.requests[-1].messages == engine.requests[-2].messages  # same turns re-sent
    assert w.chat.token_view(first) is None and w.chat.token_view(second) is not None
    assert w.chat.message_count() == count
    assert w.history() == [Message("user", "question"), Message("assistant", SCRIPT_TEXT)]
    assert len(w.records) == 2  # the session keeps both answers for export


def test_new_chat_clears_history_view_and_charts(make_window, qtbot):
    w = make_window(FakeEngine())
    send_with_enter(qtbot, w, "question")
    w.new_chat_action.trigger()
    assert w.history() == [] and w.chat.message_count() == 0
    assert len(w.charts.series()["step"]) == 0
    assert not w.regenerate_action.isEnabled()
    assert len(w.records) == 1  # the session (export) outlives a chat


def test_new_chat_while_streaming_keeps_the_late_answer_out_of_the_new_chat(make_window, qtbot):
    w = make_window(FakeEngine(long_script(), delay_s=0.005))
    rid = w.send("old question")
    qtbot.waitUntil(lambda: bool(w.chat.token_view(rid).token_spans()), timeout=5000)
    with qtbot.waitSignal(w.answer_finished, timeout=5000):
        w.new_chat()
    assert w.history() == [] and w.active_request is None
    assert w.records[-1].summary.stop_reason == "cancelled"


# --------------------------------------------------------------------------- stop, failures

def test_stop_button_mid_generation_gives_exactly_one_terminal_signal(make_window, qtbot):
    w = make_window(FakeEngine(long_script(), delay_s=0.005))
    terminal: list[tuple[str, int]] = []
    w.worker.generation_finished.connect(lambda rid, s: terminal.append(("finished", rid, s)))
    w.worker.generation_failed.connect(lambda rid, m: terminal.append(("failed", rid, m)))
    rid = w.send("go on forever")
    assert w.prompt.button.text() == "Stop"
    qtbot.waitUntil(lambda: bool(w.chat.token_view(rid).token_spans()), timeout=5000)
    qtbot.mouseClick(w.prompt.button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: bool(terminal), timeout=5000)
    qtbot.wait(200)  # nothing else may arrive
    assert len(terminal) == 1
    kind, got, summary = terminal[0]
    assert (kind, got, summary.stop_reason) == ("finished", rid, "cancelled")
    assert 0 < summary.new_tokens < 1200
    assert w.prompt.button.text() == "Send" and w.active_request is None
    assert "stopped" in w.chat.stats_text(rid)


def test_escape_stops(make_window, qtbot):
    w = make_window(FakeEngine(long_script(), delay_s=0.005))
    rid = w.send("go")
    qtbot.waitUntil(lambda: bool(w.chat.token_view(rid).token_spans()), timeout=5000)
    with qtbot.waitSignal(w.answer_finished, timeout=5000) as blocker:
        w.prompt.edit.setFocus()
        qtbot.keyClick(w.prompt.edit, Qt.Key.Key_Escape)
    assert blocker.args[1].stop_reason == "cancelled"


def test_stop_before_the_worker_starts_still_ends_once(qtbot, no_dangling_threads):
    host = WorkerHost(lambda _r, _p: FakeEngine(long_script()))
    try:
        loaded: list[ModelInfo] = []
        host.worker.load_finished.connect(loaded.append)
        host.worker.load_requested.emit(LoadSpec())
        qtbot.waitUntil(lambda: bool(loaded), timeout=5000)
        ends: list[object] = []
        host.worker.generation_finished.connect(lambda rid, s: ends.append((rid, s)))
        host.worker.generation_failed.connect(lambda rid, m: ends.append((rid, m)))
        host.worker.stop(7)  # before the request is even queued
        host.worker.generate_requested.emit(GenerationRequest(prompt="x", request_id=7))
        qtbot.waitUntil(lambda: bool(ends), timeout=5000)
        qtbot.wait(100)
        assert len(ends) == 1 and ends[0][1].stop_reason == "cancelled" and ends[0][1].new_tokens == 0
    finally:
        assert host.shutdown()


def test_steps_are_batched_and_none_is_lost(qtbot, no_dangling_threads):
    host = WorkerHost(lambda _r, _p: FakeEngine(long_script(3000)))
    try:
        loaded: list[ModelInfo] = []
        host.worker.load_finished.connect(loaded.append)
        host.worker.load_requested.emit(LoadSpec())
        qtbot.waitUntil(lambda: bool(loaded), timeout=5000)
        batches: list[tuple[Step, ...]] = []
        host.worker.steps.connect(lambda rid, b: batches.append(b))
        done: list[Summary] = []
        host.worker.generation_finished.connect(lambda rid, summary: done.append(summary))
        host.worker.generate_requested.emit(GenerationRequest(prompt="x", request_id=1))
        qtbot.waitUntil(lambda: bool(done), timeout=10000)
        got = [s.index for b in batches for s in b]
        assert got == list(range(3000))
        assert len(batches) < 300  # ~30 ms batches, not one signal per step
        assert done[0].new_tokens == 9000
    finally:
        assert host.shutdown()


class _Cycle:
    """A reference cycle holding a Qt object made on the GUI thread; records where it was collected."""

    freed_on: list[str] = []

    def __init__(self) -> None:
        from PySide6.QtCore import QTimer

        self.me = self
        self.timer = QTimer()

    def __del__(self) -> None:
        _Cycle.freed_on.append(threading.current_thread().name)


def test_garbage_is_collected_on_the_gui_thread_while_a_worker_lives(qtbot, no_dangling_threads):
    # CI died with SIGSEGV in the worker's gc.collect() after a load: it collected earlier windows'
    # Qt objects on the worker's thread. While a worker lives, every collection runs on the GUI thread.
    import gc

    from engine import garbage

    def loads_making_cycles(_request, _progress):
        for _ in range(20 * gc.get_threshold()[0]):  # enough to trigger automatic collections here
            cycle: list[object] = []
            cycle.append(cycle)
        return FakeEngine()

    collected_on: list[str] = []

    def record(phase, _info):
        if phase == "start":
            collected_on.append(threading.current_thread().name)

    _Cycle.freed_on.clear()
    gui = threading.current_thread().name
    host = WorkerHost(loads_making_cycles)
    gc.callbacks.append(record)
    try:
        assert not gc.isenabled()
        _Cycle()
        loaded: list[ModelInfo] = []
        host.worker.load_finished.connect(loaded.append)
        host.worker.load_requested.emit(LoadSpec())
        qtbot.waitUntil(lambda: bool(loaded), timeout=5000)
        # Replacing the pair collects at once (the old weights must go before the next pair loads).
        host.worker.load_requested.emit(LoadSpec())
        qtbot.waitUntil(lambda: len(loaded) == 2, timeout=5000)
        assert _Cycle.freed_on == [gui]
        assert collected_on and set(collected_on) == {gui}
    finally:
        gc.callbacks.remove(record)
        assert host.shutdown()
    assert gc.isenabled() and garbage._collect is gc.collect


def test_the_gui_thread_collects_when_python_would_have(qtbot, no_dangling_threads):
    import gc

    host = WorkerHost(lambda _r, _p: FakeEngine())
    try:
        _Cycle.freed_on.clear()
        _Cycle()
        for _ in range(3 * gc.get_threshold()[0]):
            cycle: list[object] = []
            cycle.append(cycle)
        qtbot.waitUntil(lambda: bool(_Cycle.freed_on), timeout=3000)
        assert _Cycle.freed_on == [threading.current_thread().name]
    finally:
        assert host.shutdown()


def test_closing_while_the_worker_asks_for_a_collection_does_not_wait_for_it(qtbot, no_dangling_threads):
    from engine import garbage

    asking = threading.Event()

    def collecting_load(_request, progress):
        while True:  # a close lands at the next progress call
            asking.set()
            garbage.collect_garbage()
            progress(type("P", (), {"stage": "convert", "fraction": 0.5, "message": "converting"})())

    host = WorkerHost(collecting_load)
    host.worker.load_requested.emit(LoadSpec())
    assert asking.wait(5)
    started = time.perf_counter()
    assert host.shutdown()
    assert time.perf_counter() - started < 5  # a worker waiting on this thread would hold it 10 s


def test_generation_without_a_model_fails_cleanly(qtbot, no_dangling_threads):
    worker_host = WorkerHost(lambda _r, _p: FakeEngine())
    try:
        failed: list[tuple[int, str]] = []
        worker_host.worker.generation_failed.connect(lambda rid, message: failed.append((rid, message)))
        worker_host.worker.generate_requested.emit(GenerationRequest(prompt="x", request_id=3))
        qtbot.waitUntil(lambda: bool(failed), timeout=5000)
        assert failed[0][0] == 3 and "No model is loaded" in failed[0][1]
    finally:
        worker_host.shutdown()


class OutOfMemoryError(RuntimeError):
    """Named like torch.OutOfMemoryError, which the worker recognises by name."""


@pytest.mark.parametrize("error, expected", [
    (GenerationError("The prompt is 9000 tokens; the model's context holds 4096."), "The prompt is 9000 tokens"),
    (OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), "Out of memory"),
    (ValueError("boom"), "Generation failed (ValueError: boom)"),
])
def test_generation_errors_become_one_failed_signal(make_window, qtbot, error, expected):
    w = make_window(FakeEngine(fail_at=1, error=error))
    with qtbot.waitSignal(w.answer_failed, timeout=5000) as blocker:
        rid = w.send("hi")
    assert blocker.args[0] == rid and blocker.args[1].startswith(expected)
    if expected == "Out of memory":
        assert "max new tokens" in blocker.args[1]
    qtbot.waitUntil(lambda: w.active_request is None)
    assert w.chat.token_view(rid).committed_text() == "Hello world,"  # the first step stays visible
    assert w.prompt.button.text() == "Send" and w.prompt.button.isEnabled()
    assert w.records == []  # failures are not exported as answers


# --------------------------------------------------------------------------- export errors

def test_unwritable_export_path_shows_an_error_and_keeps_the_session(make_window, qtbot, tmp_path, dialogs):
    w = make_window(FakeEngine())
    send_with_enter(qtbot, w, "question")
    bad = [str(tmp_path), "/proc/specdec/x.csv", str(tmp_path / "missing" / "dir" / "x.csv")]
    for path in bad:
        assert not w.export_session(path)
        assert not w.export_trace(path)
    errors = [c for c in dialogs if c[0] == "critical"]
    assert len(errors) == 2 * len(bad)
    assert all(title == "Export failed" and "session is kept" in text for _, title, text in errors)
    assert len(w.records) == 1 and w.history()[-1].role == "assistant"
    ok = tmp_path / "ok.csv"
    assert w.export_session(str(ok)) and len(read_csv(ok)) == 1


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores file permissions")
def test_permission_denied_export_shows_an_error(make_window, qtbot, tmp_path, dialogs):
    w = make_window(FakeEngine())
    send_with_enter(qtbot, w, "question")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert not w.export_session(str(locked / "x.csv"))
    finally:
        locked.chmod(0o700)
    assert dialogs and dialogs[-1][1] == "Export failed"


def test_export_with_nothing_to_export_says_so(make_window, tmp_path, dialogs):
    w = make_window(FakeEngine())
    assert not w.export_session(str(tmp_path / "x.csv"))
    assert dialogs[-1][0] == "information" and not (tmp_path / "x.csv").exists()


# --------------------------------------------------------------------------- loading

def test_loading_shows_its_progress_and_settings_stay_usable(make_window, qtbot):
    release = threading.Event()

    def slow_factory(_request, progress):
        progress(type("P", (), {"stage": "load", "fraction": 0.4, "message": "Loading fake-target"})())
        release.wait(5)
        return FakeEngine()

    w = make_window(factory=slow_factory, load=False)
    w.load_models(ModelSelection())
    qtbot.waitUntil(lambda: w.load_bar.value() == 40, timeout=5000)
    assert "loading" in w.prompt.button.toolTip()  # a message sent now is queued (tests/test_ready_queue.py)
    assert w.load_bar.isVisible() and w.load_bar.value() == 40 and w.load_label.text() == "Loading fake-target"
    w.panel.set_values(GenerationSettings(k=7))  # settings stay usable while loading
    with qtbot.waitSignal(w.models_loaded, timeout=5000):
        release.set()
    assert w.prompt.button.isEnabled() and not w.load_bar.isVisible()
    assert "fake-target" in w.model_label.text() and "cpu" in w.device_label.text()


def test_status_bar_names_the_runtime_and_why_auto_fell_back(make_window):
    from dataclasses import replace

    llama = replace(FAKE_INFO, fast_path="llama.cpp", runtime="llamacpp", threads=2, dtype="Q4_K_M")
    w = make_window(FakeEngine(info=llama))
    assert w.device_label.text() == "cpu · Q4_K_M · llama.cpp · 2 threads"
    fallback = replace(FAKE_INFO, fast_path="cpu-onednn", runtime_note="llama.cpp unavailable (ImportError: x)")
    w = make_window(FakeEngine(info=fallback))
    assert w.device_label.text() == "cpu · float32 · cpu-onednn (torch; llama.cpp unavailable (ImportError: x))"
    notes = [m.plain_text() for m in w.chat._messages if hasattr(m, "plain_text")]
    assert "Running on torch: llama.cpp unavailable (ImportError: x)." in notes


def test_load_failure_shows_the_message_and_keeps_the_old_engine(make_window, qtbot, dialogs, settings):
    fake = FakeEngine()

    def factory(request, progress):
        return fake if request.target is None else default_engine_factory(request, progress)

    w = make_window(factory=factory)
    good = settings.models()
    bad = ModelSelection(target=ModelChoice("folder", "/no/such/model"), draft=ModelChoice("folder", "/no/draft"))
    with qtbot.waitSignal(w.models_load_failed, timeout=60000) as blocker:
        w.load_models(bad)
    assert "Model path not found: /no/such/model" in blocker.args[0]
    assert dialogs[-1][0] == "critical" and "/no/such/model" in dialogs[-1][2]
    assert w.worker.engine is fake and w.info == FAKE_INFO
    assert settings.models() == good  # a failed selection is not remembered
    rid, summary = send_with_enter(qtbot, w, "still works?")
    assert summary.text == SCRIPT_TEXT


def test_incompatible_tokenizers_fail_before_weights_load(make_window, qtbot, dialogs, tiny_pair, tmp_path):
    from tests.tiny import build_tokenizer, save_pair

    other_target, _ = save_pair(tmp_path / "other", tokenizer=build_tokenizer(vocab_size=300, seed_corpus=["abc xyz " * 5]))
    target_dir, _ = tiny_pair
    stages: list[str] = []
    w = make_window(factory=default_engine_factory, load=False)
    w.worker.load_progress.connect(lambda p: stages.append(p.stage))  # runs on the worker thread
    selection = ModelSelection(target=ModelChoice("folder", str(target_dir)),
                               draft=ModelChoice("folder", str(other_target)), device="cpu", dtype="float32")
    with qtbot.waitSignal(w.models_load_failed, timeout=30000) as blocker:
        w.load_models(selection)
    assert "same tokenizer" in blocker.args[0]
    assert "load" not in stages  # no weights were loaded
    assert dialogs[-1][1] == "Could not load the models"


def test_model_dialog_round_trips_a_selection(qtbot):
    selection = ModelSelection(target=ModelChoice("folder", "/models/t"), draft=ModelChoice("hub", "Qwen/x"),
                               device="cuda:1", dtype="bfloat16", no_draft=False, runtime="llamacpp", threads=3)
    dialog = ModelDialog(selection)
    qtbot.addWidget(dialog)
    assert dialog.selection() == selection
    assert dialog.runtime.currentText() == "llama.cpp" and dialog.threads.text() == "3"
    dialog.threads.setValue(0)
    from engine.cpu_threads import choose_threads, physical_cores

    auto = choose_threads(physical_cores())  # 0 is the engine's own choice, named with its count
    assert dialog.selection().threads == 0 and dialog.threads.text() == f"auto ({auto.label()})"
    dialog.no_draft.setChecked(True)
    assert dialog.selection().no_draft and not dialog.draft.isEnabled()
    dialog.target.gguf.setText("/m/x.gguf")
    dialog.target.gguf.textEdited.emit("/m/x.gguf")
    assert dialog.selection().target == ModelChoice("gguf", "/m/x.gguf")
    assert ModelChoice().spec() is None and ModelChoice("hub", " a/b ").spec() == "a/b"


# --------------------------------------------------------------------------- settings, closing

def test_settings_round_trip(make_window, qtbot, tmp_path):
    path = tmp_path / "roundtrip.ini"
    first = make_window(FakeEngine(), app_settings=AppSettings(path))
    chosen = GenerationSettings(mode="speculative", proposer="draft+ngram", k=11, temperature=0.8, top_k=50,
                                top_p=0.95, seed=42, max_new_tokens=1024, system_prompt="你是一个助手。\nBe brief.")
    first.panel.set_values(chosen)
    first.panel.set_display(DisplaySettings(colouring=False, show_rejected=False))
    first.resize(1300, 820)
    first.splitter.setSizes([250, 700, 350])
    sizes = first.splitter.sizes()
    first.charts_action.setChecked(False)  # hidden charts keep their width for next time
    first.close()
    saved = AppSettings(path).splitter_sizes()
    assert saved is not None and (saved[0], saved[2]) == (sizes[0], sizes[2])  # settings | chat | charts
    assert AppSettings(path).panels() == {"sidebar": True, "settings": True, "charts": False}

    second = make_window(FakeEngine(), app_settings=AppSettings(path), load=False)
    assert second.panel.values() == chosen
    assert second.panel.display() == DisplaySettings(colouring=False, show_rejected=False)
    assert not second.charts.isVisible() and not second.charts_action.isChecked()
    # The offscreen screen is small, so the restored window (and its middle pane) may be clamped.
    assert AppSettings(path).geometry() is not None
    assert second.splitter.sizes()[0] == sizes[0]
    second.charts_action.setChecked(True)
    assert second.charts.isVisible() and second.splitter.sizes()[2] > 0
    assert not second.colouring_action.isChecked() and not second.ghosts_action.isChecked()
    assert AppSettings(path).models() == ModelSelection()  # the successful load was remembered


def test_view_menu_toggles_follow_the_panel(make_window, qtbot):
    w = make_window(FakeEngine())
    rid, _ = send_with_enter(qtbot, w, "q")
    view = w.chat.token_view(rid)
    w.ghosts_action.setChecked(False)
    assert not w.panel.display().show_rejected and not view.show_rejected()
    assert "rejected" not in [s for _, _, s in view.token_spans()]
    w.panel.colouring.setChecked(False)
    assert not w.colouring_action.isChecked() and not view.colouring()


def test_closing_mid_generation_leaves_no_thread(make_window, qtbot):
    w = make_window(FakeEngine(long_script(100000), delay_s=0.001))
    rid = w.send("stream forever")
    qtbot.waitUntil(lambda: bool(w.chat.token_view(rid).token_spans()), timeout=5000)
    started = time.perf_counter()
    w.close()
    assert time.perf_counter() - started < 5
    assert not running_threads()


def test_closing_mid_load_cancels_at_the_next_stage(make_window, qtbot):
    reported = threading.Event()

    def endless_load(_request, progress):
        while True:  # each progress call is a stage boundary where a close can land
            progress(type("P", (), {"stage": "convert", "fraction": 0.5, "message": "converting"})())
            reported.set()
            time.sleep(0.01)

    w = make_window(factory=endless_load, load=False)
    w.load_models(ModelSelection())
    qtbot.waitUntil(reported.is_set, timeout=5000)
    started = time.perf_counter()
    w.close()
    assert time.perf_counter() - started < 5
    assert not running_threads()


# --------------------------------------------------------------------------- entry point

def test_main_delegates_headless_commands_to_the_cli(monkeypatch):
    import app.cli
    from app.main import main

    seen: list[list[str]] = []
    monkeypatch.setattr(app.cli, "main", lambda argv: seen.append(list(argv)) or 7)
    assert main(["generate", "--prompt", "hi"]) == 7
    assert main(["bench", "--help"]) == 7
    assert seen == [["generate", "--prompt", "hi"], ["bench", "--help"]]


def test_every_cli_command_runs_headless():
    """`specdec-studio distill` (and any command added later) must reach the CLI, not the window's parser."""
    import argparse

    from app.cli.parser import build_parser
    from app.main import HEADLESS_COMMANDS

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(HEADLESS_COMMANDS)


def test_worker_signals_are_declared_as_designed():
    names = {"load_requested", "generate_requested", "load_progress", "load_finished", "load_failed",
             "generation_started", "steps", "generation_finished", "generation_failed"}
    assert names <= set(dir(EngineWorker))


# --------------------------------------------------------------------------- real (tiny) models

def test_end_to_end_with_tiny_real_models(make_window, qtbot, tiny_pair, tmp_path):
    target_dir, draft_dir = tiny_pair
    w = make_window(factory=default_engine_factory, load=False)
    selection = ModelSelection(target=ModelChoice("folder", str(target_dir)),
                               draft=ModelChoice("folder", str(draft_dir)), device="cpu", dtype="float32")
    stages: list[str] = []
    w.worker.load_progress.connect(lambda p: stages.append(p.stage))
    with qtbot.waitSignal(w.models_loaded, timeout=60000) as blocker:
        w.load_models(selection)
    info: ModelInfo = blocker.args[0]
    assert (info.target_name, info.draft_name, info.device, info.dtype) == ("target", "draft", "cpu", "float32")
    assert stages[0] == "check" and "load" in stages
    w.panel.set_values(GenerationSettings(mode="speculative", k=4, proposer="draft", max_new_tokens=24,
                                          system_prompt=""))
    rid, summary = send_with_enter(qtbot, w, "def add(a, b):")
    assert summary.new_tokens > 0 and summary.mode == "speculative"
    view = w.chat.token_view(rid)
    statuses = {s for _, _, s in view.token_spans()}
    assert statuses <= {"accepted", "rejected", "corrected", "bonus"} and statuses & {"corrected", "bonus"}
    assert view.committed_text() == summary.text
    assert w.chat.stats_detail(rid) == format_stats_line(summary, w.records[-1].request)
    assert len(w.charts.series()["step"]) == summary.target_forwards
    path = tmp_path / "real.csv"
    assert w.export_session(str(path))
    assert read_csv(path)[0]["target_model"] == "target"


def test_cost_verdict_says_plainly_whether_speculation_pays():
    from app.core.session import cost_verdict
    from engine.measure.stats import summarize
    from engine.types import ModelInfo, Step

    slow_draft = ModelInfo("t", "d", "cuda", "bfloat16", "cuda-graphs", 100, draft_ms=1.8,
                           target_ms=((1, 2.8), (2, 3.2), (6, 3.3)))
    short, full = cost_verdict(slow_draft, None)
    assert short == "The draft costs 64% of a forward" and "1.8 ms" in full
    # Every step accepts 2 of 5 drafts: alpha is low, so the prediction says it will not pay.
    steps = [Step(i, "speculative", (1, 2, 3, 4, 5), (0.5,) * 5, (0.5,) * 5, ("draft",) * 5, 2, 9, "corrected",
                  (), "", 3, 3 * (i + 1), 1.0, 1.0, 0.0) for i in range(10)]
    summary = summarize(steps, mode="speculative", k=5, prompt_tokens=4, seconds=1.0, stop_reason="max_new_tokens")
    short, full = cost_verdict(slow_draft, summary)
    # Plain words in the bar (the same verdict as everywhere), the figures in the tooltip.
    assert short.startswith("Standard decoding is fastest here: the draft costs 64% of a forward and ")
    assert "of its tokens are accepted" in short and full.startswith("Predicted 0.") and "will not pay" in full
    cheap_draft = ModelInfo("t", "d", "cpu", "float32", "cpu-onednn", 100, draft_ms=0.1, target_ms=((1, 10.0), (6, 11.0)))
    assert "pays here" in cost_verdict(cheap_draft, summary)[1]
    assert cost_verdict(cheap_draft, summary)[0].startswith("Speculative decoding pays here: about ")
    assert cost_verdict(ModelInfo("t", None, "cpu", "float32", "eager", 100), summary) == ("", "")


def test_memory_figure_counts_every_gpu_of_a_split_target(make_window, monkeypatch):
    """The status bar reads the GPUs that hold the pair, not whichever device is current."""
    import sys
    from dataclasses import replace
    from types import SimpleNamespace

    w = make_window()
    allocated = {"cuda:0": 3 * 2**30, "cuda:1": 5 * 2**30}
    free = {"cuda:0": 60, "cuda:1": 5}  # of 100: cuda:1 is the fullest
    fake_cuda = SimpleNamespace(memory_allocated=lambda d: allocated[d], mem_get_info=lambda d: (free[d], 100))
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=fake_cuda))
    w.session.info = replace(w.info, device="cuda:1", devices=("cuda:0", "cuda:1"))
    w._update_memory()
    assert w.memory_label.text() == "GPUs 3.00 + 5.00 GiB"
    assert w._memory_full  # 95% used on cuda:1
    w.session.info = replace(w.info, device="cuda:1", devices=())
    w._update_memory()
    assert w.memory_label.text() == "GPU 5.00 GiB"


def test_the_window_without_a_display_is_one_line(monkeypatch, capsys):
    from app.main import main

    for name in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("sys.platform", "linux")
    assert main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no display" in err[0] and "xvfb-run" in err[0]


def test_long_status_text_elides_with_the_whole_text_in_its_tooltip(qtbot):
    from widgets.elided_label import ElidedLabel

    long = "Standard decoding is fastest here: the draft costs 60% of a forward and 45% of its tokens are accepted"
    label = ElidedLabel(long)
    qtbot.addWidget(label)
    label.setToolTip("Measured at load: draft 41.0 ms per forward")
    label.resize(160, 20)
    label.show()
    assert label.is_elided() and label.shown_text().endswith("…") and label.text() == long
    assert label.shown_text()[:-1] in long  # cut at a character, marked, never mid-word without a mark
    assert label.toolTip() == long + "\n\nMeasured at load: draft 41.0 ms per forward"
    label.resize(2000, 20)
    assert not label.is_elided() and label.toolTip() == "Measured at load: draft 41.0 ms per forward"
