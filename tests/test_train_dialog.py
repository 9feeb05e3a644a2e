"""The app's "Train a draft head…": live curves from the worker, cancel, one terminal signal, the head offered after."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from app.core.head_log import head_log_for, read_head_log, read_log
from app.ui.settings import AppSettings
from app.ui.training import default_head_folder
from app.ui.window import MainWindow
from app.ui.worker import running_threads
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
def window(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))  # the dialog's default head folder is in here
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
    assert dialog.progress.isHidden()  # no empty bar before a run reports
    with qtbot.waitSignal(w.worker.training_finished, timeout=5000):
        dialog.start_button.click()
        assert w.training.running and not w.prompt._ready
    qtbot.waitUntil(lambda: not w.training.running, timeout=2000)
    assert not dialog.progress.isHidden()
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


# --------------------------------------------------------------------------- the log of the head in use

SHIPPED_HEAD = "Qwen2.5-Coder-1.5B-Instruct head"


def write_head(folder: Path, lines: list[str], *, name: str = "fake-target head", training: dict | None = None) -> Path:
    """A head folder as far as the dialog reads it: a manifest and a train_log.jsonl (no weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    training = training or {"used_minutes": 2.0, "steps": 20, "device": "cpu", "held_out_acceptance": [0.5, 0.4]}
    (folder / "manifest.json").write_text(json.dumps({"name": name, "training": training}), encoding="utf-8")
    (folder / "train_log.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def train(step: int, loss: float = 5.0, acc: float = 0.5) -> str:
    return json.dumps({"kind": "train", "step": step, "loss": loss, "acc": [acc, acc / 2]})


def evaluate(step: int, first: float = 0.5) -> str:
    return json.dumps({"kind": "eval", "step": step, "acceptance": [first, 0.4, 0.2]})


def test_a_continued_log_goes_on_from_its_last_step_and_skips_bad_lines(tmp_path):
    folder = write_head(tmp_path / "head", [
        json.dumps({"kind": "call", "call": 1, "phase": "data"}), train(10), train(20), evaluate(20),
        "{not json", json.dumps({"kind": "train", "step": 25}), "[1, 2]", json.dumps({"kind": "eval", "step": "x"}),
        "[" * 100_000 + "]" * 100_000,
        json.dumps({"kind": "continue", "from": "fake-target head", "used_minutes_before": 2.0}),
        evaluate(0, 0.6), train(10), train(20), evaluate(20, 0.7), '{"kind": "train", "step": 30, "lo',
    ], training={"used_minutes": 1.5, "used_minutes_in_all": 3.5, "steps": 20, "device": "cuda:0",
                 "held_out_acceptance": [0.7, 0.4, 0.2], "continued_from": {"name": "fake-target head"}})
    records, runs = read_log(folder / "train_log.jsonl")
    assert runs == 2
    assert [(r["kind"], r["step"]) for r in records if r["kind"] != "call"] == [
        ("train", 10), ("train", 20), ("eval", 20), ("continue", 20), ("eval", 20), ("train", 30), ("train", 40),
        ("eval", 40)]
    head = read_head_log(folder, "folder")
    assert (head.name, head.runs, head.steps, head.minutes, head.device) == ("fake-target head", 2, 40, 3.5, "cuda:0")
    assert read_head_log(tmp_path / "nothing", "folder") is None


def test_the_shipped_log_reads_as_one_history():
    head = head_log_for(SHIPPED_HEAD, Path("/nonexistent"))
    assert head is not None and head.source == "shipped" and head.runs == 5
    steps = [r["step"] for r in head.records if r["kind"] == "train"]
    assert steps == sorted(steps) and len(steps) > 100 and head.steps == head.records[-1]["step"] > 2000
    assert head_log_for("another head", Path("/nonexistent")) is None and head_log_for(None, Path("/x")) is None


def test_the_dialog_opens_on_the_log_of_the_head_in_use_and_a_start_clears_it(window, qtbot):
    w = window(FakeTrainer(steps=30), replace(FAKE_INFO, draft_name=None, head_name=SHIPPED_HEAD))
    dialog = w.open_train_dialog()
    dialog.refresh()
    series = dialog.series()
    shipped = head_log_for(SHIPPED_HEAD, Path("/nonexistent"))
    assert len(series["loss"][0]) == sum(r["kind"] == "train" for r in shipped.records)
    assert len(series["held_out"][0]) == sum(r["kind"] == "eval" for r in shipped.records)
    assert series["held_out"][0][-1] == shipped.steps and series["held_out"][1][-1] > 70
    assert dialog.status.text().startswith(f"Training log of the head in use ({SHIPPED_HEAD}): 73.8 minutes on cuda:0 "
                                           "in five runs, 5,638 steps; held-out acceptance by draft position 81% 77%")
    # where each later run began; the fourth wrote the third's data rounds again, and its mark says so
    assert [line.value() for _plot, line in dialog._marks] == [1415, 1415, 2096, 2096, 3680, 3680, 5084, 5084]
    assert [line.label.format for _plot, line in dialog._marks[::2]] == ["run 2", "run 3", "run 4", "run 5"]
    tips = [line.toolTip() for _plot, line in dialog._marks[::2]]
    assert ["data of an earlier run again" in t for t in tips] == [False, False, True, False]
    assert all("fresh data" in t for i, t in enumerate(tips) if i != 2)
    with qtbot.waitSignal(w.worker.training_finished, timeout=5000):
        dialog.start_button.click()
        assert dialog.series()["loss"][0].size == 0 and not dialog._marks  # the log is gone as the live run begins
    qtbot.waitUntil(lambda: not w.training.running, timeout=2000)
    dialog.refresh()
    series = dialog.series()
    assert len(series["loss"][0]) == 30 and series["loss"][0][-1] == 30 and len(series["held_out"][0]) == 3


def test_a_head_trained_in_the_dialog_folder_comes_first(window):
    info = replace(FAKE_INFO, draft_name=None, head_name=SHIPPED_HEAD)
    write_head(default_head_folder(info.target_name), [train(10), train(20), evaluate(20)])
    dialog = window(FakeTrainer(), info).open_train_dialog()
    dialog.refresh()
    assert len(dialog.series()["loss"][0]) == 2
    assert dialog.status.text() == ("Training log of your head in this folder (fake-target head): 2.0 minutes on cpu, "
                                    "20 steps; held-out acceptance by draft position 50% 40%.")


def test_a_run_given_an_earlier_runs_data_is_marked_as_both(window):
    """A run that wrote fresh rounds and trained on an earlier run's again (distill --data): its mark says both."""
    data = lambda n, seed=1: json.dumps({"kind": "data", "round": n, "seed": seed, "answers": 8,  # noqa: E731
                                         "answer_tokens": 100 * n, "greedy": n == 1})
    continued = json.dumps({"kind": "continue", "from": "fake-target head"})
    info = replace(FAKE_INFO, draft_name=None, head_name=SHIPPED_HEAD)
    write_head(default_head_folder(info.target_name), [
        data(1), data(2), train(10), evaluate(10), continued, data(1, seed=7), train(10), evaluate(10),
        continued, data(1), data(2), data(1, seed=9), train(10), evaluate(10),
        continued, data(1), train(10), evaluate(10)])
    dialog = window(FakeTrainer(), info).open_train_dialog()
    dialog.refresh()
    tips = [line.toolTip() for _plot, line in dialog._marks[::2]]
    assert len(tips) == 3
    assert "on fresh data:" in tips[0]
    assert "on fresh data and on the data of an earlier run again" in tips[1]
    assert "on the data of an earlier run again:" in tips[2] and "fresh" not in tips[2]


def test_without_a_log_the_dialog_is_as_before(window, tmp_path):
    info = replace(FAKE_INFO, draft_name=None, head_name="a head shipped nowhere")
    default_head_folder(info.target_name).mkdir(parents=True)  # a folder without a manifest and log
    dialog = window(FakeTrainer(), info).open_train_dialog()
    dialog.refresh()
    assert dialog.status.text() == "Not started." and all(x.size == 0 for x, _y in dialog.series().values())


# --------------------------------------------------------------------------- continuing a head

def pick(dialog, data: str) -> None:
    """Chooses the "Start from" entry holding `data` as a person would (activated, not only current)."""
    index = dialog.start_from.findData(data)
    assert index >= 0, [dialog.start_from.itemData(i) for i in range(dialog.start_from.count())]
    dialog.start_from.setCurrentIndex(index)
    dialog.start_from.activated.emit(index)


def test_a_run_can_continue_the_shipped_head(window, qtbot, tmp_path):
    from app.core.head_log import shipped_head_folders

    trainer = FakeTrainer(steps=10)
    w = window(trainer, replace(FAKE_INFO, draft_name=None, head_name=SHIPPED_HEAD))
    dialog = w.open_train_dialog()
    labels = [dialog.start_from.itemText(i) for i in range(dialog.start_from.count())]
    assert labels == ["A new head", f"The shipped head ({SHIPPED_HEAD})", "Another head folder…"]
    shipped = next(f for f in shipped_head_folders() if json.loads((f / "manifest.json").read_text())["name"]
                   == SHIPPED_HEAD)
    pick(dialog, str(shipped))
    dialog.folder.setText(str(tmp_path / "mine"))
    with qtbot.waitSignal(w.worker.training_finished, timeout=5000):
        dialog.start_button.click()
        assert not dialog.start_from.isEnabled()
    qtbot.waitUntil(lambda: not w.training.running, timeout=2000)
    assert trainer.requests[0].init == str(shipped) and trainer.requests[0].out == str(tmp_path / "mine")
    # the head just trained is offered to the next run, before "Another head folder…"
    assert dialog.start_from.findData(str(tmp_path / "mine")) == dialog.start_from.count() - 2
    pick(dialog, "")  # a new head again
    with qtbot.waitSignal(w.worker.training_finished, timeout=5000):
        dialog.start_button.click()
    qtbot.waitUntil(lambda: not w.training.running, timeout=2000)
    assert trainer.requests[1].init is None


def test_a_head_is_not_continued_into_its_own_folder(window, qtbot):
    info = replace(FAKE_INFO, draft_name=None, head_name=None)
    folder = default_head_folder(info.target_name)
    write_head(folder, [train(10), evaluate(10)])
    write_head(folder.with_name(folder.name + "-continued"), [train(10)])  # taken: the next free name is -2
    trainer = FakeTrainer(steps=5)
    w = window(trainer, info)
    dialog = w.open_train_dialog()
    assert dialog.start_from.itemText(1) == "Your head in this folder (fake-target head)"
    assert dialog.folder.text() == str(folder.with_name(folder.name + "-2"))  # a new head never replaces that one
    dialog.folder.setText(str(folder))
    pick(dialog, str(folder))
    assert dialog.folder.text() == str(folder.with_name(folder.name + "-continued-2"))
    dialog.folder.setText(str(folder))  # typed back: refused with one line, nothing starts
    dialog.start_button.click()
    assert dialog.status.text() == "Save the continued head in another folder than the one it starts from."
    assert not w.training.running and not trainer.requests and dialog.start_button.text() == "Start"


@pytest.mark.parametrize("typed", ["heads/a\x00b", "heads/a\tb", "heads/two\nlines"])
def test_a_folder_name_with_a_control_character_is_refused_in_one_line(window, qtbot, typed):
    """A NUL, tab or line break pasted into the field names no folder one means: refused before anything loads."""
    trainer = FakeTrainer(steps=3)
    w = window(trainer, replace(FAKE_INFO, draft_name=None, head_name=None))
    dialog = w.open_train_dialog()
    dialog.folder.setText(typed)
    dialog.start_button.click()
    assert dialog.status.text() == ("The folder name holds a control character (a NUL, tab or line break); "
                                    "type it again or choose it with Browse.")
    assert not w.training.running and not trainer.requests and dialog.start_button.text() == "Start"


def test_a_folder_under_home_reads_with_a_tilde_and_starts_where_it_says(window, qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # the default head folder lies under the cache dir, here under home
    trainer = FakeTrainer(steps=3)
    w = window(trainer, replace(FAKE_INFO, draft_name=None, head_name=None))
    dialog = w.open_train_dialog()
    folder = default_head_folder(FAKE_INFO.target_name)
    assert dialog.folder.text() == "~/" + str(folder.relative_to(tmp_path))
    dialog.folder.setText("~/heads/mine ")
    with qtbot.waitSignal(w.worker.training_finished, timeout=5000):
        dialog.start_button.click()
    assert trainer.requests[0].out == str(tmp_path / "heads" / "mine")


def test_another_head_folder_is_asked_for_and_a_cancelled_choice_changes_nothing(window, qtbot, tmp_path,
                                                                                 monkeypatch):
    from PySide6.QtWidgets import QFileDialog

    from widgets.train_dialog import OTHER

    dialog = window(FakeTrainer()).open_train_dialog()
    answers = iter(["", str(tmp_path / "elsewhere")])
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *a, **k: next(answers))
    pick(dialog, OTHER)  # cancelled: back on "A new head"
    assert dialog.start_from.currentData() == "" and dialog.start_from.count() == 2
    pick(dialog, OTHER)
    assert dialog.start_from.currentData() == str(tmp_path / "elsewhere")
    assert dialog.start_from.itemData(dialog.start_from.count() - 1) == OTHER


def test_the_app_trainer_hands_the_chosen_head_to_the_distiller(monkeypatch, tmp_path):
    import engine.heads.distill as distill
    from app.core.session import TrainRequest
    from app.ui.worker import default_head_trainer

    seen = {}

    class Stopped:
        head = None

        def run(self):
            return {"steps": 0}

    def prepare(target, out, **options):
        seen.update(options, out=out)
        return Stopped()

    monkeypatch.setattr(distill, "prepare", prepare)
    for init, expected in ((str(tmp_path / "head"), tmp_path / "head"), (None, None)):
        request = TrainRequest(1, None, "cpu", "float32", 2.0, str(tmp_path / "out"), init)
        assert default_head_trainer(request, None, lambda p: None, threading.Event()) == ({"steps": 0}, None)
        assert seen["init"] == expected and seen["out"] == tmp_path / "out" and seen["data"] == []
    # Earlier runs' answers ticked in the dialog: their work folders, as `distill --data` takes them.
    request = TrainRequest(1, None, "cpu", "float32", 2.0, str(tmp_path / "out"), None, (str(tmp_path / "w"),))
    default_head_trainer(request, None, lambda p: None, threading.Event())
    assert seen["data"] == [tmp_path / "w"]
