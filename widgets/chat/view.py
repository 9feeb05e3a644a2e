"""The conversation: questions, streaming answers with coloured tokens (markdown once done), notes and stats."""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from PySide6.QtCore import QTimer, Signal
from PySide6.QtGui import QGuiApplication, QResizeEvent
from PySide6.QtWidgets import QWidget

from engine.types import Step, Summary
from widgets.chat.bubbles import AssistantBubble, HintBubble, NoteBubble, UserBubble
from widgets.chat.pages import PagedColumn
from widgets.chat.markdown import MarkdownView, shared_renderer
from widgets.chat.welcome import WelcomePane
from widgets.token_text import TokenTextView

log = logging.getLogger(__name__)

USER_BUBBLE_WIDTH = 0.75  # share of the viewport a user bubble may take
BUILD_BUDGET_S = 0.012  # bubbles are built for at most this long per event-loop turn when a conversation opens
_view_ids = itertools.count(1)


@dataclass(frozen=True)
class ShownMessage:
    """One message of a saved conversation, as the chat shows it (plain data from the app)."""

    role: str  # "user", "assistant" or "note"
    text: str  # the message (an answer's committed text)
    key: str = ""  # the turn id, echoed back in edit / branch signals
    branch: tuple[int, int] = (0, 1)  # (index, count) among the alternatives at this place
    request_id: int = 0  # answers: the id the chat knows the bubble by
    header: str = ""  # answers: model and settings line
    # answers: tokens to colour, or a function that makes them when first shown (None: saved without them)
    steps: tuple[Step, ...] | Callable[[], Sequence[Step]] | None = None
    stats: str = ""  # answers: the figures line, in plain words
    stats_detail: str = ""  # answers: the same with every figure (the line's tooltip)
    error: str = ""  # answers: why it failed, if it did


class ChatView(PagedColumn):
    """A vertical list of message bubbles that follows the newest text unless the reader scrolled up.

    Streaming touches only the active bubble's TokenTextView; the list relayouts when that
    bubble's height changes (once per batch), never per token.
    """

    regenerate_requested = Signal(int)  # Regenerate clicked on an answer: its request id
    edit_submitted = Signal(str, str)  # a question was edited and sent again: turn key, new text
    branch_requested = Signal(str, int)  # show another version of a message: turn key, -1 / +1
    loading_finished = Signal()  # show_messages() has built every bubble
    example_chosen = Signal(str)  # an example prompt of the welcome pane was clicked: its text

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("chatView")
        self._assistants: dict[int, AssistantBubble] = {}
        self._colouring = True
        self._show_rejected = True
        self._markdown = True  # finished answers rendered as markdown (the global preference)
        self._busy = False  # an answer is streaming: no Edit / Regenerate meanwhile
        self._view_id = next(_view_ids)
        self._queue: list[ShownMessage] = []  # show_messages() still to build
        self._building = False
        self._load_timer = QTimer(self)
        self._load_timer.setInterval(0)
        self._load_timer.timeout.connect(lambda: self._build_some())
        # Rendered answers arrive in bursts (a conversation opened); one is applied per event-loop turn,
        # so input and painting get their turn between them.
        self._rendered: deque[tuple[int, tuple]] = deque()
        self._apply_timer = QTimer(self)
        self._apply_timer.setInterval(0)
        self._apply_timer.timeout.connect(self._apply_one)
        shared_renderer().rendered.connect(self._on_rendered)
        # The empty state: above the (empty) list of messages, hidden as soon as there is one.
        self.welcome = WelcomePane(self._holder)
        self._holder.layout().insertWidget(0, self.welcome)
        self.welcome.example_chosen.connect(self.example_chosen)
        self._hint: HintBubble | None = None  # the hint shown at the end, if any

    # --- public API -------------------------------------------------------------------------

    def add_user_message(self, text: str, key: str = "", branch: tuple[int, int] = (0, 1)) -> int:
        self._drain()
        bubble = UserBubble(text, key, self._contents)
        bubble.frame.setMaximumWidth(self._user_width())
        bubble.branches.set_branch(*branch)
        bubble.copy_requested.connect(lambda: self.copy_message(self._messages.index(bubble)))
        bubble.edit_submitted.connect(lambda text: self.edit_submitted.emit(bubble.key, text))
        bubble.branches.moved.connect(lambda delta: self.branch_requested.emit(bubble.key, delta))
        bubble.edit_button.setVisible(bool(key) and not self._busy)
        self._follow = True  # the reader just sent this; show it and the answer that follows
        return self._add(bubble)

    def begin_assistant_message(self, request_id: int, header: str, key: str = "",
                                branch: tuple[int, int] = (0, 1)) -> None:
        self._drain()
        bubble = self._new_assistant(request_id, header, key, branch)
        self._add(bubble)
        self._update_regenerate(bubble)

    def add_answer(self, message: ShownMessage) -> None:
        """A finished answer from a saved conversation: tokens replayed lazily, markdown rendered off-thread.

        The bubble is complete before it is shown (one layout, not one per label)."""
        self._drain()
        bubble = self._new_assistant(message.request_id, message.header, message.key, message.branch)
        bubble.has_tokens = message.steps is not None
        if message.steps is not None:
            if self._markdown and message.text:
                bubble.set_pending_steps(message.steps)  # built only if someone asks for the tokens
            else:
                bubble.view.append_steps(message.steps() if callable(message.steps) else message.steps)
        bubble.finish(message.text)
        if message.error:
            bubble.error.setText(f"⚠ {message.error}")
            bubble.error.show()
        bubble.stats.setText(message.stats)
        bubble.stats.setToolTip(message.stats_detail)
        bubble.stats.setVisible(bool(message.stats))
        self._finish_view(bubble)
        self._update_regenerate(bubble)
        self._add(bubble)

    def _new_assistant(self, request_id: int, header: str, key: str, branch: tuple[int, int]) -> AssistantBubble:
        bubble = AssistantBubble(request_id, header, key, self._contents)
        bubble.view.set_colouring(self._colouring)
        bubble.view.set_show_rejected(self._show_rejected)
        bubble.branches.set_branch(*branch)
        bubble.copy_button.clicked.connect(lambda: self.copy_message(self._messages.index(bubble)))
        bubble.regenerate_button.clicked.connect(lambda: self.regenerate_requested.emit(bubble.request_id))
        bubble.tokens_button.toggled.connect(lambda tokens: self._toggle(bubble, not tokens))
        bubble.branches.moved.connect(lambda delta: self.branch_requested.emit(bubble.key, delta))
        self._assistants[request_id] = bubble
        return bubble

    def show_messages(self, messages: Sequence[ShownMessage]) -> None:
        """Replaces the chat with a saved conversation, built a few bubbles per event-loop turn."""
        self.clear()
        self.append_messages(messages)

    def append_messages(self, messages: Sequence[ShownMessage]) -> None:
        """Adds saved messages at the end, a few per event-loop turn (anything added later goes after them)."""
        self._queue.extend(messages)
        if any(m.role in ("user", "assistant") for m in messages):
            self.welcome.hide()
        if self._queue:
            self._load_timer.start()

    def keys(self) -> list[str]:
        """Turn keys of the questions and answers shown, in order (queued ones built first)."""
        self._drain()
        return [w.key for w in self._messages if isinstance(w, (UserBubble, AssistantBubble)) and w.key]

    def truncate_from(self, key: str) -> None:
        """Removes the message with this key and everything after it (a fork shows another branch)."""
        self._drain()
        index = next((i for i, w in enumerate(self._messages)
                      if isinstance(w, (UserBubble, AssistantBubble)) and w.key == key), None)
        if index is None:
            return
        for widget in self._messages[index:]:
            self._discard(widget)
            if isinstance(widget, AssistantBubble):
                self._assistants.pop(widget.request_id, None)
        del self._messages[index:]
        self._update_regenerate()
        self._update_welcome()

    def is_loading(self) -> bool:
        return bool(self._queue)

    def set_branch(self, key: str, index: int, count: int) -> None:
        for widget in self._messages:
            if isinstance(widget, (UserBubble, AssistantBubble)) and widget.key == key:
                widget.branches.set_branch(index, count)

    def append_steps(self, request_id: int, steps: Sequence[Step]) -> None:
        bubble = self._assistants.get(request_id)
        if bubble is None or bubble.done:
            log.debug("steps for unknown or finished request %s ignored", request_id)
            return
        if bubble.progress.isVisibleTo(bubble):  # the answer has begun: the prompt has been read
            bubble.show_progress("")
        bubble.view.append_steps(steps)

    def show_progress(self, request_id: int, text: str) -> None:
        """A line in an answer's bubble before its first token (how far the prompt has been read)."""
        bubble = self._assistants.get(request_id)
        if bubble is not None and not bubble.done:
            bubble.show_progress(text)

    def progress_text(self, request_id: int) -> str:
        """The bubble's progress line as shown ("" when hidden)."""
        bubble = self._assistants.get(request_id)
        return bubble.progress.text() if bubble is not None and bubble.progress.isVisibleTo(bubble) else ""

    def finish_assistant_message(self, request_id: int, summary: Summary, stats_text: str,
                                 stats_detail: str = "") -> None:
        bubble = self._assistants.get(request_id)
        if bubble is None:
            log.debug("finish for unknown request %s ignored", request_id)
            return
        bubble.finish(summary.text)
        bubble.stats.setText(stats_text)
        bubble.stats.setToolTip(stats_detail)
        bubble.stats.setVisible(bool(stats_text))
        self._finish_view(bubble)
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
        self._discard(bubble)
        self._update_regenerate()
        self._update_welcome()

    def show_hint(self, text: str, choices: Sequence[str], on_choice: Callable[[int], None]) -> HintBubble:
        """A hint with buttons at the end of the chat; `on_choice(index)` when one is clicked (-1: Cancel).
        It goes once answered, or when the next message is added."""
        self.dismiss_hint()
        self._drain()
        hint = HintBubble(text, choices, self._contents)
        self._hint = hint

        def chosen(index: int) -> None:
            self.dismiss_hint()
            on_choice(index)

        hint.chosen.connect(chosen)
        self._add(hint)
        return hint

    def hint(self) -> HintBubble | None:
        return self._hint

    def dismiss_hint(self) -> None:
        hint, self._hint = self._hint, None
        if hint is not None and hint in self._messages:
            self._messages.remove(hint)
            self._discard(hint)
            self._update_welcome()

    def add_system_note(self, text: str) -> int:
        self._drain()
        return self._add(NoteBubble(text, self._contents))

    def clear(self) -> None:
        self._queue = []
        self._load_timer.stop()
        self._hint = None  # goes with the old contents
        self._swap_contents()
        self._assistants.clear()
        self._follow = True
        self._update_welcome()

    def set_busy(self, busy: bool) -> None:
        """While an answer streams, Edit and Regenerate wait (one generation at a time)."""
        self._busy = busy
        for widget in self._messages:
            if isinstance(widget, UserBubble):
                widget.edit_button.setVisible(bool(widget.key) and not busy)
        self._update_regenerate()

    def set_render_markdown(self, on: bool) -> None:
        """The global preference: finished answers formatted (True) or as coloured tokens (False)."""
        self._markdown = on
        for bubble in self._assistants.values():
            if bubble.done and bubble.plain_text().strip():
                self._toggle(bubble, on)

    def render_markdown(self) -> bool:
        return self._markdown

    def refresh_theme(self) -> None:
        """The palette changed: token colours rebuilt, rendered answers rendered again (code colours)."""
        for bubble in self._assistants.values():
            bubble.view.refresh_palette()
            if bubble.segments is not None:
                bubble.segments = None
                self._request_render(bubble, force=True)

    def set_colouring(self, on: bool) -> None:
        self._colouring = on
        for bubble in self._assistants.values():
            bubble.view.set_colouring(on)

    def set_show_rejected(self, show: bool) -> None:
        self._show_rejected = show
        for bubble in self._assistants.values():
            bubble.view.set_show_rejected(show)

    def showing_welcome(self) -> bool:
        """True while the chat is empty and shows the welcome pane."""
        return not self.welcome.isHidden()

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
        if bubble is None:
            return None
        bubble.ensure_tokens()
        return bubble.view

    def markdown_view(self, request_id: int) -> MarkdownView | None:
        """The rendered answer, once it is rendered and shown (None while tokens are shown)."""
        bubble = self._assistants.get(request_id)
        return bubble.markdown if bubble is not None and bubble.showing_markdown() else None

    def set_answer_markdown(self, request_id: int, on: bool) -> None:
        """The per-answer toggle (the bubble's Tokens button)."""
        bubble = self._assistants.get(request_id)
        if bubble is not None and bubble.done:
            self._toggle(bubble, on)

    def answer_ids(self) -> list[int]:
        return [w.request_id for w in self._messages if isinstance(w, AssistantBubble)]

    def user_bubble(self, index: int) -> UserBubble | None:
        """The index-th question shown (0-based), for edits and tests."""
        users = [w for w in self._messages if isinstance(w, UserBubble)]
        return users[index] if 0 <= index < len(users) else None

    def stats_text(self, request_id: int) -> str:
        """The stats line under an answer ("" while it streams)."""
        bubble = self._assistants.get(request_id)
        return bubble.stats.text() if bubble is not None else ""

    def stats_detail(self, request_id: int) -> str:
        """Every figure behind the stats line (its tooltip)."""
        bubble = self._assistants.get(request_id)
        return bubble.stats.toolTip() if bubble is not None else ""

    def regenerate_visible(self, request_id: int) -> bool:
        bubble = self._assistants.get(request_id)
        return bubble is not None and not bubble.regenerate_button.isHidden()

    # --- Qt overrides ---------------------------------------------------------------------------

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        width = self._user_width()
        for widget in self._messages:
            if isinstance(widget, UserBubble):
                widget.frame.setMaximumWidth(width)

    # --- internals ------------------------------------------------------------------------------

    def _add(self, widget: QWidget) -> int:
        if isinstance(widget, (UserBubble, AssistantBubble)):
            self.welcome.hide()  # a note (model loaded) leaves the chat as empty as it was
        if self._hint is not None and widget is not self._hint:
            self.dismiss_hint()  # a hint answers the moment it was shown in; anything newer makes it stale
        return super()._add(widget)

    def _update_welcome(self) -> None:
        self.welcome.setVisible(not self._queue and not any(isinstance(w, (UserBubble, AssistantBubble))
                                                            for w in self._messages))

    def _user_width(self) -> int:
        return max(200, int(self.viewport().width() * USER_BUBBLE_WIDTH))

    def _update_regenerate(self, only: AssistantBubble | None = None) -> None:
        for bubble in (only,) if only is not None else self._assistants.values():
            bubble.regenerate_button.setVisible(bubble.done and not self._busy)

    def _finish_view(self, bubble: AssistantBubble) -> None:
        """A finished answer shows the view the global preference asks for, rendering it if needed."""
        if not bubble.plain_text().strip():
            return  # nothing to format (failed before any text): the tokens, if any, stay
        bubble.tokens_button.setVisible(bubble.has_tokens)
        bubble.show_markdown(self._markdown)
        self._request_render(bubble)

    def _toggle(self, bubble: AssistantBubble, markdown: bool) -> None:
        bubble.show_markdown(markdown)
        self._request_render(bubble)

    def _request_render(self, bubble: AssistantBubble, *, force: bool = False) -> None:
        text = bubble.plain_text()
        if bubble.done and text.strip() and bubble.wants_markdown and (bubble.segments is None or force):
            shared_renderer().request((self._view_id, bubble.request_id), text)

    def _on_rendered(self, key: object, segments: tuple) -> None:
        view_id, request_id = key  # type: ignore[misc]
        if view_id != self._view_id:
            return
        self._rendered.append((request_id, segments))
        self._apply_timer.start()

    def _apply_one(self) -> None:
        if not self._rendered:
            self._apply_timer.stop()
            return
        request_id, segments = self._rendered.popleft()
        bubble = self._assistants.get(request_id)
        if bubble is not None and bubble.done:
            bubble.set_segments(segments)

    def _drain(self) -> None:
        # Something is added out of the loader's turn: build what is queued first, to keep the order.
        if self._queue and not self._building:
            self._build_some(len(self._queue))

    def _build_some(self, count: int = 0) -> None:
        """Builds queued bubbles: `count` of them, or (0) as many as fit in BUILD_BUDGET_S."""
        self._building = True
        deadline = time.perf_counter() + BUILD_BUDGET_S
        try:
            built = 0
            while self._queue and (built < count if count else built == 0 or time.perf_counter() < deadline):
                built += 1
                message = self._queue.pop(0)
                if message.role == "user":
                    self.add_user_message(message.text, message.key, message.branch)
                elif message.role == "assistant":
                    self.add_answer(message)
                else:
                    self.add_system_note(message.text)
        finally:
            self._building = False
        if not self._queue and self._load_timer.isActive():
            self._load_timer.stop()
            self._update_welcome()
            self.loading_finished.emit()
