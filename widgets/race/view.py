"""The Race view: one prompt, standard and speculative decoding in two live panes, a shared chart, results.

Fair timing. Two decoders running at the same time on one device would slow each other down, so the
race is not run concurrently: the app runs the two modes ONE AFTER THE OTHER on the same device
(standard first, then speculative; the order alternates on every repeat so that slow drift such as
clocks and heat cancels), each streaming live into its own pane and each timed by its own Steps'
`elapsed_s` (the engine's clock). The speedup shown is speculative tok/s ÷ standard tok/s from the two
Summaries, which is exactly what each mode gets when run alone. "Replay" then plays both recorded
runs in sync on one shared timeline (real time, scaled so that it is watchable), so a person sees the
race as if side by side.

This module is pure Qt: it takes plain data (Steps, Summaries, and result objects that have the
attributes of app.core.race_logic's RaceResult / RaceSummary) and never imports torch or the app.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from PySide6.QtCore import QElapsedTimer, QSignalBlocker, Qt, QTimer, Signal
from PySide6.QtGui import (
    QStandardItem,
    QStandardItemModel,
)
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSizePolicy,
    QSpinBox,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

import widgets.charts  # noqa: F401  (sets pyqtgraph options once, before any plot exists)
from engine.types import Step, Summary
from widgets.flow_layout import FlowLayout
from widgets.race.chart import RACE_MODES, RaceChart
from widgets.race.pane import DIVERGENCE_COLOUR, RacePane, times_text
from widgets.race.table import CATEGORY_LABELS, PromptLike, RaceSummaryLike, RaceTable

REPEATS_RANGE = (1, 20)
REPLAY_SHORTEST_S, REPLAY_LONGEST_S = 4.0, 20.0

FAIRNESS_NOTE = (
    "Fair timing: the two modes run one after the other on the same device (the order alternates per "
    "repeat), each timed by its own engine clock, so neither slows the other. Replay plays both "
    "recordings on one timeline. Speedup = speculative tok/s ÷ standard tok/s."
)


# --------------------------------------------------------------------------- plain data it takes

class RaceResultLike(Protocol):
    """What show_result reads (app.core.race_logic.RaceResult has it)."""

    repeat: int
    standard: Summary
    speculative: Summary
    speedup: float
    identical: bool | None
    divergence_index: int | None
    reason: str | None


def replay_scale(longest_s: float, *, shortest: float = REPLAY_SHORTEST_S, longest: float = REPLAY_LONGEST_S) -> float:
    """Replay seconds per recorded second: a 50 ms CPU race is slowed to be watchable, a minute sped up."""
    if longest_s <= 0:
        return 1.0
    return min(max(longest_s, shortest), longest) / longest_s


def _row(*parts: QWidget) -> QWidget:
    """Widgets side by side that wrap together (a label stays with its field)."""
    row = QWidget()
    layout = QHBoxLayout(row)
    layout.setContentsMargins(0, 0, 0, 0)
    layout.setSpacing(6)
    for part in parts:
        layout.addWidget(part, 1 if isinstance(part, QComboBox) else 0)
    return row


# --------------------------------------------------------------------------- the view

class RaceView(QWidget):
    """Prompt picker and controls on top, the two panes, the result line, then chart and results table."""

    race_requested = Signal(str, int)  # prompt text, repeats
    stop_requested = Signal()
    export_requested = Signal()
    replay_finished = Signal()

    def __init__(self, prompts: Sequence[PromptLike] = (), parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("raceView")
        self._prompts: list[PromptLike] = []
        self._recorded: dict[str, list[Step]] = {m: [] for m in RACE_MODES}
        self._summaries: dict[str, Summary | None] = {m: None for m in RACE_MODES}
        self._result: RaceResultLike | None = None
        self._running = False
        self._race_enabled = True
        self._build()
        self.set_prompts(prompts)
        self._replay_timer = QTimer(self)
        self._replay_timer.setInterval(round(1000 / 30))
        self._replay_timer.timeout.connect(self._replay_tick)
        self._replay_clock = QElapsedTimer()
        self._replay_scale = 1.0
        self._replay_pos: dict[str, int] = {}
        self._replay_done: set[str] = set()  # modes whose recording the replay has shown in full
        self._set_buttons()

    # --- construction ---------------------------------------------------------------------------

    def _build(self) -> None:
        self.picker = QComboBox()
        self.picker.setObjectName("racePromptPicker")
        self.picker.setMinimumContentsLength(28)
        self.picker.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.picker.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.picker.currentIndexChanged.connect(self._on_picked)
        self.repeats_spin = QSpinBox()
        self.repeats_spin.setRange(*REPEATS_RANGE)
        self.repeats_spin.setValue(1)
        self.repeats_spin.setToolTip("Repeat the race to get the median and spread of the speedup")
        self.race_button = QPushButton("Race")
        self.race_button.setObjectName("primaryButton")
        self.race_button.clicked.connect(self._on_race_clicked)
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stop_requested)
        self.replay_button = QPushButton("Replay")
        self.replay_button.setToolTip("Play both recorded runs side by side on one timeline")
        self.replay_button.clicked.connect(self.replay)
        self.export_button = QPushButton("Export CSV…")
        self.export_button.clicked.connect(self.export_requested)

        # One row when the window is wide; the buttons wrap under the prompt picker when it is narrow.
        bar_widget = QWidget()
        bar = FlowLayout(bar_widget, spacing=6, line_spacing=6)
        picked = _row(QLabel("Prompt"), self.picker)
        picked.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        bar.addWidget(picked)
        bar.addWidget(_row(QLabel("Repeat"), self.repeats_spin, QLabel("times")))
        for b in (self.race_button, self.stop_button, self.replay_button, self.export_button):
            bar.addWidget(b)

        self.prompt_edit = QPlainTextEdit()
        self.prompt_edit.setObjectName("racePrompt")
        self.prompt_edit.setPlaceholderText("Pick a benchmark prompt above or type your own…")
        self.prompt_edit.setFixedHeight(self.prompt_edit.fontMetrics().lineSpacing() * 3 + 14)
        self.prompt_edit.textChanged.connect(self._on_prompt_edited)

        self.note = QLabel(FAIRNESS_NOTE)
        self.note.setObjectName("systemNote")
        self.note.setWordWrap(True)

        self.panes = {mode: RacePane(mode) for mode in RACE_MODES}
        pane_split = QSplitter(Qt.Orientation.Horizontal)
        pane_split.setChildrenCollapsible(False)
        for mode in RACE_MODES:
            pane_split.addWidget(self.panes[mode])

        self.result_label = QLabel("")
        self.result_label.setObjectName("raceResult")
        self.result_label.setTextFormat(Qt.TextFormat.RichText)
        self.result_label.setWordWrap(True)
        self.repeats_label = QLabel("")
        self.repeats_label.setObjectName("statsLine")
        self.status_label = QLabel("")
        self.status_label.setObjectName("statsLine")
        self.status_label.setWordWrap(True)
        self.error_label = QLabel("")
        self.error_label.setObjectName("bubbleError")
        self.error_label.setWordWrap(True)
        self.error_label.hide()

        self.chart = RaceChart()
        self.chart.setMinimumHeight(180)
        self.table = RaceTable()

        bottom = QSplitter(Qt.Orientation.Horizontal)
        bottom.setChildrenCollapsible(False)
        bottom.addWidget(self.chart)
        bottom.addWidget(self.table)
        bottom.setStretchFactor(0, 1)
        bottom.setStretchFactor(1, 1)
        bottom.setSizes([640, 860])

        results = QWidget()
        results_layout = QVBoxLayout(results)
        results_layout.setContentsMargins(0, 0, 0, 0)
        results_layout.setSpacing(4)
        results_layout.addWidget(self.result_label)
        results_layout.addWidget(self.repeats_label)
        results_layout.addWidget(bottom, 1)

        self.splitter = QSplitter(Qt.Orientation.Vertical)
        self.splitter.setChildrenCollapsible(False)
        self.splitter.addWidget(pane_split)
        self.splitter.addWidget(results)
        self.splitter.setStretchFactor(0, 3)
        self.splitter.setStretchFactor(1, 2)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 8, 8)
        layout.setSpacing(6)
        layout.addWidget(bar_widget)
        layout.addWidget(self.prompt_edit)
        layout.addWidget(self.note)
        layout.addWidget(self.splitter, 1)
        layout.addWidget(self.error_label)
        layout.addWidget(self.status_label)

    # --- prompts --------------------------------------------------------------------------------

    def set_prompts(self, prompts: Sequence[PromptLike]) -> None:
        """Fills the picker grouped by category (headers are not selectable); keeps the typed prompt."""
        self._prompts = list(prompts)
        model = QStandardItemModel(self.picker)
        custom = QStandardItem("Custom prompt (type below)")
        custom.setData(-1, Qt.ItemDataRole.UserRole)
        model.appendRow(custom)
        order = list(CATEGORY_LABELS) + sorted({p.category for p in self._prompts} - set(CATEGORY_LABELS))
        for category in order:
            members = [(i, p) for i, p in enumerate(self._prompts) if p.category == category]
            if not members:
                continue
            head = QStandardItem(CATEGORY_LABELS.get(category, category))
            head.setFlags(Qt.ItemFlag.NoItemFlags)  # a group header, not a choice
            font = head.font()
            font.setBold(True)
            head.setFont(font)
            model.appendRow(head)
            for i, p in members:
                line = " ".join(p.prompt.split())
                short = line if len(line) <= 70 else line[:69] + "…"
                item = QStandardItem(f"    {p.id} · {short}")
                item.setData(i, Qt.ItemDataRole.UserRole)
                item.setToolTip(p.prompt)
                model.appendRow(item)
        with QSignalBlocker(self.picker):
            self.picker.setModel(model)
            self.picker.setCurrentIndex(0)
        self._sync_picker()

    def select_prompt(self, prompt_id: str) -> bool:
        """Picks a bench prompt by id (fills the prompt box); False if there is none."""
        for row in range(self.picker.count()):
            i = self.picker.itemData(row, Qt.ItemDataRole.UserRole)
            if isinstance(i, int) and i >= 0 and self._prompts[i].id == prompt_id:
                self.picker.setCurrentIndex(row)
                return True
        return False

    def prompt_text(self) -> str:
        return self.prompt_edit.toPlainText()

    def set_prompt_text(self, text: str) -> None:
        self.prompt_edit.setPlainText(text)

    def repeats(self) -> int:
        return self.repeats_spin.value()

    def set_repeats(self, n: int) -> None:
        self.repeats_spin.setValue(n)

    # --- the race, fed by the controller -------------------------------------------------------

    def set_running(self, running: bool) -> None:
        """Race and Replay wait while a race runs; Stop only works then."""
        self._running = running
        if running:
            self._stop_replay()
            self.error_label.hide()
            self.result_label.setText("")
            self.repeats_label.setText("")
        self._set_buttons()

    def set_race_enabled(self, enabled: bool, reason: str = "") -> None:
        """The app turns Race off while models load or a chat answer is generating; `reason` is its tooltip."""
        self._race_enabled = enabled
        self.race_button.setToolTip("" if enabled else reason)
        self._set_buttons()

    def set_progress(self, repeat: int, repeats: int, mode: str) -> None:
        """Says which repeat and mode is running, under the panes."""
        self.status_label.setText(f"Repeat {repeat + 1}/{repeats} · {mode} decoding running…")

    def reset_panes(self) -> None:
        """A new repeat: both panes and curves empty, the previous result and its mark gone."""
        self._stop_replay()
        self._result = None
        for mode in RACE_MODES:
            self._recorded[mode] = []
            self._summaries[mode] = None
            self.panes[mode].reset("waiting")
        self.chart.clear_series()
        self._set_buttons()

    def start_pane(self, mode: str) -> None:
        """Clears a pane (and its curve) for a new run of `mode`."""
        self._stop_replay()
        self._recorded[mode] = []
        self._summaries[mode] = None
        if self._result is not None:
            self._result = None
            for pane in self.panes.values():
                pane.view.clear_highlight()
        self.panes[mode].reset("running…")
        self.chart.clear_series(mode)
        self._set_buttons()

    def append_steps(self, mode: str, steps: Sequence[Step]) -> None:
        """A batch of Steps of the running `mode` (the worker sends ~30 batches a second)."""
        self._recorded[mode].extend(steps)
        self.panes[mode].append(steps)
        self.chart.push_steps(mode, steps)

    def finish(self, mode: str, summary: Summary) -> None:
        """The run of `mode` ended: its own Summary's tok/s and seconds replace the live figures."""
        self._summaries[mode] = summary
        self.panes[mode].finish(summary)
        self._set_buttons()

    def show_result(self, result: RaceResultLike) -> None:
        """Both runs of a repeat are in: speedup, acceptance, tokens per target forward, identity."""
        self._result = result
        spec = result.speculative
        parts = [
            ("" if result.repeat == 0 else f"Repeat {result.repeat + 1}: ") + f"<b>Speedup {times_text(result.speedup)}</b>",
            f"acceptance {spec.acceptance_rate * 100:.0f}%",
            f"{spec.tokens_per_target_forward:.2f} tokens per target forward",
        ]
        if result.identical is None:
            parts.append("outputs not compared (sampling: they differ by design)")
        elif result.identical:
            parts.append('<span style="color:#1f9d55">outputs identical ✓</span>')
        else:
            parts.append(f'<span style="color:{DIVERGENCE_COLOUR}">outputs differ from token '
                         f"{result.divergence_index}</span> — {result.reason}")
        self.result_label.setText(" · ".join(parts))
        self._apply_divergence()

    def show_race_summary(self, summary: RaceSummaryLike) -> None:
        """A race ended: median and spread over its repeats, and one row in the per-category table."""
        s = summary.speedup
        if s.n > 1:
            self.repeats_label.setText(
                f"Over {s.n} repeats: median speedup {times_text(s.median)} · min–max {times_text(s.minimum)}–"
                f"{times_text(s.maximum)} · IQR {s.iqr:.2f}×" + (f" — {summary.verdict}" if summary.verdict else ""))
        else:
            self.repeats_label.setText(summary.verdict or "One repeat: repeat the race a few times for the median "
                                       "and spread.")
        self.table.add_summary(summary)

    def race_ended(self, note: str = "") -> None:
        """The controller is done (finished, stopped or failed)."""
        self.status_label.setText(note)
        self.set_running(False)

    def show_error(self, message: str) -> None:
        self.error_label.setText(message)
        self.error_label.show()

    def show_status(self, message: str) -> None:
        self.status_label.setText(message)

    def refresh_theme(self) -> None:
        """Token colours and the chart follow a theme change."""
        for pane in self.panes.values():
            pane.view.refresh_palette()
        self.chart.refresh_theme()

    def set_colouring(self, on: bool) -> None:
        """Follows the app's colouring toggle in both panes."""
        for pane in self.panes.values():
            pane.view.set_colouring(on)

    def set_show_rejected(self, show: bool) -> None:
        """Follows the app's ghosts toggle in both panes."""
        for pane in self.panes.values():
            pane.view.set_show_rejected(show)

    # --- replay ---------------------------------------------------------------------------------

    def can_replay(self) -> bool:
        return not self._running and all(self._recorded[m] for m in RACE_MODES)

    def replay(self) -> None:
        """Plays both recorded runs in sync on one shared timeline (scaled real time)."""
        if not self.can_replay():
            return
        longest = max(self._recorded[m][-1].elapsed_s for m in RACE_MODES)
        self._replay_scale = replay_scale(longest)
        for mode in RACE_MODES:
            self.panes[mode].reset("replay")
            self.chart.clear_series(mode)
        self._replay_pos = {m: 0 for m in RACE_MODES}
        self._replay_done = set()
        speed = 1 / self._replay_scale
        self.status_label.setText(f"Replay at {speed:.3g}× real time" + (" (slowed down to watch)" if speed < 1 else ""))
        self._replay_clock.start()
        self._replay_timer.start()
        self._set_buttons()

    def is_replaying(self) -> bool:
        return self._replay_timer.isActive()

    def replay_to(self, t: float) -> None:
        """Shows both runs as they were `t` recorded seconds in (the replay's tick; tests call it directly)."""
        for mode in RACE_MODES:
            steps, pos = self._recorded[mode], self._replay_pos.get(mode, 0)
            end = pos
            while end < len(steps) and steps[end].elapsed_s <= t:
                end += 1
            if end > pos:
                self.panes[mode].view.append_steps(steps[pos:end])
                self.chart.push_steps(mode, steps[pos:end])
            self._replay_pos[mode] = end
            if end < len(steps):
                tokens = steps[end - 1].total_tokens if end else 0
                self.panes[mode].show_progress(tokens, t)
            elif mode not in self._replay_done:
                self._replay_done.add(mode)
                summary = self._summaries[mode]
                if summary is not None:
                    self.panes[mode].finish(summary)
        if all(self._replay_pos[m] >= len(self._recorded[m]) for m in RACE_MODES):
            self._stop_replay()
            self._apply_divergence()
            self.status_label.setText("Replay finished.")
            self.replay_finished.emit()

    def _replay_tick(self) -> None:
        self.replay_to(self._replay_clock.elapsed() / 1000 / self._replay_scale)

    def _stop_replay(self) -> None:
        self._replay_timer.stop()
        self._set_buttons()

    # --- internals ------------------------------------------------------------------------------

    def _apply_divergence(self) -> None:
        r = self._result
        for pane in self.panes.values():
            if r is not None and r.divergence_index is not None:
                pane.view.highlight_token(r.divergence_index, r.reason or "")
            else:
                pane.view.clear_highlight()

    def table_rows(self) -> list[list[str]]:
        """The results table's text, row by row (for tests and copy)."""
        return self.table.rows()

    def _on_race_clicked(self) -> None:
        text = self.prompt_text().strip()
        if not text:
            self.show_error("Type a prompt or pick one from the list first.")
            return
        self.race_requested.emit(text, self.repeats())

    def _on_picked(self, row: int) -> None:
        i = self.picker.itemData(row, Qt.ItemDataRole.UserRole)
        if isinstance(i, int) and i >= 0:
            with QSignalBlocker(self.prompt_edit):
                self.prompt_edit.setPlainText(self._prompts[i].prompt)

    def _on_prompt_edited(self) -> None:
        self._sync_picker()

    def _sync_picker(self) -> None:
        # A typed or edited prompt is a custom one; a pasted bench prompt selects its entry.
        text = self.prompt_text().strip()
        target = 0
        for row in range(self.picker.count()):
            i = self.picker.itemData(row, Qt.ItemDataRole.UserRole)
            if isinstance(i, int) and i >= 0 and self._prompts[i].prompt.strip() == text:
                target = row
                break
        if self.picker.currentIndex() != target:
            with QSignalBlocker(self.picker):
                self.picker.setCurrentIndex(target)

    def _set_buttons(self) -> None:
        replaying = self.is_replaying()
        self.race_button.setEnabled(not self._running and self._race_enabled)
        self.stop_button.setEnabled(self._running)
        self.replay_button.setEnabled(not replaying and self.can_replay())
        self.repeats_spin.setEnabled(not self._running)
