"""Runs the Tune tab's sweep through the app's engine worker, fills the view live, and words the diagnoses.

The sweep itself is engine.measure.sweep (the same code as `specdec-studio sweep`), run on the
worker thread where the models live; this controller turns the view's plan into configurations
and requests (app.core.session.build_request, like the chat's), recomputes the rows after every run,
estimates the time left, and applies a chosen row to the chat settings. Diagnoses come from
engine.measure.diagnostics over everything this session measured: sweeps, races, chat answers,
and the memory in use.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from PySide6.QtCore import QObject, Signal, Slot

from app.core.export import SweepRun, now_iso
from app.core.session import build_request, system_messages
from engine.limits import K_AUTO
from engine.measure import diagnostics as dx
from engine.measure import sweep as sw
from engine.measure.experiment import BenchPrompt, RunRecord, packaged_prompts
from engine.measure.explain import describe_diagnosis
from engine.settings import GenerationSettings
from engine.types import Diagnosis, GenerationRequest, Message, ModelInfo, SweepRow
from widgets.tune.view import DiagnosisItem, TunePlan, TuneView

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SweepJob:
    """What the worker runs: engine.measure.sweep.run_sweep's arguments."""

    prompts: tuple[BenchPrompt, ...]  # in order
    configs: tuple[sw.SweepConfig, ...]  # standard at each temperature first
    make_request: sw.RequestFactory  # (prompt text, configuration, max_new_tokens) -> request
    max_new_tokens: int  # per generation
    repeat: int  # timed runs per configuration and prompt


def settings_for(row: SweepRow, base: GenerationSettings) -> GenerationSettings:
    """The chat settings that reproduce a sweep row (the rest of `base` kept)."""
    if row.mode == "standard":
        return replace(base, mode="standard", temperature=row.temperature)
    return replace(base, mode=row.mode, proposer=row.proposer or base.proposer, k=row.k,
                   temperature=row.temperature)


def best_note(rows: Sequence[SweepRow]) -> str:
    """The sweep's verdict in plain words: a configuration wins only beyond the measured spread."""
    top = sw.best(rows)
    if top is None:
        return ""
    if top.mode == "standard":
        drafting = [r for r in rows if r.mode != "standard" and r.runs]
        if not drafting:
            return "Standard decoding is fastest here."
        closest = max(drafting, key=lambda r: r.speedup)
        return (f"Standard decoding is fastest here: the best other configuration ({closest.label}, "
                f"{closest.speedup:.2f}×, {closest.acceptance:.0%} of drafted tokens accepted) is within "
                f"the measured spread (±{max(closest.spread, 0.03):.0%}).")
    return (f"Best: {top.label} at T={top.temperature:g}, {top.speedup:.2f}× standard (beyond the measured "
            f"spread of ±{top.spread:.0%}; {top.acceptance:.0%} of drafted tokens accepted).")


class TuneController(QObject):
    """Sequences nothing itself: the worker runs the whole sweep; this one listens and shows."""

    running_changed = Signal(bool)
    sweep_done = Signal(object)  # list[SweepRow] when a sweep ends (stopped ones included)
    settings_applied = Signal(object)  # GenerationSettings put into the chat

    def __init__(self, worker, view: TuneView, *, current_settings: Callable[[], GenerationSettings],
                 apply_settings: Callable[[GenerationSettings], None], info: Callable[[], ModelInfo | None],
                 prompts: Sequence[BenchPrompt] | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.worker = worker
        self.view = view
        self._settings = current_settings
        self._apply = apply_settings
        self._info = info
        self.prompts = tuple(prompts) if prompts is not None else packaged_prompts()
        self.rows: list[SweepRow] = []  # the latest sweep's rows
        self.records: list[RunRecord] = []  # the latest sweep's runs
        self.session_runs: list[SweepRun] = []  # every sweep's runs this session, for the session CSV
        self.diagnoses: list[Diagnosis] = []  # shown now
        self._configs: tuple[sw.SweepConfig, ...] = ()
        self._started = 0.0
        self._running = False
        self._evidence = dx.Evidence()
        view.start_requested.connect(self.start)
        view.stop_requested.connect(self.stop)
        view.apply_requested.connect(self.apply)
        view.action_requested.connect(self._on_action)
        worker.sweep_progress.connect(self._on_progress)
        worker.sweep_finished.connect(self._on_finished)
        worker.sweep_failed.connect(self._on_failed)

    @property
    def running(self) -> bool:
        return self._running

    # --- a sweep --------------------------------------------------------------------------------

    def start(self, plan: TunePlan) -> bool:
        if self._running:
            return False
        info = self._info()
        loaded = {"ngram": True, "draft": bool(info and info.draft_name), "draft+ngram": bool(info and info.draft_name),
                  "head": bool(info and info.head_name)}
        proposers = [p for p in plan.proposers if loaded.get(p, False)]
        if not proposers:
            self.view.show_status("None of the chosen proposers is loaded (a draft model, a draft head).")
            return False
        self._configs = tuple(sw.plan(proposers, plan.ks, plan.temperatures, auto=plan.auto))
        settings = self._settings()
        system = system_messages(settings)

        def make_request(prompt: str, config: sw.SweepConfig, max_new: int) -> GenerationRequest:
            chosen = replace(settings, mode=config.mode, proposer=config.proposer or settings.proposer,
                             k=config.k, temperature=config.temperature, max_new_tokens=max_new)
            return build_request(chosen, system + (Message("user", prompt),))

        job = SweepJob(self.prompts[: plan.prompts], self._configs, make_request, plan.max_new_tokens, plan.repeat)
        self.records, self.rows = [], []
        self.view.clear()
        self.view.set_progress(0, len(job.prompts) * len(self._configs) * plan.repeat, None)
        self.view.show_status(f"Measuring {len(self._configs)} configurations on {len(job.prompts)} prompts "
                              f"({plan.repeat} repeat(s)); each prompt is warmed up first.")
        self._started = time.perf_counter()
        self._set_running(True)
        self.worker.sweep_requested.emit(job)
        return True

    def stop(self) -> None:
        if self._running:
            self.worker.stop_sweep()

    def apply(self, row: SweepRow) -> None:
        chosen = settings_for(row, self._settings())
        self._apply(chosen)
        self.view.show_status(f"Chat now uses {row.label} at T={row.temperature:g}.")
        self.settings_applied.emit(chosen)

    @Slot(int, int, object)
    def _on_progress(self, done: int, total: int, record: RunRecord) -> None:
        if not self._running:
            return
        self.records.append(record)
        elapsed = time.perf_counter() - self._started
        self.view.set_progress(done, total, elapsed / done * (total - done) if done else None)
        self._show(self.records)

    def _keep(self, records: Sequence[RunRecord]) -> None:
        """The runs of a sweep that ended (finished, stopped or failed), with their configuration and prompt."""
        configs = {c.label: c for c in self._configs}
        questions = {p.id: p.prompt for p in self.prompts}
        info, when = self._info(), now_iso()
        for r in records:
            c = configs.get(r.mode)
            if c is not None:
                self.session_runs.append(SweepRun(r, c.mode, c.proposer, c.k, questions.get(r.prompt_id, ""), info,
                                                  when))

    @Slot(object)
    def _on_finished(self, records: list[RunRecord]) -> None:
        if not self._running:
            return
        self._keep(records)
        self._show(records)
        stopped = self.worker.sweep_stop.is_set()  # cleared by the worker when the next sweep starts
        note = best_note(self.rows)
        self.view.show_status(("Stopped. " if stopped else "Sweep finished. ") + note)
        self._set_running(False)
        self.update_evidence(sweep=tuple(self.rows), categories=self._categories(records))
        self.sweep_done.emit(list(self.rows))

    @Slot(str)
    def _on_failed(self, message: str) -> None:
        if not self._running:
            return
        self._keep(self.records)
        self.view.show_status(f"The sweep failed: {message}")
        self._set_running(False)

    def _show(self, records: Sequence[RunRecord]) -> None:
        self.records = list(records)
        self.rows = sw.rows(records, self._configs, self._info())
        self.view.show_rows(self.rows, sw.best(self.rows))

    def _categories(self, records: Sequence[RunRecord]) -> tuple[tuple[str, float], ...]:
        """Per prompt category: the best fixed configuration's speedup there (does it lose anywhere?)."""
        top = sw.best(self.rows, fixed_only=True)
        if top is None or top.mode == "standard":
            return ()
        per_category = sw.category_speedups(records, self._configs).get(sw.label_of(top, self._configs), {})
        return tuple(per_category.items()) if len(per_category) > 1 else ()

    def _set_running(self, running: bool) -> None:
        self._running = running
        self.view.set_running(running)
        self.running_changed.emit(running)

    # --- diagnoses ------------------------------------------------------------------------------

    def update_evidence(self, **changes) -> None:
        """Merges new measurements (sweep=, answers=, categories=, memory_used=, ...) and re-diagnoses."""
        settings = self._settings()
        self._evidence = replace(self._evidence, info=self._info(), k=settings.k if settings.mode == "speculative"
                                 else K_AUTO, proposer=settings.proposer, temperature=settings.temperature, **changes)
        found = dx.diagnose(self._evidence)
        if found == self.diagnoses:
            return
        self.diagnoses = found
        items = []
        for d in found:
            finding, action = describe_diagnosis(d)
            button = (f"Apply K={d.k}" if d.action == "apply_k" else "Use auto mode" if d.action == "use_auto"
                      else f"Use T={d.temperature:g}" if d.action == "lower_temperature" else None)
            items.append(DiagnosisItem(finding, action, button))
        self.view.show_diagnoses(items)

    @Slot(int)
    def _on_action(self, index: int) -> None:
        if not 0 <= index < len(self.diagnoses):
            return
        d, settings = self.diagnoses[index], self._settings()
        if d.action == "apply_k":
            chosen = replace(settings, mode="speculative", k=d.k)
        elif d.action == "use_auto":
            chosen = replace(settings, mode="auto", k=K_AUTO)
        elif d.action == "lower_temperature":
            chosen = replace(settings, temperature=d.temperature)
        else:
            return
        self._apply(chosen)
        self.view.show_status("Applied to the chat settings.")
        self.settings_applied.emit(chosen)
        self.update_evidence()
