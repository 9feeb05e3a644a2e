"""The decoding loop: standard and speculative decoding behind one Iterator[Step] protocol."""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from engine.decoding.control import KController
from engine.decoding.describe import describe_step, with_text
from engine.decoding.detok import Detokenizer
from engine.decoding.outcome import Launched, RoundResult, read_outcome
from engine.decoding.prefill import Feed, ProgressCallback
from engine.decoding.proposers import ProposerSet
from engine.decoding.verify import verify_chain, verify_path, verify_standard, verify_tree
from engine.limits import K_MAX, TREE_K_MAX, widest_draft
from engine.measure.stats import summarize
from engine.runners import ids_tensor
from engine.runners.tree import sibling_rows
from engine.types import Decision, GenerationRequest, Step, StopReason, Summary

if TYPE_CHECKING:  # annotations only: the Engine makes each Generation and hands itself in
    from engine.decoding.engine import Engine


def widest(request: GenerationRequest) -> int:
    """The most draft tokens one step of this request may verify."""
    return widest_draft(request.mode, request.k)


@dataclass
class _Run:
    """The state of one generation's loop between its phases (not frozen: the loop moves it on)."""

    generator: torch.Generator  # every random draw of this generation
    detok: Detokenizer  # token ids -> text, across steps
    controller: KController  # chooses each round's K (0: a standard round)
    max_new: int  # tokens it may commit (the request's, or what the context has room for)
    lookahead: bool  # rounds are queued before the host describes the previous one
    stop_reason: StopReason  # why it ends, if nothing else ends it first
    t0: float  # perf_counter at the start
    proposers: ProposerSet | None = None  # set by the prefill
    pending: int = 0  # the committed token the next round feeds first
    depth: int = 1  # rounds in flight
    queue: deque[Launched] = field(default_factory=deque)  # launched, not yet collected
    steps: list[Step] = field(default_factory=list)  # described so far
    text: str = ""  # committed text so far
    draft_forwards: int = 0  # draft-model forwards spent
    late_prefill_ms: float = 0.0  # a proposer's prompt prefill, deferred to its first draft (Proposer.prepare)
    prefilled: float = 0.0  # perf_counter after the prompt prefill
    last_collect: float = 0.0  # perf_counter of the last collected round


class Generation(Iterator[Step]):
    """The Steps of one request; `summary` is set once iteration ends."""

    def __init__(self, engine: Engine, request: GenerationRequest, prompt: list[int], cancel,
                 progress: ProgressCallback | None = None) -> None:
        """progress: told how far each model has read the prompt (PrefillProgress), between its chunks."""
        self.engine = engine
        self.request = request
        self.prompt = prompt
        self.cancel = cancel or threading.Event()
        self.feed = Feed(engine.prefill_rates, engine.device, cancel=self.cancel, progress=progress,
                         estimate=engine.prefill_estimate)
        self.summary: Summary | None = None
        self.token_ids: list[int] = []  # committed tokens, EOS included
        self.tree_alternatives = 0  # alternatives beside each draft of its proposer (0: chains)
        self.tree_nodes = 0  # nodes of the dynamic trees its proposer grows (0: none)
        self._steps: Iterator[Step] = self._run()

    def __next__(self) -> Step:
        return next(self._steps)

    def close(self) -> None:
        """Ends a generation its consumer stops reading: the engine is free for the next one at once.

        A generation holds the engine's lock from its first step to its last; one abandoned midway
        would keep it until the garbage collector found it (it references itself through its steps),
        and the next generate() would wait for that. Closing one that has ended does nothing.
        """
        self._steps.close()

    def _run(self) -> Iterator[Step]:
        with self.engine._lock:
            yield from self._loop()

    def _loop(self) -> Iterator[Step]:
        run = self._prefill()  # 1. both caches take the prompt
        if run.proposers is None or self.cancel.is_set():
            run.stop_reason = "cancelled"
        else:
            self._top_up(run)  # 2. launch rounds
        while run.queue:
            launched = run.queue.popleft()
            result = read_outcome(launched)  # the round's one host sync
            wall_ms = self._wall_ms(run, launched, result)
            committed, kept_draft, done = self._commit(run, launched, result, wall_ms)  # 3. and 4.
            if run.lookahead and not done:
                self._top_up(run)
            step, done = self._describe(run, launched, result, committed, kept_draft, wall_ms, done)  # 5.
            run.steps.append(step)
            yield step
            if done:
                break
            if self.cancel.is_set():  # rounds queued ahead are dropped (their cost is counted below)
                run.stop_reason = "cancelled"
                break
            self._top_up(run)
        self._finish(run)

    # -- the phases ------------------------------------------------------------------------------
    def _prefill(self) -> _Run:
        """1. Prefill: both caches take the prompt except its last token, which every step feeds."""
        eng, req = self.engine, self.request
        target = eng.target_runner
        max_new = min(req.max_new_tokens, target.max_length - len(self.prompt) - (widest(req) + 1))
        run = _Run(
            generator=torch.Generator(device=eng.device).manual_seed(req.sampling.seed),
            detok=Detokenizer(eng.tokenizer, self.prompt),
            controller=eng.make_controller(req),
            max_new=max_new,
            lookahead=eng.device.type == "cuda" if eng.lookahead is None else eng.lookahead,
            stop_reason="max_new_tokens" if max_new == req.max_new_tokens else "context_full",
            t0=time.perf_counter(),
        )
        target.reset()
        if not self._prefill_target():
            run.prefilled = time.perf_counter()
            return run  # cancelled: no proposers, no rounds
        proposers = eng.make_proposers(req, run.generator)  # none for standard decoding
        self.tree_alternatives = max((p.alternatives for p in proposers.parts), default=0)
        self.tree_nodes = max((p.tree_nodes for p in proposers.parts), default=0)
        proposers.start(self.prompt)
        run.pending = self.prompt[-1]
        if not proposers.read_prompt(self.feed.feed):  # a head reads the prompt's rows now; cancelled midway
            run.prefilled = time.perf_counter()
            return run
        run.proposers = proposers
        # 2. With lookahead, rounds are queued before the host describes the previous one, so the
        #    device computes while the host describes and the consumer takes each step. A standard
        #    round's input is the previous round's token, already on the device: two are kept
        #    queued, so the device never waits for the host. A speculative round needs the host's
        #    decision (how much was accepted), so it is queued once the previous one is committed.
        run.depth = 2 if run.lookahead and proposers.queue_standard else 1
        run.prefilled = run.last_collect = time.perf_counter()
        return run

    def _prefill_target(self) -> bool:
        """The target takes prompt[:-1] in measured chunks (prefill.Feed); False when cancelled midway.

        A draft head reads the rows of every prompt position: gathered over the chunks, they are left
        in the runner's `hidden` as one prefill of the whole prompt would leave them.
        """
        target, device = self.engine.target_runner, self.engine.device
        body = self.prompt[:-1]
        target.reserve(len(self.prompt))
        rows: list[torch.Tensor] = []

        def work(start: int, end: int) -> None:
            target.prefill(ids_tensor(body[start:end], device))
            if target.hidden is not None:
                rows.append(target.hidden[: end - start].clone() if rows or end < len(body) else target.hidden)

        done = self.feed.feed("target", len(body), work)
        if done and len(rows) > 1:
            target.hidden = torch.cat(rows)  # [len(body), F]
        return done

    def _top_up(self, run: _Run) -> None:
        """2. Launch rounds until `depth` are in flight; the controller picks each round's K first."""
        assert run.proposers is not None, "launched after the prefill"
        queue = run.queue
        while len(queue) < run.depth and len(self.token_ids) + len(queue) < run.max_new:
            if queue and queue[-1].proposal is not None:
                return  # what follows a speculative round depends on how much it accepted
            room = run.max_new - len(self.token_ids) - len(queue)
            decision = run.controller.choose(run.proposers.offers(min(room, K_MAX)), room)
            if decision.k and queue:
                return  # a speculative round starts from the committed state
            source = queue[-1].token if queue else run.pending
            begin = _mark(self.engine.device.type == "cuda", self.engine.device)
            prepared = self._prepare(run.proposers, decision, begin)
            if self.cancel.is_set() and prepared is not begin:  # stopped while a proposer read the prompt
                run.stop_reason = "cancelled"
                return
            queue.append(self._launch(run.proposers, decision, source, run.generator, begin, prepared))

    def _wall_ms(self, run: _Run, launched: Launched, result: RoundResult) -> float:
        """Host time since the last round was collected, less a deferred prompt prefill (booked as prefill)."""
        now = time.perf_counter()
        wall_ms, run.last_collect = (now - run.last_collect) * 1e3, now
        if not run.steps and self.engine.device.type == "cuda":  # the queued prefill ran inside it
            wall_ms = result.prefill_ms + result.draft_ms + result.verify_ms
        run.late_prefill_ms += result.prefill_ms
        if launched.proposal is not None:
            run.draft_forwards += launched.proposal.forwards
        return wall_ms - result.prefill_ms

    def _commit(self, run: _Run, launched: Launched, result: RoundResult,
                wall_ms: float) -> tuple[list[int], int, bool]:
        """3. Commit the accepted prefix + the target's token, cut at EOS or max_new_tokens; 4. roll
        both caches back to exactly that prefix (minus the newest token). Returns (committed, drafts
        kept, done)."""
        assert run.proposers is not None, "committed after the prefill"
        target, proposal = self.engine.target_runner, launched.proposal
        committed = result.proposed[: result.accepted] + [result.added]
        if result.extra >= 0:  # a tree round kept an alternative: the target's token after it too
            committed.append(result.extra)
        cut = len(committed)
        for i, tok in enumerate(committed):
            if tok in self.engine.eos_ids:
                cut, run.stop_reason = i + 1, "eos"
                break
        room = run.max_new - len(self.token_ids)
        if cut > room:
            cut, run.stop_reason = room, "max_new_tokens"
        committed = committed[:cut]
        # Standard rounds feed only committed tokens: nothing to roll back (and rounds queued
        # behind this one have already moved the target's write position on).
        kept_draft = min(result.accepted, cut)
        if result.extra >= 0 and cut > result.accepted + 1:
            # The alternative is cached (the extra token after it is pending): move its slot and
            # hidden row next to the accepted chain.
            target.keep_path([*range(result.accepted + 1), result.extra_row])
        if result.path_rows is not None:  # a walked tree: its path's rows become the cached sequence
            target.keep_path(result.path_rows[:cut])
        if proposal is not None:
            target.rollback(len(self.prompt) + len(self.token_ids) + cut - 1)
        run.proposers.commit(proposal, kept_draft, committed)
        # A walked tree drafted its depth (the K decided) whatever the walk showed: ending on a branch without
        # children is a miss at the next depth, and the verify priced is the K-deep tree's.
        drafted = launched.decision.k if launched.path else len(result.proposed)
        run.controller.observe(launched.decision, drafted, result.accepted, result.draft_ms,
                               result.verify_ms, wall_ms, tree=launched.tree or launched.path,
                               extra=result.extra >= 0)
        self.token_ids += committed
        run.pending = committed[-1]
        return committed, kept_draft, run.stop_reason == "eos" or len(self.token_ids) >= run.max_new

    def _describe(self, run: _Run, launched: Launched, result: RoundResult, committed: list[int],
                  kept_draft: int, wall_ms: float, done: bool) -> tuple[Step, bool]:
        """5. Describe the step (texts, statuses, probabilities), cut at a stop string; (step, done)."""
        overhead_ms = max(wall_ms - result.draft_ms - result.verify_ms, 0.0)
        step, piece = describe_step(len(run.steps), result, committed, kept_draft, launched, run.detok, run.t0,
                                    overhead_ms, len(self.token_ids))
        run.text += piece
        hit = next((s for s in self.request.stop_strings if s and s in run.text), None)
        if hit is not None:
            # Text already streamed cannot be taken back: cut inside this step's text only.
            start = len(run.text) - len(step.text)
            cut_at = max(run.text.index(hit), start)
            step = with_text(step, step.text[: cut_at - start])
            run.text, run.stop_reason, done = run.text[:cut_at], "stop_string", True
        if done:
            # The detokenizer still holds the bytes of a character the answer ended inside of.
            tail = run.detok.flush() if hit is None else ""
            step = replace(with_text(step, step.text + tail), stop_reason=run.stop_reason)
            run.text += tail
        return step, done

    def _finish(self, run: _Run) -> None:
        eng, req = self.engine, self.request
        if eng.device.type == "cuda":
            # A round queued ahead and then not needed (EOS, stop string, cancel) still runs:
            # the clock stops when the device is idle, so it counts here, not in the next request.
            torch.cuda.synchronize(eng.device)
        seconds = time.perf_counter() - run.t0
        run.controller.finish()
        self.summary = summarize(
            run.steps,
            mode=req.mode,
            k=req.k if req.mode == "speculative" else 0,
            prompt_tokens=len(self.prompt),
            seconds=seconds,
            stop_reason=run.stop_reason,
            draft_forwards=run.draft_forwards,
            prefill_s=run.prefilled - run.t0 + run.late_prefill_ms / 1e3,
        )
        # summarize() rebuilds text from the steps; a stop string cut keeps them consistent.
        assert self.summary.text == run.text, "step texts and generation text disagree"

    # -- one round: launch (queue the device work); outcome.read_outcome is its one host sync ----
    def _prepare(self, proposers: ProposerSet, decision: Decision, begin):
        """The proposer's deferred prompt prefill (the draft model's), fed in chunks before its first
        draft (Stop is checked between them): a mark after it, or `begin` when there was none."""
        if decision.k == 0 or decision.source is None:
            return begin
        if not proposers.prepare(decision.source, self.feed.feed):
            return begin
        return _mark(self.engine.device.type == "cuda", self.engine.device)

    def _launch(
        self, proposers: ProposerSet, decision: Decision, pending: int | torch.Tensor, generator: torch.Generator,
        begin=None, prepared=None,
    ) -> Launched:
        """Queues one round of K = decision.k drafts. No host syncs in here: on CUDA it returns before the
        device has run it.

        pending: the token this round feeds first; for a standard round it may be the previous
        round's token still on the device ([1] long), so the round can be queued behind it.
        begin, prepared: the marks _top_up took around the proposer's prepare (None: begin now, no prepare).
        """
        eng, sampling = self.engine, self.request.sampling
        cuda = eng.device.type == "cuda"
        begin = _mark(cuda, eng.device) if begin is None else begin
        marks = [begin]
        tree = path = False
        if decision.k == 0:  # a standard round: one target forward, one token
            ids = pending if isinstance(pending, torch.Tensor) else ids_tensor([pending], eng.device)
            logits = eng.target_runner.forward(ids)[0, : eng.vocab]  # [V]
            marks += [marks[0], marks[0]]  # no prefill, no draft phase
            outcome, next_input = verify_standard(logits, sampling, generator)
            n, proposal = 0, None
        else:
            next_input = None
            assert decision.source is not None, "a speculative round names its proposer"
            # The proposer's deferred prompt prefill, if any, has its own mark: it is prefill, not drafting.
            marks.append(begin if prepared is None else prepared)
            proposal = proposers.propose(decision.source, decision.k)
            draft = proposal.tokens  # [n]
            n = draft.shape[0]
            marks.append(_mark(cuda, eng.device))
            alts = proposal.alts
            path = proposal.tree is not None  # a grown tree (the proposer checked the context has room)
            # A tree verifies point-mass drafts (q = None): a sampled chain's q needs the chain rule.
            tree = alts is not None and proposal.q is None and 0 < n <= TREE_K_MAX and \
                eng.target_runner.length + sibling_rows(n, alts.shape[1]) <= eng.target_runner.max_length
            if path:
                ids = torch.cat([ids_tensor([pending], eng.device), draft])  # [1 + N]
                logits = eng.target_runner.forward(ids, proposal.tree.shape)[:, : eng.vocab]  # [1 + N, V]
                outcome = verify_path(logits, proposal.tree, sampling, generator)
                n = proposal.tree.max_depth  # the outcome's slots per field
            elif tree:
                ids = torch.cat([ids_tensor([pending], eng.device), draft, alts.reshape(-1)])  # [1 + n(1 + S)]
                logits = eng.target_runner.forward(ids, eng.tree(n, alts.shape[1]))[:, : eng.vocab]  # [W, V]
                outcome = verify_tree(logits, draft, alts, proposal.q_display, sampling, generator)
            else:
                ids = torch.cat([ids_tensor([pending], eng.device), draft])  # [n+1]
                logits = eng.target_runner.forward(ids)[:, : eng.vocab]  # [n+1, V]
                outcome = verify_chain(logits, draft, proposal.q, proposal.q_display, sampling, generator)
        done = None
        if cuda:
            # Pinned destination: the copy to the host is queued too.
            outcome = torch.empty(outcome.shape, pin_memory=True).copy_(outcome, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(eng.device))
        marks.append(_mark(cuda, eng.device))
        return Launched(outcome, n, proposal, decision, done, tuple(marks), next_input, tree=tree, path=path)


def _mark(cuda: bool, device: torch.device):
    """A point in a round's timeline: a recorded timing event on CUDA, the host clock elsewhere.

    Recorded on the stream of the engine's device, which need not be the current device (cuda:1,
    or the last GPU of a split target, where its logits and the draft live).
    """
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event
