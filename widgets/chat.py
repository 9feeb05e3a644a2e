"""The conversation: user bubbles, streaming assistant bubbles with coloured tokens, notes and stats."""
from __future__ import annotations

import logging
from collections.abc import Sequence

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QGuiApplication, QResizeEvent
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QScrollArea,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from engine.types import Step, Summary
from widgets.token_text import TokenTextView

log = logging.getLogger(__name__)

USER_BUBBLE_WIDTH = 0.75  # share of the viewport a user bubble may take
_FOLLOW_SLACK_PX = 24  # "at the bottom" tolerance, so a near-bottom reader keeps following


def _plain_label(text: str, object_name: str, parent: QWidget) -> QLabel:
    label = QLabel(text, parent)
    label.setObjectName(object_name)
    label.setTextFormat(Qt.TextFormat.PlainText)  # people's text is never HTML
    label.setWordWrap(True)
    label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    return label


class _UserBubble(QWidget):
    """A right-aligned bubble with the user's text."""

    def __init__(self, text: str, parent: QWidget) -> None:
        super().__init__(parent)
        self._text = text
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        row.addStretch(1)
        self.frame = QFrame(self)
        self.frame.setObjectName("userBubble")
        inner = QVBoxLayout(self.frame)
        inner.setContentsMargins(12, 8, 12, 8)
        inner.addWidget(_plain_label(text, "userText", self.frame))
        row.addWidget(self.frame)

    def plain_text(self) -> str:
        return self._text


class _NoteBubble(QLabel):
    """A centred grey line: model loaded, generation stopped, ..."""

    def __init__(self, text: str, parent: QWidget) -> None:
        super().__init__(text, parent)
        self.setObjectName("systemNote")
        self.setTextFormat(Qt.TextFormat.PlainText)
        self.setWordWrap(True)
        self.setAlignment(Qt.AlignmentFlag.AlignHCenter)

    def plain_text(self) -> str:
        return self.text()


class _AssistantBubble(QFrame):
    """Header, the streaming token view, an error line, then stats and Copy / Regenerate."""

    def __init__(self, request_id: int, header: str, parent: QWidget) -> None:
        super().__init__(parent)
        self.setObjectName("assistantBubble")
        self.request_id = request_id
        self.done = False
        self._final_text: str | None = None
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 8, 12, 8)
        layout.setSpacing(4)
        self.header = QLabel(header, self)
        self.header.setObjectName("bubbleHeader")
        self.header.setTextFormat(Qt.TextFormat.PlainText)
        self.header.setVisible(bool(header))
        layout.addWidget(self.header)
        self.view = TokenTextView(self, fit_content=True)
        self.view.setObjectName("assistantText")
        self.view.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        layout.addWidget(self.view)
        self.error = _plain_label("", "bubbleError", self)
        self.error.hide()
        layout.addWidget(self.error)
        footer = QHBoxLayout()
        footer.setContentsMargins(0, 0, 0, 0)
        self.stats = _plain_label("", "statsLine", self)
        self.stats.hide()
        footer.addWidget(self.stats, 1)
        self.copy_button = QToolButton(self)
        self.copy_button.setObjectName("bubbleButton")
        self.copy_button.setText("Copy")
        self.copy_button.setToolTip("Copy this answer as plain text")
        self.regenerate_button = QToolButton(self)
        self.regenerate_button.setObjectName("bubbleButton")
        self.regenerate_button.setText("Regenerate")
        self.regenerate_button.setToolTip("Generate this answer again")
        for button in (self.copy_button, self.regenerate_button):
            button.setCursor(Qt.CursorShape.PointingHandCursor)
            button.hide()
            footer.addWidget(button, 0, Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        layout.addLayout(footer)

    def plain_text(self) -> str:
        return self._final_text if self._final_text is not None else self.view.committed_text()

    def finish(self, final_text: str | None) -> None:
        self.done = True
        self._final_text = final_text
        self.view.finish()
        self.copy_button.show()


class ChatView(QScrollArea):
    """A vertical list of message bubbles that follows the newest text unless the reader scrolled up.

    Streaming touches only the active bubble's TokenTextView; the list relayouts when that
    bubble's height changes (once per batch), never per token.
    """

    regenerate_requested = Signal()  # Regenerate clicked on the last answer

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("chatView")
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self._contents = QWidget(self)
        self._contents.setObjectName("chatContents")
        self._layout = QVBoxLayout(self._contents)
        self._layout.setContentsMargins(14, 14, 14, 14)
        self._layout.setSpacing(12)
        self._layout.addStretch(1)  # keeps bubbles at the top while the chat is short
        self.setWidget(self._contents)
        self._messages: list[QWidget] = []
        self._assistants: dict[int, _AssistantBubble] = {}
        self._colouring = True
        self._show_rejected = True
        self._follow = True
        bar = self.verticalScrollBar()
        bar.rangeChanged.connect(self._on_range_changed)
        bar.valueChanged.connect(self._on_value_changed)

    # --- public API -------------------------------------------------------------------------

    def add_user_message(self, text: str) -> int:
        bubble = _UserBubble(text, self._contents)
        bubble.frame.setMaximumWidth(self._user_width())
        self._follow = True  # the reader just sent this; show it and the answer that follows
        return self._add(bubble)

    def begin_assistant_message(self, request_id: int, header: str) -> None:
        bubble = _AssistantBubble(request_id, header, self._contents)
        bubble.view.set_colouring(self._colouring)
        bubble.view.set_show_rejected(self._show_rejected)
        bubble.copy_button.clicked.connect(lambda: self.copy_message(self._messages.index(bubble)))
        bubble.regenerate_button.clicked.connect(self.regenerate_requested)
        self._assistants[request_id] = bubble
        self._add(bubble)
        self._update_regenerate()

    def append_steps(self, request_id: int, steps: Sequence[Step]) -> None:
        bubble = self._assistants.get(request_id)
        if bubble is None or bubble.done:
            log.debug("steps for unknown or finished request %s ignored", request_id)
            return
        bubble.view.append_steps(steps)

    def finish_assistant_message(self, request_id: int, summary: Summary, stats_text: str) -> None:
        bubble = self._assistants.get(request_id)
        if bubble is None:
            log.debug("finish for unknown request %s ignored", request_id)
            return
        bubble.finish(summary.text)
        bubble.stats.setText(stats_text)
        bubble.stats.setVisible(bool(stats_text))
        self._update_regenerate()

    def fail_assistant_message(self, request_id: int, message: str) -> None:
        """Shows the error in the bubble; the partial answer stays."""
        bubble = self._assistants.get(request_id)
        if bubble is None:
            log.debug("failure for unknown request %s: %s", request_id, message)
            return
        bubble.finish(None)
        bubble.error.setText(f"⚠ {message}")
        bubble.error.show()
        self._update_regenerate()

    def remove_assistant_message(self, request_id: int) -> None:
        """Drops an answer bubble (Regenerate replaces the last answer with a new one)."""
        bubble = self._assistants.pop(request_id, None)
        if bubble is None:
            return
        self._messages.remove(bubble)
        self._layout.removeWidget(bubble)
        bubble.deleteLater()
        self._update_regenerate()

    def add_system_note(self, text: str) -> int:
        return self._add(_NoteBubble(text, self._contents))

    def clear(self) -> None:
        for widget in self._messages:
            self._layout.removeWidget(widget)
            widget.deleteLater()
        self._messages.clear()
        self._assistants.clear()
        self._follow = True

    def set_colouring(self, on: bool) -> None:
        self._colouring = on
        for bubble in self._assistants.values():
            bubble.view.set_colouring(on)

    def set_show_rejected(self, show: bool) -> None:
        self._show_rejected = show
        for bubble in self._assistants.values():
            bubble.view.set_show_rejected(show)

    def message_count(self) -> int:
        return len(self._messages)

    def message_text(self, index: int) -> str:
        """Plain text of a message: for answers, the final text without rejected drafts."""
        return self._messages[index].plain_text()  # type: ignore[attr-defined]

    def copy_message(self, index: int) -> None:
        QGuiApplication.clipboard().setText(self.message_text(index))

    def token_view(self, request_id: int) -> TokenTextView | None:
        """The token view of an answer, for hover tooltips and tests."""
        bubble = self._assistants.get(request_id)
        return bubble.view if bubble is not None else None

    def stats_text(self, request_id: int) -> str:
        """The stats line under an answer ("" while it streams)."""
        bubble = self._assistants.get(request_id)
        return bubble.stats.text() if bubble is not None else ""

    def regenerate_visible(self, request_id: int) -> bool:
        bubble = self._assistants.get(request_id)
        return bubble is not None and not bubble.regenerate_button.isHidden()

    def is_following(self) -> bool:
        """True while the view sticks to the bottom as text streams in."""
        return self._follow

    # --- Qt overrides ---------------------------------------------------------------------------

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        width = self._user_width()
        for widget in self._messages:
            if isinstance(widget, _UserBubble):
                widget.frame.setMaximumWidth(width)

    # --- internals ------------------------------------------------------------------------------

    def _add(self, widget: QWidget) -> int:
        self._layout.insertWidget(self._layout.count() - 1, widget)
        self._messages.append(widget)
        return len(self._messages) - 1

    def _user_width(self) -> int:
        return max(200, int(self.viewport().width() * USER_BUBBLE_WIDTH))

    def _update_regenerate(self) -> None:
        last = next((w for w in reversed(self._messages) if isinstance(w, _AssistantBubble)), None)
        for bubble in self._assistants.values():
            bubble.regenerate_button.setVisible(bubble is last and bubble.done)

    def _on_range_changed(self, _minimum: int, maximum: int) -> None:
        if self._follow:
            self.verticalScrollBar().setValue(maximum)

    def _on_value_changed(self, value: int) -> None:
        self._follow = value >= self.verticalScrollBar().maximum() - _FOLLOW_SLACK_PX
