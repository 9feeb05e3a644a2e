"""The K controller: before each step it picks K (0 = a standard step) and who drafts; after it, it learns.

The loop (loop.py) asks `choose(offers, room)` at the top of every round and reports the round with
`observe(...)` after its commit. Two controllers sit behind that seam:

- FixedK: the K a person asked for (standard decoding is FixedK(0)).
- AdaptiveK: the K in 0..K_MAX that maximises predicted tokens per second,

      rate(0) = 1 / t_std,   rate(K) = E_K / t_K,   E_K = 1 + sum_{j<=K} prod_{i<=j} a_i,

  from the forward costs measured at load (every verify width 1..K_MAX+1, each proposer's own
  cost), ratios and per-step overheads measured online from this process's real steps, and a
  decayed Beta posterior of the acceptance a_i at each draft position i, so K moves within one
  answer (a code block drafts long, prose short). When no K beats a standard step it decodes
  standard steps and probes every PROBE_EVERY of them (a short draft) to see whether that is
  still true, as long as probes have cost at most PROBE_SHARE of the time decoded so far: an
  expensive draft (a draft model's probe after a long standard stretch first feeds it every token
  it missed) is then probed rarely, a cheap one (the draft head) often enough to notice within a
  few dozen steps that the text has turned its way again. What it learns is kept per engine
  (TuningMemory), so the next answer starts from it.

Decisions cost microseconds: plain Python floats, no torch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.decoding.proposers import Offer
from engine.limits import K_MAX, TREE_K_MAX
from engine.types import Decision, ProposerCost

DECAY = 0.92  # per step the proposer drafts: evidence older than ~12 such steps fades, so K follows the text
IDLE_DECAY = 0.99  # per step it does not draft: an old verdict weighs less when a probe brings news
PRIOR_MEAN = 0.6  # acceptance assumed before any evidence
PRIOR_WEIGHT = 2.0  # pseudo-observations behind PRIOR_MEAN, and behind the pooled mean for each position
RATE = 0.15  # weight of the newest step in the online timing averages
# Standard steps between probes while speculation does not pay. The interval once doubled after every
# probe that confirmed the verdict (up to 128): with the draft head on the H200 a bad patch of text
# then kept auto standard for hundreds of steps after the text turned back (701 standard steps of
# 2,145, 1.27x against the fixed head's 1.55x); PROBE_SHARE alone now spaces out costly probes.
PROBE_EVERY = 16
PROBE_K = (2, 3)  # shortest and longest probe: short (they are not expected to pay), but informative
EXPLORE = 6.0  # draft positions a proposer must have been tried on before a verdict against it counts
# Probes (after the first tries) may lose at most this share of the time decoded so far. On the H200
# a probe of the 0.5B draft cost 50-70 ms, most of it feeding the draft the tokens of the standard
# stretch before it, against 3 ms a token: probing every 16-128 steps put auto at 0.92x standard.
PROBE_SHARE = 0.015
# A draft must promise this much over a standard step before it runs (probes aside): on the H200 the
# measured speedups came in 3-7% under the prediction near break-even (auto with the 0.5B draft:
# predicted 1.00-1.02x, measured 0.93-0.97x), and a gain inside the model's error is not worth the risk.
GAIN_MARGIN = 0.05
_STANDARD = Decision(0, None, "standard")


class KController(Protocol):
    def choose(self, offers: Sequence[Offer], room: int) -> Decision:
        """K for the next round (at most `room` tokens are still wanted), given what each proposer offers."""

    def observe(self, decision: Decision, drafted: int, accepted: int, draft_ms: float, verify_ms: float,
                wall_ms: float, *, tree: bool = False, extra: bool = False) -> None:
        """What the round decided: tokens drafted and accepted, its draft/verify times and its wall time;
        tree: it verified a tree of drafts, extra: which kept an alternative (one more token)."""

    def finish(self) -> None:
        """The generation ended: keep what was learned for the next one."""


class FixedK:
    """The K a person asked for, every step; K = 0 is standard decoding."""

    def __init__(self, k: int) -> None:
        assert 0 <= k <= K_MAX, f"K={k} outside 0..{K_MAX}"
        self.k = k
        self._decisions: dict[tuple[int, str], Decision] = {}  # frozen, so one object per (K, source)

    def choose(self, offers: Sequence[Offer], room: int) -> Decision:
        if self.k == 0 or not offers:
            return _STANDARD
        k, source = min(self.k, room), offers[0].source
        decision = self._decisions.get((k, source))
        if decision is None:
            decision = self._decisions[(k, source)] = Decision(k, source, "fixed")  # type: ignore[arg-type]
        return decision

    def observe(self, decision: Decision, drafted: int, accepted: int, draft_ms: float, verify_ms: float,
                wall_ms: float, *, tree: bool = False, extra: bool = False) -> None:
        pass

    def finish(self) -> None:
        pass


@dataclass(frozen=True)
class StepCosts:
    """The costs measured at load, as the controller reads them."""

    target_ms: tuple[float, ...]  # index w: ms of a w-token target forward, w = 1..K_MAX+1 (index 0 unused)
    proposers: dict[str, ProposerCost]  # source -> its measured drafting cost
    tree_ms: dict[int, float] = field(default_factory=dict)  # K -> ms of a tree round's verify (Offer.tree)
    tree_draft_ms: dict[int, float] = field(default_factory=dict)  # K -> ms of a dynamic tree's drafting

    def __post_init__(self) -> None:
        assert len(self.target_ms) >= K_MAX + 2, "every verify width up to K_MAX + 1 must be measured"


@dataclass
class Acceptance:
    """Decayed Beta posteriors of P(accepted | reached) per draft position, pooled over positions too.

    Each position's estimate is shrunk towards a centre by PRIOR_WEIGHT pseudo-observations, so
    positions rarely reached (long drafts) borrow from the others instead of from nothing. The first
    position and the later ones are centred apart (`later` pools positions 2.. only): whether a draft
    starts right and whether it goes on once right are different odds. An n-gram match of one token
    is right 20% of the time, but once right its copy goes on 60-100% of the time (the H200 edit
    sweep's streams): pooled with the first position, every later one read 0.2-0.3 and a 12-token
    draft looked worth 1.06x standard, where that stream's own acceptance gives 1.35x.
    """

    hits: list[float] = field(default_factory=lambda: [0.0] * K_MAX)  # decayed accepted counts per position
    trials: list[float] = field(default_factory=lambda: [0.0] * K_MAX)  # decayed reached counts per position
    pooled_hits: float = 0.0
    pooled_trials: float = 0.0
    later_hits: float = 0.0  # pooled_hits of positions 2.. only
    later_trials: float = 0.0  # pooled_trials of positions 2.. only
    tried: float = 0.0  # draft positions ever reached (not decayed): how much was ever seen
    idle: int = 0  # steps since this proposer last drafted: its evidence is worth IDLE_DECAY ** idle
    rescued: float = 0.0  # decayed tree rounds that kept an alternative where the target rejected the chain
    rejected: float = 0.0  # decayed tree rounds where the target rejected the chain

    def update(self, drafted: int, accepted: int, rescued: bool | None = None) -> None:
        """rescued: None for a chain; for a tree, whether it kept an alternative at the rejection."""
        decay = DECAY * IDLE_DECAY**self.idle
        if rescued is not None and accepted < drafted:
            self.rescued = self.rescued * decay + rescued
            self.rejected = self.rejected * decay + 1.0
        hits, trials = self.hits, self.trials
        for i in range(K_MAX):
            hits[i] *= decay
            trials[i] *= decay
        reached = min(drafted, accepted + 1)  # position i is reached when every earlier one was accepted
        for i in range(reached):
            trials[i] += 1.0
            hits[i] += i < accepted
        kept = min(accepted, drafted)
        self.pooled_hits = self.pooled_hits * decay + kept
        self.pooled_trials = self.pooled_trials * decay + reached
        self.later_hits = self.later_hits * decay + max(kept - 1, 0)
        self.later_trials = self.later_trials * decay + max(reached - 1, 0)
        self.tried += reached
        self.idle = 0

    def rescue(self) -> float:
        """P(an alternative is kept | the chain was rejected) of its tree rounds, shrunk towards 0: a
        tree's extra token is credited only once it has been seen."""
        fade = IDLE_DECAY**self.idle
        return self.rescued * fade / (self.rejected * fade + PRIOR_WEIGHT)

    def pooled(self) -> float:
        fade = IDLE_DECAY**self.idle
        return (self.pooled_hits * fade + PRIOR_WEIGHT * PRIOR_MEAN) / (self.pooled_trials * fade + PRIOR_WEIGHT)

    def later(self, prior: float = PRIOR_MEAN) -> float:
        """Acceptance at positions 2.. once reached, shrunk towards `prior` (a wider pool's, when there is one)."""
        fade = IDLE_DECAY**self.idle
        return (self.later_hits * fade + PRIOR_WEIGHT * prior) / (self.later_trials * fade + PRIOR_WEIGHT)

    def means(self, first_prior: float | None = None, later_prior: float = PRIOR_MEAN) -> list[float]:
        """Per position; the first is centred on `first_prior` (default: the pool of all positions)."""
        fade = IDLE_DECAY**self.idle
        first = self.pooled() if first_prior is None else first_prior
        centres = [first] + [self.later(later_prior)] * (K_MAX - 1)
        return [(h * fade + PRIOR_WEIGHT * m) / (t * fade + PRIOR_WEIGHT)
                for h, t, m in zip(self.hits, self.trials, centres)]

    def copy(self) -> Acceptance:
        return Acceptance(list(self.hits), list(self.trials), self.pooled_hits, self.pooled_trials,
                          self.later_hits, self.later_trials, self.tried, rescued=self.rescued, rejected=self.rejected)


@dataclass
class Timing:
    """Online corrections to the load-time costs, from the real steps of this process."""

    standard_overhead_ms: float | None = None  # wall - draft - verify of a standard step
    overhead_ms: float | None = None  # the same for a speculative step
    standard_ratio: float | None = None  # measured verify time / load-time cost of a standard step
    verify_ratio: float | None = None  # the same for a speculative step's verify
    draft_ratio: dict[str, float] = field(default_factory=dict)  # source -> measured / load-time drafting
    catch_up_ms: dict[str, float] = field(default_factory=dict)  # source -> extra drafting after standard steps
    probe_loss_ms: dict[str, float] = field(default_factory=dict)  # source -> what a probe lost against standard

    def copy(self) -> Timing:
        return Timing(self.standard_overhead_ms, self.overhead_ms, self.standard_ratio, self.verify_ratio,
                      dict(self.draft_ratio), dict(self.catch_up_ms), dict(self.probe_loss_ms))


def _ema(old: float | None, new: float, low: float = 0.0, high: float = float("inf")) -> float:
    new = min(max(new, low), high)
    return new if old is None else old + RATE * (new - old)


@dataclass
class TuningMemory:
    """What adaptive controllers learned, per engine: the next generation starts from it.

    Acceptance is kept per (statistics key, temperature): sampling hotter accepts less.
    """

    acceptance: dict[tuple[str, float], Acceptance] = field(default_factory=dict)
    timing: Timing = field(default_factory=Timing)
    elapsed_ms: float = 0.0  # wall time of every step observed
    probe_spent_ms: float = 0.0  # what probes (first tries aside) lost against standard steps


class AdaptiveK:
    """Picks (proposer, K) per step to maximise predicted tokens/s; K = 0 is a standard step."""

    def __init__(self, costs: StepCosts, memory: TuningMemory | None = None, *, temperature: float = 0.0,
                 k_max: int = K_MAX) -> None:
        self.costs = costs
        self.memory = memory if memory is not None else TuningMemory()
        self.temperature = round(temperature, 2)
        self.k_max = min(k_max, K_MAX)
        self.timing = self.memory.timing.copy()
        self.acceptance: dict[str, Acceptance] = {}  # statistics key -> this generation's posterior
        self.idle = 0  # standard steps since the last speculative one
        self.elapsed_ms = self.memory.elapsed_ms
        self.probe_spent_ms = self.memory.probe_spent_ms
        self._offers: Sequence[Offer] = ()

    # -- the decision ------------------------------------------------------------------------------

    def _stats(self, key: str) -> Acceptance:
        stats = self.acceptance.get(key)
        if stats is None:
            remembered = self.memory.acceptance.get((key, self.temperature))
            stats = self.acceptance[key] = remembered.copy() if remembered is not None else Acceptance()
        return stats

    def _means(self, offer: Offer) -> list[float]:
        """Acceptance per position for this offer. A statistics key ("ngram:1", one kind of match)
        borrows from its proposer's pool over all its keys, first position from first position and
        later ones from later ones: each key sees a fraction of the proposer's drafts, and a short
        match's drafts seldom get past the first token, so on its own a key's later positions rest
        on a handful of decayed trials and a run of misses silences the key for dozens of steps."""
        stats = self._stats(offer.key)
        if offer.key == offer.source:
            return stats.means()
        pool = self._stats(offer.source)
        return stats.means(pool.means()[0], pool.later())

    def standard_ms(self) -> float:
        t = self.timing
        return self.costs.target_ms[1] * (t.standard_ratio or 1.0) + (t.standard_overhead_ms or 0.0)

    def _draft_ms(self, source: str, k: int, tree: bool) -> float:
        """Load-time cost of drafting k: a dynamic tree's own (K levels of F * F children), else the chain's."""
        if tree and k in self.costs.tree_draft_ms:
            return self.costs.tree_draft_ms[k]
        cost = self.costs.proposers[source]
        return cost.per_proposal_ms + k * cost.per_token_ms

    def _verify_ms(self, offer: Offer, k: int) -> float:
        """Load-time cost of verifying k of this offer's drafts: a tree's own where they verify as one."""
        if offer.tree and k <= TREE_K_MAX and k in self.costs.tree_ms:
            return self.costs.tree_ms[k]
        return self.costs.target_ms[k + 1]

    def _best(self, offer: Offer, room: int) -> tuple[int, float, float]:
        """(K, predicted tokens/ms, pooled acceptance) of the best K >= 1 for one offer.

        A tree's alternatives add a token whenever the chain is rejected (1 - reach of its K drafts)
        and an alternative is the target's token (the rescue rate its tree rounds showed): at T = 0.7
        on an H200 they made 0.33 of the head's 2.48 tokens a round, which auto, counting chains
        only, missed, and decoded standard steps where the head paid."""
        t = self.timing
        ratio = t.draft_ratio.get(offer.source, 1.0)
        catch_up = t.catch_up_ms.get(offer.source, 0.0) if offer.catch_up else 0.0
        verify_ratio, overhead = t.verify_ratio or 1.0, t.overhead_ms or 0.0
        stats = self._stats(offer.key)
        means = self._means(offer)
        rescue = stats.rescue() if offer.tree else 0.0
        best_k, best_rate = 0, 0.0
        reach, expected = 1.0, 1.0
        for k in range(1, min(offer.max_tokens, room, self.k_max) + 1):
            reach *= means[k - 1]
            expected += reach
            extra = rescue * (1.0 - reach) if k <= TREE_K_MAX else 0.0
            rate = (expected + extra) / (self._draft_ms(offer.source, k, offer.tree) * ratio + catch_up
                                         + self._verify_ms(offer, k) * verify_ratio + overhead)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k, best_rate, stats.pooled()

    def _ceiling(self, offer: Offer) -> tuple[int, float]:
        """(K, tokens/ms) of this proposer's best K if every draft were accepted: what it could pay at most."""
        t = self.timing
        ratio = t.draft_ratio.get(offer.source, 1.0)
        verify_ratio, overhead = t.verify_ratio or 1.0, t.overhead_ms or 0.0
        rates = [((k + 1) / (self._draft_ms(offer.source, k, offer.tree) * ratio
                             + self._verify_ms(offer, k) * verify_ratio + overhead), k)
                 for k in range(1, self.k_max + 1)]
        rate, k = max(rates)
        return k, rate

    def choose(self, offers: Sequence[Offer], room: int) -> Decision:
        self._offers = offers
        if not offers:
            return _STANDARD
        standard_rate = 1.0 / self.standard_ms()
        best: tuple[int, float, float, Offer] | None = None
        hopeless: tuple[int, float] | None = None
        for offer in offers:
            if offer.max_tokens <= 0:
                continue
            ceiling_k, ceiling = self._ceiling(offer)
            if ceiling <= (1.0 + GAIN_MARGIN) * standard_rate:
                # Even accepting every draft it would not pay (a draft costing most of a forward, a verify
                # costing several): never drafted, never probed, so auto costs nothing over standard.
                hopeless = (ceiling_k, ceiling / standard_rate)
                continue
            k, rate, acceptance = self._best(offer, room)
            if k and (best is None or rate > best[1]):
                best = (k, rate, acceptance, offer)
        if best is None:
            if hopeless is not None:
                return Decision(0, None, "no_gain", 1.0, 1.0, hopeless[0], hopeless[1])
            return Decision(0, None, "no_match")
        k, rate, acceptance, offer = best
        speedup = rate / standard_rate
        if speedup > 1.0 + GAIN_MARGIN:
            return Decision(k, offer.source, "best", acceptance, speedup, k, speedup)
        exploring = self._stats(offer.key).tried < EXPLORE
        if exploring or (self.idle >= PROBE_EVERY and self._probe_affordable(offer.source)):
            probe_k = min(max(k, PROBE_K[0]), PROBE_K[1], room, offer.max_tokens)
            return Decision(probe_k, offer.source, "probe", acceptance, speedup, k, speedup)
        return Decision(0, None, "no_gain", acceptance, 1.0, k, speedup)

    def _probe_affordable(self, source: str) -> bool:
        """A probe fits the budget: what probes lost so far plus what this one is expected to lose."""
        expected = self.timing.probe_loss_ms.get(source, 0.0)
        return self.probe_spent_ms + expected <= PROBE_SHARE * self.elapsed_ms

    # -- learning ----------------------------------------------------------------------------------

    def observe(self, decision: Decision, drafted: int, accepted: int, draft_ms: float, verify_ms: float,
                wall_ms: float, *, tree: bool = False, extra: bool = False) -> None:
        t, target = self.timing, self.costs.target_ms
        overhead = wall_ms - draft_ms - verify_ms
        self.elapsed_ms += wall_ms
        for stats in self.acceptance.values():
            stats.idle += 1  # the one that drafted resets it in update()
        if decision.k == 0 or decision.source is None:
            t.standard_overhead_ms = _ema(t.standard_overhead_ms, overhead)
            t.standard_ratio = _ema(t.standard_ratio, verify_ms / target[1], 0.25, 4.0)
            self.idle += 1
            return
        source = decision.source
        t.overhead_ms = _ema(t.overhead_ms, overhead)
        tree_ms = self.costs.tree_ms.get(drafted) if tree else None
        t.verify_ratio = _ema(t.verify_ratio, verify_ms / (tree_ms or target[min(drafted, K_MAX) + 1]), 0.25, 4.0)
        predicted = self._draft_ms(source, decision.k, tree)
        ratio = t.draft_ratio.get(source)
        offer = next((o for o in self._offers if o.source == source), None)
        if offer is not None and offer.catch_up:
            # It first fed the tokens committed without it: that extra is what switching back costs.
            t.catch_up_ms[source] = _ema(t.catch_up_ms.get(source), draft_ms - predicted * (ratio or 1.0))
        elif predicted > 0:
            t.draft_ratio[source] = _ema(ratio, draft_ms / predicted, 0.25, 4.0)
        stats = self._stats(offer.key if offer is not None else source)
        exploring = stats.tried < EXPLORE  # first tries of a proposer: no verdict to confirm yet
        rescued = extra if tree else None
        stats.update(drafted, accepted, rescued)
        if offer is not None and offer.key != source:
            self._stats(source).update(drafted, accepted, rescued)  # the proposer's pool over all its keys
        if decision.reason == "probe" and not exploring:
            lost = max(wall_ms - (accepted + 1 + extra) * self.standard_ms(), 0.0)  # against standard steps' tokens
            self.probe_spent_ms += lost
            t.probe_loss_ms[source] = _ema(t.probe_loss_ms.get(source), lost)
        self.idle = 0

    def finish(self) -> None:
        for key, stats in self.acceptance.items():
            self.memory.acceptance[(key, self.temperature)] = stats.copy()
        self.memory.timing = self.timing.copy()
        self.memory.elapsed_ms = self.elapsed_ms
        self.memory.probe_spent_ms = self.probe_spent_ms
