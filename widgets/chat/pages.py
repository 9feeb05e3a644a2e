"""The chat's scrolling column: messages in pages, shown and destroyed on a time budget, following the end."""
from __future__ import annotations

import time
from collections import deque

import shiboken6
from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QFrame, QScrollArea, QVBoxLayout, QWidget

PAGE_SIZE = 8  # messages per page: a change relayouts its page and the list of pages, not every message
BURY_BUDGET_S = 0.012  # removed messages are destroyed for at most this long per event-loop turn
_FOLLOW_SLACK_PX = 24  # "at the bottom" tolerance, so a near-bottom reader keeps following


class PagedColumn(QScrollArea):
    """A vertical column of message widgets that follows the newest unless the reader scrolled up.

    With a hundred long messages, what costs is not the messages but relayouts and deletions; so
    messages live in pages of PAGE_SIZE (a change relayouts one page and the list of pages), are shown
    as they are added (not as a queued show that runs later all at once), and removed ones are
    destroyed a few per event-loop turn.
    """

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self._messages: list[QWidget] = []  # every message widget, in order
        self._follow = True
        self._graveyard: deque[QWidget] = deque()  # removed widgets, destroyed on a time budget
        self._graveyard_timer = QTimer(self)
        self._graveyard_timer.setInterval(0)
        self._graveyard_timer.timeout.connect(self._bury_some)
        self._new_contents()
        bar = self.verticalScrollBar()
        bar.rangeChanged.connect(self._on_range_changed)
        bar.valueChanged.connect(self._on_value_changed)

    def is_following(self) -> bool:
        """True while the view sticks to the bottom as text streams in."""
        return self._follow

    def _add(self, widget: QWidget) -> int:
        if not self._pages or self._pages[-1].layout().count() >= PAGE_SIZE:
            page = QWidget(self._contents)
            page.setObjectName("chatPage")
            column = QVBoxLayout(page)
            column.setContentsMargins(0, 0, 0, 0)
            column.setSpacing(self._layout.spacing())
            self._layout.insertWidget(self._layout.count() - 1, page)
            page.show()
            self._pages.append(page)
        self._pages[-1].layout().addWidget(widget)
        # Shown now, inside the caller's time budget: a layout would otherwise queue the show, and a
        # conversation's worth of queued shows runs as one long stall.
        widget.show()
        self._messages.append(widget)
        return len(self._messages) - 1

    def _swap_contents(self) -> None:
        # The whole column is swapped for an empty one at once; the old widgets (hidden with it, never
        # reparented: that would re-polish and re-wrap every text) are destroyed a few per turn.
        old = self._contents
        old.hide()
        self._holder.layout().removeWidget(old)
        self._graveyard.extend(self._messages)
        self._graveyard.append(old)
        self._graveyard_timer.start()
        self._new_contents()
        self._messages.clear()

    def _new_contents(self) -> None:
        if not hasattr(self, "_holder"):
            # The scroll area's one widget; the list of messages inside it is swapped on clear().
            self._holder = QWidget(self)
            self._holder.setObjectName("chatContents")
            holder_layout = QVBoxLayout(self._holder)
            holder_layout.setContentsMargins(0, 0, 0, 0)
            self.setWidget(self._holder)
        self._contents = QWidget(self._holder)
        self._contents.setObjectName("chatContents")
        self._layout = QVBoxLayout(self._contents)
        self._layout.setContentsMargins(14, 14, 14, 14)
        self._layout.setSpacing(12)
        self._layout.addStretch(1)  # keeps bubbles at the top while the chat is short
        self._pages: list[QWidget] = []  # containers of PAGE_SIZE messages each, in order
        self._holder.layout().addWidget(self._contents)

    def _discard(self, widget: QWidget) -> None:
        # Hidden now, destroyed a few at a time: deleting a long conversation's bubbles at once
        # (deleteLater) would stall the UI for hundreds of ms when another conversation opens.
        page = widget.parentWidget()
        if page is not None and page.layout() is not None:
            page.layout().removeWidget(widget)
        widget.hide()
        self._graveyard.append(widget)
        if page in self._pages and page.layout().count() == 0:  # an empty page goes too
            self._pages.remove(page)
            self._layout.removeWidget(page)
            page.hide()
            self._graveyard.append(page)
        self._graveyard_timer.start()

    def _bury_some(self) -> None:
        deadline = time.perf_counter() + BURY_BUDGET_S
        while self._graveyard and time.perf_counter() < deadline:
            widget = self._graveyard.popleft()
            if shiboken6.isValid(widget):
                shiboken6.delete(widget)  # safe here: no handler of this widget is running (a timer is)
        if not self._graveyard:
            self._graveyard_timer.stop()

    def _on_range_changed(self, _minimum: int, maximum: int) -> None:
        if self._follow:
            self.verticalScrollBar().setValue(maximum)

    def _on_value_changed(self, value: int) -> None:
        self._follow = value >= self.verticalScrollBar().maximum() - _FOLLOW_SLACK_PX
