"""The decoding loop: standard and speculative decoding behind one Iterator[Step] protocol."""
from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import torch

from engine.decoding.detok import Detokenizer
from engine.decoding.proposers import DraftModelProposer, Proposal, Proposer
from engine.decoding.sampling import accept_draft, display_probs, draw, process
from engine.errors import GenerationError
from engine.limits import K_MAX
from engine.measure.stats import summarize
from engine.runners import Runner, ids_tensor
from engine.types import (
    GenerationRequest,
    ModelInfo,
    Step,
    StopReason,
    Summary,
    TokenView,
)

log = logging.getLogger(__name__)


@dataclass
class _StepResult:
    """What one round decided, on the host, after the step's single device sync."""

    proposed: list[int]  # draft token ids
    q_shown: list[float]  # q(x) per draft token, as displayed
    p_shown: list[float]  # p(x) per draft token, as displayed
    accept_prob: list[float]  # min(1, p/q) per draft token
    accepted: int  # accepted prefix length
    added: int  # the target's token (correction, bonus or standard)
    added_p: float  # its displayed target probability
    draft_ms: float
    verify_ms: float


@dataclass
class _Launched:
    """One round's device work, queued; `_collect` reads its outcome with the round's one host sync.

    On CUDA nothing here has run yet when it is created: the outcome is copied into pinned host
    memory behind the round's kernels and `done` marks when it has landed.
    """

    outcome: torch.Tensor  # [4n + 3] float: drafts, q(x), p(x), accept prob, accepted, added, p(added)
    n: int  # draft tokens in this round
    proposal: Proposal | None  # None for a standard round
    done: torch.cuda.Event | None  # CUDA: recorded after the copy to the host
    marks: tuple  # CUDA: timing events (begin, drafted, verified); CPU: perf_counter times
    token: torch.Tensor | None = None  # standard round: its token [1] on the device, the next round's input


class Engine:
    """A loaded target (and optional draft) that decodes requests; holds the models resident."""

    def __init__(
        self,
        target: torch.nn.Module | None,
        tokenizer,
        info: ModelInfo,
        *,
        draft: torch.nn.Module | None = None,
        vocab: int | None = None,
        target_runner: Runner | None = None,
        draft_runner: Runner | None = None,
        eos_ids: Iterable[int] = (),
    ) -> None:
        """target/draft: torch models, or None where a runner brings its own (llama.cpp);
        eos_ids: end-of-generation ids beyond the tokenizer's and the model config's."""
        assert target is not None or target_runner is not None, "a target model or a target runner"
        self.tokenizer = tokenizer
        self.info = info
        self.target = target
        self.draft = draft
        if target_runner is None or (draft is not None and draft_runner is None):
            from engine.runners.eager import EagerRunner  # imports transformers: only for torch models

            target_runner = target_runner or EagerRunner(target)
            draft_runner = draft_runner or (EagerRunner(draft) if draft is not None else None)
        self.target_runner = target_runner
        self.draft_runner = draft_runner
        self.device = next(target.parameters()).device if target is not None else self.target_runner.device
        # Compare on the shared vocabulary: Qwen2.5 0.5B has 151936 rows, 7B 152064.
        heads = [self.target_runner.vocab_size] + ([self.draft_runner.vocab_size] if self.draft_runner else [])
        self.vocab = vocab or min(heads)
        self.eos_ids = _eos_ids(tokenizer, target) | {int(i) for i in eos_ids}
        self._lock = threading.Lock()  # one generation at a time: the caches are shared
        # Queue rounds ahead of the host (see Generation._loop). None: on CUDA only, where it keeps
        # the device busy while the host describes steps; on a CPU the work runs inside the launch,
        # so it would only delay each step's tokens. Tests force it on to check it changes no output.
        self.lookahead: bool | None = None

    @classmethod
    def from_pair(cls, pair, *, fast_path: str = "auto", progress=None, compile_k: int = 5) -> Engine:
        """Builds runners for a LoadedPair (engine.models.store); the fast path when CUDA allows it.

        fast_path: "auto" (CUDA graphs where possible, else eager), "eager", "static" (graphs or
        an error), "compiled" (graphs of inductor-compiled forwards for K = compile_k: minutes of
        warm-up, fewer kernels per forward).
        """
        target_runner = draft_runner = None
        name = "eager"
        if fast_path in ("auto", "static") and pair.target.device.type == "cpu":
            from engine.runners.cpu import try_pack

            if progress is not None:
                from engine.models.store import LoadProgress

                progress(LoadProgress("warmup", 0.5, "Packing weights for the CPU fast path (oneDNN)"))
            # In place: the pair's models are the engine's from now on (baselines load their own).
            packed = try_pack(pair.target)
            if packed and pair.draft is not None:
                try_pack(pair.draft)
            name = packed or name
        if fast_path != "eager" and pair.target.device.type == "cuda":
            try:
                from engine.runners.graphs import build_runners

                target_runner, draft_runner, name = build_runners(
                    pair.target, pair.draft, progress=progress,
                    compile_k=compile_k if fast_path == "compiled" else None,
                )
            except Exception as exc:  # any model the fast path cannot take falls back, loudly
                if fast_path in ("static", "compiled"):
                    raise
                log.warning("fast path unavailable, using eager decoding: %s", exc)
                target_runner = draft_runner = None
                name = "eager"
        info = replace(pair.info, fast_path=name)
        engine = cls(
            pair.target,
            pair.tokenizer,
            info,
            draft=pair.draft,
            vocab=pair.shared_vocab,
            target_runner=target_runner,
            draft_runner=draft_runner,
        )
        engine.measure_costs(progress)
        if progress is not None:
            from engine.models.store import LoadProgress

            progress(LoadProgress("warmup", 1.0, f"Ready ({name})"))
        return engine

    def measure_costs(self, progress=None, k_max: int | None = None, rounds: int = 3) -> None:
        """The cost model's inputs, measured once at load: ms per draft forward and per target width.

        GPU: the mean of 20 back-to-back graph replays per width (stable, well under a second).
        CPU: forwards take a few hundred ms and their speed drifts with the machine's memory
        bandwidth (right after load and next to other work it can be 2x slower for seconds), so
        after one discarded pass, `rounds` passes each time every width and the draft once, in
        turn, and the median per width is kept: the draft/target ratio is measured side by side.
        About 11 s for the default pair in float32. Never fails a load: without figures the app
        and bench simply say nothing about costs.
        """
        if self.draft_runner is None:
            return
        on_gpu = self.device.type == "cuda"
        widths = range(1, (k_max or (8 if on_gpu else 5)) + 2)  # verify widths up to K_max + 1
        if progress is not None:
            from engine.models.store import LoadProgress

            progress(LoadProgress("warmup", 0.95, "Measuring forward costs for the cost model"))
        try:
            if on_gpu:
                target = self.target_runner.measure_costs(widths, 20)
                draft = self.draft_runner.measure_costs((1,), 20)[1]
            else:
                passes = [
                    (self.target_runner.measure_costs(widths, 1), self.draft_runner.measure_costs((1,), 1)[1])
                    for _ in range(rounds + 1)
                ][1:]  # the first pass only warms up (page faults, allocator, oneDNN primitives)
                target = {w: statistics.median(t[w] for t, _ in passes) for w in passes[0][0]}
                draft = statistics.median(d for _, d in passes)
        except Exception as exc:  # measuring is advice, not a reason to refuse the models
            log.warning("could not measure forward costs: %s", exc)
            return
        self.info = replace(self.info, draft_ms=draft, target_ms=tuple(sorted(target.items())))

    # -- prompts ---------------------------------------------------------------------------
    def encode(self, request: GenerationRequest) -> list[int]:
        """The prompt ids: chat template for messages, raw text otherwise."""
        if request.messages:
            chat = [{"role": m.role, "content": m.content} for m in request.messages]
            if getattr(self.tokenizer, "chat_template", None):
                text = self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            else:
                text = "\n".join(f"{m['role']}: {m['content']}" for m in chat) + "\nassistant: "
        else:
            text = request.prompt or ""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise GenerationError("The prompt is empty.")
        return list(ids)

    def generate(self, request: GenerationRequest, cancel: threading.Event | None = None) -> Generation:
        """Validates the request now (so errors surface before any step) and returns the steps."""
        if request.mode == "speculative":
            if request.k < 1:
                raise GenerationError(f"K must be at least 1 (got {request.k}).")
            if request.k > K_MAX:
                raise GenerationError(f"K must be at most {K_MAX} (got {request.k}).")
            if request.proposer != "ngram" and self.draft_runner is None:
                raise GenerationError("Speculative decoding with a draft model needs a draft; load one first.")
        if request.max_new_tokens < 1:
            raise GenerationError("max_new_tokens must be at least 1.")
        s = request.sampling
        if s.temperature < 0 or not (0.0 < s.top_p <= 1.0) or s.top_k < 0:
            raise GenerationError("temperature must be >= 0, top_p in (0, 1], top_k >= 0.")
        prompt = self.encode(request)
        room = self.target_runner.max_length - len(prompt) - (request.k + 1)
        if room < 1:
            raise GenerationError(
                f"The prompt is {len(prompt)} tokens; the model's context holds "
                f"{self.target_runner.max_length}. Shorten the prompt or start a new chat."
            )
        return Generation(self, request, prompt, cancel)

    def make_proposer(self, request: GenerationRequest, generator: torch.Generator | None) -> Proposer:
        draft = (
            DraftModelProposer(self.draft_runner, request.sampling, self.vocab, generator)
            if self.draft_runner is not None and request.proposer != "ngram"
            else None
        )
        if request.proposer == "draft":
            assert draft is not None
            return draft
        from engine.decoding.ngram import CombinedProposer, NgramProposer

        ngram = NgramProposer(device=self.device)
        return ngram if request.proposer == "ngram" else CombinedProposer(ngram, draft)


class Generation(Iterator[Step]):
    """The Steps of one request; `summary` is set once iteration ends."""

    def __init__(self, engine: Engine, request: GenerationRequest, prompt: list[int], cancel) -> None:
        self.engine = engine
        self.request = request
        self.prompt = prompt
        self.cancel = cancel or threading.Event()
        self.summary: Summary | None = None
        self.token_ids: list[int] = []  # committed tokens, EOS included
        self._steps: Iterator[Step] = self._run()

    def __next__(self) -> Step:
        return next(self._steps)

    def _run(self) -> Iterator[Step]:
        with self.engine._lock:
            yield from self._loop()

    def _loop(self) -> Iterator[Step]:
        eng, req = self.engine, self.request
        speculative = req.mode == "speculative"
        generator = torch.Generator(device=eng.device).manual_seed(req.sampling.seed)
        detok = Detokenizer(eng.tokenizer, self.prompt)
        target = eng.target_runner
        lookahead = eng.device.type == "cuda" if eng.lookahead is None else eng.lookahead
        max_new = min(req.max_new_tokens, target.max_length - len(self.prompt) - (req.k + 1))
        steps: list[Step] = []
        text = ""
        stop_reason: StopReason = "max_new_tokens" if max_new == req.max_new_tokens else "context_full"
        t0 = time.perf_counter()

        # 1. Prefill: both caches take the prompt except its last token, which every step feeds.
        target.reset()
        if len(self.prompt) > 1:
            target.prefill(ids_tensor(self.prompt[:-1], eng.device))
        proposer = eng.make_proposer(req, generator) if speculative else None
        if proposer is not None:
            proposer.start(self.prompt)
        pending = self.prompt[-1]
        draft_forwards = 0
        # 2. Launch a round: propose (speculative) and verify with one target forward of width n+1.
        #    With lookahead, rounds are queued before the host describes the previous one, so the
        #    device computes while the host describes and the consumer takes each step. A standard
        #    round's input is the previous round's token, already on the device: two are kept
        #    queued, so the device never waits for the host. A speculative round needs the host's
        #    decision (how much was accepted), so it is queued once the previous one is committed.
        depth = 2 if lookahead and not speculative else 1  # rounds in flight
        queue: deque[_Launched] = deque()

        def top_up() -> None:
            while len(queue) < depth and len(self.token_ids) + len(queue) < max_new:
                source = queue[-1].token if queue else pending
                queue.append(self._launch(proposer, source, generator, max_new))

        if self.cancel.is_set():
            stop_reason = "cancelled"
        else:
            top_up()

        while queue:
            result, proposal = self._collect(queue.popleft())
            if proposal is not None:
                draft_forwards += proposal.forwards
            # 3. Commit: accepted prefix + the target's token, cut at EOS or max_new_tokens.
            committed = result.proposed[: result.accepted] + [result.added]
            cut = len(committed)
            for i, tok in enumerate(committed):
                if tok in eng.eos_ids:
                    cut, stop_reason = i + 1, "eos"
                    break
            room = max_new - len(self.token_ids)
            if cut > room:
                cut, stop_reason = room, "max_new_tokens"
            committed = committed[:cut]
            # 4. Roll both caches back to exactly the committed prefix (minus the newest token).
            #    Standard rounds feed only committed tokens: nothing to roll back (and rounds
            #    queued behind this one have already moved the target's write position on).
            kept_draft = min(result.accepted, cut)
            if speculative:
                target.rollback(len(self.prompt) + len(self.token_ids) + cut - 1)
                proposer.commit(proposal, kept_draft, committed)
            self.token_ids += committed
            pending = committed[-1]
            done = stop_reason == "eos" or len(self.token_ids) >= max_new
            if lookahead and not done:
                top_up()
            # 5. Describe the step: texts, statuses, probabilities.
            step, piece = self._describe(len(steps), result, committed, kept_draft, proposal, detok, t0)
            text += piece
            hit = next((s for s in req.stop_strings if s and s in text), None)
            if hit is not None:
                # Text already streamed cannot be taken back: cut inside this step's text only.
                start = len(text) - len(step.text)
                cut_at = max(text.index(hit), start)
                step = replace(step, text=step.text[: cut_at - start])
                text, stop_reason, done = text[:cut_at], "stop_string", True
            if done:
                tail = detok.flush() if hit is None else ""
                step = replace(step, text=step.text + tail, stop_reason=stop_reason)
                text += tail
            steps.append(step)
            yield step
            if done:
                break
            if self.cancel.is_set():  # rounds queued ahead are dropped (their cost is counted below)
                stop_reason = "cancelled"
                break
            top_up()
        if eng.device.type == "cuda":
            # A round queued ahead and then not needed (EOS, stop string, cancel) still runs:
            # the clock stops when the device is idle, so it counts here, not in the next request.
            torch.cuda.synchronize(eng.device)
        seconds = time.perf_counter() - t0
        self.summary = summarize(
            steps,
            mode=req.mode,
            k=req.k,
            prompt_tokens=len(self.prompt),
            seconds=seconds,
            stop_reason=stop_reason,
            draft_forwards=draft_forwards,
        )
        # summarize() rebuilds text from the steps; a stop string cut keeps them consistent.
        assert self.summary.text == text, "step texts and generation text disagree"

    # -- one round: launch (queue the device work) and collect (the one host sync) ----------------
    def _launch(
        self, proposer: Proposer | None, pending: int | torch.Tensor, generator: torch.Generator, max_new: int
    ) -> _Launched:
        """Queues one round. No host syncs in here: on CUDA it returns before the device has run it.

        pending: the token this round feeds first; for a standard round it may be the previous
        round's token still on the device ([1] long), so the round can be queued behind it.
        """
        eng, sampling = self.engine, self.request.sampling
        cuda = eng.device.type == "cuda"
        marks = [_mark(cuda)]
        if proposer is None:  # standard decoding: one target forward, one token
            ids = pending if isinstance(pending, torch.Tensor) else ids_tensor([pending], eng.device)
            logits = eng.target_runner.forward(ids)[0, : eng.vocab]  # [V]
            marks.append(marks[0])  # no draft phase
            if sampling.greedy:
                token = logits.argmax()
                p_shown = torch.softmax(logits, -1).gather(0, token.view(1))[0]
            else:
                probs = process(logits, sampling)  # [V]
                token = draw(probs.unsqueeze(0), generator)[0]
                p_shown = probs.gather(0, token.view(1))[0]
            outcome, n, proposal = torch.stack([torch.zeros((), device=eng.device), token.float(), p_shown]), 0, None
            next_input = token.view(1)
        else:
            next_input = None
            k = min(self.request.k, max_new - len(self.token_ids))
            proposal = proposer.propose(k)
            draft = proposal.tokens  # [n]
            n = draft.shape[0]
            marks.append(_mark(cuda))
            ids = torch.cat([ids_tensor([pending], eng.device), draft])  # [n+1]
            logits = eng.target_runner.forward(ids)[:, : eng.vocab]  # [n+1, V]
            p = process(logits, sampling)  # [n+1, V]
            accepted, added, accept_prob = accept_draft(draft, proposal.q, p, sampling.greedy, generator)
            shown_p = display_probs(logits, p, sampling)  # [n+1, V]
            rows = torch.arange(n, device=eng.device)
            p_x = shown_p[rows, draft]  # [n]
            if proposal.q_display is not None:
                q_x = proposal.q_display
            elif proposal.q is not None:
                q_x = proposal.q[rows, draft]
            else:
                q_x = torch.ones(n, device=eng.device)
            added_p = shown_p[accepted.view(1), added.view(1)]  # [1]
            outcome = torch.cat(
                [draft.float(), q_x.float(), p_x.float(), accept_prob.float(),
                 torch.stack([accepted.float(), added.float()]), added_p.float()]
            )
        done = None
        if cuda:
            # Token ids stay exact in float32 (< 2**24). Pinned destination: the copy is queued too.
            outcome = torch.empty(outcome.shape, pin_memory=True).copy_(outcome, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        marks.append(_mark(cuda))
        return _Launched(outcome, n, proposal, done, tuple(marks), next_input)

    def _collect(self, launched: _Launched) -> tuple[_StepResult, Proposal | None]:
        """Waits for a launched round (the step's one host sync) and reads its outcome."""
        if launched.done is not None:
            launched.done.synchronize()
        values = launched.outcome.tolist()
        n = launched.n
        begin, drafted, verified = launched.marks
        if isinstance(begin, float):  # CPU: the work ran inside _launch, so host times are exact
            draft_ms, verify_ms = (drafted - begin) * 1e3, (verified - drafted) * 1e3
        else:  # CUDA: device time between the events
            draft_ms = begin.elapsed_time(drafted) if n else 0.0
            verify_ms = drafted.elapsed_time(verified)
        result = _StepResult(
            proposed=[int(x) for x in values[:n]],
            q_shown=values[n : 2 * n],
            p_shown=values[2 * n : 3 * n],
            accept_prob=values[3 * n : 4 * n],
            accepted=int(values[4 * n]),
            added=int(values[4 * n + 1]),
            added_p=values[4 * n + 2],
            draft_ms=draft_ms,
            verify_ms=verify_ms,
        )
        return result, launched.proposal

    def _describe(
        self,
        index: int,
        r: _StepResult,
        committed: list[int],
        kept_draft: int,
        proposal: Proposal | None,
        detok: Detokenizer,
        t0: float,
    ) -> tuple[Step, str]:
        """Builds the Step with one TokenView per shown token; returns it and its committed text."""
        speculative = proposal is not None
        n_shown = kept_draft if len(committed) <= r.accepted else len(r.proposed)
        proposed = r.proposed[:n_shown]
        views: list[TokenView] = []
        pieces: list[str] = []
        rejected: list[TokenView] = []
        for i, tok in enumerate(proposed):
            src = proposal.sources[i] if proposal is not None else None
            common = dict(token_id=tok, step=index, draft_pos=i, q=r.q_shown[i], p=r.p_shown[i],
                          accept_prob=r.accept_prob[i], source=src)
            if i < kept_draft:
                piece = detok.push(tok)
                pieces.append(piece)
                views.append(TokenView(text=piece, status="accepted", **common))
            else:
                rejected.append(TokenView(text=detok.peek(tok), status="rejected", **common))
        added: int | None = None
        status = None
        if len(committed) > kept_draft:
            added = committed[kept_draft]
            if not speculative or not r.proposed:
                status = "target"  # no draft this step: the target decoded on its own
            else:
                status = "bonus" if r.accepted == len(r.proposed) else "corrected"
        # Rejected tokens are shown before the correction that replaces them.
        views.extend(rejected)
        if added is not None:
            piece = detok.push(added)
            pieces.append(piece)
            views.append(
                TokenView(token_id=added, text=piece, status=status, step=index, draft_pos=None, q=None,
                          p=r.added_p, accept_prob=None, source=None)
            )
        text = "".join(pieces)
        step = Step(
            index=index,
            mode="speculative" if speculative else "standard",
            proposed=tuple(proposed),
            proposed_q=tuple(r.q_shown[:n_shown]),
            proposed_p=tuple(r.p_shown[:n_shown]),
            sources=tuple(proposal.sources[:n_shown]) if proposal is not None else (),
            accepted=kept_draft,
            added=added,
            added_status=status,
            tokens=tuple(views),
            text=text,
            new_tokens=len(committed),
            total_tokens=len(self.token_ids),
            draft_ms=r.draft_ms,
            verify_ms=r.verify_ms,
            elapsed_s=time.perf_counter() - t0,
        )
        return step, text


def _mark(cuda: bool):
    """A point in a round's timeline: a recorded timing event on CUDA, the host clock elsewhere."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _eos_ids(tokenizer, model) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
