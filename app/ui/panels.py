"""The Chat tab's side panels (conversations, settings, charts): shown or collapsed from the View menu, collapsed
by themselves when the window is too narrow for them beside a usable chat, and remembered in the settings."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from PySide6.QtCore import QEvent, QObject, QSignalBlocker, QTimer
from PySide6.QtGui import QAction
from PySide6.QtWidgets import QFrame, QScrollArea, QSplitter, QWidget

from app.ui.settings import AppSettings

CHAT_SHARE = 0.5  # the chat keeps at least this share of the window when the panels are laid out (minimums allowing)


@dataclass(frozen=True)
class Panel:
    """One side panel: where it sits and below which window width it collapses by itself."""

    name: str  # "sidebar", "settings" or "charts" (the settings key and the action's name)
    widget: QWidget  # what is shown or hidden
    splitter: QSplitter  # the splitter holding it
    index: int  # its index in that splitter
    collapse_below: int  # window width (px) under which it collapses unless asked for
    default_width: int  # its width the first time it shows


# Collapse order as the window narrows: the charts first (at the 1,480 px default window all three fit beside a
# chat of nearly half the width), then the conversations, then the settings, so at 640 px the chat has the whole width.
COLLAPSE_BELOW = {"charts": 1280, "sidebar": 1000, "settings": 760}
DEFAULT_WIDTHS = {"sidebar": 190, "settings": 300, "charts": 340}


class SidePanels(QObject):
    """What the person asked for (`wanted`, saved) and what the width allows decide what shows.

    Turning a panel on while the window is too narrow for it shows it anyway, until the window crosses
    that panel's width again. The View menu's toggles show what is on screen.
    """

    def __init__(self, window: QWidget, panels: tuple[Panel, ...], actions: Mapping[str, QAction],
                 settings: AppSettings, *, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._window = window
        self._panels = {p.name: p for p in panels}
        self._actions = actions
        self._settings = settings
        self._laid_out = False  # the first Show lays the panels out at their widths
        self.wanted: dict[str, bool] = {p.name: True for p in panels}
        self.widths: dict[str, int] = {p.name: p.default_width for p in panels}
        self._forced: set[str] = set()  # turned on while too narrow for it
        self._narrow: dict[str, bool] = {}  # the width rule's last verdict per panel
        for name, act in actions.items():
            act.toggled.connect(lambda on, n=name: self.set_wanted(n, on))
        for splitter in {p.splitter for p in panels}:
            splitter.splitterMoved.connect(lambda *_: self._remember_widths())
        window.installEventFilter(self)

    # --- public -----------------------------------------------------------------------------

    def restore(self, wanted: Mapping[str, bool], widths: Mapping[str, int]) -> None:
        """The saved choices and widths; applies them for the window's current width."""
        self.wanted.update({k: bool(v) for k, v in wanted.items() if k in self.wanted})
        self.widths.update({k: int(v) for k, v in widths.items() if k in self.widths and v > 0})
        self._narrow.clear()
        self._apply(self._window.width(), relayout=True)

    def shown(self, name: str) -> bool:
        """On screen now (the chat tab's own visibility aside)."""
        return not self._panels[name].widget.isHidden()

    def set_wanted(self, name: str, on: bool) -> None:
        """The View menu's toggle (or a caller): shows or collapses a panel, and remembers the choice."""
        self._remember_widths()
        self.wanted[name] = on
        if on and self._too_narrow(name, self._window.width()):
            self._forced.add(name)
        else:
            self._forced.discard(name)
        self._settings.set_panels(self.wanted)
        self._apply(self._window.width(), relayout=True)

    def saved_widths(self) -> dict[str, int]:
        self._remember_widths()
        return dict(self.widths)

    # --- the window's width -------------------------------------------------------------------

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if watched is not self._window:
            return False
        if event.type() == QEvent.Type.Resize:
            width = event.size().width()
            # After the resize reaches the splitters, or the sizes set would be scaled to the old width.
            QTimer.singleShot(0, self, lambda: self._apply(width, relayout=not self._laid_out))
        elif event.type() == QEvent.Type.Show and not self._laid_out:
            QTimer.singleShot(0, self, self._first_layout)
        return False

    def _first_layout(self) -> None:
        self._laid_out = True
        self._apply(self._window.width(), relayout=True)

    def _too_narrow(self, name: str, width: int) -> bool:
        return width < self._panels[name].collapse_below

    def _apply(self, width: int, *, relayout: bool) -> None:
        changed = False
        for name, panel in self._panels.items():
            narrow = self._too_narrow(name, width)
            if self._narrow.get(name) is not None and self._narrow[name] != narrow:
                self._forced.discard(name)  # the window crossed this panel's width: the rule decides again
            self._narrow[name] = narrow
            show = self.wanted[name] and (not narrow or name in self._forced)
            if show != (not panel.widget.isHidden()):
                # No width is remembered here: a window being narrowed squeezes its panels first.
                panel.widget.setVisible(show)
                changed = True
            with QSignalBlocker(self._actions[name]):
                self._actions[name].setChecked(show)
        if changed or relayout:
            self._lay_out(width)

    def _lay_out(self, width: int) -> None:
        """Each shown panel at its remembered width, scaled down together so the chat keeps its share."""
        shown = [p for p in self._panels.values() if not p.widget.isHidden()]
        splitters = {p.splitter for p in self._panels.values()}
        budget = int(width * (1 - CHAT_SHARE)) - sum(s.handleWidth() * (s.count() - 1) for s in splitters)
        asked = sum(self.widths[p.name] for p in shown)
        scale = min(1.0, budget / asked) if asked else 1.0
        for splitter in splitters:
            sizes = splitter.sizes()
            total = sum(sizes) or width
            mine = {p.index: p for p in self._panels.values() if p.splitter is splitter}
            for i in range(len(sizes)):
                panel = mine.get(i)
                if panel is not None:
                    sizes[i] = (max(panel.widget.minimumWidth(), int(self.widths[panel.name] * scale))
                                if not panel.widget.isHidden() else 0)
            rest = [i for i in range(len(sizes)) if i not in mine]
            free = max(0, total - sum(sizes[i] for i in mine))
            for i in rest:  # the chat column (or the splitter holding it) takes what is left
                sizes[i] = free // max(1, len(rest))
            splitter.setSizes(sizes)

    def _remember_widths(self) -> None:
        """The widths the person gave the shown panels (dragging a handle, or before turning one off)."""
        for name, panel in self._panels.items():
            if not panel.widget.isHidden():
                width = panel.splitter.sizes()[panel.index]
                if width > 0:
                    self.widths[name] = width


def scrolling(view: QWidget) -> QScrollArea:
    """A tab's view in a frameless scroll area: a small window scrolls it instead of growing to fit it."""
    area = QScrollArea()
    area.setWidgetResizable(True)
    area.setFrameShape(QFrame.Shape.NoFrame)
    area.setWidget(view)
    return area
