"""What the batched step (engine/decoding/batch.py) keeps per sequence, and its drafting with a draft model."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from engine.decoding.control import KController, StepCosts
from engine.decoding.detok import Detokenizer
from engine.decoding.ngram import NgramProposer
from engine.decoding.sampling import draw, process
from engine.runners.batched import BatchedForward, Part
from engine.runners.lean import PREFILL_CHUNK
from engine.types import Decision, DraftSource, GenerationRequest, Step, StopReason, Summary


@dataclass
class Sequence:
    """One request decoding in the batch: its rows, what it committed, and its steps so far."""

    slot: int  # its cache row in the target (and draft) decoder
    request: GenerationRequest  # what was asked
    prompt: list[int]  # rendered prompt ids
    cancel: threading.Event  # set: the sequence ends before its next round
    controller: KController  # chooses its K each round (0: a standard step)
    generator: torch.Generator | None  # every random draw of this sequence (None: greedy)
    sources: tuple[DraftSource, ...]  # proposers it may draft from, in the order they are offered
    detok: Detokenizer  # its text, complete characters only
    max_new: int  # tokens it may commit (the request's cap, or what the context leaves)
    stop_reason: StopReason  # why it ends if nothing else stops it first
    lone_costs: StepCosts | None = None  # an adaptive controller's costs at load, re-priced for the batch
    ngram: NgramProposer | None = None  # its n-gram index ("ngram" in sources)
    draft_len: int = 0  # tokens its draft row holds ("draft" in sources)
    head: bool = False  # the draft head keeps a cache row for it ("head" in sources; batch_head.py)
    head_rows: torch.Tensor | None = None  # the head's layers of its part of this round's verify [W, F]
    rows: int = 1  # tokens of its last verify: what its neighbours' pricing counts for it
    token_ids: list[int] = field(default_factory=list)  # committed tokens, EOS included
    steps: list[Step] = field(default_factory=list)
    draft_forwards: int = 0  # draft forwards spent on it after prefill
    t0: float = field(default_factory=time.perf_counter)
    prefill_s: float = 0.0
    summary: Summary | None = None  # set when it has ended
    # It decodes no more (a stop was committed or it was dropped): its rows are free, its last Step may wait to be
    # described (BatchEngine.round describes a round's outcomes while the next round's forwards run).
    stopped: bool = False

    @property
    def context(self) -> list[int]:
        return self.prompt + self.token_ids


@dataclass
class Drafted:
    """One sequence's drafts of a round (host ids, what they show, and q when the draft model sampled them)."""

    tokens: list[int] = field(default_factory=list)  # draft ids, in order
    q_shown: list[float] = field(default_factory=list)  # q(x) people see (softmax at T = 1 under greedy)
    q_rows: list[torch.Tensor] = field(default_factory=list)  # [V] each: processed q of sampled drafts
    # The head's drafts and their shown q still on the device (beside a static batched forward): the verify
    # reads them there, and `tokens` / `q_shown` are filled from its outcome.
    device: torch.Tensor | None = None  # [n] long
    shown_device: torch.Tensor | None = None  # [n]


@dataclass
class Outcome:
    """A sequence's round after its verify was read: committed, waiting to be described as a Step."""

    seq: Sequence
    drafted: Drafted
    values: list[float]  # verify_chain's layout
    decision: Decision
    committed: list[int]
    kept: int  # drafts kept
    draft_ms: float
    verify_ms: float
    stop: StopReason | None  # set: the sequence ends with this round


def draft_with_model(draft: BatchedForward, vocab: int, seqs: list[Sequence], decisions: dict[int, Decision],
                     drafted: dict[int, Drafted]) -> None:
    """The draft-model sequences' drafts, one batched draft forward per position (greedy: the argmax; sampled: a
    draw from the draft's processed q with the sequence's generator)."""
    # A row far behind (after standard steps or n-gram drafts) first reads what it missed, no logits.
    lag = {id(s): s.context[s.draft_len: -1] for s in seqs if len(s.context) - s.draft_len > 2}
    while lag:
        draft.forward([Part(s.slot, tuple(lag[id(s)][:PREFILL_CHUNK])) for s in seqs if id(s) in lag],
                           logits=False)
        for s in [s for s in seqs if id(s) in lag]:
            s.draft_len += len(lag[id(s)][:PREFILL_CHUNK])
            lag[id(s)] = lag[id(s)][PREFILL_CHUNK:]
            if not lag[id(s)]:
                del lag[id(s)]
    feed = {id(s): tuple(s.context[s.draft_len:]) for s in seqs}  # what each draft row lacks, pending last
    active = list(seqs)
    while active:
        logits = draft.forward([Part(s.slot, feed[id(s)], outputs=1) for s in active])  # [1, V] each
        picked = []
        for s, lg in zip(active, logits):
            s.draft_len += len(feed[id(s)])
            s.draft_forwards += 1
            lg = lg[-1, : vocab]  # [V]
            if s.generator is None:  # greedy: a point mass on the argmax; people see q at T = 1
                x = lg.argmax(-1, keepdim=True)  # [1]
                shown = lg.softmax(-1).gather(0, x)  # [1]
            else:
                q = process(lg, s.request.sampling)  # [V]
                x = draw(q.unsqueeze(0), s.generator)  # [1]
                shown = q.gather(0, x)
                drafted[id(s)].q_rows.append(q)
            picked.append(torch.cat([x.float(), shown]))  # [2]
        # One host sync per position: the next draft forward feeds these tokens.
        for s, (token, q_x) in zip(active, torch.stack(picked).tolist()):
            drafted[id(s)].tokens.append(int(token))
            drafted[id(s)].q_shown.append(q_x)
            feed[id(s)] = (int(token),)
        # A sequence's last draft token is never fed: the verify takes it.
        active = [s for s in active if len(drafted[id(s)].tokens) < decisions[id(s)].k]
