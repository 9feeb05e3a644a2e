"""A one-line label that elides its text at its width (never cut mid-word by the frame); the whole text is its tooltip."""
from __future__ import annotations

from PySide6.QtCore import QSize, Qt
from PySide6.QtWidgets import QLabel, QSizePolicy, QWidget

MIN_WIDTH = 48  # px a status bar may squeeze it to


class ElidedLabel(QLabel):
    """`setText` keeps the whole text; what shows is elided with "…" to the width it gets. The tooltip is
    the whole text when it does not fit, followed by `setToolTip`'s detail (the technical figures)."""

    def __init__(self, text: str = "", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setTextFormat(Qt.TextFormat.PlainText)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Preferred)
        self._full = ""
        self._detail = ""
        self.setText(text)

    def text(self) -> str:  # the whole text, not the elided one shown
        return self._full

    def shown_text(self) -> str:
        return super().text()

    def is_elided(self) -> bool:
        return super().text() != self._full

    def detail(self) -> str:
        return self._detail

    def setText(self, text: str) -> None:
        self._full = text
        self.updateGeometry()
        self._refit()

    def setToolTip(self, detail: str) -> None:
        self._detail = detail
        self._refit()

    def sizeHint(self) -> QSize:
        hint = super().sizeHint()
        return QSize(self.fontMetrics().horizontalAdvance(self._full) + 8, hint.height())

    def minimumSizeHint(self) -> QSize:
        return QSize(min(MIN_WIDTH, self.sizeHint().width()), super().minimumSizeHint().height())

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._refit()

    def _refit(self) -> None:
        shown = self.fontMetrics().elidedText(self._full, Qt.TextElideMode.ElideRight, max(0, self.width() - 4))
        if shown != super().text():
            super().setText(shown)
        parts = [self._full] if shown != self._full else []
        if self._detail and self._detail != self._full:
            parts.append(self._detail)
        super().setToolTip("\n\n".join(parts))
