"""The Models dialog's "Check drafts", wired to the worker; the last check's prediction beside the measured figures."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from PySide6.QtCore import QObject

from app.core.failures import generation_error_message
from app.core.session import PROPOSER_LABELS, load_request_for
from engine.errors import GenerationError
from engine.loadspec import LoadSpec
from engine.measure.check_types import STOPPED, CandidateCheck, CheckReport
from engine.settings import GenerationSettings, ModelSelection
from engine.types import GenerationRequest, ModelInfo, Sampling, Summary

if TYPE_CHECKING:  # torch: imported when a check runs, not with the window
    from engine.decoding import Engine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckJob:
    """One check the worker runs on the resident engine (Worker._on_check_requested)."""

    target: str | None  # the loaded target's spec (None: the packaged one)
    drafts: tuple[str, ...]  # further drafts to load beside it (the dialog's choice when it is not the loaded one)
    sampling: Sampling  # the temperature / top-p / top-k acceptance is priced at (the settings panel's)
    further: LoadSpec  # how a further draft loads on torch (its spec goes in as `target`): the loaded pair's options
    answer_tokens: int | None = None  # the answers the speedups are priced for (the settings panel's max new tokens)
    stop: threading.Event = field(default_factory=threading.Event)  # set by the dialog's Stop (or its closing)

    def run(self, engine, progress: Callable[[float, str], None], finished: Callable[[object], None],
            failed: Callable[[str], None], cancel: threading.Event) -> None:
        """On the worker thread: exactly one of finished(report) or failed(message)."""
        from engine.measure.check import check_engine  # torch: imported when a check runs, not with the window

        if engine is None:
            failed("No model is loaded yet; load the target first, then check drafts.")
            return

        def report(fraction: float, message: str) -> None:
            # The check reports before each further draft loads and before each probe: the points where
            # Stop can end it without leaving a half-loaded draft or a probe's generation open.
            if self.stop.is_set():
                raise GenerationError(STOPPED)
            progress(fraction, message)

        try:
            result = check_engine(engine, self.target, self.drafts, sampling=self.sampling, head=True, ngram=True,
                                  progress=report, cancel=cancel, load_torch=self._load_torch,
                                  answer_tokens=self.answer_tokens)
        except Exception as e:
            failed(generation_error_message(e))
            return
        finished(result)

    def _load_torch(self, spec: str) -> Engine:
        """A further draft as the target of an engine of its own: the call `specdec-studio check` makes for
        its further drafts (engine.assemble.build_engine, through app.cli.common.load_engine)."""
        from engine.assemble import build_engine

        return build_engine(replace(self.further, target=spec))


def further_drafts_load(loaded: ModelSelection, chosen: ModelSelection) -> LoadSpec:
    """Where and how a further draft loads: beside the loaded pair (its device, dtype, threads, context, memory), in
    the draft precision the dialog shows (what Load would give it), alone on torch, without a head. Costs kept for
    it as a target are used, as every load of the app does: its target costs are never read by the check."""
    return replace(load_request_for(loaded), target=None, draft=None, with_draft=False, runtime="torch", head=None,
                   needs_head=False, target_precision=chosen.draft_precision)


class CheckLink(QObject):
    """Connects each Models dialog to the worker's check signals and keeps the last report (for the stats line)
    while the pair it was made on stays loaded."""

    def __init__(self, worker, *, loaded: Callable[[], ModelSelection | None], info: Callable[[], ModelInfo | None],
                 current_settings: Callable[[], GenerationSettings],
                 apply_settings: Callable[[GenerationSettings], None], parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.worker = worker
        self._loaded = loaded
        self._info = info
        self._settings = current_settings
        self._apply_settings = apply_settings
        self.report: CheckReport | None = None  # the last check's ranking (kept for the answers after it)
        # Checks sent to the worker, in the order it ends them (one terminal signal each), with the dialog that
        # asked (None once it closed): a stopped check's end must not end the next one in another dialog.
        self._in_flight: list[tuple[CheckJob, object | None]] = []
        worker.check_finished.connect(self._keep)
        worker.check_failed.connect(self._ended)
        # Another pair, another head or none at all: the report's costs and rows describe what is gone.
        for gone in (worker.load_finished, worker.head_attached, worker.engine_released):
            gone.connect(self.forget)

    def attach(self, dialog) -> None:
        """dialog: a widgets.model_dialog.ModelDialog; its signals live as long as it does."""
        view = dialog.check_view
        # Only the check in flight reports progress: a stopped one raises before its next report.
        self.worker.check_progress.connect(view.set_progress)
        dialog.check_requested.connect(lambda selection: self._start(selection, dialog))
        dialog.check_stop_requested.connect(self.stop)
        view.apply_requested.connect(lambda c: self._apply(dialog, c))

        def detach() -> None:
            self.stop()  # nobody sees its result now, and a load or an answer would wait minutes behind it
            self.worker.check_progress.disconnect(view.set_progress)
            self._in_flight = [(job, None if asker is dialog else asker) for job, asker in self._in_flight]
        dialog.finished.connect(detach)

    def stop(self) -> None:
        """Ends the checks in flight after their probe in progress (each then fails with STOPPED)."""
        for job, _ in self._in_flight:
            job.stop.set()

    def forget(self, *_why: object) -> None:
        """Drops the last report: the pair it was made on is no longer the one answering."""
        self.report = None

    def _start(self, selection: ModelSelection, dialog: object | None = None) -> None:
        self.stop()  # a new check replaces one still in flight
        loaded = self._loaded()
        target = loaded.target.spec() if loaded is not None else selection.target.spec()
        drafts: tuple[str, ...] = ()
        spec = selection.draft.spec()
        if not selection.no_draft and spec and (loaded is None or loaded.no_draft or spec != loaded.draft.spec()):
            drafts = (spec,)
        s = self._settings()
        job = CheckJob(target, drafts, Sampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p),
                       further_drafts_load(loaded or selection, selection), answer_tokens=s.max_new_tokens)
        self._in_flight.append((job, dialog))
        self.worker.check_requested.emit(job)

    def _keep(self, report: CheckReport) -> None:
        self.report = report
        dialog = self._ended_check()
        if dialog is not None:
            dialog.check_view.set_report(report)
            dialog.check_ended()

    def _ended(self, message: str) -> None:
        dialog = self._ended_check()
        if dialog is not None:
            dialog.check_view.set_failed(message)
            dialog.check_ended()

    def _ended_check(self):
        """The dialog of the check that just ended (None: it closed, or the check came from elsewhere)."""
        return self._in_flight.pop(0)[1] if self._in_flight else None

    def _apply(self, dialog, candidate: CandidateCheck) -> None:
        """A further draft becomes the dialog's draft (loaded with Load); the rest set the proposer and K now."""
        if candidate.kind == "draft" and candidate.spec:
            dialog.use_draft(candidate.spec)
        proposer = {"draft": "draft", "head": "head", "ngram": "ngram"}[candidate.kind]
        self._apply_settings(replace(self._settings(), mode="speculative", proposer=proposer,
                                     k=candidate.best_k or self._settings().k))

    # --- the prediction beside an answer's measured figures ----------------------------------------

    def annotate(self, line: str, summary: Summary, request: GenerationRequest) -> str:
        """The stats line with the check's prediction for the proposer this answer drafted with."""
        if self.report is None or summary.mode == "standard":
            return line
        note = self._note(summary, request)
        return line if note is None else f"{line} · {note}"

    def prediction(self, request: GenerationRequest, summary: Summary | None = None) -> CandidateCheck | None:
        """The check's row for the proposer that drafted this answer: in speculative mode the request's own (for a
        draft, the loaded draft's row, never a further draft's); in auto mode the one the controller settled on
        (its last decision). None when no single row applies: draft+ngram combined, auto ending on standard steps."""
        kinds = request.proposer.kinds if request.mode != "auto" else _settled_on(summary)
        return self._row(kinds[0]) if len(kinds) == 1 else None

    def _note(self, summary: Summary, request: GenerationRequest) -> str | None:
        report = self.report
        assert report is not None, "annotate checks for a report"
        asked = "" if report.temperature == request.sampling.temperature else f", priced at T={report.temperature:g}"
        single = request.proposer.kinds if request.mode != "auto" else _settled_on(summary)
        if len(single) == 1:
            c = self._row(single[0])
            if c is None or c.speedup is None:
                return None
            who = f" for {c.name}" if request.mode == "auto" else ""
            spread = "" if c.speedup_range is None else f" ({c.speedup_range[0]:.2f}–{c.speedup_range[1]:.2f})"
            return (f"check predicted {c.speedup:.2f}×{spread}{who} at K={c.best_k}, "
                    f"{(c.sampled_positions or (0.0,))[0]:.0%} accepted at position 1{asked}")
        # No single proposer drafted this answer: the check's figure for each one it could have used.
        kinds = request.proposer.kinds
        if request.mode == "auto" and "head" not in kinds:
            kinds += ("head",)  # auto routes a loaded head too (engine/decoding/factory.py)
        rows = [r for r in (self._row(k) for k in kinds) if r is not None and r.speedup is not None]
        if not rows:
            return None
        figures = ", ".join(f"{r.name} {r.speedup:.2f}×" for r in rows)
        if request.mode != "auto":
            label = PROPOSER_LABELS.get(request.proposer, request.proposer)
            return f"check has no single prediction for {label} combined ({figures}){asked}"
        if not any((r.speedup or 0.0) > 1.0 for r in rows):
            return f"check predicted no proposer pays ({figures}){asked}"
        ended = "auto ended on standard steps; " if summary.decision is not None else ""
        return f"{ended}check predicted {figures}{asked}"

    def _row(self, kind: str) -> CandidateCheck | None:
        """The checked row of the loaded pair's own proposer of this kind (None: not checked, or another pair's)."""
        report, info = self.report, self._info()
        if report is None or (info is not None and info.target_name != report.target):
            return None
        for c in report.candidates:
            if c.kind != kind or c.status != "ok":
                continue
            # A further draft carries the spec it loaded from; the loaded draft has none, and the engine's names.
            if kind == "draft" and (c.spec or (info is not None and c.name != (info.draft_name or "draft"))):
                continue
            if kind == "head" and info is not None and c.name != f"draft head {info.head_name}":
                continue
            return c
        return None


def _settled_on(summary: Summary | None) -> tuple[str, ...]:
    """The proposer auto's last decision drafted with, or () when it ended on standard steps (probes included:
    a probe is auto checking again that drafting still does not pay)."""
    d = summary.decision if summary is not None else None
    return (d.source,) if d is not None and d.source is not None and d.k > 0 and d.reason != "probe" else ()
