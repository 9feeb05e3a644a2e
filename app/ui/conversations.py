"""Wires the conversations sidebar and the chat to the session: list, open, rename, delete + Undo, search,
export, and the chat showing the branch the session shows."""
from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

from PySide6.QtCore import QObject, Qt, Signal

from app.core.chat_tree import Conversation, search_text
from app.core.conversations import ConversationHeader, ConversationStore, default_folder
from app.core.export import write_conversation_json, write_conversation_markdown
from app.core.session import ChatSession, ShownTurn, answer_header
from app.ui.notices import Notices
from widgets.chat.conversation_list import ConversationList, SidebarEntry
from widgets.chat.view import ChatView, ShownMessage
from widgets.stats_line import format_stats_line, format_stats_plain

log = logging.getLogger(__name__)


def header_of(conversation: Conversation) -> ConversationHeader:
    return ConversationHeader(id=conversation.id, title=conversation.title or "Untitled",
                              created=conversation.created, updated=conversation.updated,
                              model=conversation.model, turns=len(conversation.turns))


def subtitle(header: ConversationHeader, now: datetime | None = None) -> str:
    """"14:05 · qwen-1.5B + qwen-0.5B · 6 messages" (a date instead of the time after today)."""
    try:
        when = datetime.fromisoformat(header.updated)
        now = now or datetime.now(when.tzinfo)
        stamp = when.strftime("%H:%M") if when.date() == now.date() else when.strftime("%d %b %Y")
    except ValueError:
        stamp = ""
    parts = [p for p in (stamp, header.model, f"{header.turns} messages") if p]
    return " · ".join(parts)



def open_store() -> ConversationStore | None:
    """The user's conversations folder; without one (a read-only home) the app still works, unsaved."""
    try:
        return ConversationStore(default_folder())
    except OSError as e:
        log.warning("conversations will not be saved: %s", e)
        return None

class ConversationsController(QObject):
    """Keeps the sidebar in step with the store and the conversation shown.

    `new_chat()` starts an empty conversation; `open_conversation(id)` shows a saved one (False if it cannot).
    """

    searched = Signal(int, object)  # search generation, list of ids (from the search thread)

    def __init__(self, session: ChatSession, sidebar: ConversationList, chat: ChatView, notices: Notices, *,
                 new_chat: Callable[[], None], open_conversation: Callable[[str], bool],
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.session = session
        self.sidebar = sidebar
        self.chat = chat
        self.notices = notices
        self._new_chat = new_chat
        self._headers: dict[str, ConversationHeader] = {h.id: h for h in self.session.list()}
        self._search_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="conversation-search")
        self._search_generation = 0
        self._closed = False
        self._query = ""
        self._current_hit: str | None = None  # the shown conversation, when it matches the query
        self.bubble_turn: dict[int, str] = {}  # answer bubble (its request id) -> its turn in the conversation
        s = self.sidebar
        s.new_requested.connect(new_chat)
        s.selected.connect(open_conversation)
        s.rename_requested.connect(self.rename)
        s.delete_requested.connect(self.delete)
        s.undo_requested.connect(self.undo)
        s.export_requested.connect(self.export)
        s.search_changed.connect(self.search)
        self.searched.connect(self._on_searched, Qt.ConnectionType.QueuedConnection)
        self.refresh()
        self.report_problems()

    def report_problems(self) -> None:
        store = self.session.store
        problems = store.problems if store is not None else []
        for p in problems:
            log.warning("skipped %s: %s", p.path, p.reason)
        self.sidebar.set_problems([f"{p.path.name}: {p.reason}" for p in problems])

    def refresh(self) -> None:
        """Sidebar entries, newest first; the conversation shown is selected (once it has a message)."""
        current = self.session.conversation
        headers = dict(self._headers)
        if not current.is_empty():
            headers[current.id] = header_of(current)
        ordered = sorted(headers.values(), key=lambda h: h.updated, reverse=True)
        self.sidebar.set_entries([SidebarEntry(h.id, h.title, subtitle(h)) for h in ordered], current.id)
        if self._query:
            self.search(self._query)

    def touch_current(self) -> None:
        current = self.session.conversation
        if not current.is_empty():
            self._headers[current.id] = header_of(current)
        self.refresh()

    def rename(self, conversation_id: str, title: str) -> None:
        try:
            self.session.rename(conversation_id, title)
        except (OSError, ValueError) as e:
            self.notices.error("Could not rename the conversation", str(e))
            return
        header = self._headers.get(conversation_id)
        if conversation_id == self.session.conversation.id:
            header = header_of(self.session.conversation)
        elif header is not None:
            header = ConversationHeader(header.id, title, header.created, header.updated, header.model, header.turns)
        if header is not None:
            self._headers[conversation_id] = header
        self.refresh()

    def delete(self, conversation_id: str) -> None:
        """Deleted at once, with Undo offered in the sidebar until the next start."""
        header = self._headers.get(conversation_id)
        if conversation_id == self.session.conversation.id:
            header = header_of(self.session.conversation)
            self._new_chat()
        self.session.delete(conversation_id)
        self._headers.pop(conversation_id, None)
        self.refresh()
        self.sidebar.offer_undo(conversation_id, header.title if header else "conversation")

    def undo(self, conversation_id: str) -> None:
        if not self.session.restore(conversation_id):
            self.notices.note("That conversation can no longer be restored.", 5000)
            return
        try:
            self._headers[conversation_id] = header_of(self.session.load(conversation_id))
        except (OSError, ValueError) as e:
            log.warning("restored conversation %s cannot be read: %s", conversation_id, e)
        self.refresh()

    def search(self, query: str) -> None:
        """Titles and every message; runs on a background thread, a newer query wins."""
        self._query = query
        self._search_generation += 1
        generation = self._search_generation
        if self._closed:  # the window is closing: its last save may refresh the list, nothing is searched now
            return
        if not query or self.session.store is None:
            self.sidebar.set_filter(None)
            return
        current = self.session.conversation
        store, writer = self.session.store, self.session.writer
        # The conversation shown may have changes not yet on disk: it is searched here as well.
        self._current_hit = (current.id if not current.is_empty()
                             and query.casefold() in search_text(current).casefold() else None)

        def work() -> None:
            if generation != self._search_generation:
                return
            try:
                if writer is not None:
                    writer.flush()  # an answer saved in the background is searched as it ends, not as it began
                hits = store.search(query, cancelled=lambda: generation != self._search_generation)
            except Exception:  # a file no check foresaw: this query finds nothing, the next one runs as usual
                log.warning("search for %r failed", query[:60], exc_info=True)
                hits = []
            self.searched.emit(generation, hits)

        self._search_pool.submit(work)

    def export(self, conversation_id: str | None, kind: str, path: str | None = None) -> bool:
        """Markdown (the branch shown) or JSON (everything); asks for a file when `path` is None."""
        try:
            conversation = self.session.conversation if conversation_id is None else self.session.load(conversation_id)
        except (OSError, ValueError) as e:
            self.notices.error("Export failed", f"Could not read the conversation: {e}.")
            return False
        if conversation.is_empty():
            self.notices.info("Export conversation", "Nothing to export yet: this conversation is empty.")
            return False
        suffix, label = (".md", "Markdown (*.md)") if kind == "markdown" else (".json", "JSON (*.json)")
        if path is None:
            stem = "".join(c if c.isalnum() or c in " -_" else "_" for c in conversation.title)[:50].strip() or "chat"
            path = self.notices.save_path("Export conversation", str(Path.home() / (stem + suffix)),
                                          f"{label};;All files (*)")
            if not path:
                return False
        try:
            if kind == "markdown":
                write_conversation_markdown(path, conversation, format_stats_line)
            else:
                write_conversation_json(path, conversation)
        except OSError as e:
            self.notices.error("Export failed", f"Could not write {path}: {e.strerror or e}. Choose another "
                                                "location; the conversation is kept.")
            return False
        self.notices.note(f"Exported “{conversation.title}” to {path}", 5000)
        return True

    def sync_chat(self, until: str | None = None) -> None:
        """Makes the chat show the branch shown, rebuilding only from the first difference (up to, not
        including, the turn `until`: the answer about to stream)."""
        shown = self.session.shown()
        if until is not None:
            shown = shown[: next((i for i, t in enumerate(shown) if t.turn.id == until), len(shown))]
        keys = self.chat.keys()
        same = 0
        while same < min(len(shown), len(keys)) and keys[same] == shown[same].turn.id:
            same += 1
        for item in shown[:same]:
            self.chat.set_branch(item.turn.id, item.index, item.count)
        if same < len(keys):
            self.chat.truncate_from(keys[same])
        kept = set(self.chat.answer_ids())
        self.bubble_turn = {r: t for r, t in self.bubble_turn.items() if r in kept}
        self.chat.append_messages([self._shown_message(item) for item in shown[same:]])

    def _shown_message(self, item: ShownTurn) -> ShownMessage:
        turn = item.turn
        if turn.role == "user":
            return ShownMessage("user", turn.content, turn.id, (item.index, item.count))
        rid = self.session.allocate_request_id()
        self.bubble_turn[rid] = turn.id
        name = turn.model.split(" + ")[0] if turn.model else "model"
        header = answer_header(turn.request, None).replace("model", name, 1) if turn.request is not None else name
        return ShownMessage(
            "assistant", turn.content, turn.id, (item.index, item.count), request_id=rid, header=header,
            steps=turn.tokens.to_steps if turn.tokens is not None else None,  # made when first shown
            stats=format_stats_plain(turn.summary, turn.request) if turn.summary is not None else "",
            stats_detail=format_stats_line(turn.summary, turn.request) if turn.summary is not None else "",
            error=turn.error or ("" if turn.content or turn.summary else "No answer was saved."),
        )

    def shutdown(self) -> None:
        self._search_generation += 1
        self._closed = True
        self._search_pool.shutdown(wait=True, cancel_futures=True)

    def _on_searched(self, generation: int, hits: list[str]) -> None:
        if generation != self._search_generation:
            return
        ids = [i for i in hits if i != self.session.conversation.id]
        if self._current_hit is not None:
            ids.append(self._current_hit)
        self.sidebar.set_filter(ids)
