"""Sweep plots: speedup and acceptance against K, a line per temperature (and proposer), from SweepRows.

Used live by the Tune tab and, rendered offscreen, for the CLI's sweep.png (widgets/tune/sweep_png.py).
Curves are made when a (proposer, temperature) first appears, then only get setData.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QVBoxLayout, QWidget

from engine.limits import K_MAX
from engine.types import SweepRow
from widgets.charts import adopt_menus, plain_axes, show_empty, theme_plot  # importing charts also sets pyqtgraph's options once
from widgets.palette import current_palette

# One colour per temperature (coolest first) and one line style per proposer.
TEMPERATURE_COLOURS = ((37, 99, 235), (22, 163, 74), (234, 88, 12), (190, 24, 93), (107, 114, 128), (124, 58, 237))
PROPOSER_STYLES = {"draft": Qt.PenStyle.SolidLine, "ngram": Qt.PenStyle.DashLine, "draft+ngram": Qt.PenStyle.DotLine}
SYMBOLS = {"draft": "o", "ngram": "t", "draft+ngram": "s"}


def _series_key(row: SweepRow) -> tuple[str, float]:
    return (row.proposer or "standard", row.temperature)


class SweepPlots(QWidget):
    """Two plots side by side: speedup over standard, and acceptance, against K.

    Fixed K are lines; K chosen per step (K auto, auto mode) are stars at their mean K.
    """

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.graphics = pg.GraphicsLayoutWidget(self)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.graphics)
        self.speedup_plot = self.graphics.addPlot(row=0, col=0, title="Speedup over standard decoding")
        self.acceptance_plot = self.graphics.addPlot(row=0, col=1, title="Acceptance rate")
        for plot, units in ((self.speedup_plot, "×"), (self.acceptance_plot, "%")):
            plot.setLabel("bottom", "draft length K")
            plot.setLabel("left", units)
            plot.showGrid(x=True, y=True, alpha=0.15)
            plot.setXRange(0.5, K_MAX + 0.5, padding=0)
            plot.addLegend(offset=(-6, 4), labelTextSize="8pt", brush=(255, 255, 255, 200))
            plain_axes(plot)
            show_empty(plot, True, "No data yet: start a sweep")
        self.acceptance_plot.setYRange(0, 100, padding=0.04)
        self.speedup_plot.addItem(pg.InfiniteLine(pos=1.0, angle=0, pen=pg.mkPen((120, 120, 120), style=Qt.PenStyle.DashLine)))
        self._curves: dict[tuple[str, float], tuple[pg.PlotDataItem, pg.PlotDataItem]] = {}
        self._auto: dict[tuple[str, float], tuple[pg.ScatterPlotItem, pg.ScatterPlotItem]] = {}
        self._temperatures: list[float] = []
        adopt_menus(self.graphics)
        self.refresh_theme()

    def refresh_theme(self) -> None:
        """Background, axes, titles and legends in the current theme's chart colours."""
        self.graphics.setBackground(current_palette().chart.get("background", "w"))
        for plot in (self.speedup_plot, self.acceptance_plot):
            theme_plot(plot)

    def show_rows(self, rows: Sequence[SweepRow]) -> None:
        """Redraws every series from the rows (rows may be partial while a sweep runs)."""
        series: dict[tuple[str, float], list[SweepRow]] = {}
        auto: dict[tuple[str, float], list[SweepRow]] = {}
        for row in rows:
            if row.mode == "standard" or math.isnan(row.speedup):
                continue
            target = auto if row.mode == "auto" or row.k == 0 else series
            target.setdefault(_series_key(row), []).append(row)
        for plot in (self.speedup_plot, self.acceptance_plot):
            show_empty(plot, not series and not auto, "No data yet: start a sweep")
        top = 1.0
        for key, items in series.items():
            items.sort(key=lambda r: r.k)
            speed, accept = self._curve(key)
            x = np.array([r.k for r in items], dtype=float)
            speed.setData(x, np.array([r.speedup for r in items]))
            accept.setData(x, np.array([100 * r.acceptance for r in items]))
            top = max(top, max(r.speedup for r in items))
        for key, items in auto.items():
            speed, accept = self._stars(key)
            x = np.array([max(r.k_mean, 0.1) for r in items])
            speed.setData(x, np.array([r.speedup for r in items]))
            accept.setData(x, np.array([100 * r.acceptance for r in items]))
            top = max(top, max(r.speedup for r in items))
        self.speedup_plot.setYRange(0, max(top * 1.1, 1.2), padding=0)

    def clear_rows(self) -> None:
        for speed, accept in (*self._curves.values(), *self._auto.values()):
            speed.setData([], [])
            accept.setData([], [])

    def series(self) -> dict[str, tuple[list[float], list[float]]]:
        """What the speedup plot shows, per "proposer T=t" (K, speedup); for tests."""
        out = {}
        for (proposer, t), (speed, _) in self._curves.items():
            x, y = speed.getData()
            out[f"{proposer} T={t:g}"] = ([] if x is None else list(x), [] if y is None else list(y))
        return out

    def _pen(self, key: tuple[str, float], width: int = 2) -> pg.QtGui.QPen:
        if key[1] not in self._temperatures:
            self._temperatures.append(key[1])
        colour = TEMPERATURE_COLOURS[self._temperatures.index(key[1]) % len(TEMPERATURE_COLOURS)]
        return pg.mkPen(colour, width=width, style=PROPOSER_STYLES.get(key[0], Qt.PenStyle.SolidLine))

    def _curve(self, key: tuple[str, float]) -> tuple[pg.PlotDataItem, pg.PlotDataItem]:
        if key not in self._curves:
            pen = self._pen(key)
            name = f"{key[0]} T={key[1]:g}"
            symbol = SYMBOLS.get(key[0], "o")
            self._curves[key] = (
                self.speedup_plot.plot(pen=pen, symbol=symbol, symbolSize=6, symbolBrush=pen.color(), name=name),
                self.acceptance_plot.plot(pen=pen, symbol=symbol, symbolSize=6, symbolBrush=pen.color(), name=name),
            )
        return self._curves[key]

    def _stars(self, key: tuple[str, float]) -> tuple[pg.ScatterPlotItem, pg.ScatterPlotItem]:
        if key not in self._auto:
            colour = self._pen(key).color()
            name = f"auto {key[0]} T={key[1]:g}"
            items = []
            for plot in (self.speedup_plot, self.acceptance_plot):
                item = pg.ScatterPlotItem(symbol="star", size=14, brush=colour, pen=pg.mkPen("k"), name=name)
                plot.addItem(item)
                items.append(item)
            self._auto[key] = (items[0], items[1])
        return self._auto[key]
