"""Counting the tokens a request would use, with the loaded model's tokenizer, off the UI thread."""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from PySide6.QtCore import QObject, Qt, QTimer, Signal
from PySide6.QtWidgets import QMessageBox

from app.core.chat_tree import messages_fitting
from app.core.session import ChatSession, system_messages
from engine.limits import widest_draft
from engine.settings import GenerationSettings
from engine.types import Message
from widgets.chat.prompt_box import PromptBox
from widgets.context_meter import ContextMeter

log = logging.getLogger(__name__)

DEBOUNCE_MS = 150  # counting starts once typing pauses this long
DEFAULT_CONTEXT = 32768  # engines that do not say (scripted demo, fakes)
PER_MESSAGE_OVERHEAD = 4  # template tokens around a message when counting without a template


class TokenCounter(Protocol):
    context_length: int  # the most tokens the model takes (prompt + answer)

    def count_prompt(self, messages: Sequence[Message]) -> int:
        """Tokens of the rendered prompt for these messages, generation prompt included."""

    def count_text(self, text: str) -> int: ...

    def message_overhead(self, role: str) -> int:
        """Template tokens one more message of this role adds around its text."""


class TokenizerCounter:
    """The engine's own tokenizer and chat template: the same count the engine will see.

    The tokenizer is shared with the engine thread; encoding without truncation or padding only
    reads it (no settings change), which a Rust fast tokenizer allows from several threads.
    """

    def __init__(self, tokenizer: Any, context_length: int) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length
        self._overhead: dict[str, int] = {}

    def message_overhead(self, role: str) -> int:
        # Measured on the template itself (Qwen's: 5 tokens, <|im_start|>user\n … <|im_end|>\n).
        if role not in self._overhead:
            one = [Message("user", "a")]
            two = one + [Message(role, "a")]  # type: ignore[arg-type]
            self._overhead[role] = max(0, self.count_prompt(two) - self.count_prompt(one) - self.count_text("a"))
        return self._overhead[role]

    def count_text(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0

    def count_prompt(self, messages: Sequence[Message]) -> int:
        chat = [{"role": m.role, "content": m.content} for m in messages]
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        else:  # as engine.decoding.Engine.encode does without a template
            text = "\n".join(f"{m['role']}: {m['content']}" for m in chat) + "\nassistant: "
        return self.count_text(text)


class ApproxCounter:
    """Word-ish pieces (the scripted demo's own split) plus a few template tokens per message."""

    def __init__(self, context_length: int = DEFAULT_CONTEXT) -> None:
        self.context_length = context_length

    def count_text(self, text: str) -> int:
        from app.core.demo import split_tokens

        return len(split_tokens(text))

    def count_prompt(self, messages: Sequence[Message]) -> int:
        return sum(self.count_text(m.content) + PER_MESSAGE_OVERHEAD for m in messages) + 3

    def message_overhead(self, role: str) -> int:
        return PER_MESSAGE_OVERHEAD


def counter_for(engine: Any) -> TokenCounter:
    """The loaded engine's tokenizer and context, or an estimate for engines without them."""
    tokenizer = getattr(engine, "tokenizer", None)
    runner = getattr(engine, "target_runner", None)
    context = int(getattr(runner, "max_length", 0) or getattr(engine, "context_length", 0) or DEFAULT_CONTEXT)
    if tokenizer is not None and callable(tokenizer):
        return TokenizerCounter(tokenizer, context)
    return ApproxCounter(context)


class ContextCount:
    """The figures behind the meter and the overflow choice."""

    def __init__(self, used: int, limit: int, dropped: int, message_counts: tuple[int, ...]) -> None:
        self.used = used  # tokens the next request would use (after dropping, when trimming is on)
        self.limit = limit  # the model's context
        self.dropped = dropped  # oldest messages left out (trimming on)
        self.message_counts = message_counts  # per conversation message, for trimming


class ContextCounter(QObject):
    """Counts (system + conversation + draft) on one background thread, debounced, cached per message."""

    counted = Signal(object)  # ContextCount, on the UI thread

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.counter: TokenCounter | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="context-count")
        self._cache: OrderedDict[tuple[Any, ...], int] = OrderedDict()
        self._pending: tuple[tuple[Message, ...], tuple[Message, ...], str, int, bool] | None = None
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(DEBOUNCE_MS)
        self._timer.timeout.connect(self._submit)
        self._generation = 0
        self._closed = False
        self._done.connect(self._on_done, Qt.ConnectionType.QueuedConnection)

    _done = Signal(int, object)  # generation, ContextCount (from the pool thread)

    def set_counter(self, counter: TokenCounter | None) -> None:
        self.counter = counter
        self._cache.clear()

    def update(self, system: Sequence[Message], messages: Sequence[Message], draft: str, reserve: int,
               trim: bool, *, now: bool = False) -> None:
        """Asks for a count; `counted` follows once typing pauses (at once with now=True)."""
        self._pending = (tuple(system), tuple(messages), draft, reserve, trim)
        if now:
            self._timer.stop()
            self._submit()
        else:
            self._timer.start()

    def count_now(self, system: Sequence[Message], messages: Sequence[Message], draft: str, reserve: int,
                  trim: bool) -> ContextCount | None:
        """The same count, synchronously (at Send, where the answer decides what happens next)."""
        if self.counter is None:
            return None
        return self._count(self.counter, tuple(system), tuple(messages), draft, reserve, trim)

    def shutdown(self) -> None:
        self._closed = True
        self._timer.stop()
        self._pool.shutdown(wait=True, cancel_futures=True)

    # --- internals ------------------------------------------------------------------------------

    def _submit(self) -> None:
        if self.counter is None or self._pending is None or self._closed:
            return
        self._generation += 1
        generation, counter, args = self._generation, self.counter, self._pending
        self._pending = None

        def work() -> None:
            try:
                result = self._count(counter, *args)
            except Exception:  # a count is advice; never an error dialog
                log.exception("could not count context tokens")
                return
            self._done.emit(generation, result)

        self._pool.submit(work)

    def _on_done(self, generation: int, result: ContextCount) -> None:
        if generation == self._generation:  # an older count that arrived late is dropped
            self.counted.emit(result)

    def _cached(self, counter: TokenCounter, key: tuple[Any, ...], compute) -> int:
        hit = self._cache.get(key)
        if hit is None:
            hit = compute()
            self._cache[key] = hit
            while len(self._cache) > 4096:
                self._cache.popitem(last=False)
        return hit

    def _count(self, counter: TokenCounter, system: tuple[Message, ...], messages: tuple[Message, ...],
               draft: str, reserve: int, trim: bool) -> ContextCount:
        # The template's cost of the frame (system, generation prompt, an empty next question) is
        # counted once per system prompt; each message's own tokens are cached by its text, so typing
        # re-encodes only the draft and a long conversation is encoded once.
        frame = self._cached(counter, ("frame", system), lambda: counter.count_prompt(system + (Message("user", ""),)))
        per_message = tuple(
            self._cached(counter, ("msg", m.content), lambda m=m: counter.count_text(m.content))
            + counter.message_overhead(m.role)
            for m in messages
        )
        draft_tokens = counter.count_text(draft)
        budget = counter.context_length - reserve - frame - draft_tokens
        items, counts = list(messages), list(per_message)
        if draft:  # the message being typed is the newest and always stays
            items.append(Message("user", draft))
            counts.append(0)
        dropped = messages_fitting(items, counts, budget) if trim and items else 0
        used = frame + sum(per_message[dropped:]) + draft_tokens + reserve
        return ContextCount(used, counter.context_length, dropped, per_message)


class ContextGuard(QObject):
    """Keeps the meter under the prompt current as one types, and decides what to do at Send when the
    conversation no longer fits: start a new chat or leave the oldest turns out (asked once per conversation).

    `ask_overflow(count)` gives "new", "drop" or "cancel"; `new_chat()` starts an empty conversation.
    """

    def __init__(self, counter: ContextCounter, prompt: PromptBox, meter: ContextMeter, session: ChatSession, *,
                 settings: Callable[[], GenerationSettings], ask_overflow: Callable[[ContextCount], str],
                 new_chat: Callable[[], None], parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.counter = counter
        self.prompt = prompt
        self.session = session
        self._settings = settings
        self._ask_overflow = ask_overflow
        self._new_chat = new_chat
        prompt.edit.textChanged.connect(self.update)
        counter.counted.connect(lambda count: meter.set_usage(count.used, count.limit, dropped=count.dropped))

    def reserve(self) -> int:
        # The engine needs room for one round of K drafts + 1 beyond the prompt (engine.decoding).
        settings = self._settings()
        return widest_draft(settings.mode, settings.k) + 1

    def update(self, *_: object, now: bool = False) -> None:
        conversation = self.session.conversation
        self.counter.update(system_messages(self._settings()), conversation.messages(), self.prompt.text(),
                            self.reserve(), conversation.trim_oldest, now=now)

    def count(self, draft: str, trim: bool) -> ContextCount | None:
        return self.counter.count_now(system_messages(self._settings()), self.session.conversation.messages(), draft,
                                      self.reserve(), trim)

    def drop_count(self) -> int:
        """Oldest turns left out of the next request (only once the person chose that for this conversation)."""
        if not self.session.conversation.trim_oldest:
            return 0
        count = self.count("", True)
        return count.dropped if count is not None else 0

    def room_for(self, text: str) -> int | None:
        """How many oldest turns to leave out so the question fits (mostly 0); None when the person cancelled."""
        conversation = self.session.conversation
        count = self.count(text, conversation.trim_oldest)
        if count is None or count.used < count.limit or not conversation.messages():
            return count.dropped if count is not None else 0  # a lone prompt too long: the engine says so
        if conversation.trim_oldest:
            return count.dropped
        choice = self._ask_overflow(count)
        if choice == "new":
            self._new_chat()
            return 0
        if choice == "drop":
            self.session.set_trim_oldest(True)
            trimmed = self.count(text, True)
            return trimmed.dropped if trimmed is not None else 0
        return None


def ask_overflow(parent, count: ContextCount) -> str:
    """"new", "drop" or "cancel", asked in a dialog."""
    box = QMessageBox(parent)
    box.setIcon(QMessageBox.Icon.Question)
    box.setWindowTitle("The conversation is longer than the model's context")
    box.setText(f"With this message the conversation needs {count.used:,} tokens; the model holds {count.limit:,}.")
    box.setInformativeText("Start a new chat with this message, or leave the oldest turns out of what is sent "
                           "(they stay in the saved conversation).")
    new = box.addButton("Start a new chat", QMessageBox.ButtonRole.AcceptRole)
    drop = box.addButton("Drop the oldest turns", QMessageBox.ButtonRole.ActionRole)
    box.addButton(QMessageBox.StandardButton.Cancel)
    box.setDefaultButton(new)
    box.exec()
    return "new" if box.clickedButton() is new else "drop" if box.clickedButton() is drop else "cancel"
