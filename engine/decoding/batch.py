"""The batched step: every active sequence drafts, then the target verifies all of their drafts in one forward.

A sequence is one request with its own cache rows (target and draft: engine/runners/batched.py), its
own K (from the engine's controller: 0 is a standard step, so standard and speculative sequences mix
in one batch) and its own proposer (the draft model or n-gram lookup). One `round()`:

1. Draft: n-gram sequences look up their continuation; draft-model sequences feed what their draft
   row lacks and draft K tokens greedily, all of them together one token per draft forward.
2. Verify: one target forward over every sequence's pending token and drafts.
3. Accept (greedy): the longest prefix equal to the target's argmax, then its argmax after it.
4. Commit and roll back each row to exactly the committed prefix; cut at EOS / max_new_tokens.
5. Describe each sequence's Step as the single-sequence loop does (statuses, q, p, text).

Greedy only (sampled requests are served by the single-sequence loop), fixed K, draft or n-gram.
In float32 a sequence's tokens equal the single-sequence loop's: the same argmax acceptance.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace

import torch

from engine.decoding.control import KController
from engine.decoding.detok import Detokenizer
from engine.decoding.ngram import NgramProposer
from engine.decoding.proposers import Offer
from engine.limits import K_AUTO, K_MAX, widest_draft
from engine.measure.stats import summarize
from engine.runners.batched import BatchedDecoder, Part
from engine.runners.lean import PREFILL_CHUNK, LeanDecoder, UnsupportedModelError
from engine.types import Decision, GenerationRequest, Step, StopReason, Summary, TokenView


@dataclass
class Sequence:
    """One request decoding in the batch: its rows, what it committed, and its steps so far."""

    slot: int  # its cache row in the target (and draft) decoder
    request: GenerationRequest  # what was asked
    prompt: list[int]  # rendered prompt ids
    cancel: threading.Event  # set: the sequence ends before its next round
    controller: KController  # chooses its K each round (0: a standard step)
    detok: Detokenizer  # its text, complete characters only
    max_new: int  # tokens it may commit (the request's cap, or what the context leaves)
    stop_reason: StopReason  # why it ends if nothing else stops it first
    ngram: NgramProposer | None = None  # its n-gram index (proposer "ngram")
    draft_len: int = 0  # tokens its draft row holds (proposer "draft")
    token_ids: list[int] = field(default_factory=list)  # committed tokens, EOS included
    steps: list[Step] = field(default_factory=list)
    draft_forwards: int = 0  # draft forwards spent on it after prefill
    t0: float = field(default_factory=time.perf_counter)
    prefill_s: float = 0.0
    summary: Summary | None = None  # set when it has ended

    @property
    def context(self) -> list[int]:
        return self.prompt + self.token_ids


class BatchEngine:
    """Decodes up to `slots` greedy sequences together on an Engine's torch models."""

    def __init__(self, engine, slots: int) -> None:
        """engine: a loaded engine.decoding.Engine on the torch runtime (raises UnsupportedModelError otherwise)."""
        if engine.target is None:
            raise UnsupportedModelError(f"Batched decoding needs torch models, not the {engine.info.runtime} runtime.")
        self.engine = engine
        max_length = engine.target_runner.max_length
        shared = getattr(engine.target_runner, "decoder", None)
        self.target = BatchedDecoder(engine.target, max_length, slots,
                                     shared if isinstance(shared, LeanDecoder) else None)
        self.draft: BatchedDecoder | None = None
        if engine.draft is not None:
            shared = getattr(engine.draft_runner, "decoder", None)
            self.draft = BatchedDecoder(engine.draft, max_length, slots,
                                        shared if isinstance(shared, LeanDecoder) else None)
        self.free = list(range(slots))
        self.active: list[Sequence] = []

    def supports(self, request: GenerationRequest) -> bool:
        """Greedy, fixed K (or standard), the draft model or n-gram lookup, no engine-side stop strings."""
        if not request.sampling.greedy or request.stop_strings or request.mode == "auto":
            return False
        if request.mode == "standard":
            return True
        return request.k != K_AUTO and (request.proposer == "ngram" or
                                        (request.proposer == "draft" and self.draft is not None))

    # -- admission -------------------------------------------------------------------------------
    def add(self, request: GenerationRequest, prompt: list[int], cancel: threading.Event) -> Sequence:
        """Takes a free row and prefills it with the prompt (all but its last token)."""
        assert self.free and self.supports(request), "a free row and a request the batch can take"
        slot = self.free.pop(0)
        eng = self.engine
        room = self.target.max_length - len(prompt) - (widest_draft(request.mode, request.k) + 1)
        max_new = min(request.max_new_tokens, room)
        seq = Sequence(slot, request, list(prompt), cancel, eng.make_controller(request),
                       Detokenizer(eng.tokenizer, prompt), max_new,
                       "max_new_tokens" if max_new == request.max_new_tokens else "context_full")
        decoders = [self.target] + ([self.draft] if self._drafts(seq) else [])
        for decoder in decoders:
            decoder.reset(slot)
            for i in range(0, len(prompt) - 1, PREFILL_CHUNK):
                decoder.forward([Part(slot, tuple(prompt[i: min(i + PREFILL_CHUNK, len(prompt) - 1)]))], logits=False)
        seq.draft_len = len(prompt) - 1 if self._drafts(seq) else 0
        if request.mode != "standard" and request.proposer == "ngram":
            seq.ngram = NgramProposer(eng.device)
            seq.ngram.start(prompt)
        seq.prefill_s = time.perf_counter() - seq.t0
        self.active.append(seq)
        return seq

    def _drafts(self, seq: Sequence) -> bool:
        return seq.request.mode != "standard" and seq.request.proposer == "draft"

    # -- one round -------------------------------------------------------------------------------
    @torch.inference_mode()
    def round(self) -> list[tuple[Sequence, Step | None]]:
        """One batched step for every active sequence: (sequence, its Step) each; a sequence that has
        ended has its summary set (Step None when it ended without one: cancelled before this round)."""
        out: list[tuple[Sequence, Step | None]] = []
        for seq in [s for s in self.active if s.cancel.is_set()]:
            self._finish(seq, "cancelled")
            out.append((seq, None))
        live = list(self.active)
        if not live:
            return out
        t_begin = time.perf_counter()
        # 1. Draft.
        decisions = {id(s): self._decide(s) for s in live}
        drafts: dict[int, list[int]] = {id(s): [] for s in live}
        q_shown: dict[int, list[float]] = {id(s): [] for s in live}
        by_model = [s for s in live if decisions[id(s)].k and decisions[id(s)].source == "draft"]
        for s in live:
            if s.ngram is not None and decisions[id(s)].k:
                drafts[id(s)] = s.ngram.match(decisions[id(s)].k)[0]
                q_shown[id(s)] = [1.0] * len(drafts[id(s)])
        if by_model:
            self._draft_tokens(by_model, decisions, drafts, q_shown)
        t_drafted = time.perf_counter()
        # 2. Verify: pending token + drafts, every sequence in one target forward.
        parts = [Part(s.slot, (s.context[-1], *drafts[id(s)])) for s in live]
        logits = self.target.forward(parts)
        t_verified = time.perf_counter()
        draft_ms, verify_ms = (t_drafted - t_begin) * 1e3, (t_verified - t_drafted) * 1e3
        for s, lg in zip(live, logits):
            step = self._commit(s, drafts[id(s)], q_shown[id(s)], lg[:, : self.engine.vocab], decisions[id(s)],
                                draft_ms, verify_ms)
            out.append((s, step))
        return out

    def _decide(self, s: Sequence) -> Decision:
        room = s.max_new - len(s.token_ids)
        if s.request.mode == "standard":
            offers: tuple[Offer, ...] = ()
        elif s.ngram is not None:
            offers = (s.ngram.offer(min(room, K_MAX)),)
        else:
            offers = (Offer("draft", min(room, K_MAX)),)
        decision = s.controller.choose(offers, room)
        if decision.k and s.ngram is not None and not s.ngram.match(decision.k)[0]:
            return Decision(0, None, "no_match")
        return decision

    def _draft_tokens(self, seqs: list[Sequence], decisions, drafts, q_shown) -> None:
        """Greedy drafts for the draft-model sequences, one batched draft forward per position."""
        assert self.draft is not None
        feed = {id(s): tuple(s.context[s.draft_len:]) for s in seqs}  # what each draft row lacks, pending last
        active = list(seqs)
        position = 0
        while active:
            logits = self.draft.forward([Part(s.slot, feed[id(s)]) for s in active])
            for s, lg in zip(active, logits):
                s.draft_len += len(feed[id(s)])
                s.draft_forwards += 1
                probs = lg[-1, : self.engine.vocab].softmax(-1)
                token = int(probs.argmax())
                drafts[id(s)].append(token)
                q_shown[id(s)].append(float(probs[token]))
                feed[id(s)] = (token,)
            position += 1
            # A sequence's K-th draft token is never fed: the verify takes it.
            active = [s for s in active if len(drafts[id(s)]) < decisions[id(s)].k]

    def _commit(self, s: Sequence, drafted: list[int], q_shown: list[float], logits: torch.Tensor,
                decision: Decision, draft_ms: float, verify_ms: float) -> Step:
        eng = self.engine
        probs = logits.softmax(-1)  # [W, V] what the hover shows under greedy
        best = logits.argmax(-1).tolist()  # [W]
        accepted = 0
        while accepted < len(drafted) and drafted[accepted] == best[accepted]:
            accepted += 1
        committed = drafted[:accepted] + [best[accepted]]
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
        # 4. Rows back to the committed prefix, minus the newest token (fed next round).
        self.target.rollback(s.slot, base + len(committed) - 1)
        if drafted and decision.source == "draft":
            s.draft_len = min(s.draft_len, base + kept)
            self.draft.rollback(s.slot, s.draft_len)
        if s.ngram is not None:
            s.ngram.commit(None, kept, committed)  # type: ignore[arg-type]  # n-gram ignores the proposal
        s.controller.observe(decision, len(drafted), accepted, draft_ms, verify_ms, draft_ms + verify_ms)
        step = self._describe(s, drafted, q_shown, probs, kept, committed, accepted, decision, draft_ms, verify_ms)
        s.token_ids += committed
        step = _with_total(step, len(s.token_ids))
        s.steps.append(step)
        if stop is None and len(s.token_ids) >= s.max_new:
            stop = s.stop_reason
        if stop is not None:
            tail = s.detok.flush()
            step = _end(step, tail, stop)
            s.steps[-1] = step
            self._finish(s, stop)
        return step

    def _describe(self, s: Sequence, drafted: list[int], q_shown: list[float], probs: torch.Tensor, kept: int,
                  committed: list[int], accepted: int, decision: Decision, draft_ms: float,
                  verify_ms: float) -> Step:
        index = len(s.steps)
        source = "ngram" if s.ngram is not None else "draft"
        n_shown = kept if len(committed) <= accepted else len(drafted)
        shown = drafted[:n_shown]
        p_shown = [float(probs[i, t]) for i, t in enumerate(shown)]
        views, rejected, pieces = [], [], []
        for i, tok in enumerate(shown):
            common = dict(token_id=tok, step=index, draft_pos=i, q=q_shown[i], p=p_shown[i],
                          accept_prob=min(1.0, p_shown[i] / q_shown[i]) if q_shown[i] else None, source=source)
            if i < kept:
                piece = s.detok.push(tok)
                pieces.append(piece)
                views.append(TokenView(text=piece, status="accepted", **common))
            else:
                rejected.append(TokenView(text=s.detok.peek(tok), status="rejected", **common))
        views.extend(rejected)
        added = status = None
        if len(committed) > kept:
            added = committed[kept]
            status = "target" if not drafted else ("bonus" if accepted == len(drafted) else "corrected")
            piece = s.detok.push(added)
            pieces.append(piece)
            views.append(TokenView(token_id=added, text=piece, status=status, step=index, draft_pos=None, q=None,
                                   p=float(probs[kept, added]), accept_prob=None))
        return Step(index=index, mode="speculative" if s.request.mode != "standard" else "standard",
                    proposed=tuple(shown), proposed_q=tuple(q_shown[:n_shown]), proposed_p=tuple(p_shown),
                    sources=(source,) * n_shown, accepted=kept, added=added, added_status=status,
                    tokens=tuple(views), text="".join(pieces), new_tokens=len(committed), total_tokens=0,
                    draft_ms=draft_ms, verify_ms=verify_ms, elapsed_s=time.perf_counter() - s.t0,
                    decision=decision)

    def drop(self, s: Sequence) -> None:
        """Takes a sequence out without a summary (its round failed)."""
        self.active.remove(s)
        self.free.append(s.slot)

    def _finish(self, s: Sequence, stop: StopReason) -> None:
        s.controller.finish()
        s.summary = summarize(s.steps, mode=s.request.mode, k=s.request.k if s.request.mode == "speculative" else 0,
                              prompt_tokens=len(s.prompt), seconds=time.perf_counter() - s.t0, stop_reason=stop,
                              draft_forwards=s.draft_forwards, prefill_s=s.prefill_s)
        self.active.remove(s)
        self.free.append(s.slot)


def _with_total(step: Step, total: int) -> Step:
    return replace(step, total_tokens=total)


def _end(step: Step, tail: str, stop: StopReason) -> Step:
    """The last step: the detokenizer's pending bytes go to its last committed token, and why it stopped."""
    if tail:
        views = list(step.tokens)
        last = max(i for i, v in enumerate(views) if v.status != "rejected")
        views[last] = replace(views[last], text=views[last].text + tail)
        step = replace(step, text=step.text + tail, tokens=tuple(views))
    return replace(step, stop_reason=stop)
