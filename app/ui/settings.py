"""Persistent settings (QSettings): model choices, generation settings, window geometry, splitter sizes."""
from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

from PySide6.QtCore import QByteArray, QSettings

from engine.settings import GenerationSettings, ModelSelection
from widgets.remote_box import RemoteChoice
from widgets.settings_panel import DisplaySettings

log = logging.getLogger(__name__)

ORGANIZATION = "SpecDec Studio"
APPLICATION = "SpecDec Studio"
SETTINGS_ENV = "SPECDEC_SETTINGS"  # path of an .ini file to use instead of the platform store
VERSION = 1  # bump when the stored layout changes incompatibly
MAX_VALUE_CHARS = 1_000_000  # a stored JSON value longer than this is damage, not settings
MAX_GEOMETRY_BYTES = 4096  # Qt's saved geometry is ~70 bytes; anything huge is not one
MAX_PANE_PIXELS = 100_000  # no screen is wider; Qt's sizes are C ints and overflow beyond 2**31


MAX_FILE_BYTES = 16 << 20  # a settings file this app wrote is a few kB; a larger one is someone else's
GROUPS = ("models", "generation", "display", "window")  # the INI sections this app writes
PANELS = ("sidebar", "settings", "charts")  # the Chat tab's side panels (app/ui/panels.py)


def foreign_reason(path: Path) -> str | None:
    """Why `path` is not a settings file of this app (None: it is, or it does not exist yet).

    Ours: a plain file (a link is judged by what it points at) of UTF-8 INI text whose every
    section is one this app writes. Anything else (a text file, /etc/passwd through a link, binary
    data, a FIFO, a folder) is read-only: this app never rewrites it.
    """
    try:
        st = path.stat()  # follows a link: the file that would be rewritten
    except FileNotFoundError:
        return None if not path.is_symlink() else "a link to a file that does not exist"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if not stat.S_ISREG(st.st_mode):
        return "not a plain file"
    if st.st_size > MAX_FILE_BYTES:
        return f"{st.st_size:,} bytes, far more than a settings file"
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_FILE_BYTES + 1).decode("utf-8")
    except UnicodeDecodeError:
        return "not text"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            if line[1:-1] not in GROUPS:
                return f"it has a section {line[:40]} this app never writes"
        elif line and not line.startswith((";", "#")) and "=" not in line:
            return "not an INI file"
    return None


class AppSettings:
    """Typed access to the QSettings store; every read tolerates a missing or damaged entry.

    A file given by path that is not this app's own (see foreign_reason) is neither read nor written:
    `refused` says why, and the session's settings are not saved.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        path = path if path is not None else os.environ.get(SETTINGS_ENV)
        self.refused: str | None = None  # why the file given is left alone, or None
        self._qs: QSettings | None = None
        self._path = str(path or "")
        if path:
            self.refused = foreign_reason(Path(path))
            if self.refused is None:
                self._qs = QSettings(str(path), QSettings.Format.IniFormat)
            else:
                log.warning("%s is not a SpecDec Studio settings file (%s): it is left untouched and this "
                            "session's settings are not saved", path, self.refused)
        else:
            self._qs = QSettings(QSettings.Format.IniFormat, QSettings.Scope.UserScope, ORGANIZATION, APPLICATION)

    def file_name(self) -> str:
        return self._qs.fileName() if self._qs is not None else self._path

    def sync(self) -> None:
        if self._qs is not None:
            self._qs.sync()

    # --- models -------------------------------------------------------------------------------

    def models(self) -> ModelSelection:
        return ModelSelection.from_dict(self._json("models/selection"))

    def set_models(self, selection: ModelSelection) -> None:
        self._set("models/selection", json.dumps(asdict(selection)))

    def remote(self) -> RemoteChoice:
        """The Models dialog's remote server (its API key is stored like every setting, and never logged)."""
        return RemoteChoice.from_dict(self._json("models/remote"))

    def set_remote(self, choice: RemoteChoice) -> None:
        self._set("models/remote", json.dumps(asdict(choice), ensure_ascii=False))

    # --- generation -----------------------------------------------------------------------------

    def generation(self) -> GenerationSettings:
        return GenerationSettings.from_dict(self._json("generation/settings"))

    def set_generation(self, settings: GenerationSettings) -> None:
        self._set("generation/settings", json.dumps(asdict(settings), ensure_ascii=False))

    def display(self) -> DisplaySettings:
        # Before display settings had their own key they were stored with the generation settings.
        raw = self._json("display/settings") or self._json("generation/settings")
        return DisplaySettings.from_dict(raw)

    def set_display(self, display: DisplaySettings) -> None:
        self._set("display/settings", json.dumps(asdict(display)))

    # --- window ---------------------------------------------------------------------------------

    def geometry(self) -> QByteArray | None:
        value = self._get("window/geometry")
        # restoreGeometry refuses bytes it does not understand, so only the size needs a check here.
        ok = isinstance(value, QByteArray) and 0 < value.size() <= MAX_GEOMETRY_BYTES
        return value if ok else None

    def set_geometry(self, geometry: QByteArray) -> None:
        self._set("window/geometry", geometry)

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
        self._set("window/splitter", json.dumps({"sizes": [int(s) for s in sizes]}))

    def panels(self) -> dict[str, bool]:
        """Which side panels the person wants shown ("sidebar", "settings", "charts"); True unless turned off."""
        raw = self._json("window/view")
        stored = raw.get("panels")
        stored = stored if isinstance(stored, dict) else {"charts": raw.get("charts_visible", True)}  # older files
        return {name: stored.get(name, True) is not False for name in PANELS}

    def set_panels(self, wanted: Mapping[str, bool]) -> None:
        self._set("window/view", json.dumps({"panels": {name: bool(wanted.get(name, True)) for name in PANELS}}))

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
        self._set("window/appearance", json.dumps(raw))

    # --- internals ------------------------------------------------------------------------------

    def _get(self, key: str) -> object:
        return self._qs.value(key) if self._qs is not None else None

    def _set(self, key: str, value: object) -> None:
        if self._qs is not None:  # a refused file is never written
            self._qs.setValue(key, value)

    def _json(self, key: str) -> dict:
        # JSON strings rather than QSettings' own types: INI files round-trip them exactly on every OS.
        value = self._get(key)
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
