"""The live charts' plot of draft trees: per round, the draft tokens the target verified as a tree and its levels."""
from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF
from PySide6.QtGui import QColor

from widgets.palette import current_palette

TITLE = "Draft tree"
# The title names the curves beside a swatch of their colour: a legend over the plot would hide the nodes
# curve, which runs along its top.
SWATCH = "━"
LEVELS_AXIS_WIDTH = 24  # pixels inside the plot's right edge for the levels' tick labels


def _pen(colour: QColor) -> pg.QtGui.QPen:
    return pg.mkPen((colour.red(), colour.green(), colour.blue()), width=1)


def _ceiling(value: float, step: int) -> float:
    """The multiple of `step` at or above `value` (at least one step): the axis' range grows in coarse steps."""
    return float(step * max(1, int(np.ceil(value / step))))


class TreePlot:
    """A step plot of the rounds verified as trees: nodes (draft tokens verified) on the left axis, levels on a
    second view box sharing the x range (behind the plot's own, so panning and menus stay the plot's), whose
    axis sits just inside the plot's right edge; the title names both curves beside a swatch of their colour.

    The levels axis is inside, not beside, the plot: an axis beside it would make its x range narrower than
    the other step plots' (a step would no longer sit at the same x in every plot), and keeping as much room
    on theirs would widen the charts past the narrowest column the window gives them.

    The plot joins its layout at `row` only while `set_shown(True)`: an answer without tree rounds gives it
    no room. Curves are made once; `set_data` only calls setData.
    """

    def __init__(self, layout: pg.GraphicsLayout, plot: pg.PlotItem, row: int) -> None:
        self.plot = plot
        self._layout, self._row = layout, row
        self._shown = plot.scene() is not None
        self._y_top = (0.0, 0.0)  # the ranges set last: a changed range re-renders the axis, so only on change
        plot.setLabel("left", "nodes")
        self._levels = pg.ViewBox(enableMouse=False, enableMenu=False)
        self._levels.setParentItem(plot)
        self._levels.setZValue(-10)  # under the plot's own (transparent) view box, which keeps the mouse
        self._levels.setXLink(plot)
        # A left-facing axis whose line is the plot's right edge: its ticks and numbers point into the plot.
        # Drags and wheel turns over it fall through to the plot (AxisItem ignores those inside its view).
        self.levels_axis = pg.AxisItem("left", parent=plot)
        self.levels_axis.linkToView(self._levels)
        self.levels_axis.enableAutoSIPrefix(False)
        self.levels_axis.setWidth(LEVELS_AXIS_WIDTH)
        self.levels_axis.setStyle(tickLength=4)  # ticks into the plot too, not out past its edge
        plot.vb.sigResized.connect(self._on_resized)
        plot.setYRange(0, 1, padding=0)
        self._levels.setYRange(0, 1, padding=0)
        self.width_curve = plot.plot()
        self.depth_curve = pg.PlotDataItem()
        for curve in (self.width_curve, self.depth_curve):
            curve.setClipToView(True)
            curve.setDownsampling(auto=True, method="peak")
        self._levels.addItem(self.depth_curve)
        self.refresh_theme()

    def set_shown(self, shown: bool) -> None:
        """Puts the plot in its layout row or takes it out (and so gives the other plots its room)."""
        if shown == self._shown:
            return
        self._shown = shown
        if not shown:
            self._layout.removeItem(self.plot)
            return
        self._layout.addItem(self.plot, row=self._row, col=0)
        linked = self.plot.vb.linkedView(pg.ViewBox.XAxis)
        if linked is not None:  # back in the scene: take up the shared x range at once
            self.plot.setXRange(*linked.viewRange()[0], padding=0)

    def is_shown(self) -> bool:
        return self._shown

    def set_data(self, x: np.ndarray, width: np.ndarray, depth: np.ndarray) -> None:
        """Per step: nodes verified and levels (NaN for a chain or a standard step: a gap)."""
        self.width_curve.setData(x, width, connect="finite")
        self.depth_curve.setData(x, depth, connect="finite")
        if not np.isfinite(width).any():
            return
        tops = (_ceiling(float(np.nanmax(width)) * 1.1, 16), _ceiling(float(np.nanmax(depth)) + 1, 4))
        if tops != self._y_top:
            self._y_top = tops
            self.plot.setYRange(0, tops[0], padding=0)
            self._levels.setYRange(0, tops[1], padding=0)
            step = int(tops[1]) // 4  # no 0: at the bottom edge it would sit on the step axis' numbers
            self.levels_axis.setTicks([[(v, str(v)) for v in range(step, int(tops[1]) + 1, step)]])

    def refresh_theme(self) -> None:
        """Curve, title and levels-axis colours from the current theme (the caller themes the plot's own axes)."""
        palette = current_palette()
        width_colour = palette.colours("bonus").chart  # what the target verified, as "verifying" in the time plot
        depth_colour = palette.colours("corrected").chart
        self.width_curve.setPen(_pen(width_colour))
        self.depth_curve.setPen(_pen(depth_colour))  # 1 px: wider antialiased zig-zags cost ~100 ms a repaint
        fg = palette.chart.get("foreground", "#1f2328")
        self.levels_axis.setPen(fg)
        self.levels_axis.setTextPen(fg)
        self.plot.setTitle(f"{TITLE}: <span style='color: {width_colour.name()}'>{SWATCH}</span> nodes · "
                           f"<span style='color: {depth_colour.name()}'>{SWATCH}</span> levels", color=fg)

    def _on_resized(self, *_: object) -> None:
        box = self.plot.vb.geometry()
        self._levels.setGeometry(box)
        self._levels.linkedViewChanged(self.plot.vb, pg.ViewBox.XAxis)
        self.levels_axis.setGeometry(QRectF(box.right() - LEVELS_AXIS_WIDTH, box.top(), LEVELS_AXIS_WIDTH,
                                            box.height()))
