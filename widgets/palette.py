"""The one token/chart palette (assets/palette.json) and the stylesheet, loaded once for every view."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any

from PySide6.QtGui import QColor

from engine.types import TokenStatus

STATUSES: tuple[TokenStatus, ...] = ("accepted", "rejected", "corrected", "bonus", "target")
THEMES: tuple[str, ...] = ("light", "dark")
REJECTED_DISPLAYS: tuple[str, ...] = ("mark", "flash")  # how rejected drafts show while an answer streams


@dataclass(frozen=True)
class StatusColours:
    background: QColor  # token background in text views and legend chips
    foreground: QColor  # token text colour
    chart: QColor  # saturated variant for curves and bars (pale backgrounds vanish on white plots)


@dataclass(frozen=True)
class GhostStyle:
    foreground_alpha: float  # 0..1, how much of the text colour a rejected ghost keeps
    background_alpha: float  # 0..1, how much of its background it keeps
    strikeout: bool  # a flashed ghost is struck through (off: a strike inside a word reads as a dash)
    display: str = "mark"  # "mark": a small mark where drafts were rejected; "flash": shown briefly, then a mark
    mark: QColor = field(default_factory=lambda: QColor("#d92d20"))  # the mark's colour


@dataclass(frozen=True)
class Palette:
    theme: str  # "light" or "dark"
    statuses: dict[str, StatusColours]  # one entry per TokenStatus
    ghost: GhostStyle  # how rejected draft tokens are faded
    text: QColor  # default text colour (plain reading mode)
    muted: QColor  # secondary text: stats lines, notes, faded ghosts without colouring
    code: dict[str, str] = field(default_factory=dict)  # code highlighting: role -> "#rrggbb" (plain, for threads)
    chart: dict[str, str] = field(default_factory=dict)  # plot background / foreground / legend colours
    ui: dict[str, str] = field(default_factory=dict)  # the stylesheet's @names -> colours

    def colours(self, status: str) -> StatusColours:
        return self.statuses[status]

    def ghost_colours(self, status: str) -> StatusColours:
        """The faded variant used for rejected tokens."""
        c = self.statuses[status]
        return StatusColours(
            background=_with_alpha(c.background, self.ghost.background_alpha),
            foreground=_with_alpha(c.foreground, self.ghost.foreground_alpha),
            chart=c.chart,
        )


def _with_alpha(colour: QColor, alpha: float) -> QColor:
    faded = QColor(colour)
    faded.setAlphaF(max(0.0, min(1.0, alpha)))
    return faded


def _parse(theme: str, raw: dict[str, Any]) -> Palette:
    statuses = {}
    for status in STATUSES:
        entry = raw["statuses"][status]
        statuses[status] = StatusColours(
            background=QColor(entry["background"]),
            foreground=QColor(entry["foreground"]),
            chart=QColor(entry["chart"]),
        )
    ghost = raw.get("ghost", {})
    return Palette(
        theme=theme,
        statuses=statuses,
        ghost=GhostStyle(
            foreground_alpha=float(ghost.get("foreground_alpha", 0.6)),
            background_alpha=float(ghost.get("background_alpha", 0.45)),
            strikeout=bool(ghost.get("strikeout", False)),
            display=str(ghost.get("display", "mark")) if ghost.get("display") in REJECTED_DISPLAYS else "mark",
            mark=QColor(ghost.get("mark", raw["statuses"]["rejected"]["chart"])),
        ),
        text=QColor(raw.get("text", "#1f2328")),
        muted=QColor(raw.get("muted", "#6b7280")),
        code=dict(raw.get("code", {})),
        chart=dict(raw.get("chart", {})),
        ui=dict(raw.get("ui", {})),
    )


@lru_cache(maxsize=None)
def load_palette(theme: str = "light") -> Palette:
    """Reads assets/palette.json; cached so every view shares the same objects."""
    if theme not in THEMES:
        raise ValueError(f"unknown theme {theme!r}; choose one of {', '.join(THEMES)}")
    raw = json.loads(resources.files("assets").joinpath("palette.json").read_text(encoding="utf-8"))
    return _parse(theme, raw["themes"][theme])


_current_theme = "light"


def current_palette() -> Palette:
    """The palette every widget paints with; views read it when they (re)build their formats."""
    return load_palette(_current_theme)


def set_current_theme(theme: str) -> None:
    """Switches the shared palette; views pick it up on their next re-render."""
    global _current_theme
    load_palette(theme)  # validates before switching
    _current_theme = theme


def current_theme() -> str:
    return _current_theme


_NAME = re.compile(r"@([a-z_]+)")


def load_stylesheet(theme: str | None = None) -> str:
    """assets/style.qss with every @name filled from the theme's colours (the current theme by default)."""
    palette = load_palette(theme or _current_theme)
    values = dict(palette.ui)
    values.update({f"code_{k}": v for k, v in palette.code.items()})
    folder = resources.files("assets")
    values["assets"] = str(folder).replace("\\", "/")  # url(@assets/icons/…): Qt reads forward slashes everywhere
    template = folder.joinpath("style.qss").read_text(encoding="utf-8")

    def fill(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in values:
            raise KeyError(f"style.qss uses @{name}, which palette.json's {palette.theme!r} theme does not define")
        return values[name]

    return _NAME.sub(fill, template)
