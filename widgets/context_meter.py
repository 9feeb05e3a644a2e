"""How much of the model's context the conversation and the message being typed would use."""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QHBoxLayout, QLabel, QProgressBar, QWidget

WARN_SHARE = 0.8  # from this share of the context on, the meter turns amber


def level(used: int, limit: int) -> str:
    """"ok", "warn" or "full" (the next request would be refused or cut)."""
    if limit <= 0:
        return "ok"
    if used >= limit:
        return "full"
    return "warn" if used >= WARN_SHARE * limit else "ok"


class ContextMeter(QWidget):
    """A thin bar and "1,234 / 32,768 tokens of context"; its colour says ok / nearly full / full."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("contextMeter")
        row = QHBoxLayout(self)
        row.setContentsMargins(2, 0, 2, 0)
        row.setSpacing(8)
        self.bar = QProgressBar(self)
        self.bar.setObjectName("contextBar")
        self.bar.setTextVisible(False)
        self.bar.setFixedHeight(4)
        self.bar.setRange(0, 1000)
        self.label = QLabel("", self)
        self.label.setObjectName("contextLabel")
        self.label.setTextFormat(Qt.TextFormat.PlainText)
        row.addWidget(self.bar, 1)
        row.addWidget(self.label)
        self._used = 0
        self._limit = 0
        self.set_usage(0, 0)

    def set_usage(self, used: int, limit: int, *, dropped: int = 0) -> None:
        """`used` tokens of `limit` (0: unknown, no model); `dropped` oldest messages left out."""
        self._used, self._limit = used, limit
        if limit <= 0:
            self.bar.setValue(0)
            self.label.setText("Context: load a model to measure")
            self._set_level("ok")
            return
        self.bar.setValue(min(1000, round(1000 * used / limit)))
        text = f"{used:,} / {limit:,} tokens of context"
        if dropped:
            text += f" · {dropped} oldest message{'s' if dropped > 1 else ''} left out"
        elif used >= limit:
            text += " · too long to send"
        self.label.setText(text)
        self.setToolTip("The system prompt, the conversation shown and the message being typed, as the "
                        "model's tokenizer counts them, against the model's context window.")
        self._set_level(level(used, limit))

    def usage(self) -> tuple[int, int]:
        return self._used, self._limit

    def level(self) -> str:
        return str(self.bar.property("level") or "ok")

    def _set_level(self, name: str) -> None:
        if self.bar.property("level") != name:
            self.bar.setProperty("level", name)
            self.bar.style().unpolish(self.bar)
            self.bar.style().polish(self.bar)
