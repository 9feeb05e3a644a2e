"""The serving scheduler: one worker thread owns the Engine and answers queued requests in turn.

Requests are validated (tokenized, checked against the context) when they are submitted, so a bad
one is refused at once; admitted ones wait in a bounded queue. Every ticket reports through one
callback: `("step", Step)` per round, then exactly one terminal event, `("done", Summary)` or
`("error", message)`. A ticket's `cancel` Event is the engine's own: setting it ends the generation
between two steps.

Requests greedy or sampled, standard, speculative (a fixed K or K auto) or auto mode, drafting from the
draft model, n-gram lookup or both, are decoded together, up to max_seqs at once, by the batched step
(engine/decoding/batch.py), on torch models and on the llama.cpp runtime alike (its multi-sequence
batches), and so are those drafting from the draft head on torch: one target forward verifies every
sequence's drafts, each sequence with its own K, sampling and random generator. The rest (engine-side
stop strings, a model the batched forward cannot take) runs through the single-sequence loop, one at a
time, a step of it between two batched rounds; with `alone_in_loop`, so does a request that arrives to an
idle server (the loop drafts the head's trees; on a GPU the batch of one is the faster, docs/serve.md). A
sampled answer from the batch follows the target's law but not the loop's exact tokens for the same seed
(the random draws come in another order); with a fixed K it is the same answer whatever else is in the
batch.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from engine.decoding.batch import BatchEngine
from engine.errors import EngineError, GenerationError
from engine.runners.lean import UnsupportedModelError
from engine.limits import widest_draft
from engine.types import GenerationRequest, Step, Summary

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
    summary: Summary | None = None  # what it did, once it has ended (None: still running, or failed)


class Scheduler:
    """Owns the engine; `submit` admits a request or refuses it; `close` stops the worker."""

    def __init__(self, engine: Engine, *, max_seqs: int = 4, queue_size: int = 16, batched: bool = True,
                 alone_in_loop: bool = False) -> None:
        """max_seqs: sequences decoded together; queue_size: admitted requests beyond them that wait.
        batched: decode the requests the batch takes together (engine/decoding/batch.py, BatchEngine.supports)
        where the engine's models allow it (torch on one device, or llama.cpp); the rest, and every request
        otherwise, one at a time.
        alone_in_loop: a request that arrives to an idle server runs through the single-sequence loop (the
        others that come while it runs are batched beside it). Off by default: on an H100 a batch of one runs
        1.04x the loop's standard speed and 1.06x its head speed (its trees included; docs/serve.md), and on a
        CPU it is as fast."""
        assert max_seqs >= 1 and queue_size >= 0, "max_seqs >= 1, queue_size >= 0"
        self.engine = engine
        self.batch: BatchEngine | None = None
        if batched:
            try:
                self.batch = BatchEngine(engine, max_seqs)
            except UnsupportedModelError as e:
                log.warning("requests are decoded one at a time: %s", e)
        self.alone_in_loop = alone_in_loop and self.batch is not None
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
        """Each turn: admit what fits, one batched round for the batch, one step of the lone sequence."""
        backlog: deque[Ticket] = deque()
        of: dict[int, Ticket] = {}  # id(batch Sequence) -> its ticket
        solo: tuple[Ticket, Iterator[Step]] | None = None
        while True:
            idle = not backlog and solo is None and not (self.batch and self.batch.active)
            try:
                item = self._queue.get(block=idle)
                while True:
                    if item is None:
                        self._stop(backlog, of, solo)
                        return
                    backlog.append(item)
                    item = self._queue.get_nowait()
            except queue.Empty:
                pass
            # A lone request to an idle server: the loop (alone_in_loop); several at once go to the batch.
            alone = (self.alone_in_loop and solo is None and len(backlog) == 1 and self.batch is not None
                     and not self.batch.active)
            for ticket in list(backlog):
                if self.batch is not None and self.batch.supports(ticket.request) and not alone:
                    if not self.batch.free:
                        continue
                    backlog.remove(ticket)
                    ticket.started = time.perf_counter()
                    try:
                        seq = self.batch.add(ticket.request, ticket.generation.prompt, ticket.cancel)
                    except Exception as e:  # noqa: BLE001 - one line to the client, the server goes on
                        self._fail(ticket, e)
                        continue
                    of[id(seq)] = ticket
                elif solo is None:
                    backlog.remove(ticket)
                    ticket.started = time.perf_counter()
                    solo = (ticket, iter(ticket.generation))
            self._running = (len(self.batch.active) if self.batch else 0) + (solo is not None)
            if self.batch is not None and self.batch.active:
                self._batch_round(of)
            if solo is not None and not self._solo_step(*solo):
                solo = None
            self._running = (len(self.batch.active) if self.batch else 0) + (solo is not None)

    def _batch_round(self, of: dict[int, Ticket]) -> None:
        assert self.batch is not None
        try:
            results = self.batch.round()
        except Exception as e:  # noqa: BLE001 - every sequence of the batch fails with one line
            for seq in list(self.batch.active):
                self.batch.drop(seq)
                self._fail(of.pop(id(seq)), e)
            return
        for seq, step in results:
            ticket = of[id(seq)]
            if step is not None:
                ticket.on_event("step", step)
            if seq.summary is not None:
                del of[id(seq)]
                self._done(ticket, "done", seq.summary)

    def _solo_step(self, ticket: Ticket, steps: Iterator[Step]) -> bool:
        """One step of the sequence the batch cannot take; False once it has ended."""
        try:
            ticket.on_event("step", next(steps))
            return True
        except StopIteration:
            assert ticket.generation is not None and ticket.generation.summary is not None
            self._done(ticket, "done", ticket.generation.summary)
        except Exception as e:  # noqa: BLE001 - one line to the client, the server goes on
            if ticket.generation is not None:
                ticket.generation.close()  # abandoned midway (its client failed): the engine's lock is freed now
            self._fail(ticket, e)
        return False

    def _fail(self, ticket: Ticket, e: Exception) -> None:
        if isinstance(e, GenerationError):
            self._done(ticket, "error", str(e))
            return
        log.exception("generation %d failed", ticket.request.request_id, exc_info=e)
        self._done(ticket, "error", f"internal error ({type(e).__name__}: {str(e)[:200]})")

    def _done(self, ticket: Ticket, kind: EventKind, payload: object) -> None:
        if kind == "done":
            ticket.summary = payload  # type: ignore[assignment]  # "done" carries the Summary
        with self._admit:
            self._admitted -= 1
        ticket.on_event(kind, payload)

    def _stop(self, backlog: deque[Ticket], of: dict[int, Ticket], solo) -> None:
        """Shutdown: whatever was admitted ends with one line."""
        for ticket in [*backlog, *of.values(), *([solo[0]] if solo else [])]:
            self._done(ticket, "error", "The server is shutting down.")
