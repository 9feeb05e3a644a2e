"""The draft check in the app: the worker's job loads further drafts on torch, the dialog can stop it, the kept
report is the loaded pair's and is shown for the proposer that drafted; the Models dialog greys what cannot run."""
from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
from PySide6.QtCore import QObject, Signal

from app.ui.check import STOPPED, CheckJob, CheckLink
from engine.measure.check_types import CandidateCheck, CheckReport
from engine.settings import GenerationSettings, ModelChoice, ModelSelection
from engine.types import Decision, GenerationRequest, ModelInfo
from tests.engine_fixtures import tiny_engine
from widgets.model_dialog import ModelDialog

INFO = ModelInfo(target_name="target", draft_name="Qwen2.5-Coder-0.5B", device="cpu", dtype="float32",
                 fast_path="eager", vocab_size=100, head_name="qwen")
FP8_CPU = "fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper); this is the CPU — use int8-wo"


class FakeWorker(QObject):
    """The EngineWorker's signals the check link listens to and sends."""

    check_requested = Signal(object)
    check_progress = Signal(float, str)
    check_finished = Signal(object)
    check_failed = Signal(str)
    load_finished = Signal(object)
    head_attached = Signal(object)
    engine_released = Signal(str)


def _row(name: str, kind: str, speedup: float, k: int, first: float, spec: str = "") -> CandidateCheck:
    return CandidateCheck(name, kind, "ok", best_k=k, speedup=speedup, speedups=(speedup,) * k,
                          greedy_positions=(first,), sampled_positions=(first,), spec=spec)


def _report(*rows: CandidateCheck, target: str = "target", temperature: float = 0.0) -> CheckReport:
    ranked = tuple(sorted(rows, key=lambda c: -(c.speedup or 0.0)))
    return CheckReport(target, "torch", "cpu", temperature, 1.0, 0, 14, 600, 35.0, ranked, "verdict", 40.0)


HEAD = _row("draft head qwen", "head", 1.9, 3, 0.7)
LOADED = _row("Qwen2.5-Coder-0.5B", "draft", 0.86, 1, 0.62)
FURTHER = _row("Qwen2.5-Coder-0.5B-q", "draft", 1.2, 2, 0.66, spec="/models/other")  # ranked above the loaded one
NGRAM = _row("n-gram lookup", "ngram", 1.1, 4, 0.3)


def _link(worker: FakeWorker, *, info: ModelInfo | None = INFO, loaded: ModelSelection | None = None,
          settings: GenerationSettings | None = None, applied: list | None = None) -> CheckLink:
    return CheckLink(worker, loaded=lambda: loaded, info=lambda: info,
                     current_settings=lambda: settings or GenerationSettings(),
                     apply_settings=(applied if applied is not None else []).append)


def _summary(mode: str, decision: Decision | None = None):
    return type("S", (), {"mode": mode, "decision": decision})()


def test_a_further_draft_loads_on_torch_through_the_apps_check_job(tiny_pair, tmp_path, monkeypatch):
    """The Models dialog's draft other than the loaded one loads beside the resident target on torch, the way
    `specdec-studio check` loads its further drafts (engine.assemble.build_engine)."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))  # costs kept for it stay in the test's folder
    target_dir, draft_dir = tiny_pair
    loaded = ModelSelection(target=ModelChoice("folder", str(target_dir)), draft=ModelChoice("folder", str(draft_dir)),
                            device="cpu", dtype="float32", runtime="torch")
    worker = FakeWorker()
    jobs: list[CheckJob] = []
    worker.check_requested.connect(jobs.append)
    link = _link(worker, info=None, loaded=loaded, settings=GenerationSettings(max_new_tokens=48))
    link._start(ModelSelection(target=loaded.target, draft=ModelChoice("folder", str(target_dir)), device="cpu"))
    job = jobs[0]
    assert job.answer_tokens == 48, "priced for the answers the settings panel asks for"
    assert job.drafts == (str(target_dir),) and job.further.runtime == "torch" and job.further.device == "cpu"
    assert job.further.head is None and not job.further.with_draft
    finished, failed = [], []
    threads = torch.get_num_threads()
    try:
        job.run(tiny_engine(target_dir, draft_dir), lambda *_: None, finished.append, failed.append, threading.Event())
    finally:
        torch.set_num_threads(threads)  # a CPU load sets the cores' threads; the other tests run on one
    assert not failed, failed
    report = finished[0]
    assert report.answer_tokens == 48
    further = next(c for c in report.candidates if c.spec == str(target_dir))
    assert further.status == "ok", further.reason
    assert further.kind == "draft" and further.top1 is not None and further.top1 > 0.9  # the target itself


def test_stop_in_the_dialog_ends_the_check_and_closing_it_stops_it_too(qtbot, tiny_pair):
    worker = FakeWorker()
    jobs: list[CheckJob] = []
    worker.check_requested.connect(jobs.append)
    link = _link(worker)
    dialog = ModelDialog(ModelSelection())
    qtbot.addWidget(dialog)
    link.attach(dialog)
    assert dialog.check_button.text() == "Check drafts"
    dialog.check_button.click()
    assert len(jobs) == 1 and dialog.check_button.text() == "Stop check" and dialog.check_button.isEnabled()
    dialog.check_button.click()
    assert jobs[0].stop.is_set() and not dialog.check_button.isEnabled() and "Stopping" in dialog.check_view.status.text()
    failed: list[str] = []
    jobs[0].run(tiny_engine(*tiny_pair), lambda *_: None, lambda _r: None, failed.append, threading.Event())
    assert failed == [STOPPED]  # before its first probe: it reports, and Stop ends it there
    worker.check_failed.emit(failed[0])
    assert dialog.check_button.text() == "Check drafts" and dialog.check_button.isEnabled()
    assert dialog.check_view.status.text() == STOPPED
    dialog.check_button.click()
    assert not jobs[1].stop.is_set()
    dialog.reject()  # nobody would see its result: it must not hold the worker for minutes
    assert jobs[1].stop.is_set()


def test_a_stopped_checks_end_does_not_end_the_next_one_in_another_dialog(qtbot):
    worker = FakeWorker()
    jobs: list[CheckJob] = []
    worker.check_requested.connect(jobs.append)
    link = _link(worker)
    first, second = ModelDialog(ModelSelection()), ModelDialog(ModelSelection())
    for dialog in (first, second):
        qtbot.addWidget(dialog)
    link.attach(first)
    first.check_button.click()
    first.reject()  # stops the first check; the worker still has to finish its probe in progress
    link.attach(second)
    second.check_button.click()
    assert jobs[0].stop.is_set() and not jobs[1].stop.is_set()
    worker.check_failed.emit(STOPPED)  # the first check's end
    assert second.check_button.text() == "Stop check" and second.check_view.status.text() != STOPPED
    second.check_button.click()
    assert jobs[1].stop.is_set()  # Stop still reaches the second check
    report = _report(HEAD, LOADED)
    worker.check_finished.emit(report)
    assert second.check_view.report is report and second.check_button.text() == "Check drafts"
    assert link.report is report


def test_the_report_is_forgotten_once_another_pair_or_head_is_in_use():
    worker = FakeWorker()
    link = _link(worker)
    for gone in (lambda: worker.load_finished.emit(INFO), lambda: worker.head_attached.emit(INFO),
                 lambda: worker.engine_released.emit("remote")):
        worker.check_finished.emit(_report(HEAD, LOADED))
        assert link.report is not None
        gone()
        assert link.report is None
    line = link.annotate("speculative · K=3", _summary("speculative"), GenerationRequest(proposer="head"))
    assert line == "speculative · K=3"


def test_the_prediction_is_the_loaded_drafts_row_not_the_first_draft_row():
    worker = FakeWorker()
    link = _link(worker)
    other = _link(worker, info=replace(INFO, draft_name="another"))  # the same target, another draft loaded
    worker.check_finished.emit(_report(HEAD, FURTHER, LOADED, NGRAM))
    request = GenerationRequest(proposer="draft", mode="speculative")
    assert link.prediction(request) is LOADED
    line = link.annotate("speculative · K=1", _summary("speculative"), request)
    assert line.endswith("check predicted 0.86× at K=1, 62% accepted at position 1")
    assert link.prediction(GenerationRequest(proposer="head")) is HEAD
    assert link.prediction(GenerationRequest(proposer="ngram")) is NGRAM
    # A report made on another pair, or a draft of another name, predicts nothing for this one.
    assert other.prediction(request) is None and other.prediction(GenerationRequest(proposer="head")) is HEAD
    worker.check_finished.emit(_report(HEAD, LOADED, target="another target"))
    assert link.prediction(request) is None


def test_auto_mode_shows_the_proposer_it_settled_on_or_says_no_single_prediction_applies():
    worker = FakeWorker()
    link = _link(worker)
    worker.check_finished.emit(_report(HEAD, FURTHER, LOADED, NGRAM))
    auto = GenerationRequest(mode="auto", proposer="draft+ngram", k=0)
    head = _summary("auto", Decision(k=3, source="head", reason="best"))
    assert link.prediction(auto, head) is HEAD
    assert link.annotate("auto", head, auto) == \
        "auto · check predicted 1.90× for draft head qwen at K=3, 70% accepted at position 1"
    draft = _summary("auto", Decision(k=1, source="draft", reason="best"))
    assert link.prediction(auto, draft) is LOADED
    standard = _summary("auto", Decision(k=0, source=None, reason="no_gain"))
    probe = _summary("auto", Decision(k=1, source="draft", reason="probe"))
    for ended in (standard, probe):
        assert link.prediction(auto, ended) is None
        assert link.annotate("auto", ended, auto) == ("auto · auto ended on standard steps; check predicted "
                                                      "Qwen2.5-Coder-0.5B 0.86×, n-gram lookup 1.10×, "
                                                      "draft head qwen 1.90×")
    worker.check_finished.emit(_report(LOADED, _row("n-gram lookup", "ngram", 0.95, 2, 0.2)))
    assert link.annotate("auto", standard, auto) == \
        "auto · check predicted no proposer pays (Qwen2.5-Coder-0.5B 0.86×, n-gram lookup 0.95×)"
    combined = GenerationRequest(mode="speculative", proposer="draft+ngram", k=4)
    assert link.prediction(combined) is None
    assert link.annotate("speculative", _summary("speculative"), combined) == (
        "speculative · check has no single prediction for draft + n-gram combined "
        "(Qwen2.5-Coder-0.5B 0.86×, n-gram lookup 0.95×)")


def test_a_prediction_priced_at_another_temperature_says_so():
    worker = FakeWorker()
    link = _link(worker)
    worker.check_finished.emit(_report(HEAD, temperature=0.7))
    request = GenerationRequest(proposer="head")
    assert link.annotate("x", _summary("speculative"), request).endswith(", priced at T=0.7")


def test_apply_a_further_draft_puts_it_in_the_dialog_and_sets_the_proposer():
    applied: list[GenerationSettings] = []
    link = _link(FakeWorker(), applied=applied)
    dialog = type("D", (), {"used": [], "use_draft": lambda self, spec: self.used.append(spec)})()
    link._apply(dialog, FURTHER)
    assert dialog.used == ["/models/other"] and applied[-1].proposer == "draft" and applied[-1].k == 2


# --------------------------------------------------------------------------- fp8 where the device cannot run it

def test_the_dialog_greys_fp8_where_the_apps_refusals_say_it_cannot_run(qtbot):
    dialog = ModelDialog(ModelSelection(device="auto"), refusals={"fp8": {"auto": FP8_CPU, "cpu": FP8_CPU}})
    qtbot.addWidget(dialog)
    for combo in (dialog.target.precision, dialog.draft.precision):
        fp8 = combo.model().item(combo.findText("fp8"))
        assert not fp8.isEnabled() and fp8.toolTip() == FP8_CPU
        assert combo.model().item(combo.findText("int8-wo")).isEnabled()
    dialog.device.setCurrentText("cuda")
    fp8 = dialog.target.precision.model().item(dialog.target.precision.findText("fp8"))
    assert fp8.isEnabled() and fp8.toolTip() == ""
    dialog.set_refusals({"fp8": {"cuda": "fp8 needs … (Ada, Hopper); this is 8.6 — use int8-wo"}})
    assert not fp8.isEnabled() and "8.6" in fp8.toolTip()


def _gpus(monkeypatch, capabilities: list[tuple[int, int]]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(capabilities))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capabilities))
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: capabilities[torch.device(device).index or 0])


@pytest.mark.parametrize(("capabilities", "refused"), (
    ([], {"auto": "this is the CPU", "cpu": "this is the CPU", "cuda": "sees no CUDA GPU"}),
    ([(8, 6), (9, 0)], {"auto": "this is 8.6", "cpu": "this is the CPU", "cuda": "this is 8.6", "cuda:0": "this is 8.6"}),
    ([(9, 0)], {"cpu": "this is the CPU"}),
))
def test_the_refusals_name_why_each_device_cannot_run_fp8(monkeypatch, capabilities, refused):
    from engine.models.fastquant import precision_refusals
    from engine.settings import PRECISIONS

    _gpus(monkeypatch, capabilities)
    found = precision_refusals(PRECISIONS)
    assert set(found) == {"fp8"} and set(found["fp8"]) == set(refused)
    for device, why in refused.items():
        line = found["fp8"][device]
        assert line.startswith("fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper)") and why in line


def test_the_window_gives_the_models_dialog_what_this_machine_cannot_run(qtbot, monkeypatch, tmp_path,
                                                                         no_dangling_threads):
    from app.ui import loading
    from app.ui.settings import AppSettings
    from app.ui.window import MainWindow
    from tests.test_app import FakeEngine

    _gpus(monkeypatch, [])
    shown: list[ModelDialog] = []

    def choose(selection, notices, attach, use_remote=None):
        shown.append(ModelDialog(selection))
        attach(shown[-1])
        return None

    monkeypatch.setattr(loading, "choose_models", choose)
    window = MainWindow(engine_factory=lambda _request, _progress: FakeEngine(),
                        settings=AppSettings(tmp_path / "settings.ini"))
    qtbot.addWidget(window)
    try:
        window.open_model_dialog()
        dialog = shown[0]
        qtbot.addWidget(dialog)
        assert dialog.refusal("fp8", "auto") == FP8_CPU and dialog.refusal("int8-wo", "auto") is None
    finally:
        window.close()
