"""Where drafts come from: a small interface (propose K tokens with their q; learn what was kept)."""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
import torch

from engine.decoding.prefill import FeedFn, feed_all
from engine.decoding.sampling import draw, process
from engine.runners import Runner, ids_tensor
from engine.runners.tree import TreeDraft
from engine.types import DraftSource, ProposerCost, Sampling


@dataclass
class Proposal:
    tokens: torch.Tensor  # [n] long on the loop's device; n <= k (an n-gram miss gives n = 0)
    q: torch.Tensor | None  # [n, V] processed draft distributions; None = point masses on tokens
    sources: tuple[DraftSource, ...]  # proposer of each token
    forwards: int  # draft-model forwards spent on this proposal
    q_display: torch.Tensor | None = None  # [n] q(x) to show people (softmax at T=1 under greedy)
    # [n, S] S alternative target ids beside each draft token (point-mass drafts), verified as a tree
    # (engine/runners/tree.py: leaves sharing the draft token's parent); None: a chain.
    alts: torch.Tensor | None = None
    # A tree the proposer grew (the head's dynamic trees): `tokens` are its nodes [N], verified in one
    # tree forward and walked (verify.verify_path); None: a chain (or alts' sibling tree).
    tree: TreeDraft | None = None


@dataclass(frozen=True)
class Offer:
    """What a proposer can do this step, for the K controller (engine/decoding/control.py)."""

    source: DraftSource  # who would draft: the key of its measured cost (ModelInfo.proposer_costs)
    max_tokens: int  # most draft tokens it can propose now (n-gram: the match's continuation; 0: nothing)
    key: str = ""  # key of its acceptance statistics when they depend on more than the source ("ngram:3")
    catch_up: bool = False  # it must first feed tokens committed without it (a draft model after standard steps)
    # Its drafts carry alternatives: a draft of up to TREE_K_MAX tokens verifies as a tree, which
    # costs a wider verify and keeps one more token when the target's token at a rejection is one of them.
    tree: bool = False

    def __post_init__(self) -> None:
        if not self.key:
            object.__setattr__(self, "key", self.source)


class Proposer:
    """Where drafts come from (HF's CandidateGenerator): one subclass per strategy.

    Four methods every proposer has; its optional capabilities are declared here with their
    defaults, and a proposer that has one overrides it.
    """

    # It reads the target's outputs of every round at commit (a head reading hidden rows): the loop
    # then never queues a standard round ahead of that commit (ProposerSet.queue_standard).
    reads_target: bool = False
    alternatives: int = 0  # next-best tokens proposed beside each draft, verified as a tree (0: chains)
    tree_nodes: int = 0  # nodes of the dynamic trees it grows instead of chains (0: none)

    def start(self, prompt: list[int]) -> None:
        """A new generation begins with these prompt ids."""
        raise NotImplementedError

    def offer(self, k: int) -> Offer:
        """What it could draft now, at most k tokens (no device work: the controller asks every step)."""
        raise NotImplementedError

    def propose(self, k: int) -> Proposal:
        """Up to k draft tokens continuing the committed text."""
        raise NotImplementedError

    def commit(self, proposal: Proposal, accepted: int, new_tokens: list[int]) -> None:
        """The step kept `accepted` proposed tokens; `new_tokens` is everything it committed.

        A step it did not draft (a standard step, or another proposer's) comes with an empty
        proposal: its caches must then take `new_tokens` on its next proposal.
        """
        raise NotImplementedError

    def prepare(self, source: str, feed: FeedFn = feed_all) -> bool:
        """The one-off work it defers to its first proposal of a generation (the draft model's prompt
        prefill), fed through `feed` in chunks (the loop stops between them on a cancel); says whether
        there was any. The loop calls it just before propose() and books its time as prefill, not
        drafting: it is paid once per answer, so costing it per proposal or per token would mispredict
        every step. Default: nothing to do."""
        return False

    def read_prompt(self, feed: FeedFn) -> bool:
        """The prompt work it needs whether it drafts or not (a head reading the prompt's rows), right
        after start() and fed through `feed`; False when cancelled midway. Default: nothing to do."""
        return True


def empty_proposal(device: torch.device) -> Proposal:
    """A proposal of no tokens: tells a proposer that a step was committed without its draft."""
    return Proposal(tokens=torch.zeros(0, dtype=torch.long, device=device), q=None, sources=(), forwards=0)


class DraftModelProposer(Proposer):
    """The draft model proposes autoregressively, one 1-token forward per draft token.

    Its cache holds every committed token except the ones in `pending`, which the next proposal
    feeds first (usually just the last committed token; two after a fully accepted draft).
    """

    def __init__(self, runner: Runner, sampling: Sampling, vocab: int, generator: torch.Generator | None) -> None:
        self.runner = runner
        self.sampling = sampling
        self.vocab = vocab  # shared vocabulary: draft logits beyond it are never proposed
        self.generator = generator
        self.device = runner.device
        self.pending: list[int] = []
        self.cached = 0  # committed tokens in the draft cache (after rollback)

    def offer(self, k: int) -> Offer:
        # Two pending tokens are the normal case after a fully accepted draft (a captured width).
        # Before its first proposal the prompt is pending: that is a prefill (prepare), not a catch-up.
        return Offer("draft", k, catch_up=self.cached > 0 and len(self.pending) > 2)

    def start(self, prompt: list[int]) -> None:
        # The prompt is fed when the draft first drafts, not now: auto mode may never draft (a draft
        # that cannot pay), and then its prompt prefill was ~10% of a short answer's time on llama.cpp.
        self.runner.reset()
        self.cached = 0
        self.pending = list(prompt)

    @torch.inference_mode()
    def prepare(self, source: str = "draft", feed: FeedFn = feed_all) -> bool:
        """The first draft of this generation feeds the prompt (all pending tokens but the last) first.

        Cancelled midway, what was fed stays cached and the rest pending: the next proposal would
        catch up on it (the loop ends the generation instead, and start() empties the cache)."""
        if self.cached or len(self.pending) <= 1:
            return False
        body = self.pending[:-1]
        self.runner.reserve(len(self.pending))
        fed = 0

        def work(start: int, end: int) -> None:
            nonlocal fed
            self.runner.prefill(ids_tensor(body[start:end], self.device))
            fed = end

        feed("draft", len(body), work)
        self.cached, self.pending = fed, self.pending[fed:]
        return True

    @torch.inference_mode()
    def propose(self, k: int) -> Proposal:
        greedy = self.sampling.greedy
        tokens, q_rows, shown = [], [], []
        self.prepare()  # a no-op when the loop has prepared it
        if len(self.pending) > 2:
            # A catch-up after standard steps: fed as a prefill, with no logits for rows nobody reads;
            # only the last token goes through forward.
            self.runner.prefill(ids_tensor(self.pending[:-1], self.device))
            self.cached += len(self.pending) - 1
            self.pending = self.pending[-1:]
        ids = ids_tensor(self.pending, self.device)  # [P], queued: no wait for the device
        for _ in range(k):
            logits = self.runner.forward(ids)[-1, : self.vocab]  # [V]
            if greedy:
                # Greedy drafts are point masses (q = None): no [V] one-hot per token to build.
                x = logits.argmax(-1, keepdim=True)
                shown.append(logits.softmax(-1).gather(0, x))
            else:
                q = process(logits, self.sampling)  # [V]
                x = draw(q.unsqueeze(0), self.generator)
                q_rows.append(q)
            tokens.append(x)
            ids = x
        return Proposal(
            tokens=torch.cat(tokens),  # [K]
            q=torch.stack(q_rows) if q_rows else None,  # [K, V]
            sources=("draft",) * k,
            forwards=k,
            q_display=torch.cat(shown) if shown else None,
        )

    def commit(self, proposal: Proposal, accepted: int, new_tokens: list[int]) -> None:
        n = len(proposal.tokens)
        # propose() fed pending + the first n-1 proposals; keep the part that was committed.
        # n == 0: another proposer drafted this step and nothing was fed here.
        keep = len(self.pending) + min(accepted, n - 1) if n else 0
        self.cached += keep
        self.runner.rollback(self.cached)
        self.pending = (self.pending + new_tokens)[keep:]


class ProposerSet:
    """The proposers one generation may draft from; the controller picks one per step, or none.

    Every proposer is told every step's committed tokens: the one that drafted gets its proposal,
    the others (and all of them after a standard step) an empty one, so their caches stay in step.
    Standard decoding is the empty set.
    """

    def __init__(self, parts: Sequence[Proposer], device: torch.device) -> None:
        self.parts = tuple(parts)
        self._empty = empty_proposal(device)  # made once: no allocation per standard step
        # Standard rounds are not queued ahead of the commit of a proposer that reads the target's rows.
        self.queue_standard = not any(p.reads_target for p in self.parts)
        self._offered: dict[str, Proposer] = {}  # source -> the part that offered it last
        self._drafter: Proposer | None = None  # the part that drafted the round in flight

    def start(self, prompt: list[int]) -> None:
        for part in self.parts:
            part.start(prompt)

    def offers(self, k: int) -> tuple[Offer, ...]:
        offers = tuple(part.offer(k) for part in self.parts)
        self._offered = {offer.source: part for offer, part in zip(offers, self.parts)}
        return offers

    def prepare(self, source: str, feed: FeedFn = feed_all) -> bool:
        """The one-off work of the part that will propose for `source` (see Proposer); True if there was any."""
        return self._offered[source].prepare(source, feed)

    def read_prompt(self, feed: FeedFn) -> bool:
        """Every part's prompt work after start() (see Proposer); False when cancelled midway."""
        return all(part.read_prompt(feed) for part in self.parts)

    def propose(self, source: str, k: int) -> Proposal:
        self._drafter = self._offered[source]
        return self._drafter.propose(k)

    def commit(self, proposal: Proposal | None, accepted: int, new_tokens: list[int]) -> None:
        for part in self.parts:
            if proposal is not None and part is self._drafter:
                part.commit(proposal, accepted, new_tokens)
            else:
                part.commit(self._empty, 0, new_tokens)
        if proposal is not None:
            self._drafter = None


def measure_proposer(proposer: Proposer, source: DraftSource, prompt: list[int], device: torch.device, *,
                     k: int = 4, iters: int = 3, warm: bool = True) -> ProposerCost:
    """A proposer's own cost, measured the way the loop calls it: propose(1) and propose(k), then commit.

    per token = (t(k) - t(1)) / (k - 1); per proposal = t(1) - per token. Medians over `iters`
    rounds, after one untimed round when `warm`; every round restarts from `prompt`, and the
    one-off work of a generation (prepare: the draft model's prompt prefill) is done before the
    clock starts, as the loop books it as prefill.
    """
    assert k >= 2, "two draft lengths are needed to tell per-token from per-proposal cost"

    def sync() -> None:  # CUDA work is asynchronous: the clock reads only after it has run
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    samples: dict[int, list[float]] = {1: [], k: []}
    for i in range(iters + 1 if warm else iters):
        for n in (1, k):
            proposer.start(prompt)
            proposer.prepare(source)
            sync()
            t0 = time.perf_counter()
            proposal = proposer.propose(n)
            proposer.commit(proposal, 0, [prompt[-1]])
            sync()
            if i or not warm:  # a warm round pays for allocator growth, kernel choice, caches
                samples[n].append((time.perf_counter() - t0) * 1000)
    one, many = (sorted(v)[len(v) // 2] for v in (samples[1], samples[k]))
    if many <= one:  # noise swamped the difference (a busy machine, a nearly free proposer): no split
        return ProposerCost(source, many / k, 0.0)
    per_token = (many - one) / (k - 1)
    return ProposerCost(source, per_token, max(one - per_token, 0.0))
