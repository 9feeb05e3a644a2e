"""The race's shared chart: tokens over time for both modes, each on its own clock."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import (
    QWidget,
)

import widgets.charts  # noqa: F401  (sets pyqtgraph options once, before any plot exists)
from engine.types import Step
from widgets.charts import adopt_menus, plain_axes, show_empty, theme_plot
from widgets.palette import current_palette

RACE_MODES: tuple[str, str] = ("standard", "speculative")
MODE_STATUS = {"standard": "target", "speculative": "accepted"}  # palette entry that colours each mode's curve
REFRESH_HZ = 15.0  # chart redraws (live and replay); panes append in batches at the same pace


# --------------------------------------------------------------------------- the chart

class RaceChart(pg.PlotWidget):
    """Tokens generated (y) against seconds on each mode's own clock (x), both modes overlaid.

    Points are kept per mode and pushed with `setData` by a timer, only when something changed.
    """

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        palette = current_palette()
        item = self.getPlotItem()
        item.setTitle("Tokens generated over time")
        item.setLabel("bottom", "seconds (each mode on its own clock)")
        item.setLabel("left", "tokens")
        item.showGrid(x=True, y=True, alpha=0.15)
        item.setMouseEnabled(x=False, y=False)
        plain_axes(item)
        item.addLegend(offset=(8, 4), labelTextSize="8pt", brush=(255, 255, 255, 200))
        self._curves: dict[str, pg.PlotDataItem] = {}
        self._points: dict[str, list[tuple[float, float]]] = {}
        for mode in RACE_MODES:
            colour = palette.colours(MODE_STATUS[mode]).chart
            self._curves[mode] = item.plot(pen=pg.mkPen(colour, width=2.5), name=mode)
        adopt_menus(self)
        self.clear_series()
        self.refresh_theme()
        self._timer = QTimer(self)
        self._timer.setInterval(round(1000 / REFRESH_HZ))
        self._timer.timeout.connect(self.refresh)
        self._timer.start()

    def refresh_theme(self) -> None:
        """Background, axes and curves in the current theme's chart colours."""
        palette = current_palette()
        self.setBackground(palette.chart.get("background", "w"))
        theme_plot(self.getPlotItem())
        for mode, curve in self._curves.items():
            curve.setPen(pg.mkPen(palette.colours(MODE_STATUS[mode]).chart, width=2.5))

    def clear_series(self, mode: str | None = None) -> None:
        for m in (RACE_MODES if mode is None else (mode,)):
            self._points[m] = [(0.0, 0.0)]
        self._dirty = True
        self.refresh()

    def push_steps(self, mode: str, steps: Sequence[Step]) -> None:
        self._points[mode].extend((s.elapsed_s, float(s.total_tokens)) for s in steps)
        self._dirty = True

    def series(self, mode: str) -> tuple[np.ndarray, np.ndarray]:
        pts = np.asarray(self._points[mode], dtype=float)
        return pts[:, 0], pts[:, 1]

    def refresh(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        show_empty(self.getPlotItem(), all(len(p) <= 1 for p in self._points.values()),
                   "No data yet: pick a prompt and press Race")
        for mode, curve in self._curves.items():
            x, y = self.series(mode)
            if len(x) > 1:
                curve.setData(x, y)
            else:
                curve.setData([], [])
