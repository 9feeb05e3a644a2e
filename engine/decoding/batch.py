"""The batched step: every active sequence drafts, then the target verifies all of their drafts in one forward.

The models are reached through one seam, BatchedForward (engine/runners/batched.py): on torch, rows of
the lean decoder's KV cache; on llama.cpp, sequences of a multi-sequence context (llamacpp_batch.py). All
that follows is the same for both. A sequence is one request with its own cache rows (target and draft), its
own K (from its controller: 0 is a standard step, so standard and speculative sequences mix in one
batch), its own proposers (the draft model, n-gram lookup, both, or the draft head on torch), its own
sampling and its own random generator. One `round()`:

1. Decide: each sequence's controller picks its K and proposer (an adaptive one against the batch's
   costs, below).
2. Draft: n-gram sequences look up their continuation; every draft-head sequence's head cache row
   reads the rows the last verify kept for it, all in one batched head forward, and those drafting with
   the head draft their chains together, one head forward per position (batch_head.py; beside a GPU's
   static forward their drafts reach the verify on the device, read with its outcome); draft-model
   sequences feed what their draft row lacks and draft their tokens, all of them together one token per
   draft forward (greedy: the argmax; sampled: a draw from the draft's processed distribution q, with
   the sequence's generator).
3. Verify: one target forward over every sequence's pending token and drafts.
4. Accept, each sequence with its own generator and engine/decoding/sampling.py, as the loop: greedy,
   the longest prefix equal to the target's argmax; sampled, Leviathan et al. / Chen et al. (accept x
   with probability min(1, p(x)/q(x)), the correction from normalize(max(0, p - q)), the bonus from p;
   n-gram drafts are point masses); a standard step draws from the processed p. One host sync reads
   every sequence's outcome.
5. Commit and roll back each row to exactly the committed prefix; cut at EOS / max_new_tokens (a sequence
   that stops frees its rows now), and describe each sequence's Step as the single-sequence loop does
   (statuses, q, p, text). On a GPU the Steps come out of the next round(): the host describes a round
   while the device runs the next one's forwards, which no longer wait for it (the description costs about
   as much host time as the round's launches); elsewhere forwards run as they are called, and each round
   describes its own.

Exactness. Greedy in float32: a sequence's tokens equal the single-sequence loop's (on llama.cpp: as far
as its kernels give a row the same argmax whatever else is in its batch). Sampled: every
random draw of a sequence comes from its own generator (seeded by its request), in an order set by its
own decisions only, so with a fixed K it answers in a batch exactly what it answers alone in the batch,
whoever its neighbours are. It does not reproduce the single-sequence loop's tokens for the same seed
(the loop draws in another order): only their law, the target's processed distribution.

Pricing a batch. A sequence with K auto (or auto mode) gets the engine's adaptive controller, which
prices K from verify costs by width. In a batch its round is the whole batched round: it waits for a
verify of every sequence's rows, not of its own. So before each choice its costs are re-priced:
target_ms[w] is what a verify of w rows plus its neighbours' rows (as they were last decided) costs,
from RowCosts (the batch's own measured forwards by total rows; between and beyond them, the shape of
the lone costs measured at load). After the round it observes the batched verify's time, the draft
phase's time when it drafted with the draft model (else 0: waiting while others drafted is overhead of
its round) and the round's wall time. Its timing corrections are the batch's own (a batch's rounds are
not a lone sequence's); its acceptance is shared with the engine (the same pair, the same text). Each
sequence maximises its own tokens/s beside its neighbours, not the batch's total: the time its rows add
to their rounds is not charged to it.
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import replace

import torch

from engine.decoding.batch_head import BatchHeads
from engine.decoding.batch_seq import Drafted, Outcome, Sequence, draft_with_model
from engine.decoding.control import RATE, AdaptiveK, StepCosts, TuningMemory
from engine.decoding.describe import describe_step, with_text
from engine.decoding.detok import Detokenizer
from engine.decoding.ngram import NgramProposer
from engine.decoding.outcome import Launched, RoundResult
from engine.decoding.proposers import Offer, Proposal
from engine.decoding.verify import chain_values, verify_chain, verify_rows_greedy
from engine.errors import GenerationError
from engine.limits import K_MAX, widest_draft
from engine.measure.stats import summarize
from engine.runners.batched import BatchedDecoder, BatchedForward, Part, RowCosts
from engine.runners.graphs import captured_graphs
from engine.runners.llamacpp import LlamaCppRunner
from engine.runners.llamacpp_batch import LlamaCppBatch
from engine.runners.lean import PREFILL_CHUNK, LeanDecoder, UnsupportedModelError
from engine.types import Decision, DraftSource, GenerationRequest, Step, StopReason

MIN_MATCH = 2  # speculative draft+ngram drafts by n-gram on a match this long (CombinedProposer's min_match)


class BatchEngine:
    """Decodes up to `slots` sequences together on an Engine's models (torch, or llama.cpp's runners)."""

    def __init__(self, engine, slots: int, attention: str | None = None) -> None:
        """engine: a loaded engine.decoding.Engine (raises UnsupportedModelError where its models cannot batch);
        attention: how the torch batched forward attends (runners/batched.py ROW_ATTENTION; None: its default)."""
        self.engine = engine
        max_length = engine.target_runner.max_length
        self.target = batched_forward(engine.target, engine.target_runner, slots, max_length)
        self.draft: BatchedForward | None = None
        if engine.draft_runner is not None:
            self.draft = batched_forward(engine.draft, engine.draft_runner, slots, max_length)
        self.free = list(range(slots))
        # The draft head reads the target's kept layers, which the lean decoder's rows give (not llama.cpp's).
        self.heads = BatchHeads(engine, slots, max_length) \
            if engine.head_runner is not None and isinstance(self.target, BatchedDecoder) else None
        # On a GPU every row goes through one static forward, captured as CUDA graphs where the engine's own
        # runner captured its graphs (runners/batched_graphs.py); on a CPU each part attends alone.
        for decoder, runner, keep in ((self.target, engine.target_runner, self.heads.layers if self.heads else ()),
                                      (self.draft, engine.draft_runner, ())):
            if isinstance(decoder, BatchedDecoder) and attention is not None:
                decoder.attention = attention
            if isinstance(decoder, BatchedDecoder) and decoder.device.type == "cuda":
                decoder.use_all_rows(keep, graphs=captured_graphs(runner))
        if self.heads is not None and captured_graphs(engine.target_runner):
            self.heads.warmup()
        # On a GPU a round's Steps are described while the next round's forwards run (they come out of the next
        # round); elsewhere a forward runs as it is called and each round describes its own.
        self.overlap = isinstance(self.target, BatchedDecoder) and self.target.device.type == "cuda"
        self.active: list[Sequence] = []  # admitted, not yet summarised (a stopped one's last Step may wait)
        self.pending: list[Outcome] = []  # the last round's outcomes, described in the next round
        self.costs = RowCosts(RATE)  # what this batch's verifies cost by their rows (as the controller averages)
        self.host_ms = 0.0  # the last round's commits (and, without overlap, descriptions): part of a round's wall time
        # Where rounds spent their time, summed: deciding and drafting, the verify (its forward and acceptance up to
        # the host sync), committing, describing (with overlap the round before's, inside the verify's time: the
        # host describes while the device computes); and how many rounds (a benchmark reads them).
        self.spent_ms = {"draft": 0.0, "verify": 0.0, "commit": 0.0, "describe": 0.0}
        self.rounds = 0
        # Adaptive controllers learn the batch's timing here; acceptance is the engine's (the same dict).
        self.tuning = TuningMemory(acceptance=engine.tuning.acceptance)

    def _sources(self, request: GenerationRequest) -> tuple[DraftSource, ...]:
        """The proposers a request drafts from (engine/decoding/factory.py's rule)."""
        if request.mode == "standard":
            return ()
        kinds = request.proposer.kinds
        if request.mode == "auto" and self.engine.head_runner is not None and "head" not in kinds:
            kinds += ("head",)
        return kinds

    def supports(self, request: GenerationRequest) -> bool:
        """Greedy or sampled; standard, speculative (a fixed K or K auto) or auto; drafts from the draft
        model, n-gram lookup, both, or the draft head (chains; on torch, whose batched forward keeps the
        head's layers). Not engine-side stop strings."""
        sources = self._sources(request)
        return (not request.stop_strings and ("draft" not in sources or self.draft is not None)
                and ("head" not in sources or self.heads is not None))

    # -- admission -------------------------------------------------------------------------------
    def add(self, request: GenerationRequest, prompt: list[int], cancel: threading.Event) -> Sequence:
        """Takes a free row and prefills it with the prompt (all but its last token)."""
        assert self.free and self.supports(request), "a free row and a request the batch can take"
        room = self.target.max_length - len(prompt) - (widest_draft(request.mode, request.k) + 1)
        max_new = min(request.max_new_tokens, room)
        if max_new < 1:  # the scheduler refuses these first; a caller that did not is told the same
            raise GenerationError(f"The prompt is {len(prompt)} tokens; the model's context holds "
                                  f"{self.target.max_length} (prompt and answer together). Shorten the prompt.")
        slot = self.free.pop(0)
        eng = self.engine
        controller = eng.make_controller(request)
        if isinstance(controller, AdaptiveK):
            controller = AdaptiveK(controller.costs, self.tuning, temperature=request.sampling.temperature)
        generator = None
        if not request.sampling.greedy:
            generator = torch.Generator(device=eng.device).manual_seed(request.sampling.seed)
        seq = Sequence(slot, request, list(prompt), cancel, controller, generator, self._sources(request),
                       Detokenizer(eng.tokenizer, prompt), max_new,
                       "max_new_tokens" if max_new == request.max_new_tokens else "context_full",
                       lone_costs=controller.costs if isinstance(controller, AdaptiveK) else None)
        decoders = [self.target] + ([self.draft] if "draft" in seq.sources else [])
        head = self.heads is not None and "head" in seq.sources
        rows = []  # the head's layers over the prompt, as the target reads it
        for decoder in decoders:
            decoder.reset(slot)
            decoder.reserve(slot, len(prompt))
            for i in range(0, len(prompt) - 1, PREFILL_CHUNK):
                part = Part(slot, tuple(prompt[i: min(i + PREFILL_CHUNK, len(prompt) - 1)]))
                if head and decoder is self.target:
                    self.target.forward([part], logits=False, keep=self.heads.layers)  # type: ignore[call-arg]
                    rows.append(self.target.kept[0])  # type: ignore[attr-defined]
                else:
                    decoder.forward([part], logits=False)
        if head:
            assert self.heads is not None
            seq.head = True
            self.heads.start(slot, torch.cat(rows) if rows else None, prompt)
        seq.draft_len = len(prompt) - 1 if "draft" in seq.sources else 0
        if "ngram" in seq.sources:
            seq.ngram = NgramProposer(eng.device)
            seq.ngram.start(prompt)
        seq.prefill_s = time.perf_counter() - seq.t0
        self.active.append(seq)
        return seq

    # -- one round -------------------------------------------------------------------------------
    @torch.inference_mode()
    def round(self) -> list[tuple[Sequence, Step | None]]:
        """One batched step for every sequence still decoding: (sequence, its Step) each, in order, a sequence at
        most once; one that has ended has its summary set with its last Step (Step None: cancelled with none left
        to describe). With `overlap` (a GPU) the Steps are the round before's, described while this round's
        forwards run, and a round with nothing left to decode only describes."""
        out: list[tuple[Sequence, Step | None]] = []
        cancelled = [s for s in self.active if s.cancel.is_set() and not s.stopped]
        for seq in cancelled:
            seq.stopped = True
            self._release(seq)
        live = [s for s in self.active if not s.stopped]
        pending, self.pending = self.pending, []
        t_begin = time.perf_counter()
        read = self._launch(live) if live else None  # asynchronous on a GPU
        t_launched = time.perf_counter()
        out += [(o.seq, self._describe(o)) for o in pending]
        t_described = time.perf_counter()
        described = {id(seq) for seq, _ in out}
        for seq in cancelled:  # each sequence once: a cancelled one's summary comes with its last Step, if any
            self._finish(seq, "cancelled")
            if id(seq) not in described:
                out.append((seq, None))
        if read is not None:
            self._accept(live, *read, t_begin, t_launched, t_described)
            if not self.overlap:  # the forwards ran as they were called: nothing to overlap, no Step need wait
                t0 = time.perf_counter()
                out += [(o.seq, self._describe(o)) for o in self.pending]
                self.pending = []
                ms = (time.perf_counter() - t0) * 1e3
                self.host_ms += ms  # part of the next round's wall time, as the commits are
                self.spent_ms["describe"] += ms
        return out

    def _launch(self, live: list[Sequence]):
        """Decide, draft, verify: every sequence's verify launched (read by _accept)."""
        # 1. Decide, each sequence priced beside the rows its neighbours verify.
        rows = sum(s.rows for s in live)
        decisions: dict[int, Decision] = {}
        for s in live:
            decisions[id(s)] = self._decide(s, rows - s.rows)
            rows += decisions[id(s)].k + 1 - s.rows
            s.rows = decisions[id(s)].k + 1
        # 2. Draft.
        drafted = {id(s): Drafted() for s in live}
        by_model = [s for s in live if decisions[id(s)].k and decisions[id(s)].source == "draft"]
        for s in live:
            if s.ngram is not None and decisions[id(s)].k and decisions[id(s)].source == "ngram":
                tokens = drafted[id(s)].tokens = s.ngram.match(decisions[id(s)].k)[0]
                drafted[id(s)].q_shown = [1.0] * len(tokens)  # point masses
                s.rows = len(tokens) + 1
        if self.heads is not None:
            self._draft_head([s for s in live if s.head], decisions, drafted)
        if by_model:
            assert self.draft is not None
            draft_with_model(self.draft, self.engine.vocab, by_model, decisions, drafted)
        t_drafted = time.perf_counter()
        # 3. Verify: pending token + drafts, every sequence in one target forward.
        parts = [Part(s.slot, (s.context[-1], *drafted[id(s)].tokens), tail=drafted[id(s)].device) for s in live]
        if any(s.head for s in live):  # the head's layers are kept for its sequences (it reads every round's rows)
            logits = self.target.forward(parts, keep=self.heads.layers)  # type: ignore[call-arg,union-attr]
            for s, rows in zip(live, self.target.kept):  # type: ignore[attr-defined]
                s.head_rows = rows if s.head else None
        else:
            logits = self.target.forward(parts)
        # 4. Accept: each sequence's outcome on the device, read in one host sync by _accept.
        table = self._verify_rows(live, drafted, parts)
        if table is None:
            flat = [self._verify(s, drafted[id(s)], lg[:, : self.engine.vocab]) for s, lg in zip(live, logits)]
            ends = list(itertools.accumulate(t.shape[0] for t in flat))
            table = (torch.cat(flat), lambda values: [values[e - t.shape[0]: e] for e, t in zip(ends, flat)])
        return decisions, drafted, parts, table, t_drafted

    def _accept(self, live: list[Sequence], decisions: dict[int, Decision], drafted: dict[int, Drafted],
                parts: list[Part], table: tuple, t_drafted: float, t_begin: float, t_launched: float,
                t_described: float) -> None:
        """Reads every sequence's outcome (the host sync) and commits it; round() describes them (with overlap, in the
        next round)."""
        values, split = table
        outcomes = split(values.tolist())
        t_verified = time.perf_counter()
        # With overlap the verify's wall time holds the last round's Steps, described while its forwards ran: what a
        # round costs either way.
        draft_ms, verify_ms = (t_drafted - t_begin) * 1e3, (t_verified - t_drafted) * 1e3
        self.costs.observe(sum(p.width for p in parts), verify_ms)
        wall_ms = (t_verified - t_begin) * 1e3 + self.host_ms
        head_ms = self.heads.ms if self.heads is not None else 0.0  # what a sequence drafting with the head waited
        for s, row in zip(live, outcomes):
            d = drafted[id(s)]
            if d.device is not None:  # the outcome opens with the drafts and their shown q (verify_chain's layout)
                k = (len(row) - 3) // 4
                d.tokens, d.q_shown = [int(x) for x in row[:k]], row[k: 2 * k]
            source = decisions[id(s)].source
            own_draft_ms = draft_ms if source == "draft" else head_ms if source == "head" else 0.0
            self.pending.append(self._commit(s, d, row, decisions[id(s)], own_draft_ms, verify_ms, wall_ms))
        self.host_ms = (time.perf_counter() - t_verified) * 1e3
        self.rounds += 1
        for phase, ms in (("draft", draft_ms), ("verify", verify_ms), ("commit", self.host_ms),
                          ("describe", (t_described - t_launched) * 1e3)):
            self.spent_ms[phase] += ms

    def _decide(self, s: Sequence, others: int) -> Decision:
        """Its controller's choice; an adaptive one priced for a verify beside `others` rows."""
        room = s.max_new - len(s.token_ids)
        if s.lone_costs is not None:
            assert isinstance(s.controller, AdaptiveK), "only an adaptive controller is priced"
            s.controller.costs = priced(self.costs, s.lone_costs, others)
        decision = s.controller.choose(self._offers(s, min(room, K_MAX)), room)
        if decision.k and s.ngram is not None and decision.source == "ngram" and not s.ngram.match(decision.k)[0]:
            return Decision(0, None, "no_match")
        return decision

    def _offers(self, s: Sequence, k: int) -> tuple[Offer, ...]:
        """What each of its proposers could draft now (as their Proposer.offer says in the loop)."""
        if not s.sources:
            return ()
        # Its draft row lags by more than the usual 1-2 pending tokens after standard steps or n-gram drafts.
        offers = {"draft": Offer("draft", k, catch_up=s.draft_len > 0 and len(s.context) - s.draft_len > 2)}
        if s.head:  # it drafts once its row has rows to read (a one-token prompt: from its second round)
            assert self.heads is not None
            offers["head"] = Offer("head", k if self.heads.can_draft(s.slot) else 0)
        if s.ngram is not None:
            tokens, n = s.ngram.match(k)
            offers["ngram"] = Offer("ngram", len(tokens), key=f"ngram:{n}")
            if s.request.mode == "speculative" and "draft" in s.sources:  # draft+ngram: CombinedProposer's rule
                return (offers["ngram"],) if tokens and n >= MIN_MATCH else (offers["draft"],)
        return tuple(offers[kind] for kind in s.sources if kind in offers)

    def _draft_head(self, seqs: list[Sequence], decisions: dict[int, Decision], drafted: dict[int, Drafted]) -> None:
        """The head's rows read what the last verify kept for them; those drafting with it take their chains
        (batch_head.py: one batched catch-up, K-1 chain steps, one host sync)."""
        assert self.heads is not None
        # A fixed K is not bound by the offer: a row with nothing to read yet (a one-token prompt) drafts nothing.
        ks = {s.slot: decisions[id(s)].k for s in seqs
              if decisions[id(s)].k and decisions[id(s)].source == "head" and self.heads.can_draft(s.slot)}
        # Beside a static forward (a GPU's) the drafts go to the verify on the device, with no host sync.
        on_device = getattr(self.target, "all_rows", None) is not None
        out = self.heads.draft(ks, on_device)
        for s in seqs:
            if s.slot in out and on_device:
                drafted[id(s)].device, drafted[id(s)].shown_device = out[s.slot]
            elif s.slot in out:
                drafted[id(s)].tokens, drafted[id(s)].q_shown = out[s.slot]

    def _verify_rows(self, live: list[Sequence], drafted: dict[int, Drafted], parts: list[Part]) -> tuple | None:
        """Every sequence's verify_chain values as one table on the device and how to split it once read, where the
        verify took the static forward (a GPU's) and all are greedy: a dozen kernels for the batch, not twenty a
        sequence. None: each verifies alone."""
        static = getattr(self.target, "all_rows", None)
        if static is None or static.last is None or any(s.generator is not None for s in live):
            return None
        rows, width = static.last
        device = static.out[width].device
        n = [0] * rows  # drafts per row; rows no sequence holds verify nothing
        for s, p in zip(live, parts):
            n[s.slot] = p.width - 1
        if self.heads is not None and all(drafted[id(s)].shown_device is not None for s in live):
            q = self.heads.runner.shown[:rows, : width - 1]  # every row's q(x) as the head drafted it (its view)
        else:
            q = torch.ones(rows, width - 1)  # q(x) people see, host-known ones filled here
            for s in live:
                q[s.slot, : len(drafted[id(s)].q_shown)] = torch.tensor(drafted[id(s)].q_shown)
            q = q.to(device, non_blocking=True)
            for s, p in zip(live, parts):  # the head's shown q, still on the device
                if drafted[id(s)].shown_device is not None:
                    q[s.slot, : p.width - 1].copy_(drafted[id(s)].shown_device)
        table = verify_rows_greedy(static.out[width][:rows, :, : self.engine.vocab], static.ids[width][:rows],
                                   torch.tensor(n).to(device, non_blocking=True), q)
        return table, lambda values: [chain_values(values[s.slot], width, p.width - 1) for s, p in zip(live, parts)]

    def _verify(self, s: Sequence, d: Drafted, logits: torch.Tensor) -> torch.Tensor:
        """One sequence's acceptance from the target's logits [n+1, V], on the device, with its own generator: the
        loop's verify_chain (no drafts: a standard step, the target's token from its processed law).

        Returns verify_chain's [4n + 3]: drafts, q(x), p(x), accept prob, accepted, added, p(added)."""
        draft = d.device if d.device is not None else torch.tensor(d.tokens, dtype=torch.long, device=logits.device)
        q = torch.stack(d.q_rows).to(logits.device) if d.q_rows else None  # [n, V]; None: point masses
        return verify_chain(logits, draft, q, d.shown_device, s.request.sampling, s.generator)

    def _commit(self, s: Sequence, d: Drafted, values: list[float], decision: Decision, draft_ms: float,
                verify_ms: float, wall_ms: float) -> Outcome:
        """A sequence's verified round into its state (tokens, rows, proposers, controller); at a stop its rows are
        freed. Describing it for people waits (_describe)."""
        eng, n = self.engine, len(d.tokens)
        accepted, added = int(values[4 * n]), int(values[4 * n + 1])
        committed = d.tokens[:accepted] + [added]
        stop: StopReason | None = None
        cut = len(committed)
        for i, tok in enumerate(committed):
            if tok in eng.eos_ids:
                cut, stop = i + 1, "eos"
                break
        room = s.max_new - len(s.token_ids)
        if cut > room:
            cut, stop = room, "max_new_tokens"
        committed = committed[:cut]
        kept = min(accepted, cut)
        base = len(s.context)  # prompt + committed before this round
        # 5. Rows back to the committed prefix, minus the newest token (fed next round).
        self.target.rollback(s.slot, base + len(committed) - 1)
        if n and decision.source == "draft":
            assert self.draft is not None
            s.draft_len = min(s.draft_len, base + kept)
            self.draft.rollback(s.slot, s.draft_len)
        if s.ngram is not None:
            s.ngram.commit(None, kept, committed)  # type: ignore[arg-type]  # n-gram ignores the proposal
        if s.head and s.head_rows is not None:  # every round: rounds it did not draft keep its row in step
            self.heads.commit(s.slot, s.head_rows, committed)  # type: ignore[union-attr]
            s.head_rows = None
        s.controller.observe(decision, n, accepted, draft_ms, verify_ms, wall_ms)
        s.token_ids += committed
        if stop is None and len(s.token_ids) >= s.max_new:
            stop = s.stop_reason
        if stop is not None:
            s.stopped = True
            self._release(s)
        return Outcome(s, d, values, decision, committed, kept, draft_ms, verify_ms, stop)

    def _describe(self, o: Outcome) -> Step:
        """The Step as the single-sequence loop describes one (engine/decoding/describe.py), from a round's
        verify_chain outcome read back on the host; the sequence's summary with its last."""
        s, d, values, n = o.seq, o.drafted, o.values, len(o.drafted.tokens)
        result = RoundResult(proposed=d.tokens, q_shown=d.q_shown, p_shown=values[2 * n: 3 * n],
                             accept_prob=values[3 * n: 4 * n], accepted=int(values[4 * n]),
                             added=int(values[4 * n + 1]), added_p=values[4 * n + 2], draft_ms=o.draft_ms,
                             verify_ms=o.verify_ms)
        proposal = None
        if o.decision.k:
            proposal = Proposal(tokens=torch.tensor(d.tokens, dtype=torch.long), q=None,
                                sources=(o.decision.source,) * n, forwards=n)  # type: ignore[arg-type]
        launched = Launched(torch.tensor(values), n, proposal, o.decision, None, ())
        # Its tokens already hold this round's (committed before it is described).
        step, _ = describe_step(len(s.steps), result, o.committed, o.kept, launched, s.detok, s.t0, 0.0,
                                len(s.token_ids))
        if o.stop is not None:
            # The detokenizer's pending bytes go to the last committed token, as the loop's last step does.
            step = replace(with_text(step, step.text + s.detok.flush()), stop_reason=o.stop)
        s.steps.append(step)
        if o.stop is not None:
            self._finish(s, o.stop)
        return step

    @property
    def decoding(self) -> int:
        """Sequences still decoding (the active ones whose last Step may still wait are not)."""
        return sum(not s.stopped for s in self.active)

    def drop(self, s: Sequence) -> None:
        """Takes a sequence out without a summary (its round failed)."""
        if not s.stopped:
            s.stopped = True
            self._release(s)
        self.pending = [o for o in self.pending if o.seq is not s]
        self.active.remove(s)

    def _finish(self, s: Sequence, stop: StopReason) -> None:
        s.controller.finish()
        s.summary = summarize(s.steps, mode=s.request.mode, k=s.request.k if s.request.mode == "speculative" else 0,
                              prompt_tokens=len(s.prompt), seconds=time.perf_counter() - s.t0, stop_reason=stop,
                              draft_forwards=s.draft_forwards, prefill_s=s.prefill_s)
        self.active.remove(s)

    def _release(self, s: Sequence) -> None:
        """Its rows are emptied now (llama.cpp's cells go back to the pool its neighbours share) and free."""
        for decoder in (self.target, self.draft):
            if decoder is not None:
                decoder.reset(s.slot)
        if s.head:
            self.heads.release(s.slot)  # type: ignore[union-attr]
        self.free.append(s.slot)
        self.free.sort()  # a new sequence takes the lowest free row: a GPU's static forward runs the rows up to it


def batched_forward(model: torch.nn.Module | None, runner, slots: int, max_length: int) -> BatchedForward:
    """One model's batched forward: llama.cpp's multi-sequence batches beside a llama.cpp runner, the lean
    decoder's cache rows for a torch model (its fused weights shared with the runner's lean decoder, if any)."""
    if isinstance(runner, LlamaCppRunner):
        return LlamaCppBatch(runner, slots, max_length)
    if model is None:
        raise UnsupportedModelError(f"Batched decoding cannot run on the {runner.name} runner; serving one at a time.")
    shared = getattr(runner, "decoder", None)
    return BatchedDecoder(model, max_length, slots, shared if isinstance(shared, LeanDecoder) else None)


def priced(costs: RowCosts, lone: StepCosts, others: int) -> StepCosts:
    """`lone` for a sequence verifying w = 1..K_MAX+1 tokens beside `others` rows of its neighbours."""
    return replace(lone, target_ms=(0.0, *(costs.ms(lone.target_ms, others + w) for w in range(1, K_MAX + 2))))
