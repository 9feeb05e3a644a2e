"""The chat from the window: send, regenerate, edit and resend, versions of a message, new and saved
conversations, stop; and the worker's steps and last word for each answer."""
from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QObject, QTimer, Signal

from app.core.session import ChatSession, answer_header
from app.ui.context import ContextGuard
from app.ui.conversations import ConversationsController
from app.ui.notices import Notices
from app.ui.status_bar import StatusBarController
from app.ui.worker import EngineWorker
from engine.settings import GenerationSettings
from engine.types import Message, Step, Summary
from widgets.charts import LiveCharts
from widgets.chat.prompt_box import PromptBox
from widgets.chat.view import ChatView
from widgets.stats_line import format_stats_line

# Streamed steps reach the chat, the charts and the status bar at most this often: tokens arriving one
# signal at a time (a CPU decoding 10-30 tok/s) are shown in batches, so the window relayouts ~12 times a
# second whatever the token rate (the worker batches too, at 33 Hz, to keep cross-thread signals few).
VIEW_INTERVAL_MS = 80


class ChatController(QObject):
    """A view of the session's conversation: every change goes through the session, then shows here.

    `settings()` are the panel's values for the next request; `can_chat()` says whether a request may
    start now (no answer streaming, a pair loaded, nothing else using the worker); `annotate(stats,
    summary, request)` adds the draft check's note to an answer's stats line; `ready_changed()` and
    `evidence_changed()` tell the window to re-read what it allows and what was measured.
    """

    finished = Signal(int, object)  # request_id, Summary (stop included), after the chat shows it
    failed = Signal(int, str)  # request_id, message

    def __init__(self, worker: EngineWorker, session: ChatSession, chat: ChatView, prompt: PromptBox,
                 charts: LiveCharts, *, conversations: ConversationsController, guard: ContextGuard,
                 status: StatusBarController, notices: Notices, settings: Callable[[], GenerationSettings],
                 can_chat: Callable[[], bool], annotate: Callable[[str, Summary, object], str],
                 ready_changed: Callable[[], None], evidence_changed: Callable[[], None],
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.worker = worker
        self.session = session
        self.chat = chat
        self.prompt = prompt
        self.charts = charts
        self.conversations = conversations
        self.guard = guard
        self.status = status
        self.notices = notices
        self._settings = settings
        self._can_chat = can_chat
        self._annotate = annotate
        self._ready_changed = ready_changed
        self._evidence_changed = evidence_changed
        # Steps recorded in the session but not shown yet (one request's), and the timer that shows them.
        self._unshown: list[Step] = []
        self._unshown_request: int | None = None
        self._view_timer = QTimer(self)
        self._view_timer.setSingleShot(True)
        self._view_timer.setInterval(VIEW_INTERVAL_MS)
        self._view_timer.timeout.connect(self._show_steps)
        # The worker lives on its own thread: these are queued connections, run on the UI thread.
        worker.steps.connect(self._on_steps)
        worker.generation_finished.connect(self._on_generation_finished)
        worker.generation_failed.connect(self._on_generation_failed)

    # --- asking ----------------------------------------------------------------------------------

    def send(self, text: str) -> int | None:
        """Adds a question and asks for the answer; returns the request id (None if not sent)."""
        text = text.strip()
        if not text or not self._can_chat():
            return None
        drop = self.guard.room_for(text)
        if drop is None:
            self.prompt.set_text(text)  # nothing is lost: the question goes back into the box
            return None
        return self._submit(self.session.send(text, self._settings(), drop))

    def regenerate(self, request_id: int | None = None) -> int | None:
        """A new version of an answer (the last one by default); the old one stays as another version."""
        if not self._can_chat():
            return None
        turn = self.conversations.bubble_turn.get(request_id) if request_id is not None else None
        started = self.session.regenerate(self._settings(), turn, self.guard.drop_count())
        return self._submit(started[0]) if started is not None else None

    def edit_and_resend(self, turn_id: str, text: str) -> int | None:
        """The edited question replaces the old one on a new branch, and is answered."""
        if not self._can_chat() or turn_id not in self.session.conversation.turns:
            return None
        return self._submit(self.session.edit(turn_id, text, self._settings(), self.guard.drop_count()))

    def stop(self) -> None:
        if self.session.active_request is not None:
            self.worker.stop(self.session.active_request)

    def messages_for_request(self) -> tuple[Message, ...]:
        return self.session.messages_for(self._settings(), self.guard.drop_count())

    # --- which conversation, which version -------------------------------------------------------

    def show_branch(self, turn_id: str, delta: int) -> None:
        """Shows the previous / next version of a message (not while an answer streams)."""
        if self.session.active_request is not None or turn_id not in self.session.conversation.turns:
            return
        self.session.switch(turn_id, delta)
        self.conversations.sync_chat()
        self._ready_changed()
        self.guard.update()

    def new_chat(self) -> None:
        self._leave(self.session.new_chat())
        self.conversations.refresh()
        self._ready_changed()
        self.guard.update()

    def open_conversation(self, conversation_id: str) -> bool:
        """Shows a saved conversation; False (and one line saying why) if it cannot be read."""
        if conversation_id == self.session.conversation.id:
            return True
        try:
            streaming = self.session.open(conversation_id)
        except (OSError, ValueError) as e:
            self.notices.error("Could not open the conversation", f"{e}. The other conversations are not affected.")
            self.conversations.refresh()
            return False
        self._leave(streaming)
        self.conversations.sync_chat()
        self.conversations.refresh()
        self._ready_changed()
        self.guard.update()
        return True

    def _leave(self, streaming: int | None) -> None:
        # The shown conversation changed: a streaming answer is stopped (it is saved to its own conversation).
        if streaming is not None:
            self.worker.stop(streaming)
        self._drop_unshown()  # recorded in the session; the chat they were for is gone
        self.chat.clear()
        self.conversations.bubble_turn.clear()
        self.charts.reset()

    def _submit(self, request) -> int:
        rid = request.request_id
        turn_id = self.session.turn_of(rid)
        self.conversations.sync_chat(until=turn_id)  # the question (and a fork) shown, then the new answer's bubble
        siblings = self.session.conversation.siblings(turn_id) if turn_id else []
        self.conversations.bubble_turn[rid] = turn_id or ""
        self.chat.begin_assistant_message(rid, answer_header(request, self.session.info), turn_id or "",
                                          (max(0, len(siblings) - 1), max(1, len(siblings))))
        self.charts.reset()
        self._ready_changed()
        self.conversations.touch_current()
        self.worker.generate_requested.emit(request)
        return rid

    # --- the worker's signals --------------------------------------------------------------------

    def _on_steps(self, request_id: int, steps: tuple[Step, ...]) -> None:
        # The hot path: the session records the steps now; the views get them in one batch per VIEW_INTERVAL_MS.
        if not self.session.add_steps(request_id, steps):
            return
        if self._unshown_request not in (None, request_id):
            self._show_steps()
        self._unshown_request = request_id
        self._unshown.extend(steps)
        if not self._view_timer.isActive():
            self._view_timer.start()

    def _show_steps(self) -> None:
        """One edit block in one bubble, ring-buffer appends for the charts (drawn by their timer)."""
        self._view_timer.stop()
        request_id, steps = self._unshown_request, tuple(self._unshown)
        self._drop_unshown()
        if request_id is None or not steps:
            return
        self.chat.append_steps(request_id, steps)
        if request_id == self.session.active_request:
            self.charts.push_steps(steps)
            self.status.show_decision(steps[-1].decision)

    def _drop_unshown(self) -> None:
        self._view_timer.stop()
        self._unshown = []
        self._unshown_request = None

    def _on_generation_finished(self, request_id: int, summary: Summary) -> None:
        self._show_steps()  # every step is shown before the answer is finished
        request = self.session.request(request_id)
        if request is None:
            return
        self.chat.finish_assistant_message(request_id, summary,
                                           self._annotate(format_stats_line(summary, request), summary, request))
        record = self.session.finish(request_id, summary)
        if summary.mode == "speculative" and request.proposer in ("draft", "head") and record is not None:
            self.status.show_costs(record.info, summary, request.proposer)
        self.status.show_decision(summary.decision)
        self._evidence_changed()
        self._ready_changed()
        self.conversations.touch_current()
        self.guard.update()
        self.finished.emit(request_id, summary)

    def _on_generation_failed(self, request_id: int, message: str) -> None:
        self._show_steps()  # what was decoded before the error stays visible
        if not self.session.fail(request_id, message):
            return
        self.chat.fail_assistant_message(request_id, message)
        self._ready_changed()
        self.failed.emit(request_id, message)
