"""Runs a race through the app's engine worker: standard and speculative, one after the other, per repeat.

Why sequential: two decoders on one device at once would share (and fight over) its compute and
memory bandwidth, so neither figure would be what that mode gets alone. The controller sends one
GenerationRequest, waits for its terminal signal, then sends the other, and times each run only by
its own Steps / Summary (the engine's clock). The order alternates per repeat (standard first on even
repeats) so that slow drift cancels in the median. It listens only to the request ids it issued, so
the chat and the race can share one worker; ids come from the window's allocator so they never clash.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from PySide6.QtCore import QObject, Signal, Slot
from PySide6.QtWidgets import QFileDialog

from app.core.race_logic import (
    BenchPrompt,
    RaceResult,
    load_bench_prompts,
    prompt_meta,
    race_result,
    run_order,
    summarize_race,
    write_race_csv,
)
from app.core.session import build_request, system_messages
from engine.limits import K_AUTO
from engine.settings import GenerationSettings
from engine.types import GenerationRequest, Message, ModelInfo, Mode, Step, Summary
from widgets.race.view import RaceView

log = logging.getLogger(__name__)

DEFAULT_SETTINGS = GenerationSettings(max_new_tokens=256)


@dataclass
class _Race:
    """The mutable state of the race in progress (UI thread only)."""

    race_id: int
    prompt: BenchPrompt
    repeats: int
    base: GenerationRequest  # the template with the race's messages; mode and request_id set per run
    plan: list[tuple[int, Mode]]  # (repeat, mode) in the order they run
    position: int = 0  # index into plan of the run in flight
    request_id: int | None = None  # the run in flight
    stopping: bool = False
    steps: dict[str, list[Step]] = field(default_factory=dict)  # this repeat's Steps per mode
    summaries: dict[str, Summary] = field(default_factory=dict)  # this repeat's Summaries per mode
    results: list[RaceResult] = field(default_factory=list)  # finished repeats


class RaceController(QObject):
    """Sequences the runs of a race, compares them (app.core.race_logic), feeds a RaceView, exports CSV.

    `worker` is the app's EngineWorker (or anything with its signals and `stop(request_id)`);
    `current_settings()` gives the settings panel's values (K, sampling, seed, max_new_tokens,
    proposer, system prompt), turned into requests by app.core.session.build_request like the chat's;
    `next_request_id()` hands out ids from the same counter as the chat's, because the worker
    cancels by id order.
    """

    running_changed = Signal(bool)
    result_ready = Signal(object)  # RaceResult of each finished repeat
    race_finished = Signal(object)  # RaceSummary, or None when no repeat finished (stopped / failed)

    def __init__(
        self,
        worker,
        view: RaceView,
        *,
        next_request_id: Callable[[], int],
        current_settings: Callable[[], GenerationSettings] = lambda: DEFAULT_SETTINGS,
        info: Callable[[], ModelInfo | None] = lambda: None,
        prompts: Sequence[BenchPrompt] | None = None,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self.worker = worker
        self.view = view
        self._next_request_id = next_request_id
        self._settings = current_settings
        self._info = info  # the pair in use, recorded with each repeat
        self.prompts = tuple(prompts) if prompts is not None else load_bench_prompts()
        self.results: list[RaceResult] = []  # every finished repeat of the session, for export
        self._race: _Race | None = None
        self._next_race_id = 1
        view.set_prompts(self.prompts)
        view.race_requested.connect(self.start)
        view.stop_requested.connect(self.stop)
        view.export_requested.connect(self.export_csv)
        worker.steps.connect(self._on_steps)
        worker.generation_finished.connect(self._on_generation_finished)
        worker.generation_failed.connect(self._on_generation_failed)

    # --- public API -----------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._race is not None

    def start(self, prompt: str, repeats: int) -> int | None:
        """Starts a race of `repeats` repeats; returns its id (None if one is running or the prompt is empty)."""
        prompt = prompt.strip()
        if self._race is not None or not prompt:
            return None
        repeats = max(1, int(repeats))
        settings = self._settings()
        if settings.mode == "auto":  # the speculative side then chooses K per step, as the chat would
            settings = replace(settings, mode="speculative", k=K_AUTO)
        base = build_request(settings, system_messages(settings) + (Message("user", prompt),))
        race = _Race(
            race_id=self._next_race_id,
            prompt=prompt_meta(prompt, self.prompts),
            repeats=repeats,
            base=base,
            plan=[(r, mode) for r in range(repeats) for mode in run_order(r)],
        )
        self._next_race_id += 1
        self._race = race
        self.view.set_running(True)
        self.running_changed.emit(True)
        self._send_next()
        return race.race_id

    def stop(self) -> None:
        """Cancels the run in flight; the race ends when its terminal signal arrives."""
        race = self._race
        if race is None or race.request_id is None:
            return
        race.stopping = True
        self.view.show_status("Stopping…")
        self.worker.stop(race.request_id)

    def export_csv(self, path: str | None = None) -> bool:
        """Two rows (one per mode) per finished repeat; asks for a file when `path` is None.

        An unwritable path shows an error in the view and keeps the results.
        """
        if not self.results:
            self.view.show_error("Nothing to export yet: run a race first.")
            return False
        if path is None:
            path, _ = QFileDialog.getSaveFileName(self.view, "Export race results", str(Path.home() / "specdec-race.csv"),
                                                  "CSV files (*.csv);;All files (*)")
            if not path:
                return False
        try:
            rows = write_race_csv(path, self.results)
        except OSError as e:
            log.warning("race export to %s failed: %s", path, e)
            self.view.show_error(f"Could not write {path}: {e.strerror or e}. The results are kept; "
                                 "choose another location.")
            return False
        self.view.show_status(f"Exported {rows} rows to {path}")
        return True

    # --- sequencing -----------------------------------------------------------------------------

    def _send_next(self) -> None:
        race = self._race
        assert race is not None, "no race in progress"
        if race.position >= len(race.plan):
            self._end("")
            return
        repeat, mode = race.plan[race.position]
        if mode == run_order(repeat)[0]:
            race.steps, race.summaries = {}, {}
            self.view.reset_panes()
        rid = self._next_request_id()
        race.request_id = rid
        race.steps[mode] = []
        request = replace(race.base, mode=mode, request_id=rid)
        self.view.start_pane(mode)
        self.view.set_progress(repeat, race.repeats, mode)
        log.debug("race %d repeat %d: %s as request %d", race.race_id, repeat, mode, rid)
        self.worker.generate_requested.emit(request)

    def _current_mode(self) -> Mode:
        race = self._race
        assert race is not None
        return race.plan[race.position][1]

    def _ours(self, request_id: int) -> bool:
        return self._race is not None and self._race.request_id == request_id

    @Slot(int, object)
    def _on_steps(self, request_id: int, steps: tuple[Step, ...]) -> None:
        if not self._ours(request_id):
            return
        mode = self._current_mode()
        self._race.steps[mode].extend(steps)  # type: ignore[union-attr]
        self.view.append_steps(mode, steps)

    @Slot(int, object)
    def _on_generation_finished(self, request_id: int, summary: Summary) -> None:
        if not self._ours(request_id):
            return
        race = self._race
        assert race is not None
        repeat, mode = race.plan[race.position]
        race.request_id = None
        race.summaries[mode] = summary
        self.view.finish(mode, summary)
        if race.stopping or summary.stop_reason == "cancelled":
            self._end("Stopped." + (" Finished repeats are kept." if race.results else ""))
            return
        if len(race.summaries) == 2:
            p = race.base.sampling
            result = race_result(
                race_id=race.race_id, repeat=repeat, prompt=race.prompt, k=race.base.k,
                temperature=p.temperature, seed=p.seed,
                standard=(race.steps["standard"], race.summaries["standard"]),
                speculative=(race.steps["speculative"], race.summaries["speculative"]),
                info=self._info(), proposer=race.base.proposer,
            )
            race.results.append(result)
            self.results.append(result)
            self.view.show_result(result)
            self.result_ready.emit(result)
        race.position += 1
        self._send_next()

    @Slot(int, str)
    def _on_generation_failed(self, request_id: int, message: str) -> None:
        if not self._ours(request_id):
            return
        mode = self._current_mode()
        self._race.request_id = None  # type: ignore[union-attr]
        self.view.show_error(f"The {mode} run failed: {message}")
        self._end("Race ended early.")

    def _end(self, note: str) -> None:
        race, self._race = self._race, None
        assert race is not None
        summary = summarize_race(race.results) if race.results else None
        if summary is not None:
            self.view.show_race_summary(summary)
        self.view.race_ended(note or f"Race finished: {len(race.results)} repeat(s) of {race.prompt.id}.")
        self.running_changed.emit(False)
        self.race_finished.emit(summary)
