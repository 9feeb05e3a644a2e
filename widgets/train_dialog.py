"""The "Train a draft head" dialog: a budget, a folder, Start/Cancel, progress with ETA, loss and acceptance curves (live, or a head's log)."""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from engine.types import TrainingProgress
from widgets.charts import adopt_menus
from widgets.palette import current_palette

CAPACITY = 8192  # log lines kept per curve (a 20-minute GPU run writes a few hundred)
REFRESH_MS = 100  # redraws at most 10 times a second, whatever the log rate
OTHER = "\0other"  # the "Another head folder…" entry's data (no folder is named so)


class _Series:
    """A preallocated (x, y) buffer that keeps its newest half when it fills."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.data = np.full((capacity, 2), np.nan)
        self.rows = 0

    def append(self, x: float, y: float) -> None:
        if self.rows == len(self.data):
            half = len(self.data) // 2
            self.data[:half] = self.data[half:]
            self.rows = half
        self.data[self.rows] = (x, y)
        self.rows += 1

    def view(self) -> tuple[np.ndarray, np.ndarray]:
        rows = self.data[: self.rows]
        return rows[:, 0], rows[:, 1]

    def clear(self) -> None:
        self.rows = 0


class TrainHeadDialog(QDialog):
    """Non-modal; emits `start_requested(minutes, folder, start_from, reuse)` and `cancel_requested()`; the app feeds
    it progress. `heads`: (label, folder) of heads trained for this target that a run can continue from."""

    # minutes of budget, output folder, head folder to continue ("": new), train on earlier runs' answers too
    start_requested = Signal(float, str, str, bool)
    cancel_requested = Signal()
    start_from_changed = Signal(str)  # the head folder a run would continue ("": a new head); the app recounts data

    def __init__(self, target_name: str, default_folder: str, *, on_gpu: bool,
                 heads: Sequence[tuple[str, Path]] = (), parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Train a draft head")
        self.setObjectName("trainHeadDialog")
        self.resize(740, 720)
        self._running = False
        layout = QVBoxLayout(self)
        intro = QLabel(
            f"A draft head is one small layer that reads {target_name}'s own hidden states and drafts "
            "its next tokens. It is trained on questions and answers the target writes itself "
            "(no download); benchmark prompts are never used. "
            + ("About 15–20 minutes on this GPU." if on_gpu else
               "On a CPU this is slow: expect a weak head unless you give it hours."), self)
        intro.setWordWrap(True)
        layout.addWidget(intro)
        form = QFormLayout()
        self.minutes = QDoubleSpinBox(self)
        self.minutes.setRange(1.0, 24 * 60.0)
        self.minutes.setDecimals(0)
        self.minutes.setSuffix(" min")
        self.minutes.setValue(18.0 if on_gpu else 60.0)
        form.addRow("Time budget", self.minutes)
        self.start_from = QComboBox(self)
        self.start_from.addItem("A new head", "")
        for label, folder in heads:
            self.start_from.addItem(label, str(folder))
        self.start_from.addItem("Another head folder…", OTHER)
        self.start_from.setToolTip("Continue training a head on fresh data (its weights and vocabulary), or begin a "
                                   "new one. The head you start from is left as it is.")
        self._start_index = 0
        self.start_from.activated.connect(self._on_start_from)
        form.addRow("Start from", self.start_from)
        row = QHBoxLayout()
        self.folder = QLineEdit(_shown(default_folder), self)
        browse = QPushButton("Browse…", self)
        browse.clicked.connect(self._browse)
        row.addWidget(self.folder, 1)
        row.addWidget(browse)
        form.addRow("Save the head in", row)
        self.reuse = QCheckBox(self)
        self.reuse.setToolTip("Train on the questions and answers earlier runs for this target wrote as well as on "
                              "the fresh ones this run writes: more data for the same minutes of writing. The "
                              "held-out answers stay this run's own.")
        form.addRow("Earlier answers", self.reuse)
        self._form = form
        self.set_earlier_data(None)
        layout.addLayout(form)

        self.progress = QProgressBar(self)
        self.progress.setRange(0, 1000)
        self.progress.setTextVisible(True)
        self.progress.setFormat("")
        self.progress.setVisible(False)  # an empty bar reads as an empty text field: shown once a run reports
        layout.addWidget(self.progress)
        self.status = QLabel("Not started.", self)
        self.status.setWordWrap(True)
        self.status.setTextFormat(Qt.TextFormat.PlainText)
        layout.addWidget(self.status)

        self._build_plots(layout)

        buttons = QHBoxLayout()
        buttons.addStretch(1)
        self.start_button = QPushButton("Start", self)
        self.start_button.setDefault(True)
        self.start_button.clicked.connect(self._on_start_clicked)
        self.close_button = QPushButton("Close", self)
        self.close_button.clicked.connect(self.close)
        buttons.addWidget(self.start_button)
        buttons.addWidget(self.close_button)
        layout.addLayout(buttons)

        self._timer = QTimer(self)
        self._timer.setInterval(REFRESH_MS)
        self._timer.timeout.connect(self.refresh)
        self._timer.start()

    # --- fed by the app ---------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._running

    def set_running(self, running: bool) -> None:
        self._running = running
        self.start_button.setText("Cancel" if running else "Start")
        self.minutes.setEnabled(not running)
        self.folder.setEnabled(not running)
        self.start_from.setEnabled(not running)

    def show_progress(self, p: TrainingProgress) -> None:
        self.progress.setVisible(True)
        self.progress.setValue(round(1000 * p.fraction))
        self.progress.setFormat(f"{p.phase} · {p.fraction:.0%} · about {p.eta_s / 60:.0f} min left")
        self.status.setText(p.message)
        if p.record is not None:
            self._add_record(p.record)

    def chosen_folder(self) -> str:
        """The folder the field names (~ expanded)."""
        return _meant(self.folder.text())

    def suggest_folder(self, folder: str) -> None:
        """Puts a folder in the field (under the home folder as ~/…)."""
        self.folder.setText(_shown(folder))

    def set_earlier_data(self, description: str | None) -> None:
        """What earlier runs wrote that this run can train on too (e.g. "2 runs, 14 rounds, 1.2M answer tokens");
        None hides the choice (and unticks it)."""
        self._form.setRowVisible(self.reuse, description is not None)
        if description is None:
            self.reuse.setChecked(False)
        else:
            self.reuse.setText(f"Also train on them ({description})")

    def show_log(self, records: Iterable[dict], message: str) -> None:
        """A finished training in the curves (a head's train_log.jsonl records), `message` saying whose it is."""
        self._clear_curves()
        for record in records:
            self._add_record(record)
        self.status.setText(message)

    def show_finished(self, summary: dict) -> None:
        self.set_running(False)
        acceptance = summary.get("held_out_acceptance") or []
        by_position = " ".join(f"{a:.0%}" for a in acceptance)
        if not summary.get("steps"):
            self.status.setText("Stopped before training began: nothing was saved (the data written so far is "
                                "kept, and starting again with the same folder and budget continues).")
            return
        done = "Trained" if summary.get("finished") else "Stopped early; saved what was trained"
        self.status.setText(f"{done}: {summary.get('steps', 0)} steps on {summary.get('sequences', 0)} answers. "
                            f"Held-out acceptance by draft position: {by_position or 'not measured'}. "
                            f"Saved in {summary.get('out', '?')}; choose the proposer \u201cDraft head\u201d to use it.")
        self.progress.setValue(self.progress.maximum() if summary.get("finished") else self.progress.value())
        if summary.get("out") and self.start_from.findData(str(summary["out"])) < 0:  # the next run can go on from it
            self.start_from.insertItem(self.start_from.count() - 1, f"Your head in {summary['out']}", str(summary["out"]))

    def show_failed(self, message: str) -> None:
        self.set_running(False)
        self.status.setText(f"Training failed: {message}")

    def series(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Copies of what the curves show (for tests)."""
        return {name: tuple(a.copy() for a in s.view()) for name, s in self._series.items()}

    def refresh(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        for name, curve in self._curves.items():
            curve.setData(*self._series[name].view(), connect="finite")

    # --- internals --------------------------------------------------------------------------------

    def _build_plots(self, layout: QVBoxLayout) -> None:
        palette = current_palette()
        accepted = palette.colours("accepted").chart
        bonus = palette.colours("bonus").chart
        neutral = palette.muted
        rgb = lambda c: (c.red(), c.green(), c.blue())  # noqa: E731
        graphics = pg.GraphicsLayoutWidget(self)
        graphics.setMinimumHeight(300)
        layout.addWidget(graphics, 1)
        loss_plot = graphics.addPlot(row=0, col=0, title="Training loss")  # x as below: "step" is said once
        loss_plot.showGrid(y=True, alpha=0.15)
        acc_plot = graphics.addPlot(row=1, col=0, title="Acceptance (greedy)")
        acc_plot.setLabel("bottom", "step")
        acc_plot.setLabel("left", "%")
        acc_plot.setYRange(0, 100, padding=0.04)
        acc_plot.showGrid(y=True, alpha=0.15)
        acc_plot.setXLink(loss_plot)
        for plot in (loss_plot, acc_plot):  # one width, so the linked x axes line up
            plot.getAxis("left").setWidth(48)
        # Under the plots, in one row: inside, it covered the curves wherever it stood over a whole run.
        legend = pg.LegendItem(labelTextSize="8pt", colCount=3)
        graphics.addItem(legend, row=2, col=0)
        rows = graphics.ci.layout
        for row, stretch in enumerate((2, 3, 0)):  # acceptance is what the head is for: it gets the most room
            rows.setRowStretchFactor(row, stretch)
        self._plots = (loss_plot, acc_plot)
        adopt_menus(graphics)
        self._marks: list[tuple[pg.PlotItem, pg.InfiniteLine]] = []  # where a run continued an earlier head
        self._mark_pen = pg.mkPen(rgb(neutral), width=1, style=Qt.PenStyle.DashLine)
        self._mark_colour = rgb(neutral)
        self._loss, self._agreement, self._held_out, self._held_out_later = _Series(), _Series(), _Series(), _Series()
        self._series = {"loss": self._loss, "agreement": self._agreement, "held_out": self._held_out,
                        "held_out_later": self._held_out_later}
        self._curves = {
            "loss": loss_plot.plot(pen=pg.mkPen(rgb(neutral), width=1)),
            "agreement": acc_plot.plot(pen=pg.mkPen(rgb(neutral), width=1), name="first draft, training batches"),
            "held_out": acc_plot.plot(pen=pg.mkPen(rgb(accepted), width=2), symbol="o", symbolSize=6,
                                      symbolBrush=rgb(accepted), name="first draft, held-out answers"),
            "held_out_later": acc_plot.plot(pen=pg.mkPen(rgb(bonus), width=1), symbol="t", symbolSize=6,
                                            symbolBrush=rgb(bonus), name="later drafts (mean), held-out"),
        }
        for name in ("agreement", "held_out", "held_out_later"):
            legend.addItem(self._curves[name], self._curves[name].name())
        self._dirty = False

    def _add_record(self, record: dict) -> None:
        """One log line into the curves: live progress and a saved log go through here alike."""
        if record.get("kind") == "train":
            self._loss.append(record["step"], record["loss"])
            self._agreement.append(record["step"], 100.0 * record["acc"][0])
            self._dirty = True
        elif record.get("kind") == "eval":
            acceptance = record["acceptance"]
            self._held_out.append(record["step"], 100.0 * acceptance[0])
            if len(acceptance) > 1:
                self._held_out_later.append(record["step"], 100.0 * float(np.mean(acceptance[1:])))
            self._dirty = True
        elif record.get("kind") == "continue" and "step" in record:
            # The loss jumps and the held-out set changes here: a short label names the run (runs can begin a
            # few hundred steps apart, where a sentence would overlap the next one), its tooltip says why.
            run = len(self._marks) // len(self._plots) + 2
            for plot in self._plots:
                label = f"run {run}" if plot is self._plots[0] else None
                line = pg.InfiniteLine(pos=record["step"], angle=90, pen=self._mark_pen, label=label,
                                       labelOpts={"position": 0.92, "color": self._mark_colour,
                                                  "anchors": [(1.1, 0.5), (1.1, 0.5)]})
                if record.get("repeat") and record.get("fresh"):
                    tip = (f"Run {run} continued the head before it on fresh data and on the data of an earlier "
                           "run again: the loss jumps and the held-out answers (fresh ones) change here.")
                elif record.get("repeat"):
                    tip = (f"Run {run} continued the head before it on the data of an earlier run again: "
                           "the loss jumps here, and it holds out that run's answers.")
                else:
                    tip = (f"Run {run} continued the head before it on fresh data: the loss jumps and the "
                           "held-out answers change here.")
                line.setToolTip(tip)
                plot.addItem(line)
                self._marks.append((plot, line))

    def _clear_curves(self) -> None:
        for s in self._series.values():
            s.clear()
        for plot, line in self._marks:
            plot.removeItem(line)
        self._marks.clear()
        self._dirty = True

    def _browse(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Save the draft head in", _meant(self.folder.text()))
        if folder:
            self.folder.setText(_shown(folder))

    def _on_start_clicked(self) -> None:
        if self._running:
            self.status.setText("Cancelling: the head trained so far is saved at the next step…")
            self.cancel_requested.emit()
            return
        folder = self.folder.text().strip()
        if not folder:
            self.status.setText("Choose a folder for the head first.")
            return
        if any(ord(c) < 32 or ord(c) == 127 for c in folder):
            self.status.setText("The folder name holds a control character (a NUL, tab or line break); "
                                "type it again or choose it with Browse.")
            return
        start_from = self.start_from.currentData() or ""
        if start_from and _same_folder(start_from, folder):
            self.status.setText("Save the continued head in another folder than the one it starts from.")
            return
        self._clear_curves()
        self.set_running(True)
        self.status.setText("Starting…")
        self.start_requested.emit(float(self.minutes.value()), _meant(folder), start_from,
                                  self.reuse.isChecked() and self._form.isRowVisible(self.reuse))

    def _on_start_from(self, index: int) -> None:
        """"Another head folder…" asks for one; a head that starts the run moves the save folder off it."""
        if self.start_from.itemData(index) == OTHER:
            chosen = QFileDialog.getExistingDirectory(self, "Continue training the head in", _meant(self.folder.text()))
            if not chosen:
                self.start_from.setCurrentIndex(self._start_index)
                return
            found = self.start_from.findData(chosen)
            if found < 0:
                found = self.start_from.count() - 1
                self.start_from.insertItem(found, chosen, chosen)
            self.start_from.setCurrentIndex(found)
        self._start_index = self.start_from.currentIndex()
        start_from, text = self.start_from.currentData() or "", self.folder.text().strip()
        folder = Path(_meant(text))
        if start_from and text and _same_folder(start_from, text):
            self.folder.setText(_shown(_free_folder(folder.with_name(folder.name + "-continued"))))
        self.start_from_changed.emit(start_from)


def _shown(folder: str) -> str:
    """A folder as the field shows it: under the home folder as ~/…"""
    home = os.path.expanduser("~")
    if home not in ("", "~", os.sep) and (folder == home or folder.startswith(home.rstrip(os.sep) + os.sep)):
        return "~" + folder[len(home.rstrip(os.sep)):]
    return folder


def _meant(text: str) -> str:
    """The folder a field's text names (~ expanded)."""
    return os.path.expanduser(text.strip())


def _same_folder(a: str, b: str) -> bool:
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except (OSError, RuntimeError, ValueError):
        return a == b


def _free_folder(wanted: Path) -> str:
    """`wanted`, or wanted-2, wanted-3… where no folder of that name holds a head yet."""
    candidate, n = wanted, 1
    while (candidate / "manifest.json").exists():
        n += 1
        candidate = wanted.with_name(f"{wanted.name}-{n}")
    return str(candidate)
