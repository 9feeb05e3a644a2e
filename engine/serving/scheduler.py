"""The serving scheduler: one worker thread owns the Engine and answers queued requests in turn.

Requests are validated (tokenized, checked against the context) when they are submitted, so a bad
one is refused at once; admitted ones wait in a bounded queue. Every ticket reports through one
callback: `("step", Step)` per round, then exactly one terminal event, `("done", Summary)` or
`("error", message)`. A ticket's `cancel` Event is the engine's own: setting it ends the generation
between two steps.

Today the worker decodes one sequence at a time (the engine's caches hold one sequence): requests
beyond the first wait their turn. A batched step (several sequences verified in one target
forward) is the next piece; the scheduler's API stays the same.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from engine.errors import EngineError, GenerationError
from engine.limits import widest_draft
from engine.types import GenerationRequest

if TYPE_CHECKING:
    from engine.decoding import Engine, Generation

log = logging.getLogger(__name__)

# What a ticket reports: "step" (a Step), "done" (the final Summary) or "error" (one line saying why).
EventKind = Literal["step", "done", "error"]


class ServerBusyError(EngineError):
    """Every sequence slot and every queue place is taken; the client should retry later."""


class ContextFullError(GenerationError):
    """The prompt leaves no room for an answer in the target's context."""


@dataclass
class Ticket:
    """One admitted request: what it asks, how to stop it, and where its events go."""

    request: GenerationRequest  # what was asked
    prompt_tokens: int  # tokens of the rendered prompt (for usage, before any step)
    on_event: Callable[[EventKind, object], None]  # called on the worker thread, once per event
    cancel: threading.Event = field(default_factory=threading.Event)  # set it to stop the generation
    submitted: float = field(default_factory=time.perf_counter)  # when it was admitted
    started: float | None = None  # when the worker began it (None while it waits)
    generation: Generation | None = None  # the engine's generation, made at submit (validated)


class Scheduler:
    """Owns the engine; `submit` admits a request or refuses it; `close` stops the worker."""

    def __init__(self, engine: Engine, *, max_seqs: int = 4, queue_size: int = 16) -> None:
        """max_seqs: sequences in flight at once; queue_size: admitted requests beyond them that wait.
        Until the batched step exists, sequences in flight are decoded one after another."""
        assert max_seqs >= 1 and queue_size >= 0, "max_seqs >= 1, queue_size >= 0"
        self.engine = engine
        self.max_seqs = max_seqs
        self.queue_size = queue_size
        self._queue: queue.Queue[Ticket | None] = queue.Queue()
        self._admit = threading.Lock()  # admission count and tokenizer use at submit
        self._admitted = 0  # tickets admitted and not finished (running + waiting)
        self._running = 0  # tickets the worker is decoding now
        self._ids = itertools.count(1)
        self._closed = False
        self._worker = threading.Thread(target=self._work, name="specdec-scheduler", daemon=True)
        self._worker.start()

    # -- what monitoring reads ----------------------------------------------------------------
    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return max(self._admitted - self._running, 0)

    @property
    def capacity(self) -> int:
        """Requests admitted at most at once (in flight and waiting)."""
        return self.max_seqs + self.queue_size

    @property
    def context(self) -> int:
        """Positions the target's cache holds: prompt and answer together."""
        return self.engine.target_runner.max_length

    # -- admission ----------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, on_event: Callable[[EventKind, object], None]) -> Ticket:
        """Validates and queues a request. Raises GenerationError (bad request, prompt over the
        context) or ServerBusyError (queue full) before anything is queued."""
        with self._admit:
            if self._closed:
                raise ServerBusyError("The server is shutting down.")
            if self._admitted >= self.capacity:
                raise ServerBusyError(
                    f"All {self.max_seqs} sequences and {self.queue_size} queue places are taken; retry shortly.")
            request = replace(request, request_id=next(self._ids))
            prompt = self.engine.encode(request)
            room = self.context - len(prompt) - (widest_draft(request.mode, request.k) + 1)
            if room < 1:
                raise ContextFullError(f"The prompt is {len(prompt)} tokens; the model's context holds {self.context} "
                                       "(prompt and answer together). Shorten the prompt.")
            cancel = threading.Event()
            generation = self.engine.generate(request, cancel)  # tokenizes and checks the context now
            ticket = Ticket(request, len(generation.prompt), on_event, cancel, generation=generation)
            self._admitted += 1
        self._queue.put(ticket)
        return ticket

    def close(self, timeout: float = 10.0) -> None:
        """Cancels what runs and waits, refuses new requests, and stops the worker."""
        with self._admit:
            self._closed = True
        self._queue.put(None)
        self._worker.join(timeout)

    # -- the worker ---------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            ticket = self._queue.get()
            if ticket is None:
                break
            self._running += 1
            try:
                self._answer(ticket)
            finally:
                self._running -= 1
                with self._admit:
                    self._admitted -= 1

    def _answer(self, ticket: Ticket) -> None:
        generation = ticket.generation
        assert generation is not None, "submit made the generation"
        ticket.started = time.perf_counter()
        try:
            for step in generation:
                ticket.on_event("step", step)
            summary = generation.summary
            assert summary is not None, "a finished generation has a summary"
        except GenerationError as e:
            ticket.on_event("error", str(e))
            return
        except Exception as e:  # a bug or an out-of-memory: the client gets one line, the server goes on
            log.exception("generation %d failed", ticket.request.request_id)
            ticket.on_event("error", f"internal error ({type(e).__name__}: {str(e)[:200]})")
            return
        ticket.on_event("done", summary)

