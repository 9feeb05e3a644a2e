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
        return value if isinstance(value, QByteArray) and not value.isEmpty() else None

    def set_geometry(self, geometry: QByteArray) -> None:
        self._qs.setValue("window/geometry", geometry)

    def splitter_sizes(self) -> list[int] | None:
        raw = self._json("window/splitter")
        sizes = raw.get("sizes")
        if isinstance(sizes, list) and sizes and all(isinstance(s, int) and s >= 0 for s in sizes):
            return sizes
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
        return width if isinstance(width, int) and width > 0 else None

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
        try:
            data = json.loads(str(value))
        except ValueError:
            log.warning("ignoring damaged setting %s in %s", key, self.file_name())
            return {}
        return data if isinstance(data, dict) else {}
