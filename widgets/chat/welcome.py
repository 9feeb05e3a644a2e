"""The empty state of a new conversation: what the app does in one line, and example prompts that fill the box."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QGridLayout, QLabel, QPushButton, QSizePolicy, QVBoxLayout, QWidget

TAGLINE = ("Chat with a local model while a small draft model guesses ahead: the big model checks several "
           "guessed words in one pass, so the answer comes faster and is exactly the same.")


@dataclass(frozen=True)
class Example:
    category: str  # "Code", "Explain", "Translate", "Summarise"
    title: str  # what the button says
    prompt: str  # what goes into the message box


@lru_cache(maxsize=1)
def welcome_examples() -> tuple[Example, ...]:
    """assets/welcome_prompts.json, in file order."""
    raw = json.loads(resources.files("assets").joinpath("welcome_prompts.json").read_text(encoding="utf-8"))
    return tuple(Example(c["name"], e["title"], e["prompt"]) for c in raw["categories"] for e in c["examples"])


class ExampleButton(QPushButton):
    """A button whose title elides at its width (never cut mid-word by the frame); the prompt is its tooltip."""

    def __init__(self, title: str, parent: QWidget) -> None:
        super().__init__(title, parent)
        self.title = title
        self.setMinimumWidth(60)

    def sizeHint(self):
        hint = super().sizeHint()
        hint.setWidth(self.fontMetrics().horizontalAdvance(self.title) + 24)
        return hint

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self.setText(self.fontMetrics().elidedText(self.title, Qt.TextElideMode.ElideRight, max(0, self.width() - 20)))


class WelcomePane(QWidget):
    """A heading, the tagline, and one column of example buttons per category (two columns when narrow)."""

    example_chosen = Signal(str)  # the prompt of the example clicked

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("welcomePane")
        outer = QVBoxLayout(self)
        outer.setContentsMargins(24, 28, 24, 12)
        outer.setSpacing(10)
        title = QLabel("What would you like to ask?", self)
        title.setObjectName("welcomeTitle")
        title.setAlignment(Qt.AlignmentFlag.AlignHCenter)
        tagline = QLabel(TAGLINE, self)
        tagline.setObjectName("welcomeTagline")
        tagline.setWordWrap(True)
        tagline.setAlignment(Qt.AlignmentFlag.AlignHCenter)
        outer.addWidget(title)
        outer.addWidget(tagline)
        self._grid = QGridLayout()
        self._grid.setHorizontalSpacing(10)
        self._grid.setVerticalSpacing(6)
        outer.addLayout(self._grid)
        hint = QLabel("Click an example to put it in the message box, then edit it or press Enter.", self)
        hint.setObjectName("welcomeHint")
        hint.setWordWrap(True)
        hint.setAlignment(Qt.AlignmentFlag.AlignHCenter)
        outer.addWidget(hint)
        self.buttons: list[ExampleButton] = []
        self._headers: dict[str, QLabel] = {}
        self._columns = 0
        for example in welcome_examples():
            if example.category not in self._headers:
                header = QLabel(example.category, self)
                header.setObjectName("welcomeCategory")
                self._headers[example.category] = header
            button = ExampleButton(example.title, self)
            button.setObjectName("exampleButton")
            button.setToolTip(example.prompt)
            button.setCursor(Qt.CursorShape.PointingHandCursor)
            button.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)  # narrow: elided by width
            button.setProperty("category", example.category)
            button.clicked.connect(lambda _=False, text=example.prompt: self.example_chosen.emit(text))
            self.buttons.append(button)
        self._arrange(4)

    def categories(self) -> list[str]:
        return list(self._headers)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._arrange(4 if self.width() >= 720 else 2 if self.width() >= 360 else 1)

    def _arrange(self, columns: int) -> None:
        # Categories side by side when there is room; wrapped onto more rows when narrow.
        if columns == self._columns:
            return
        self._columns = columns
        while self._grid.count():
            self._grid.takeAt(0)
        row_of: dict[str, int] = {}
        band = 1 + max(sum(b.property("category") == c for b in self.buttons) for c in self._headers)
        for i, category in enumerate(self._headers):
            base_row, column = (i // columns) * band, i % columns
            row_of[category] = base_row
            self._grid.addWidget(self._headers[category], base_row, column)
        used: dict[str, int] = {}
        for button in self.buttons:
            category = button.property("category")
            used[category] = used.get(category, 0) + 1
            column = list(self._headers).index(category) % columns
            self._grid.addWidget(button, row_of[category] + used[category], column)
        for column in range(4):
            self._grid.setColumnStretch(column, 1 if column < columns else 0)
