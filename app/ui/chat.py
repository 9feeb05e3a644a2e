"""The chat from the window: send, regenerate, edit and resend, versions of a message, new and saved
conversations, stop; and the worker's steps and last word for each answer."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from PySide6.QtCore import QObject, QTimer, Signal
from PySide6.QtGui import QTextCursor

from app.core.session import ChatSession, answer_header
from app.ui.context import ContextGuard
from app.ui.conversations import ConversationsController
from app.ui.notices import Notices
from app.ui.status_bar import StatusBarController
from app.ui.worker import EngineWorker
from engine.measure.explain import UNSETTLED, describe_prefill
from engine.settings import GenerationSettings
from engine.types import Message, PrefillProgress, Step, Summary
from widgets.charts import LiveCharts
from widgets.chat.prompt_box import PromptBox
from widgets.chat.view import ChatView
from widgets.stats_line import format_stats_line, format_stats_plain

REGENERATE_TEMPERATURE = 0.7  # what Regenerate at T = 0 offers instead

# Streamed steps reach the chat, the charts and the status bar at most this often: tokens arriving one
# signal at a time (a CPU decoding 10-30 tok/s) are shown in batches, so the window relayouts ~12 times a
# second whatever the token rate (the worker batches too, at 33 Hz, to keep cross-thread signals few).
VIEW_INTERVAL_MS = 80


class ChatController(QObject):
    """A view of the session's conversation: every change goes through the session, then shows here.

    `settings()` are the panel's values for the next request; `can_chat()` says whether a request may
    start now (no answer streaming, a pair loaded, nothing else using the worker); `annotate(stats,
    summary, request)` adds the draft check's note to an answer's stats line; `ready_changed()` and
    `evidence_changed()` tell the window to re-read what it allows and what was measured; `apply_settings`
    puts changed settings into the panel (Regenerate at T = 0 offers to raise the temperature).
    Text typed in the message box stays with its conversation: switching keeps it and brings back the other's.
    """

    finished = Signal(int, object)  # request_id, Summary (stop included), after the chat shows it
    failed = Signal(int, str)  # request_id, message

    def __init__(self, worker: EngineWorker, session: ChatSession, chat: ChatView, prompt: PromptBox,
                 charts: LiveCharts, *, conversations: ConversationsController, guard: ContextGuard,
                 status: StatusBarController, notices: Notices, settings: Callable[[], GenerationSettings],
                 can_chat: Callable[[], bool], annotate: Callable[[str, Summary, object], str],
                 ready_changed: Callable[[], None], evidence_changed: Callable[[], None],
                 apply_settings: Callable[[GenerationSettings], None] | None = None,
                 loading: Callable[[], bool] = lambda: False, parent: QObject | None = None) -> None:
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
        self._apply_settings = apply_settings
        self._drafts: dict[str, str] = {}  # conversation id -> the unsent text of its message box
        chat.example_chosen.connect(self.fill_prompt)
        self._loading = loading
        self.queued: str | None = None  # a message sent while the models load: sent once they are ready
        # Steps recorded in the session but not shown yet (one request's), and the timer that shows them.
        self._unshown: list[Step] = []
        self._unshown_request: int | None = None
        self._view_timer = QTimer(self)
        self._view_timer.setSingleShot(True)
        self._view_timer.setInterval(VIEW_INTERVAL_MS)
        self._view_timer.timeout.connect(self._show_steps)
        # The worker lives on its own thread: these are queued connections, run on the UI thread.
        worker.prefill_progress.connect(self._on_prefill_progress)
        worker.steps.connect(self._on_steps)
        worker.generation_finished.connect(self._on_generation_finished)
        worker.generation_failed.connect(self._on_generation_failed)
        self._source = worker  # who answers: the worker, or a remote server (use_source)
        self._header = answer_header  # the line above an answer, from its request and the pair in use

    # --- asking ----------------------------------------------------------------------------------

    def send(self, text: str) -> int | None:
        """Adds a question and asks for the answer; returns the request id (None if not sent). While the
        models load it is queued instead (shown in the box, sent by send_queued, cancelled by cancel_queued)."""
        text = text.strip()
        if text and self._loading() and self.queued is None:
            self.queued = text
            self.prompt.show_queued(text)
            return None
        if not text or not self._can_chat():
            return None
        drop = self.guard.room_for(text)
        if drop is None:
            self.prompt.set_text(text)  # nothing is lost: the question goes back into the box
            return None
        return self._submit(self.session.send(text, self._settings(), drop))

    def send_queued(self) -> int | None:
        """The models are ready: the queued message is sent (it goes back into the box if it cannot be)."""
        text, self.queued = self.queued, None
        if text is None:
            return None
        self.prompt.end_queued(keep_text=False)
        rid = self.send(text)
        if rid is None and not self.prompt.text().strip():
            self.prompt.set_text(text)  # nothing is lost
        return rid

    def cancel_queued(self) -> None:
        """The queued message is not sent; it stays in the box, editable."""
        if self.queued is not None:
            self.queued = None
            self.prompt.end_queued(keep_text=True)

    def regenerate(self, request_id: int | None = None) -> int | None:
        """A new version of an answer (the last one by default); the old one stays as another version."""
        if not self._can_chat():
            return None
        settings = self._settings()
        if settings.temperature <= 0 and self.session.can_regenerate():
            self._offer_temperature(settings, request_id)  # the answer would repeat: ask first, never modal
            return None
        return self._regenerate(settings, request_id)

    def _regenerate(self, settings: GenerationSettings, request_id: int | None) -> int | None:
        if not self._can_chat():
            return None
        turn = self.conversations.bubble_turn.get(request_id) if request_id is not None else None
        started = self.session.regenerate(settings, turn, self.guard.drop_count())
        return self._submit(started[0]) if started is not None else None

    def edit_and_resend(self, turn_id: str, text: str) -> int | None:
        """The edited question replaces the old one on a new branch, and is answered."""
        if not self._can_chat() or turn_id not in self.session.conversation.turns:
            return None
        return self._submit(self.session.edit(turn_id, text, self._settings(), self.guard.drop_count()))

    def _offer_temperature(self, settings: GenerationSettings, request_id: int | None) -> None:
        # Greedy decoding picks the most likely token every time: the same question gets the same answer.
        raised = replace(settings, temperature=REGENERATE_TEMPERATURE)

        def chosen(index: int) -> None:
            if index == 0:
                if self._apply_settings is not None:
                    self._apply_settings(raised)
                self._regenerate(raised, request_id)
            elif index == 1:
                self._regenerate(settings, request_id)

        self.chat.show_hint(
            "At temperature 0 the model always picks its most likely next word, so Regenerate would write the "
            f"same answer again. Raise the temperature to {REGENERATE_TEMPERATURE:g} for a different one? It "
            "stays raised for the next messages (Settings > Temperature).",
            [f"Raise to T = {REGENERATE_TEMPERATURE:g} and regenerate", "Regenerate at T = 0"], chosen)

    def fill_prompt(self, text: str) -> None:
        """Puts `text` into the message box (an example prompt), ready to edit or send."""
        self.prompt.set_text(text)
        self.prompt.edit.moveCursor(QTextCursor.MoveOperation.End)
        self.prompt.edit.setFocus()

    def stop(self) -> None:
        if self.session.active_request is not None:
            self._source.stop(self.session.active_request)

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
        self._keep_draft()
        self._leave(self.session.new_chat())
        self._restore_draft()
        self.conversations.refresh()
        self._ready_changed()
        self.guard.update()

    def open_conversation(self, conversation_id: str) -> bool:
        """Shows a saved conversation; False (and one line saying why) if it cannot be read."""
        if conversation_id == self.session.conversation.id:
            return True
        leaving = self.session.conversation.id
        try:
            streaming = self.session.open(conversation_id)
        except (OSError, ValueError) as e:
            self.notices.error("Could not open the conversation", f"{e}. The other conversations are not affected.")
            self.conversations.refresh()
            return False
        self._keep_draft(leaving)
        self._leave(streaming)
        self._restore_draft()
        self.conversations.sync_chat()
        self.conversations.refresh()
        self._ready_changed()
        self.guard.update()
        return True

    def _keep_draft(self, conversation_id: str | None = None) -> None:
        text = self.prompt.text()
        key = conversation_id or self.session.conversation.id
        if text.strip():
            self._drafts[key] = text
        else:
            self._drafts.pop(key, None)

    def _restore_draft(self) -> None:
        self.prompt.set_text(self._drafts.pop(self.session.conversation.id, ""))

    def _leave(self, streaming: int | None) -> None:
        # The shown conversation changed: a streaming answer is stopped (it is saved to its own conversation).
        if streaming is not None:
            self._source.stop(streaming)
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
        self.chat.begin_assistant_message(rid, self._header(request, self.session.info), turn_id or "",
                                          (max(0, len(siblings) - 1), max(1, len(siblings))))
        self.charts.reset()
        self._ready_changed()
        self.conversations.touch_current()
        self._source.generate_requested.emit(request)
        return rid

    # --- the worker's signals --------------------------------------------------------------------

    def _on_prefill_progress(self, request_id: int, progress: PrefillProgress) -> None:
        # A few per second at most (one per chunk of about 0.5 s of work).
        if request_id == self.session.active_request:
            text = describe_prefill(progress)
            self.chat.show_progress(request_id, text)
            self.status.show_prefill(text)

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
            self.status.show_prefill("")
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
        unsettled = self.session.info is not None and self.session.info.costs_state in UNSETTLED
        detail = self._annotate(format_stats_line(summary, request, unsettled=unsettled), summary, request)
        # A remote answer's line is already plain (what the server reported and what it cannot show).
        plain = format_stats_plain(summary, request, unsettled=unsettled) if self._source is self.worker else detail
        self.chat.finish_assistant_message(request_id, summary, plain, detail)
        record = self.session.finish(request_id, summary)
        self.status.show_prefill("")
        # The verdict weighs what drafted this answer (in auto, the head or n-gram as often as the draft model).
        if summary.mode != "standard" and summary.drafter is not None and record is not None:
            self.status.show_costs(record.info, summary, summary.drafter)
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
        self.status.show_prefill("")
        self._ready_changed()
        self.failed.emit(request_id, message)

    # --- who answers -----------------------------------------------------------------------------

    def add_source(self, source: QObject) -> None:
        """Another answerer with the worker's chat signals and calls (app/ui/remote.py's RemoteStreams):
        `generate_requested(request)`, `stop(request_id)`, `steps`, `generation_finished`, `generation_failed`."""
        source.steps.connect(self._on_steps)
        source.generation_finished.connect(self._on_generation_finished)
        source.generation_failed.connect(self._on_generation_failed)

    def use_source(self, source: QObject | None, header: Callable[[object, object], str] | None = None) -> None:
        """Answers come from `source` from the next request on (None: the worker, with the local models),
        each under `header(request, info)` (None: which model and how it decodes)."""
        self._source = source or self.worker
        self._header = header or answer_header
