"""How the chat looks: token colouring and rejected ghosts (the panel and the View menu kept in step),
markdown for finished answers and the theme, each remembered in the settings (the side panels: panels.py)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from PySide6.QtCore import QObject, QSignalBlocker
from PySide6.QtGui import QAction

from app.ui.settings import AppSettings
from widgets.charts import LiveCharts
from widgets.chat.view import ChatView
from widgets.legend import Legend
from widgets.race.view import RaceView
from widgets.settings_panel import DisplaySettings, SettingsPanel
from widgets.theme import ThemeManager
from widgets.tune.view import TuneView

LEGEND_STATUSES = ("accepted", "rejected", "corrected", "bonus", "target")


@dataclass(frozen=True)
class ViewActions:
    """The View menu's toggles this controller answers (menus.Menus makes them)."""

    colouring: QAction  # colour tokens by what happened to them
    ghosts: QAction  # show rejected drafts, struck through
    markdown: QAction  # format finished answers
    themes: Mapping[str, QAction]  # "system", "light", "dark": one checked


class ViewOptions(QObject):
    """The panel's display settings are the source; the View menu's toggles follow them without echoing back."""

    def __init__(self, settings: AppSettings, themes: ThemeManager, panel: SettingsPanel, actions: ViewActions, *,
                 chat: ChatView, race_view: RaceView, tune_view: TuneView, charts: LiveCharts, legend: Legend,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.settings = settings
        self.themes = themes
        self.panel = panel
        self.actions = actions
        self.chat, self.race_view, self.tune_view = chat, race_view, tune_view
        self.charts, self.legend = charts, legend
        actions.colouring.toggled.connect(self._on_colouring_toggled)
        actions.ghosts.toggled.connect(self._on_ghosts_toggled)
        actions.markdown.toggled.connect(self._on_markdown_toggled)
        for name, act in actions.themes.items():
            act.toggled.connect(lambda on, n=name: on and self.set_theme(n))
        with QSignalBlocker(actions.themes[themes.preference()]):
            actions.themes[themes.preference()].setChecked(True)
        themes.changed.connect(self._on_theme_changed)
        panel.display_changed.connect(self._on_display_changed)

    # --- theme and markdown ----------------------------------------------------------------------

    def set_theme(self, preference: str) -> None:
        """"system", "light" or "dark"; remembered."""
        self.themes.set_preference(preference)
        self.settings.set_theme(preference)
        with QSignalBlocker(self.actions.themes[preference]):
            self.actions.themes[preference].setChecked(True)

    def _on_theme_changed(self, _theme: str) -> None:
        self.chat.refresh_theme()
        self.tune_view.refresh_theme()
        self.charts.refresh_theme()
        self.legend.refresh_palette()
        self.race_view.refresh_theme()

    def restore_markdown(self) -> None:
        on = self.settings.render_markdown()
        self.chat.set_render_markdown(on)
        self.actions.markdown.setChecked(on)

    def _on_markdown_toggled(self, on: bool) -> None:
        self.chat.set_render_markdown(on)
        self.settings.set_render_markdown(on)

    # --- colouring and ghosts --------------------------------------------------------------------

    def apply_display(self, display: DisplaySettings) -> None:
        for view in (self.chat, self.race_view):
            view.set_colouring(display.colouring)
            view.set_show_rejected(display.show_rejected)
        for act, on in ((self.actions.colouring, display.colouring), (self.actions.ghosts, display.show_rejected)):
            act.blockSignals(True)  # the panel is the source here; do not echo back into it
            act.setChecked(on)
            act.blockSignals(False)
        self.legend.set_visible_statuses([s for s in LEGEND_STATUSES if s != "rejected" or display.show_rejected])

    def _on_display_changed(self, display: DisplaySettings) -> None:
        self.apply_display(display)
        self.settings.set_display(display)

    def _on_colouring_toggled(self, on: bool) -> None:
        self.panel.set_display(replace(self.panel.display(), colouring=on))
        self._on_display_changed(self.panel.display())

    def _on_ghosts_toggled(self, on: bool) -> None:
        self.panel.set_display(replace(self.panel.display(), show_rejected=on))
        self._on_display_changed(self.panel.display())
