"""Light and dark themes: follows the system's colour scheme by default, or a fixed choice."""
from __future__ import annotations

import logging

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication

from widgets.palette import Palette, current_theme, load_palette, load_stylesheet, set_current_theme

log = logging.getLogger(__name__)

PREFERENCES: tuple[str, ...] = ("system", "light", "dark")


def system_theme() -> str:
    """"dark" when the desktop asks for a dark scheme (Qt >= 6.5), else "light" (also when unknown)."""
    app = QGuiApplication.instance()
    if app is None:
        return "light"
    try:
        scheme = QGuiApplication.styleHints().colorScheme()
    except AttributeError:  # Qt < 6.5: no way to ask
        return "light"
    return "dark" if scheme == Qt.ColorScheme.Dark else "light"


def resolve(preference: str) -> str:
    return system_theme() if preference not in ("light", "dark") else preference


def qt_palette(palette: Palette) -> QPalette:
    """A QPalette from the theme, so what the stylesheet does not cover (menus, Fusion frames) follows too."""
    ui = {k: QColor(v) for k, v in palette.ui.items()}
    p = QPalette()
    roles = {
        QPalette.ColorRole.Window: ui["window_bg"], QPalette.ColorRole.WindowText: ui["text"],
        QPalette.ColorRole.Base: ui["surface"], QPalette.ColorRole.AlternateBase: ui["hover"],
        QPalette.ColorRole.Text: ui["text"], QPalette.ColorRole.Button: ui["surface"],
        QPalette.ColorRole.ButtonText: ui["text"], QPalette.ColorRole.ToolTipBase: ui["tooltip_bg"],
        QPalette.ColorRole.ToolTipText: ui["text"], QPalette.ColorRole.Highlight: ui["selection"],
        QPalette.ColorRole.HighlightedText: ui["selection_text"], QPalette.ColorRole.PlaceholderText: ui["muted"],
        QPalette.ColorRole.Link: ui["accent"], QPalette.ColorRole.Mid: ui["border_strong"],
    }
    for role, colour in roles.items():
        p.setColor(role, colour)
    for role in (QPalette.ColorRole.Text, QPalette.ColorRole.WindowText, QPalette.ColorRole.ButtonText):
        p.setColor(QPalette.ColorGroup.Disabled, role, ui["disabled_text"])
    return p


class ThemeManager(QObject):
    """Applies a theme to the application and says when it changed; views re-read the palette then."""

    changed = Signal(str)  # "light" or "dark", after the palette and stylesheet were switched

    def __init__(self, preference: str = "system", parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._preference = preference if preference in PREFERENCES else "system"
        hints = QGuiApplication.styleHints()
        if hasattr(hints, "colorSchemeChanged"):
            hints.colorSchemeChanged.connect(self._on_system_changed)

    def preference(self) -> str:
        return self._preference

    def theme(self) -> str:
        return current_theme()

    def set_preference(self, preference: str) -> None:
        """"system", "light" or "dark"; applies at once."""
        if preference not in PREFERENCES:
            raise ValueError(f"unknown theme {preference!r}; choose one of {', '.join(PREFERENCES)}")
        self._preference = preference
        self.apply()

    def apply(self, force: bool = False) -> None:
        theme = resolve(self._preference)
        if theme == current_theme() and not force:
            return
        apply_theme(theme)
        self.changed.emit(theme)

    def _on_system_changed(self, *_: object) -> None:
        if self._preference == "system":
            self.apply()


def apply_theme(theme: str) -> None:
    """Switches the shared palette, the application's QPalette and its stylesheet."""
    set_current_theme(theme)
    app = QApplication.instance()
    if isinstance(app, QApplication):
        palette = qt_palette(load_palette(theme))
        if app.palette() != palette:
            app.setPalette(palette)
        sheet = load_stylesheet(theme)
        if app.styleSheet() != sheet:  # re-polishing every widget is costly; skip when nothing changes
            app.setStyleSheet(sheet)
    log.debug("theme %s applied", theme)
