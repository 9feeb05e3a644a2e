"""The draft check's result: a progress bar while it runs, then the ranked table, a bar chart and an Apply button."""
from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QProgressBar,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine.measure.check_types import CandidateCheck, CheckReport
from widgets.charts import adopt_menus

COLUMNS = ("Candidate", "Size", "KL", "Top-1", "Acceptance by position", "Cost", "K", "Speedup")
PAYS, LOSES = (46, 160, 67), (200, 80, 60)  # bar colours: predicted above / below standard decoding
REASON_CHARS = 48  # a refusal's reason in its cell; the whole of it in the row's tooltip


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def _cells(c: CandidateCheck) -> list[str]:
    if c.status != "ok":
        short = c.reason if len(c.reason) <= REASON_CHARS else c.reason[:REASON_CHARS - 1] + "…"
        return [c.name, "", "", "", f"refused: {short}", "", "", ""]
    positions = " ".join(f"{v:.2f}" for v in c.sampled_positions[:5]) or "–"
    k = f"{c.best_k}{' tree' if c.tree else ''}" if c.best_k else "–"
    speedup = "–" if c.speedup is None else f"{c.speedup:.2f}×"
    if c.speedup is not None and c.speedup_range is not None:
        speedup += f" ({c.speedup_range[0]:.2f}–{c.speedup_range[1]:.2f})"
    return [c.name, _pct(c.size_ratio), "–" if c.kl is None else f"{c.kl:.2f}",
            "–" if c.top1 is None else f"{c.top1:.2f}", positions, _pct(c.cost_ratio), k, speedup]


def _tips(c: CandidateCheck) -> dict[int, str]:
    """Tooltips per column: how positions were found, and how much the figures depend on the probes' text."""
    tips = {}
    if c.positions_from:
        first = "" if c.first_range is None else (f"; the first position over resamples of the probe prompts: "
                                                  f"{c.first_range[0]:.2f}–{c.first_range[1]:.2f}")
        tips[4] = f"positions beyond the first: {c.positions_from}{first}"
    if c.speedup_range is not None:
        low, high = c.speedup_range
        tips[7] = (f"90% of resamples of the probe prompts predict {low:.2f}–{high:.2f}×: acceptance depends on "
                   "the text; a few dozen prompts of your own spread about 1.4 times wider")
    return tips


class CheckView(QWidget):
    """Shows one CheckReport (plain data); `apply_requested` carries the candidate a person chose to use."""

    apply_requested = Signal(object)  # CandidateCheck

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.progress = QProgressBar(self)
        self.progress.setRange(0, 1000)
        self.status = QLabel("", self)
        self.status.setWordWrap(True)
        self.table = QTableWidget(0, len(COLUMNS), self)
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QTableWidget.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QTableWidget.SelectionMode.SingleSelection)
        self.table.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        self.table.itemSelectionChanged.connect(self._on_selection)
        self.chart = pg.PlotWidget(self)
        self.chart.setMinimumHeight(130)
        self.chart.setLabel("left", "predicted speedup ×")
        self.chart.showGrid(y=True, alpha=0.3)
        self.chart.setMouseEnabled(False, False)
        self._bars: pg.BarGraphItem | None = None
        self._ranges: pg.ErrorBarItem | None = None
        self._one = self.chart.addLine(y=1.0, pen=pg.mkPen((120, 120, 120), style=Qt.PenStyle.DashLine))
        adopt_menus(self.chart)
        self.verdict = QLabel("", self)
        self.verdict.setWordWrap(True)
        self.verdict.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.apply = QPushButton("Apply", self)
        self.apply.setToolTip("Use the selected candidate (the best one unless you pick another row)")
        self.apply.setEnabled(False)
        self.apply.clicked.connect(self._on_apply)
        row = QHBoxLayout()
        row.addWidget(self.verdict, 1)
        row.addWidget(self.apply)
        for w in (self.progress, self.status, self.table, self.chart):
            layout.addWidget(w)
        layout.addLayout(row)
        self.report: CheckReport | None = None
        self.table.hide()
        self.chart.hide()

    def set_progress(self, fraction: float, message: str) -> None:
        """While the check runs (the worker's check_progress)."""
        self.progress.show()
        self.progress.setValue(int(max(0.0, min(1.0, fraction)) * 1000))
        self.status.setText(message)
        self.apply.setEnabled(False)

    def set_failed(self, message: str) -> None:
        self.progress.hide()
        self.status.setText(message)

    def set_report(self, report: CheckReport) -> None:
        """The ranked table, a bar per checked candidate, the verdict; Apply starts on the best one that pays."""
        self.report = report
        self.progress.hide()
        self.status.setText(f"{report.probes} probe prompts, {report.probe_tokens} tokens, checked in "
                            f"{report.wall_s:.0f} s on {report.device} ({report.runtime}); "
                            f"temperature {report.temperature:g}"
                            + (f"; speedups of {report.answer_tokens}-token answers" if report.answer_tokens else ""))
        self.table.setRowCount(len(report.candidates))
        for r, c in enumerate(report.candidates):
            tips = _tips(c)
            for col, text in enumerate(_cells(c)):
                item = QTableWidgetItem(text)
                if c.status != "ok":
                    item.setForeground(Qt.GlobalColor.gray)
                    item.setToolTip(c.reason)
                elif col in tips:
                    item.setToolTip(tips[col])
                self.table.setItem(r, col, item)
        self.table.resizeColumnsToContents()
        header = self.table.horizontalHeader().height() + 2 * self.table.frameWidth()
        self.table.setMaximumHeight(header + sum(self.table.rowHeight(r) for r in range(self.table.rowCount())) + 4)
        self.table.show()
        self._draw(report)
        self.verdict.setText(report.verdict)
        best = report.best
        if best is not None:
            self.table.selectRow(report.candidates.index(best))
        self.apply.setEnabled(best is not None)

    def bar_heights(self) -> list[float]:
        """The chart's bars, in table order (checked candidates only)."""
        return [] if self._bars is None else [float(h) for h in self._bars.opts["height"]]

    def selected(self) -> CandidateCheck | None:
        if self.report is None:
            return None
        rows = self.table.selectionModel().selectedRows() if self.table.selectionModel() else []
        if not rows:
            return self.report.best
        return self.report.candidates[rows[0].row()]

    def _draw(self, report: CheckReport) -> None:
        checked = [c for c in report.candidates if c.status == "ok" and c.speedup is not None]
        for item in (self._bars, self._ranges):
            if item is not None:
                self.chart.removeItem(item)
        heights = [c.speedup or 0.0 for c in checked]
        brushes = [pg.mkBrush(*(PAYS if h > 1.0 else LOSES)) for h in heights]
        self._bars = pg.BarGraphItem(x=list(range(len(checked))), height=heights, width=0.6, brushes=brushes)
        self.chart.addItem(self._bars)
        ranged = [(i, c) for i, c in enumerate(checked) if c.speedup_range is not None]
        self._ranges = None
        if ranged:  # what resamples of the probes predict: a whisker over each bar
            self._ranges = pg.ErrorBarItem(
                x=np.array([i for i, _ in ranged], dtype=float), y=np.array([c.speedup for _, c in ranged]),
                bottom=np.array([c.speedup - c.speedup_range[0] for _, c in ranged]),
                top=np.array([c.speedup_range[1] - c.speedup for _, c in ranged]), beam=0.2,
                pen=pg.mkPen((60, 60, 60), width=1.5))
            self.chart.addItem(self._ranges)
            heights = heights + [c.speedup_range[1] for _, c in ranged]
        axis = self.chart.getAxis("bottom")
        axis.setTicks([[(i, c.name[:18]) for i, c in enumerate(checked)]])
        self.chart.setYRange(0, max(heights + [1.2]) * 1.1)
        self.chart.setVisible(bool(checked))

    def _on_selection(self) -> None:
        c = self.selected()
        self.apply.setEnabled(c is not None and c.status == "ok" and c.speedup is not None)

    def _on_apply(self) -> None:
        c = self.selected()
        if c is not None and c.status == "ok":
            self.apply_requested.emit(c)
