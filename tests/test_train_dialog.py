"""The app's "Train a draft head…": live curves from the worker, cancel, one terminal signal, the head offered after."""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from app.settings import AppSettings
from app.window import MainWindow
from app.worker import running_threads
from engine.settings import ModelSelection
from engine.types import ModelInfo, TrainingProgress
from tests.test_app import FAKE_INFO, FakeEngine


class FakeTrainer:
    """Head-trainer-like: reports `steps` train/eval records, honours cancel, attaches a head at the end."""

    def __init__(self, steps: int = 30, delay_s: float = 0.0, error: Exception | None = None) -> None:
        self.steps = steps
        self.delay_s = delay_s
        self.error = error
        self.requests = []

    def __call__(self, request, engine, progress, cancel: threading.Event):
        self.requests.append(request)
        done = 0
        for step in range(1, self.steps + 1):
            if cancel.is_set():
                break
            time.sleep(self.delay_s)
            record = {"kind": "train", "step": step, "loss": 10.0 / step, "acc": [min(0.9, step / self.steps)] * 3}
            progress(TrainingProgress("train", step / self.steps, 60.0, f"step {step}", record))
            if step % 10 == 0:
                record = {"kind": "eval", "step": step, "acceptance": [0.5 + step / 100, 0.4, 0.3]}
                progress(TrainingProgress("train", step / self.steps, 60.0, "eval", record))
            if self.error is not None and step == 5:
                raise self.error
            done = step
        summary = {"finished": done == self.steps, "steps": done, "sequences": 12, "out": request.out,
                   "held_out_acceptance": [0.7, 0.5, 0.4]}
        info = replace(engine.info, head_name="fake head", head_ms=0.2)
        engine.info = info
        return summary, info


@pytest.fixture
def window(qtbot, tmp_path):
    made = []

    def make(trainer: FakeTrainer, info: ModelInfo = replace(FAKE_INFO, draft_name=None)) -> MainWindow:
        engine = FakeEngine(info=info)
        w = MainWindow(engine_factory=lambda _req, _progress: engine, settings=AppSettings(tmp_path / "s.ini"),
                       head_trainer=trainer)
        qtbot.addWidget(w)
        w.show()
        with qtbot.waitSignal(w.models_loaded, timeout=5000):
            w.load_models(ModelSelection())
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()
    assert not running_threads(), f"dangling worker threads: {running_threads()}"


def test_training_draws_curves_and_offers_the_head(window, qtbot, tmp_path):
    trainer = FakeTrainer(steps=30)
    w = window(trainer)
    assert w.panel.proposer.model().item(w.panel.proposer.findData("head")).isEnabled() is False
    dialog = w.open_train_dialog()
    dialog.folder.setText(str(tmp_path / "heads"))
    dialog.minutes.setValue(5)
    with qtbot.waitSignal(w.worker.training_finished, timeout=5000):
        dialog.start_button.click()
        assert w.training.running and not w.prompt._ready
    qtbot.waitUntil(lambda: not w.training.running, timeout=2000)
    dialog.refresh()
    series = dialog.series()
    assert len(series["loss"][0]) == 30 and series["loss"][1][-1] < series["loss"][1][0]
    assert len(series["held_out"][0]) == 3 and series["held_out"][1][-1] == pytest.approx(80.0)
    request = trainer.requests[0]
    assert request.minutes == 5 and request.out == str(tmp_path / "heads") and request.device == "cpu"
    assert "Held-out acceptance" in dialog.status.text() and dialog.start_button.text() == "Start"
    qtbot.waitUntil(lambda: w.info.head_name == "fake head", timeout=2000)
    assert w.panel.proposer.model().item(w.panel.proposer.findData("head")).isEnabled()
    assert w.prompt._ready


def test_cancel_stops_training_with_one_terminal_signal(window, qtbot, tmp_path):
    trainer = FakeTrainer(steps=1000, delay_s=0.01)
    w = window(trainer)
    dialog = w.open_train_dialog()
    finished, failed = [], []
    w.worker.training_finished.connect(lambda rid, summary: finished.append(summary))
    w.worker.training_failed.connect(lambda rid, message: failed.append(message))
    dialog.start_button.click()
    qtbot.waitUntil(lambda: len(dialog.series()["loss"][0]) >= 3 or dialog.status.text().startswith("step"),
                    timeout=3000)
    dialog.start_button.click()  # now "Cancel"
    qtbot.waitUntil(lambda: not w.training.running, timeout=5000)
    qtbot.wait(50)
    assert len(finished) == 1 and not failed
    assert not finished[0]["finished"] and finished[0]["steps"] < 1000
    assert "Stopped early" in dialog.status.text()


def test_a_failing_training_is_one_line_and_keeps_the_app_usable(window, qtbot):
    from engine.errors import EngineError

    w = window(FakeTrainer(steps=20, error=EngineError("No training data was produced: give it more minutes.")))
    dialog = w.open_train_dialog()
    with qtbot.waitSignal(w.worker.training_failed, timeout=5000) as blocker:
        dialog.start_button.click()
    assert blocker.args[1] == "No training data was produced: give it more minutes."
    qtbot.waitUntil(lambda: not w.training.running, timeout=2000)
    assert dialog.status.text().startswith("Training failed") and w.train_head_action.isEnabled()
