"""The Models dialog's "Check drafts", wired to the worker; the last check's prediction beside the measured figures."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

from PySide6.QtCore import QObject

from app.core.failures import generation_error_message
from engine.measure.check_types import CandidateCheck, CheckReport
from engine.settings import GenerationSettings, ModelSelection
from engine.types import GenerationRequest, Sampling, Summary

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckJob:
    """One check the worker runs on the resident engine (Worker._on_check_requested)."""

    target: str | None  # the loaded target's spec (None: the packaged one)
    drafts: tuple[str, ...]  # further drafts to load beside it (the dialog's choice when it is not the loaded one)
    sampling: Sampling  # the temperature / top-p / top-k acceptance is priced at (the settings panel's)
    device: str  # where further drafts load (torch)

    def run(self, engine, progress: Callable[[float, str], None], finished: Callable[[object], None],
            failed: Callable[[str], None], cancel: threading.Event) -> None:
        """On the worker thread: exactly one of finished(report) or failed(message)."""
        from engine.measure.check import check_engine  # torch: imported when a check runs, not with the window

        if engine is None:
            failed("No model is loaded yet; load the target first, then check drafts.")
            return
        try:
            report = check_engine(engine, self.target, self.drafts, sampling=self.sampling, head=True, ngram=True,
                                  progress=progress, cancel=cancel, load_torch=self._load_torch)
        except Exception as e:
            failed(generation_error_message(e))
            return
        finished(report)

    def _load_torch(self, spec: str):
        from engine.models.runtime import load_engine

        return load_engine(spec, None, runtime="torch", device=self.device, with_draft=False, head=None)


class CheckLink(QObject):
    """Connects each Models dialog to the worker's check signals and keeps the last report (for the stats line)."""

    def __init__(self, worker, *, loaded: Callable[[], ModelSelection | None],
                 current_settings: Callable[[], GenerationSettings],
                 apply_settings: Callable[[GenerationSettings], None], parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.worker = worker
        self._loaded = loaded
        self._settings = current_settings
        self._apply_settings = apply_settings
        self.report: CheckReport | None = None  # the last check's ranking (kept for the answers after it)
        worker.check_finished.connect(self._keep)

    def attach(self, dialog) -> None:
        """dialog: a widgets.model_dialog.ModelDialog; its signals live as long as it does."""
        view = dialog.check_view
        w = self.worker
        w.check_progress.connect(view.set_progress)
        w.check_failed.connect(view.set_failed)
        w.check_finished.connect(view.set_report)
        dialog.check_requested.connect(self._start)
        view.apply_requested.connect(lambda c: self._apply(dialog, c))

        def detach() -> None:
            for signal, slot in ((w.check_progress, view.set_progress), (w.check_failed, view.set_failed),
                                 (w.check_finished, view.set_report)):
                signal.disconnect(slot)
        dialog.finished.connect(detach)

    def _start(self, selection: ModelSelection) -> None:
        loaded = self._loaded()
        target = loaded.target.spec() if loaded is not None else selection.target.spec()
        drafts: tuple[str, ...] = ()
        spec = selection.draft.spec()
        if not selection.no_draft and spec and (loaded is None or spec != loaded.draft.spec()):
            drafts = (spec,)
        s = self._settings()
        job = CheckJob(target, drafts, Sampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p),
                       selection.device)
        self.worker.check_requested.emit(job)

    def _keep(self, report: CheckReport) -> None:
        self.report = report

    def _apply(self, dialog, candidate: CandidateCheck) -> None:
        """A further draft becomes the dialog's draft (loaded with Load); the rest set the proposer and K now."""
        if candidate.kind == "draft" and candidate.spec:
            dialog.use_draft(candidate.spec)
        proposer = {"draft": "draft", "head": "head", "ngram": "ngram"}[candidate.kind]
        self._apply_settings(replace(self._settings(), mode="speculative", proposer=proposer,
                                     k=candidate.best_k or self._settings().k))

    def annotate(self, line: str, summary: Summary, request: GenerationRequest) -> str:
        """The stats line with the check's prediction for this proposer beside what the answer measured."""
        c = self.prediction(request)
        if c is None or summary.mode == "standard" or c.speedup is None:
            return line
        return f"{line} · check predicted {c.speedup:.2f}× at K={c.best_k}, " \
               f"{(c.sampled_positions or (0.0,))[0]:.0%} accepted at position 1"

    def prediction(self, request: GenerationRequest) -> CandidateCheck | None:
        if self.report is None:
            return None
        kind = {"draft": "draft", "head": "head", "ngram": "ngram"}.get(request.proposer)
        return next((c for c in self.report.candidates if c.kind == kind and c.status == "ok"), None)
