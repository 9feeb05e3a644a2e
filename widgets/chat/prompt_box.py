"""The message box under the chat: Enter sends, Shift+Enter breaks the line, Esc stops; Send turns into Stop."""
from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QHBoxLayout, QPlainTextEdit, QPushButton, QSizePolicy, QWidget

MIN_LINES, MAX_LINES = 2, 8  # the box grows with its text between these
# The placeholder, longest first: the longest that fits the box is shown (never one cut at the edge).
PLACEHOLDERS = ("Type a message…  (Enter to send, Shift+Enter for a new line)", "Type a message…  (Enter to send)",
                "Type a message…", "Message…")


class PromptEdit(QPlainTextEdit):
    """A plain-text editor whose Enter submits instead of inserting a newline."""

    submitted = Signal()  # Enter (without Shift) pressed
    stop_pressed = Signal()  # Esc pressed

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("promptEdit")
        self.setPlaceholderText(PLACEHOLDERS[0])
        self.setToolTip("Enter sends, Shift+Enter starts a new line, Esc stops the answer")
        self.setTabChangesFocus(True)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.document().documentLayout().documentSizeChanged.connect(self._fit_height)
        self._fit_height()

    def keyPressEvent(self, event: QKeyEvent) -> None:
        key, mods = event.key(), event.modifiers()
        if key in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            if mods & Qt.KeyboardModifier.ShiftModifier:
                # Shift+Enter would insert a paragraph separator; a plain newline is what people expect.
                self.insertPlainText("\n")
            else:
                self.submitted.emit()
            event.accept()
            return
        if key == Qt.Key.Key_Escape:
            self.stop_pressed.emit()
            event.accept()
            return
        super().keyPressEvent(event)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        room = self.viewport().width() - 2 * self.document().documentMargin() - 4
        metrics = self.fontMetrics()
        fits = next((p for p in PLACEHOLDERS if metrics.horizontalAdvance(p) <= room), PLACEHOLDERS[-1])
        if fits != self.placeholderText():
            self.setPlaceholderText(fits)

    def _fit_height(self, *_: object) -> None:
        line = self.fontMetrics().lineSpacing()
        lines = max(MIN_LINES, min(MAX_LINES, int(self.document().size().height())))
        margins = self.contentsMargins()
        doc_margin = 2 * self.document().documentMargin()
        self.setFixedHeight(int(lines * line + doc_margin + margins.top() + margins.bottom()) + 4)


class PromptBox(QWidget):
    """PromptEdit plus one button that reads Send, or Stop while an answer streams."""

    send_requested = Signal(str)  # the text to send (already stripped; never empty)
    stop_requested = Signal()  # Stop clicked or Esc pressed while generating

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("promptBox")
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        row.setSpacing(8)
        self.edit = PromptEdit(self)
        row.addWidget(self.edit, 1)
        self.button = QPushButton("Send", self)
        self.button.setObjectName("primaryButton")
        self.button.setMinimumWidth(84)
        self.button.setCursor(Qt.CursorShape.PointingHandCursor)
        row.addWidget(self.button, 0, Qt.AlignmentFlag.AlignBottom)
        self._generating = False
        self._ready = True
        self._not_ready_reason = ""
        self.edit.submitted.connect(self._on_submit)
        self.edit.stop_pressed.connect(self._on_stop)
        self.button.clicked.connect(self._on_button)
        self._update_button()

    # --- public API -------------------------------------------------------------------------

    def text(self) -> str:
        return self.edit.toPlainText()

    def set_text(self, text: str) -> None:
        self.edit.setPlainText(text)

    def set_generating(self, generating: bool) -> None:
        self._generating = generating
        self._update_button()

    def set_ready(self, ready: bool, reason: str = "") -> None:
        """While not ready (models loading) Send is disabled and says why; typing stays possible."""
        self._ready = ready
        self._not_ready_reason = reason
        self._update_button()

    # --- internals ------------------------------------------------------------------------------

    def _update_button(self) -> None:
        if self._generating:
            self.button.setText("Stop")
            self.button.setEnabled(True)
            self.button.setToolTip("Stop generating (Esc)")
        else:
            self.button.setText("Send")
            self.button.setEnabled(self._ready)
            self.button.setToolTip("Send (Enter)" if self._ready else self._not_ready_reason)
        # Re-polish so the stylesheet picks up the changed text/enabled state at once.
        self.button.style().unpolish(self.button)
        self.button.style().polish(self.button)

    def _on_submit(self) -> None:
        if self._generating or not self._ready:
            return
        text = self.edit.toPlainText().strip()
        if not text:
            return
        self.edit.clear()
        self.send_requested.emit(text)

    def _on_stop(self) -> None:
        if self._generating:
            self.stop_requested.emit()

    def _on_button(self) -> None:
        if self._generating:
            self.stop_requested.emit()
        else:
            self._on_submit()
