"""The Tune tab: plan a sweep, watch it fill live plots and a table, apply the best configuration; diagnoses below.

Pure Qt over plain data: it emits a TunePlan when a person presses Start, and shows SweepRows,
progress and diagnoses (already worded by the app) that it is given.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QBrush, QFont
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine.limits import K_MAX, MAX_NEW_TOKENS
from engine.types import PROPOSERS, SweepRow
from widgets.flow_layout import FlowLayout
from widgets.palette import current_palette
from widgets.tune.plots import SweepPlots

COLUMNS = ("Configuration", "T", "tok/s", "Speedup", "Predicted", "Accepted", "Tokens/step", "Drafting", "Identical")


@dataclass(frozen=True)
class TunePlan:
    """What a person asked the sweep to measure."""

    ks: tuple[int, ...]  # fixed K values (1..K_MAX); 0 = K auto
    temperatures: tuple[float, ...]  # sampling temperatures (0 = greedy)
    proposers: tuple[str, ...]  # draft / ngram / draft+ngram
    auto: bool  # also measure auto mode per proposer
    prompts: int  # how many of the packaged bench prompts (in file order)
    max_new_tokens: int  # per generation
    repeat: int  # timed runs per configuration and prompt


@dataclass(frozen=True)
class DiagnosisItem:
    """One diagnosis as the view shows it: worded by the app."""

    finding: str  # what was measured, with the number
    action: str  # what to do
    button: str | None = None  # label of a one-click action ("Apply K=3"), None when there is none


def parse_numbers(text: str, kind: type) -> tuple | None:
    """"1,2, 3" → (1, 2, 3); "auto" → 0 for K; None when anything does not parse."""
    values = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        if kind is int and item.lower() == "auto":
            values.append(0)
            continue
        try:
            values.append(kind(item))
        except ValueError:
            return None
    return tuple(dict.fromkeys(values)) or None


def row_cells(row: SweepRow) -> list[str]:
    predicted = f"{row.predicted_speedup:.2f}×" if row.predicted_speedup is not None else "–"
    identical = f"{row.identical}/{row.compared}" if row.identical is not None else "–"
    speedup = "–" if math.isnan(row.speedup) else f"{row.speedup:.2f}×"
    return [row.label, f"{row.temperature:g}", f"{row.tokens_per_s:.1f}", speedup, predicted,
            f"{row.acceptance:.0%}", f"{row.tokens_per_target_forward:.2f}", f"{row.drafting_share:.0%}", identical]


class TuneView(QWidget):
    start_requested = Signal(object)  # TunePlan
    stop_requested = Signal()
    apply_requested = Signal(object)  # SweepRow to use in the chat
    action_requested = Signal(int)  # index of the diagnosis whose button was pressed

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._rows: list[SweepRow] = []
        self._best: SweepRow | None = None
        self._running = False
        self._build()

    def _build(self) -> None:
        outer = QVBoxLayout(self)
        outer.setContentsMargins(8, 8, 8, 8)
        plan = QGroupBox("Sweep", self)
        form = QFormLayout(plan)
        self.ks = QLineEdit("1,2,3,5,8", plan)
        self.ks.setToolTip(f"Draft lengths to measure, 1..{K_MAX}; 'auto' chooses K per step")
        self.temperatures = QLineEdit("0,0.7", plan)
        self.temperatures.setToolTip("Sampling temperatures; 0 is greedy (outputs are checked against standard)")
        # The check boxes and the numbers wrap onto more lines in a narrow window instead of being cut off.
        proposers = QWidget(plan)
        row = FlowLayout(proposers, spacing=10)
        self.proposer_boxes = {p: QCheckBox(p, proposers) for p in PROPOSERS}
        for p, box in self.proposer_boxes.items():
            box.setChecked(p == "draft")
            row.addWidget(box)
        self.auto = QCheckBox("auto mode", proposers)
        self.auto.setChecked(True)
        self.auto.setToolTip("Also measure auto mode (K and proposer chosen per step) for each proposer")
        row.addWidget(self.auto)
        self.prompts = QSpinBox(plan)
        self.prompts.setRange(1, 20)
        self.prompts.setValue(4)
        self.prompts.setToolTip("How many of the 20 bench prompts (in file order)")
        self.max_new_tokens = QSpinBox(plan)
        self.max_new_tokens.setRange(4, MAX_NEW_TOKENS)
        self.max_new_tokens.setValue(64)
        self.repeat = QSpinBox(plan)
        self.repeat.setRange(1, 20)
        form.addRow("K", self.ks)
        form.addRow("Temperatures", self.temperatures)
        form.addRow("Proposers", proposers)
        numbers = QWidget(plan)
        line = FlowLayout(numbers, spacing=10)
        for label, widget in (("prompts", self.prompts), ("new tokens", self.max_new_tokens), ("repeats", self.repeat)):
            pair = QWidget(numbers)  # a number and its word stay together
            both = QHBoxLayout(pair)
            both.setContentsMargins(0, 0, 0, 0)
            both.addWidget(widget)
            both.addWidget(QLabel(label, pair))
            line.addWidget(pair)
        form.addRow("Each", numbers)
        buttons = QHBoxLayout()
        self.start_button = QPushButton("Start sweep", plan)
        self.start_button.clicked.connect(self._on_start_clicked)
        self.progress = QProgressBar(plan)
        self.progress.setRange(0, 1)
        self.progress.setValue(0)
        self.eta = QLabel("", plan)
        self.apply_button = QPushButton("Apply to chat", plan)
        self.apply_button.setEnabled(False)
        self.apply_button.setToolTip("Use the selected configuration (the best one unless you pick another) in the chat")
        self.apply_button.clicked.connect(self._on_apply_clicked)
        buttons.addWidget(self.start_button)
        buttons.addWidget(self.progress, 1)
        buttons.addWidget(self.eta)
        buttons.addWidget(self.apply_button)
        form.addRow(buttons)
        self.status = QLabel("", plan)
        self.status.setWordWrap(True)
        self.status.setTextFormat(Qt.TextFormat.PlainText)
        form.addRow(self.status)
        outer.addWidget(plan)

        self.plots = SweepPlots(self)
        self.table = QTableWidget(0, len(COLUMNS), self)
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.horizontalHeaderItem(COLUMNS.index("Tokens/step")).setToolTip("New tokens per target forward")
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.diagnoses = QWidget(self)
        self._diagnoses_layout = QVBoxLayout(self.diagnoses)
        self._diagnoses_layout.setContentsMargins(0, 0, 0, 0)
        box = QGroupBox("Diagnoses from this session's measurements", self)
        QVBoxLayout(box).addWidget(self.diagnoses)
        split = QSplitter(Qt.Orientation.Vertical, self)
        split.addWidget(self.plots)
        split.addWidget(self.table)
        split.addWidget(box)
        split.setSizes([300, 300, 100])
        split.setStretchFactor(1, 1)
        outer.addWidget(split, 1)
        self.show_diagnoses([])

    # --- public API -------------------------------------------------------------------------------

    def plan(self) -> TunePlan | None:
        """What the controls say; None (and a status line) when a list does not parse."""
        ks = parse_numbers(self.ks.text(), int)
        temps = parse_numbers(self.temperatures.text(), float)
        proposers = tuple(p for p, box in self.proposer_boxes.items() if box.isChecked())
        if ks is None or any(k < 0 or k > K_MAX for k in ks):
            self.show_status(f"K: a comma-separated list of 1..{K_MAX} or auto.")
            return None
        if temps is None or any(t < 0 or t > 2 for t in temps):
            self.show_status("Temperatures: a comma-separated list of numbers from 0 to 2.")
            return None
        if not proposers:
            self.show_status("Pick at least one proposer.")
            return None
        return TunePlan(ks, temps, proposers, self.auto.isChecked(), self.prompts.value(),
                        self.max_new_tokens.value(), self.repeat.value())

    def set_running(self, running: bool) -> None:
        self._running = running
        self.start_button.setText("Stop" if running else "Start sweep")
        self.start_button.setEnabled(True)
        for w in (self.ks, self.temperatures, self.prompts, self.max_new_tokens, self.repeat, self.auto,
                  *self.proposer_boxes.values()):
            w.setEnabled(not running)
        if running:
            self.eta.setText("")

    def set_enabled(self, enabled: bool, reason: str = "") -> None:
        """Whether a sweep may start now (models loaded, nothing else decoding)."""
        if not self._running:
            self.start_button.setEnabled(enabled)
            self.start_button.setToolTip("" if enabled else reason)

    def set_progress(self, done: int, total: int, eta_s: float | None) -> None:
        self.progress.setRange(0, max(total, 1))
        self.progress.setValue(done)
        self.progress.setFormat(f"{done}/{total} runs")
        if eta_s is not None:
            minutes, seconds = divmod(int(round(eta_s)), 60)
            self.eta.setText(f"ETA {minutes}:{seconds:02d}" if done < total else "done")

    def show_rows(self, rows: Sequence[SweepRow], best: SweepRow | None) -> None:
        """The table and plots for these rows; the best row is highlighted and preselected for Apply."""
        self._rows, self._best = list(rows), best
        self.plots.show_rows(rows)
        self.table.setRowCount(len(rows))
        bold = QFont()
        bold.setBold(True)
        for i, row in enumerate(rows):
            for j, text in enumerate(row_cells(row)):
                item = QTableWidgetItem(text)
                if j:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                if row is best:  # the theme's "accepted" colours: readable in light and dark
                    colours = current_palette().colours("accepted")
                    item.setBackground(QBrush(colours.background))
                    item.setForeground(QBrush(colours.foreground))
                    item.setFont(bold)
                    item.setToolTip("The fastest configuration measured")
                self.table.setItem(i, j, item)
        self.apply_button.setEnabled(best is not None)

    def refresh_theme(self) -> None:
        self.plots.refresh_theme()

    def clear(self) -> None:
        self._rows, self._best = [], None
        self.table.setRowCount(0)
        self.plots.clear_rows()
        self.apply_button.setEnabled(False)

    def best_row_index(self) -> int | None:
        return next((i for i, r in enumerate(self._rows) if r is self._best), None)

    def show_status(self, text: str) -> None:
        self.status.setText(text)

    def show_diagnoses(self, items: Sequence[DiagnosisItem]) -> None:
        while self._diagnoses_layout.count():
            widget = self._diagnoses_layout.takeAt(0).widget()
            if widget is not None:
                widget.deleteLater()
        if not items:
            quiet = QLabel("Nothing to report: what was measured so far shows no problem.", self.diagnoses)
            quiet.setObjectName("diagnosisQuiet")
            self._diagnoses_layout.addWidget(quiet)
        for i, item in enumerate(items):
            row = QWidget(self.diagnoses)
            line = QHBoxLayout(row)
            line.setContentsMargins(0, 0, 0, 0)
            label = QLabel(f"{item.finding}  →  {item.action}", row)
            label.setWordWrap(True)
            label.setTextFormat(Qt.TextFormat.PlainText)
            line.addWidget(label, 1)
            if item.button:
                button = QPushButton(item.button, row)
                button.clicked.connect(lambda _=False, index=i: self.action_requested.emit(index))
                line.addWidget(button)
            self._diagnoses_layout.addWidget(row)

    def diagnosis_texts(self) -> list[str]:
        """The diagnoses as shown (for tests)."""
        texts = []
        for i in range(self._diagnoses_layout.count()):
            widget = self._diagnoses_layout.itemAt(i).widget()
            label = widget if isinstance(widget, QLabel) else widget.findChild(QLabel) if widget else None
            if label is not None:
                texts.append(label.text())
        return texts

    # --- internals --------------------------------------------------------------------------------

    def _on_start_clicked(self) -> None:
        if self._running:
            self.start_button.setEnabled(False)  # until the controller says it stopped
            self.show_status("Stopping after the run in progress…")
            self.stop_requested.emit()
            return
        plan = self.plan()
        if plan is not None:
            self.start_requested.emit(plan)

    def _on_apply_clicked(self) -> None:
        selected = self.table.selectionModel().selectedRows() if self.table.selectionModel() else []
        index = selected[0].row() if selected else self.best_row_index()
        if index is not None and 0 <= index < len(self._rows):
            self.apply_requested.emit(self._rows[index])
