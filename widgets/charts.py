"""Live pyqtgraph charts of one generation: acceptance rate, K per step, draft trees, tokens/s, time split, acceptance
by position."""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QGraphicsItem, QLabel, QMenu, QStackedLayout, QWidget

from engine.types import Step
from widgets.palette import current_palette
from widgets.tree_plot import TreePlot

log = logging.getLogger(__name__)


# Runs once, at first import, before any plot exists (pyqtgraph reads options at item creation).
pg.setConfigOptions(antialias=True, background="w", foreground="k")

ACCEPTANCE_WINDOW = 20  # steps in the rolling acceptance rate
RATE_WINDOW_S = 1.0  # seconds of wall clock in the rolling tokens/s
NO_DRAFTS_NOTE = "no drafts in standard decoding"  # the draft plots' titles when no step drafted
# Ring buffer columns, one row per step.
_STEP, _ACCEPTANCE, _K, _ACCEPTED, _TPS, _TPS_ROLLING, _DRAFT_MS, _VERIFY_MS, _OVERHEAD_MS, _TREE_WIDTH, _TREE_DEPTH = \
    range(11)
_COLUMNS = 11
_AXIS_WIDTH = 52  # pixels for every left axis
# Redrawing five plots costs ~5 ms of the UI thread on a slow 2-core CPU (setData, then the repaint): at
# 15 Hz that is 8% of a core taken from a decode sharing those cores. The redraws may take at most this
# share of one core; where they cost more, they come less often (never less than twice a second).
CPU_SHARE = 0.04
SLOWEST_REFRESH_MS = 500
EMPTY_TEXT = ("No data yet\n\nSend a message: as the answer streams, these charts show how many drafted "
              "tokens are accepted, how many are drafted per step, the speed, and where the time goes.")


def adopt_menus(view: pg.GraphicsView) -> None:
    """Gives pyqtgraph's context menus (each plot's and each view box's, with their submenus) to the widget
    that shows them, so they go when it goes. Made parentless and owned by Qt, they outlived their plots:
    every closed dialog or window with charts left ten menus per plot as hidden top-level widgets, and
    each theme change restyled all of them. Call once the plots are added."""
    for item in view.scene().items():
        menus = (getattr(item, "ctrlMenu", None), item.menu if isinstance(item, pg.ViewBox) else None)
        for menu in menus:
            if isinstance(menu, QMenu) and menu.parent() is None:
                menu.setParent(view, menu.windowFlags())


def plain_axes(plot: pg.PlotItem) -> None:
    """Axis numbers as they are: no SI prefix rescaling ("tok/s (×0.001)") on any axis."""
    for name in ("left", "bottom"):
        plot.getAxis(name).enableAutoSIPrefix(False)


class _EmptyNote(pg.TextItem):
    """The text in the middle of an empty plot's view box, in the box's own pixels (not data coordinates),
    so it stays centred at any range. A method of the item, not a closure over the box: connected to the
    box's signal, a closure kept the box and its plot alive after their widget had gone."""

    def centre(self, *_: object) -> None:
        box = self.parentItem()
        if box is not None:
            self.setPos(box.boundingRect().center())


def show_empty(plot: pg.PlotItem, empty: bool, text: str = "No data yet") -> None:
    """While a plot has no data: no numbers on its axes (no made-up 0–1 range) and `text` in its middle."""
    for name in ("left", "bottom"):
        plot.getAxis(name).setStyle(showValues=not empty)
    note = getattr(plot, "_empty_note", None)
    if note is None:
        box = plot.getViewBox()
        note = _EmptyNote(text, color=current_palette().muted, anchor=(0.5, 0.5))
        note.setParentItem(box)
        box.sigResized.connect(note.centre)
        note.centre()
        plot._empty_note = note
    note.setText(text, color=current_palette().muted)
    note.setVisible(empty)


def _nice_ceiling(value: float) -> float:
    """The next 1-2-5 step at or above `value` (12 -> 20, 230 -> 500)."""
    if value <= 0:
        return 1.0
    magnitude = 10.0 ** np.floor(np.log10(value))
    return float(next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= value))


def _colour(qcolor: QColor, alpha: int = 255) -> tuple[int, int, int, int]:
    return (qcolor.red(), qcolor.green(), qcolor.blue(), alpha)


def chart_foreground() -> str:
    return current_palette().chart.get("foreground", "#1f2328")


def set_title(plot: pg.PlotItem, title: str) -> None:
    """A plot title in the theme's chart colour (pyqtgraph's default is black, unreadable on dark)."""
    plot.setTitle(title, color=chart_foreground())


def theme_plot(plot: pg.PlotItem) -> None:
    """Axes, title and legend in the current theme's chart colours; curves are the caller's."""
    chart = current_palette().chart
    fg = chart.get("foreground", "#1f2328")
    for name in ("left", "bottom"):
        axis = plot.getAxis(name)
        axis.setPen(fg)
        axis.setTextPen(fg)
    if plot.titleLabel.text:
        set_title(plot, plot.titleLabel.text)
    if plot.legend is not None:
        plot.legend.setBrush(pg.mkBrush(chart.get("legend", "#ffffffc8")))
        plot.legend.setLabelTextColor(fg)
        for _sample, label in plot.legend.items:  # existing labels keep their colour until set again
            label.setText(label.text, color=fg)


class _TimedGraphics(pg.GraphicsLayoutWidget):
    """The plots' view, counting the UI thread's CPU time its repaints take."""

    painted_s = 0.0  # CPU seconds spent painting since the charts last read it

    def paintEvent(self, event) -> None:  # noqa: N802 (Qt override)
        started = time.thread_time()
        super().paintEvent(event)
        self.painted_s += time.thread_time() - started


class LiveCharts(QWidget):
    """Five stacked plots fed by `push_steps` (six while an answer has rounds verified as draft trees: their
    width and depth, widgets.tree_plot); a 15 Hz timer redraws only when new data arrived.

    A redraw's measured CPU cost (its setData calls and the repaint that follows) sets how often the
    timer may fire: at most CPU_SHARE of one core, so a slow machine redraws less often, not slower.

    Curves are created once; data lives in a preallocated ring buffer that keeps the newest
    `capacity` steps contiguous (the older half is dropped when it fills), so pushing is O(steps)
    and a redraw is a few `setData` calls on array views.
    """

    def __init__(self, parent: QWidget | None = None, *, capacity: int = 4096, refresh_hz: float = 15.0) -> None:
        super().__init__(parent)
        assert capacity >= 2, "capacity must hold at least two steps"
        self._capacity = capacity
        self._buffer = np.full((capacity, _COLUMNS), np.nan)
        self._build_plots()
        self.reset()
        self._fastest_ms = max(1, round(1000 / refresh_hz))
        self._cost_s = 0.0  # a redraw's CPU seconds, smoothed
        self._timer = QTimer(self)
        self._timer.setInterval(self._fastest_ms)
        self._timer.timeout.connect(self._on_timer)
        self._timer.start()

    # --- public API -------------------------------------------------------------------------

    def push_steps(self, steps: Sequence[Step]) -> None:
        """Records Steps into the buffers; drawing waits for the timer."""
        for step in steps:
            self._push(step)
        if steps:
            self._dirty = True

    def refresh_interval_ms(self) -> int:
        """How often the timer redraws now (the fastest rate, or slower where redraws cost more)."""
        return self._timer.interval()

    def _on_timer(self) -> None:
        if not self._dirty:
            return
        started = time.thread_time()
        self.refresh()
        cost = time.thread_time() - started + self._graphics.painted_s  # the repaint of the previous redraw
        self._graphics.painted_s = 0.0
        self._cost_s = cost if self._cost_s == 0.0 else 0.7 * self._cost_s + 0.3 * cost
        wanted = round(1000 * self._cost_s / CPU_SHARE)
        self._timer.setInterval(min(SLOWEST_REFRESH_MS, max(self._fastest_ms, wanted)))

    def refresh(self) -> None:
        """Pushes the buffers to the plots if anything changed since the last refresh."""
        if not self._dirty:
            return
        self._dirty = False
        self._stack.setCurrentWidget(self._graphics if self._rows else self._empty)
        rows = self._buffer[: self._rows]
        x = rows[:, _STEP]
        if self._speculative_rows:
            self._acceptance_curve.setData(x, rows[:, _ACCEPTANCE], connect="finite")
            self._k_curve.setData(x, rows[:, _K], connect="finite")
            self._accepted_curve.setData(x, rows[:, _ACCEPTED], connect="finite")
            self._k_plot.setYRange(0, float(np.nanmax(rows[:, _K])) + 1, padding=0)
        else:  # standard decoding drafts nothing: leave these plots empty rather than all-NaN
            for curve in (self._acceptance_curve, self._k_curve, self._accepted_curve):
                curve.setData([], [])
        self._set_draft_titles(no_drafts=self._rows > 0 and not self._speculative_rows)
        self._tree.set_shown(self._tree_rows > 0)  # only answers with tree rounds give the tree plot room
        if self._tree_rows:
            self._tree.set_data(x, rows[:, _TREE_WIDTH], rows[:, _TREE_DEPTH])
        for column, curve in self._time_curves.items():
            curve.setData(x, rows[:, column], connect="finite")
        if self._rows:
            top_ms = float(np.nanmax(rows[:, [_DRAFT_MS, _VERIFY_MS, _OVERHEAD_MS]]))
            self._time_plot.setYRange(0, _nice_ceiling(top_ms * 1.1) if top_ms > 0 else 1, padding=0)
        finite = np.isfinite(rows[:, _TPS])
        self._tps_scatter.setData(x[finite], rows[finite, _TPS])
        self._tps_curve.setData(x, rows[:, _TPS_ROLLING], connect="finite")
        if finite.any():
            top = float(max(np.nanmax(rows[:, _TPS]), np.nanmax(rows[:, _TPS_ROLLING])))
            # Ranges grow in coarse steps: a changed range re-renders the axis, the costliest part of a repaint.
            self._tps_plot.setYRange(0, _nice_ceiling(top * 1.1) if top > 0 else 1, padding=0)
        if self._follow_x and self._rows:
            bound = max(_nice_ceiling(float(x[-1]) + 1), 10.0)
            if bound != self._x_bound:
                self._x_bound = bound
                self._tps_plot.setXRange(0, bound, padding=0.01)
        positions = self.position_acceptance()
        self._bars.setOpts(x=np.arange(1, len(positions) + 1), height=positions, width=0.6)
        self._position_plot.setXRange(0.4, max(len(positions), 1) + 0.6, padding=0)

    def set_no_drafts_note(self, note: str) -> None:
        """What the draft plots' titles say when no step drafted ("": no drafts in standard decoding), e.g.
        that a remote server does not report its drafts."""
        self._no_drafts_note = note or NO_DRAFTS_NOTE
        if self._no_drafts_titles:
            self._no_drafts_titles = False
            self._set_draft_titles(no_drafts=True)

    def reset(self) -> None:
        """Clears everything for a new message."""
        self._buffer[:] = np.nan
        self._rows = 0
        self._speculative_rows = 0
        self._tree_rows = 0  # steps verified as a draft tree
        self._window: deque[tuple[int, int]] = deque()
        self._window_accepted = 0
        self._window_proposed = 0
        self._rate_points: deque[tuple[float, int]] = deque()
        self._reached = np.zeros(0, dtype=np.int64)
        self._hits = np.zeros(0, dtype=np.int64)
        self._dirty = True
        self._follow_x = True  # until the reader pans or zooms the step plots
        self._x_bound = 0.0
        self.refresh()

    def series(self) -> dict[str, np.ndarray]:
        """Copies of what the plots show (NaN where a step has no value, e.g. standard decoding)."""
        rows = self._buffer[: self._rows]
        return {
            "step": rows[:, _STEP].copy(),
            "acceptance_rate": rows[:, _ACCEPTANCE].copy(),
            "k": rows[:, _K].copy(),
            "accepted": rows[:, _ACCEPTED].copy(),
            "tokens_per_s": rows[:, _TPS].copy(),
            "tokens_per_s_rolling": rows[:, _TPS_ROLLING].copy(),
            "draft_ms": rows[:, _DRAFT_MS].copy(),
            "verify_ms": rows[:, _VERIFY_MS].copy(),
            "overhead_ms": rows[:, _OVERHEAD_MS].copy(),
            "tree_width": rows[:, _TREE_WIDTH].copy(),
            "tree_depth": rows[:, _TREE_DEPTH].copy(),
            "position_acceptance": self.position_acceptance(),
        }

    def position_acceptance(self) -> np.ndarray:
        """P(accepted | reached) in % for draft positions 1..K (as in engine.measure.stats.summarize)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self._reached > 0, 100.0 * self._hits / np.maximum(self._reached, 1), 0.0)

    def is_empty(self) -> bool:
        """True while no step has arrived: the "no data yet" note shows instead of the plots."""
        return self._stack.currentWidget() is self._empty

    def plots(self) -> dict[str, pg.PlotItem]:
        return {
            "acceptance_rate": self._acceptance_plot,
            "k": self._k_plot,
            "tree": self._tree.plot,
            "tokens_per_s": self._tps_plot,
            "time_split": self._time_plot,
            "position_acceptance": self._position_plot,
        }

    # --- internals ------------------------------------------------------------------------------

    def _build_plots(self) -> None:
        palette = current_palette()
        accepted = palette.colours("accepted").chart
        bonus = palette.colours("bonus").chart
        neutral = palette.muted
        self._graphics = _TimedGraphics(self)
        # Before the first step: one line saying what will show here, not empty plots with made-up axes.
        self._empty = QLabel(EMPTY_TEXT, self)
        self._empty.setObjectName("chartsEmpty")
        self._empty.setWordWrap(True)
        self._empty.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self._empty.setMargin(24)
        self._stack = QStackedLayout(self)
        self._stack.setContentsMargins(0, 0, 0, 0)
        self._stack.addWidget(self._empty)
        self._stack.addWidget(self._graphics)

        # A repaint stays far below a 50 ms UI stall (bench/window_responsiveness.py): axes (with their
        # grid lines) are cached as pixmaps and re-rendered only when their range changes, so there
        # are no vertical grid lines (they live in the x axis' cache, redrawn as the steps grow);
        # curves draw about one point per pixel; antialiased pens wider than 1 px cost ~100 ms per
        # repaint on 800 zig-zag steps (1 px: ~5 ms), so only the smooth acceptance curve gets 2 px.
        def cache_axes(plot: pg.PlotItem) -> None:
            for name in ("left", "bottom"):
                plot.getAxis(name).setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)

        def step_plot(row: int, title: str, units: str) -> pg.PlotItem:
            plot = self._graphics.addPlot(row=row, col=0, title=title)
            plot.setLabel("left", units)
            plot.setLabel("bottom", "step")
            plot.showGrid(x=False, y=True, alpha=0.15)
            plot.setClipToView(True)
            plot.setDownsampling(auto=True, mode="peak")
            plot.setMouseEnabled(x=True, y=False)
            plot.getAxis("left").setWidth(_AXIS_WIDTH)  # equal widths keep the shared x axes aligned
            plain_axes(plot)
            cache_axes(plot)
            return plot

        self._acceptance_plot = step_plot(0, f"Acceptance rate (last {ACCEPTANCE_WINDOW} steps)", "%")
        self._acceptance_plot.setYRange(0, 100, padding=0.04)
        self._acceptance_plot.getAxis("left").setTicks([[(v, str(v)) for v in range(0, 101, 25)]])
        self._acceptance_curve = self._acceptance_plot.plot(pen=pg.mkPen(_colour(accepted), width=2))

        self._k_plot = step_plot(1, "Draft tokens per step", "tokens")
        self._k_plot.setYRange(0, 6, padding=0)
        self._k_plot.addLegend(offset=(-6, 4), labelTextSize="8pt", brush=(255, 255, 255, 200))
        # The K the controller chose (0: a standard step), which a short n-gram match may not fill.
        self._k_curve = self._k_plot.plot(pen=pg.mkPen(_colour(neutral), width=1), name="K chosen")
        self._accepted_curve = self._k_plot.plot(pen=pg.mkPen(_colour(accepted), width=1), name="accepted")

        # Row 2 is the tree plot's, while an answer has tree rounds (made below, once the plots it aligns exist).
        self._tps_plot = step_plot(3, "Speed", "tok/s")
        self._tps_plot.addLegend(offset=(-6, 4), labelTextSize="8pt", brush=(255, 255, 255, 200))
        self._tps_scatter = self._tps_plot.plot(
            pen=None, symbol="o", symbolSize=4, symbolPen=None, symbolBrush=_colour(bonus, 110), name="per step"
        )
        self._tps_curve = self._tps_plot.plot(pen=pg.mkPen(_colour(bonus), width=1), name=f"last {RATE_WINDOW_S:g} s")

        self._time_plot = step_plot(4, "Time per step", "ms")
        self._time_plot.addLegend(offset=(-6, 4), labelTextSize="8pt", brush=(255, 255, 255, 200))
        self._time_curves = {
            _DRAFT_MS: self._time_plot.plot(pen=pg.mkPen(_colour(accepted), width=1), name="drafting"),
            _VERIFY_MS: self._time_plot.plot(pen=pg.mkPen(_colour(bonus), width=1), name="verifying"),
            _OVERHEAD_MS: self._time_plot.plot(pen=pg.mkPen(_colour(neutral), width=1), name="overhead"),
        }

        self._tree = TreePlot(self._graphics.ci, step_plot(2, "", "nodes"), 2)

        # The speed plot always has data (standard decoding too), so it drives the shared x range;
        # the others would autorange to 0..1 while empty and drag it along.
        for plot in (self._acceptance_plot, self._k_plot, self._tree.plot, self._time_plot):
            plot.enableAutoRange(x=False)
            plot.setXLink(self._tps_plot)
        self._tps_plot.enableAutoRange(x=False)  # refresh() sets it in coarse steps instead
        for plot in (self._acceptance_plot, self._k_plot, self._tree.plot, self._tps_plot, self._time_plot):
            plot.getViewBox().sigRangeChangedManually.connect(self._on_x_changed_manually)

        self._position_plot = self._graphics.addPlot(row=5, col=0, title="Acceptance by draft position")
        self._position_plot.setLabel("left", "%")
        self._position_plot.getAxis("left").setWidth(_AXIS_WIDTH)
        plain_axes(self._position_plot)
        cache_axes(self._position_plot)
        self._position_plot.setLabel("bottom", "draft position")
        self._position_plot.setYRange(0, 100, padding=0.04)
        self._position_plot.getAxis("left").setTicks([[(v, str(v)) for v in range(0, 101, 25)]])
        self._position_plot.setMouseEnabled(x=False, y=False)
        self._position_plot.showGrid(y=True, alpha=0.15)
        self._position_plot.getAxis("bottom").setTickSpacing(major=1, minor=1)
        self._bars = pg.BarGraphItem(
            x=np.zeros(0), height=np.zeros(0), width=0.6, brush=_colour(accepted, 200), pen=pg.mkPen(None)
        )
        self._position_plot.addItem(self._bars)
        self._draft_titles = {
            self._acceptance_plot: f"Acceptance rate (last {ACCEPTANCE_WINDOW} steps)",
            self._k_plot: "Draft tokens per step",
            self._position_plot: "Acceptance by draft position",
        }
        self._no_drafts_titles = False
        self._no_drafts_note = NO_DRAFTS_NOTE
        adopt_menus(self._graphics)
        self.refresh_theme()

    def refresh_theme(self) -> None:
        """Background, axes and curve colours from the current theme (charts follow light / dark)."""
        palette = current_palette()
        accepted = palette.colours("accepted").chart
        bonus = palette.colours("bonus").chart
        self._graphics.setBackground(palette.chart.get("background", "w"))
        for plot in self.plots().values():
            theme_plot(plot)
        self._acceptance_curve.setPen(pg.mkPen(_colour(accepted), width=2))
        self._k_curve.setPen(pg.mkPen(_colour(palette.muted), width=1))
        self._accepted_curve.setPen(pg.mkPen(_colour(accepted), width=1))
        self._tps_scatter.setSymbolBrush(_colour(bonus, 110))
        self._tps_curve.setPen(pg.mkPen(_colour(bonus), width=1))
        for column, colour in ((_DRAFT_MS, accepted), (_VERIFY_MS, bonus), (_OVERHEAD_MS, palette.muted)):
            self._time_curves[column].setPen(pg.mkPen(_colour(colour), width=1))
        self._bars.setOpts(brush=_colour(accepted, 200))
        self._tree.refresh_theme()

    def _on_x_changed_manually(self, *_: object) -> None:
        self._follow_x = False  # the reader took over the x range; stop moving it

    def _set_draft_titles(self, *, no_drafts: bool) -> None:
        if no_drafts == self._no_drafts_titles:
            return
        self._no_drafts_titles = no_drafts
        suffix = f" — {self._no_drafts_note}" if no_drafts else ""
        for plot, title in self._draft_titles.items():
            set_title(plot, title + suffix)

    def _append_row(self, row: tuple[float, ...]) -> None:
        if self._rows == self._capacity:
            # Full: keep the newer half contiguous at the front (amortised O(1) per row).
            half = self._capacity // 2
            self._buffer[:half] = self._buffer[self._capacity - half :]
            self._buffer[half:] = np.nan
            self._rows = half
        self._buffer[self._rows] = row
        self._rows += 1

    def _push(self, step: Step) -> None:
        seconds = (step.draft_ms + step.verify_ms) / 1000.0
        tps = step.new_tokens / seconds if seconds > 0 else np.nan
        k = len(step.proposed)
        decision = step.decision
        chosen = decision is not None and decision.reason not in ("standard", "fixed")
        if chosen and not k:  # a standard step the controller chose: K = 0 on the chart, nothing drafted
            self._speculative_rows += 1
            acceptance = 100.0 * self._window_accepted / self._window_proposed if self._window_proposed else np.nan
            k_value, accepted_value = 0.0, 0.0
        elif k:
            self._speculative_rows += 1
            self._window.append((step.accepted, k))
            self._window_accepted += step.accepted
            self._window_proposed += k
            if len(self._window) > ACCEPTANCE_WINDOW:
                old_accepted, old_k = self._window.popleft()
                self._window_accepted -= old_accepted
                self._window_proposed -= old_k
            acceptance = 100.0 * self._window_accepted / self._window_proposed
            if k > len(self._reached):
                grow = k - len(self._reached)
                self._reached = np.concatenate([self._reached, np.zeros(grow, dtype=np.int64)])
                self._hits = np.concatenate([self._hits, np.zeros(grow, dtype=np.int64)])
            # Position i was reached if every earlier draft token was accepted.
            reached = min(k, step.accepted + 1)
            self._reached[:reached] += 1
            self._hits[: min(step.accepted, k)] += 1
            k_value = float(decision.k) if chosen and decision is not None else float(k)
            accepted_value = float(step.accepted)
        else:
            acceptance = k_value = accepted_value = np.nan
        # Wall-clock rate over the last second; the first point is the start of the first step.
        if not self._rate_points:
            self._rate_points.append((step.elapsed_s - seconds, step.total_tokens - step.new_tokens))
        self._rate_points.append((step.elapsed_s, step.total_tokens))
        while len(self._rate_points) > 2 and self._rate_points[1][0] <= step.elapsed_s - RATE_WINDOW_S:
            self._rate_points.popleft()
        base_s, base_tokens = self._rate_points[0]
        span = step.elapsed_s - base_s
        rolling = (step.total_tokens - base_tokens) / span if span > 0 else tps
        tree = (float(step.tree_width), float(step.tree_depth)) if step.tree_width else (np.nan, np.nan)
        self._tree_rows += bool(step.tree_width)
        self._append_row((float(step.index), acceptance, k_value, accepted_value, tps, rolling, step.draft_ms,
                          step.verify_ms, step.overhead_ms, *tree))
