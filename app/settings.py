"""Persistent settings (QSettings): model choices, generation settings, window geometry, splitter sizes."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict

from PySide6.QtCore import QByteArray, QSettings

from engine.settings import GenerationSettings, ModelSelection
from widgets.settings_panel import DisplaySettings

log = logging.getLogger(__name__)

ORGANIZATION = "SpecDec Studio"
APPLICATION = "SpecDec Studio"
SETTINGS_ENV = "SPECDEC_SETTINGS"  # path of an .ini file to use instead of the platform store
VERSION = 1  # bump when the stored layout changes incompatibly
MAX_VALUE_CHARS = 1_000_000  # a stored JSON value longer than this is damage, not settings
MAX_GEOMETRY_BYTES = 4096  # Qt's saved geometry is ~70 bytes; anything huge is not one
MAX_PANE_PIXELS = 100_000  # no screen is wider; Qt's sizes are C ints and overflow beyond 2**31


class AppSettings:
    """Typed access to the QSettings store; every read tolerates a missing or damaged entry."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        path = path if path is not None else os.environ.get(SETTINGS_ENV)
        if path:
            self._qs = QSettings(str(path), QSettings.Format.IniFormat)
        else:
            self._qs = QSettings(QSettings.Format.IniFormat, QSettings.Scope.UserScope, ORGANIZATION, APPLICATION)

    def file_name(self) -> str:
        return self._qs.fileName()

    def sync(self) -> None:
        self._qs.sync()

    # --- models -------------------------------------------------------------------------------

    def models(self) -> ModelSelection:
        return ModelSelection.from_dict(self._json("models/selection"))

    def set_models(self, selection: ModelSelection) -> None:
        self._qs.setValue("models/selection", json.dumps(asdict(selection)))

    # --- generation -----------------------------------------------------------------------------

    def generation(self) -> GenerationSettings:
        return GenerationSettings.from_dict(self._json("generation/settings"))

    def set_generation(self, settings: GenerationSettings) -> None:
        self._qs.setValue("generation/settings", json.dumps(asdict(settings), ensure_ascii=False))

    def display(self) -> DisplaySettings:
        # Before display settings had their own key they were stored with the generation settings.
        raw = self._json("display/settings") or self._json("generation/settings")
        return DisplaySettings.from_dict(raw)

    def set_display(self, display: DisplaySettings) -> None:
        self._qs.setValue("display/settings", json.dumps(asdict(display)))

    # --- window ---------------------------------------------------------------------------------

    def geometry(self) -> QByteArray | None:
        value = self._qs.value("window/geometry")
        # restoreGeometry refuses bytes it does not understand, so only the size needs a check here.
        ok = isinstance(value, QByteArray) and 0 < value.size() <= MAX_GEOMETRY_BYTES
        return value if ok else None

    def set_geometry(self, geometry: QByteArray) -> None:
        self._qs.setValue("window/geometry", geometry)

    def splitter_sizes(self) -> list[int] | None:
        raw = self._json("window/splitter")
        sizes = raw.get("sizes")
        if isinstance(sizes, list) and 0 < len(sizes) <= 8 and all(
                isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_PANE_PIXELS for s in sizes):
            return sizes
        if raw:
            log.warning("ignoring damaged splitter sizes in %s", self.file_name())
        return None

    def set_splitter_sizes(self, sizes: list[int]) -> None:
        self._qs.setValue("window/splitter", json.dumps({"sizes": [int(s) for s in sizes]}))

    def charts_visible(self) -> bool:
        return self._json("window/view").get("charts_visible", True) is not False

    def set_charts_visible(self, visible: bool) -> None:
        self._qs.setValue("window/view", json.dumps({"charts_visible": bool(visible)}))

    # --- appearance and history ----------------------------------------------------------------

    def theme(self) -> str:
        """"system" (follow the desktop), "light" or "dark"."""
        theme = self._json("window/appearance").get("theme", "system")
        return theme if theme in ("system", "light", "dark") else "system"

    def set_theme(self, theme: str) -> None:
        self._set_appearance(theme=theme)

    def render_markdown(self) -> bool:
        """Finished answers formatted as markdown (True) or left as coloured tokens (False)."""
        return self._json("window/appearance").get("markdown", True) is not False

    def set_render_markdown(self, on: bool) -> None:
        self._set_appearance(markdown=bool(on))

    def sidebar_width(self) -> int | None:
        width = self._json("window/appearance").get("sidebar_width")
        if isinstance(width, int) and not isinstance(width, bool) and 0 < width <= MAX_PANE_PIXELS:
            return width
        if width is not None:
            log.warning("ignoring damaged sidebar width in %s", self.file_name())
        return None

    def set_sidebar_width(self, width: int) -> None:
        self._set_appearance(sidebar_width=int(width))

    def _set_appearance(self, **values: object) -> None:
        raw = self._json("window/appearance")
        raw.update(values)
        self._qs.setValue("window/appearance", json.dumps(raw))

    # --- internals ------------------------------------------------------------------------------

    def _json(self, key: str) -> dict:
        # JSON strings rather than QSettings' own types: INI files round-trip them exactly on every OS.
        value = self._qs.value(key)
        if not value:
            return {}
        text = value if isinstance(value, str) else str(value)
        try:
            if len(text) > MAX_VALUE_CHARS:
                raise ValueError(f"{len(text):,} characters")
            data = json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: "[[[[…" nested deeper than Python's stack
            log.warning("ignoring damaged setting %s in %s", key, self.file_name())
            return {}
        return data if isinstance(data, dict) else {}
