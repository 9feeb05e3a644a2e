"""Predicts what speculative decoding buys from measured forward costs and the acceptance rate.

The model (Leviathan et al. 2023, section 3.3): with per-token acceptance alpha, one step with K
draft tokens commits (1 - alpha^(K+1)) / (1 - alpha) tokens on average and costs K draft
forwards plus one (K+1)-token target forward; standard decoding commits one token per 1-token
target forward. Measured per-step overheads (host work, syncs) are added to both, and with
acceptance measured per draft position a_i a step commits 1 + sum_j prod_{i<=j} a_i tokens.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.types import ModelInfo, ProposerCost, Summary

# A verify costing this many 1-token forwards or more is named in the verdict as the reason.
VERIFY_NOT_FREE = 1.5


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Mean tokens committed by one step of K drafts (accepted ones plus the target's own)."""
    assert 0.0 <= alpha <= 1.0, f"acceptance {alpha} is not a probability"
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_tokens(per_position: Sequence[float], k: int) -> float:
    """Mean tokens one step of K drafts commits when draft position i is accepted with probability
    per_position[i] once reached (positions beyond the list repeat its last value)."""
    if k <= 0:
        return 1.0
    assert per_position, "per-position acceptance needs at least one position"
    expected, reach = 1.0, 1.0
    for i in range(k):
        reach *= per_position[min(i, len(per_position) - 1)]
        expected += reach
    return expected


def answer_rounds(per_position: Sequence[float], k: int, answer_tokens: int) -> float:
    """Expected rounds of K drafts that commit an answer of `answer_tokens` tokens, drafting no more than the
    tokens still wanted, as the loop does (a round with r tokens left drafts min(K, r) and keeps what is
    left at most). Exact up to 16 (K + 1) tokens; beyond, each further token costs 1 / expected_tokens
    rounds (the renewal rate: the answer's end is all that differs from rounds that keep their mean)."""
    if answer_tokens <= 0:
        return 0.0
    if k <= 0 or not per_position:
        return float(answer_tokens)
    exact = min(answer_tokens, 16 * (k + 1))
    rounds = [0.0] * (exact + 1)  # rounds[r]: expected rounds with r tokens left
    for left in range(1, exact + 1):
        drafts = min(k, left)
        total, reach = 1.0, 1.0
        for m in range(drafts):  # m drafts accepted, then the target's token: m + 1 tokens
            a = per_position[min(m, len(per_position) - 1)]
            total += reach * (1.0 - a) * rounds[left - m - 1]
            reach *= a
        rounds[left] = total + reach * rounds[max(left - drafts - 1, 0)]  # all accepted, the bonus cut to what is left
    return rounds[exact] + (answer_tokens - exact) / expected_tokens(per_position, k)


def answer_share(per_position: Sequence[float], k: int, answer_tokens: int | None) -> float:
    """What share of a round's mean tokens an answer of `answer_tokens` keeps a round (1 for None: rounds
    priced as if answers never ended)."""
    if answer_tokens is None or k <= 0 or not per_position:
        return 1.0
    return answer_tokens / answer_rounds(per_position, k, answer_tokens) / expected_tokens(per_position, k)


@dataclass(frozen=True)
class CostModel:
    draft_ms: float  # one drafted token (a 1-token draft forward; ~0 for n-gram lookup)
    target_ms: Mapping[int, float]  # width W -> one W-token target forward; needs at least W=1
    overhead_ms: float = 0.0  # per speculative step outside the forwards (acceptance, sync, bookkeeping)
    standard_overhead_ms: float = 0.0  # per standard step outside its forward
    draft_fixed_ms: float = 0.0  # per step that drafts, whatever K (the proposer's set-up)
    _widths: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        assert 1 in self.target_ms, "target_ms needs the 1-token cost (the standard-decoding step)"
        object.__setattr__(self, "_widths", tuple(sorted(self.target_ms)))

    @classmethod
    def from_info(cls, info: ModelInfo, source: str = "draft", *, overhead_ms: float = 0.0,
                  standard_overhead_ms: float = 0.0, sampled: bool = False) -> CostModel:
        """The costs an engine measured at load (ModelInfo.target_ms, and the proposer's own cost
        from ModelInfo.proposer_costs, else the draft forward ModelInfo.draft_ms); `sampled`: those
        of sampled rounds (temperature > 0) where they were measured (costs_at)."""
        target, costs = costs_at(info, sampled)
        cost = costs.get(source)
        if cost is None:
            return cls(draft_ms=info.draft_ms, target_ms=target, overhead_ms=overhead_ms,
                       standard_overhead_ms=standard_overhead_ms)
        return cls(draft_ms=cost.per_token_ms, target_ms=target, overhead_ms=overhead_ms,
                   standard_overhead_ms=standard_overhead_ms, draft_fixed_ms=cost.per_proposal_ms)

    @property
    def k_max(self) -> int:
        """The largest K whose verify width was measured."""
        return self._widths[-1] - 1

    def target_cost(self, width: int) -> float:
        """Measured cost of a width, linearly interpolated (or extrapolated) when not measured."""
        if width in self.target_ms:
            return self.target_ms[width]
        widths = self._widths
        if len(widths) == 1:
            return self.target_ms[widths[0]]
        lower = [w for w in widths if w < width]
        upper = [w for w in widths if w > width]
        if lower and upper:
            a, b = lower[-1], upper[0]
        elif lower:  # beyond the largest: extend the last segment
            a, b = widths[-2], widths[-1]
        else:
            a, b = widths[0], widths[1]
        ca, cb = self.target_ms[a], self.target_ms[b]
        return max(ca + (cb - ca) * (width - a) / (b - a), 0.0)

    def step_ms(self, k: int) -> float:
        if k <= 0:
            return self.standard_ms()
        return self.draft_fixed_ms + k * self.draft_ms + self.target_cost(k + 1) + self.overhead_ms

    def standard_ms(self) -> float:
        return self.target_ms[1] + self.standard_overhead_ms

    def predicted_speedup(self, alpha: float, k: int) -> float:
        """Tokens/s of speculative decoding with K drafts over standard decoding (1.0 for K=0)."""
        if k <= 0:
            return 1.0
        return expected_tokens_per_step(alpha, k) * self.standard_ms() / self.step_ms(k)

    def speedup_from_positions(self, per_position: Sequence[float], k: int) -> float:
        """The same from acceptance measured per draft position (Summary.per_position_acceptance)."""
        if k <= 0 or not per_position:
            return 1.0
        return expected_tokens(per_position, k) * self.standard_ms() / self.step_ms(k)

    def predicted_from_counts(self, tokens: int, target_forwards: int, drafted: int, draft_forwards: int) -> float:
        """Speculative/standard speedup these costs predict for what a run did: its tokens per step,
        mean draft length and draft forwards per step. For drafts that vary in length (n-gram
        lookup proposes nothing when it finds no match), where a fixed K and alpha do not apply."""
        if target_forwards <= 0 or tokens <= 0:
            return 1.0
        step = (self.target_cost(1 + drafted / target_forwards) + self.draft_ms * draft_forwards / target_forwards
                + self.overhead_ms)
        return tokens / target_forwards * self.standard_ms() / step

    def best_k(self, alpha: float, k_max: int | None = None) -> tuple[int, float]:
        """(K, predicted speedup) maximising the speedup over K = 1..k_max (default: the measured
        widths); (0, 1.0) if none pays."""
        k_max = self.k_max if k_max is None else k_max
        best = (0, 1.0)
        for k in range(1, k_max + 1):
            speedup = self.predicted_speedup(alpha, k)
            if speedup > best[1]:
                best = (k, speedup)
        return best

    def verdict(self, alpha: float, k_max: int | None = None, drafter: str = "the draft") -> str:
        """One plain sentence a person can act on; `drafter` names what drafts ("the draft head", ...)."""
        k_max = self.k_max if k_max is None else k_max
        ratio = self.draft_ms / self.target_ms[1] if self.target_ms[1] > 0 else 0.0
        k, speedup = self.best_k(alpha, k_max)
        if k == 0:
            k1 = max(range(1, k_max + 1), key=lambda j: self.predicted_speedup(alpha, j))
            best = f"at {alpha:.0%} acceptance the best K={k1} gives {self.predicted_speedup(alpha, k1):.2f}×."
            verify = self.target_cost(k1 + 1)
            if verify >= VERIFY_NOT_FREE * self.target_ms[1]:
                # The usual reason on CPUs (llama.cpp, float32): a forward's cost grows with its width,
                # so checking K+1 tokens at once saves nothing over decoding them one by one.
                return (
                    f"Speculative decoding will not pay here: a {k1 + 1}-token verify costs "
                    f"{verify / self.target_ms[1]:.1f}× a 1-token forward ({verify:.0f} vs "
                    f"{self.target_ms[1]:.0f} ms) and {drafter} {ratio:.0%} of one; " + best
                )
            return f"Speculative decoding will not pay here: {drafter} costs {ratio:.0%} of a target forward; " + best
        return (
            f"Speculative decoding pays here: {drafter} costs {ratio:.0%} of a target forward; "
            f"at {alpha:.0%} acceptance K={k} should give {speedup:.2f}×."
        )


def proposer_cost(info: ModelInfo, source: str) -> ProposerCost | None:
    """The cost a proposer measured for itself at load; None when it was not measured."""
    return next((c for c in info.proposer_costs if c.source == source), None)


def costs_at(info: ModelInfo, sampled: bool) -> tuple[dict[int, float], dict[str, ProposerCost]]:
    """(verify width -> ms, proposer -> cost) of a greedy round, or of a sampled one (temperature > 0).

    A sampled round prices what it really does: a sampled draft's host-side work per token (a
    draft model's draws; a head drawing from its own law left its CUDA graphs: on an H200 0.31 ms
    per token against 0.20 greedy) and the verify's processing and draw. Each figure not measured
    for sampled rounds (sampled verify widths are timed on GPUs only) is the greedy one.
    """
    target = dict(info.target_ms)
    costs = {c.source: c for c in info.proposer_costs}
    if sampled:
        target.update(info.sampled_target_ms)
        costs.update((c.source, c) for c in info.sampled_costs)
    return target, costs


def tree_costs_at(info: ModelInfo, sampled: bool) -> dict[int, float]:
    """K -> ms of a tree round's verify (ModelInfo.tree_ms; empty without trees). Trees are timed
    greedy at load; a sampled one adds what sampling adds to a chain's verify of the same K."""
    target, greedy = costs_at(info, sampled)[0], dict(info.target_ms)
    return {k: ms + target[k + 1] - greedy[k + 1] for k, ms in info.tree_ms if k + 1 in target and k + 1 in greedy}


class _Measurable(Protocol):
    def measure_costs(self, widths: Iterable[int], iters: int = ...) -> dict[int, float]: ...


def measure(target: _Measurable, draft: _Measurable | None, *, k_max: int = 12, iters: int = 20) -> CostModel:
    """A CostModel from runners' measured forward costs (engine.runners.graphs.StaticGraphRunner.measure_costs).

    Measured at the runners' current cache length; call it on idle runners (it leaves their
    contents as they were). Without a draft (n-gram drafts) the draft cost is 0.
    """
    target_ms = target.measure_costs(range(1, k_max + 2), iters)
    draft_ms = draft.measure_costs((1,), iters)[1] if draft is not None else 0.0
    return CostModel(draft_ms=draft_ms, target_ms=target_ms)


def estimate_alpha(summary: Summary) -> float | None:
    """Per-token acceptance from a speculative generation; None when nothing was drafted.

    From the histogram of accepted lengths this is the maximum-likelihood estimate under i.i.d.
    acceptance: accepted / (accepted + rejections), where a step accepting fewer than K ended in a
    rejection. Without a histogram, the mean accepted length per step is inverted numerically.
    """
    if summary.drafted == 0:
        return None
    if summary.k == 0 and summary.per_position_acceptance:
        # K chosen per step: the histogram mixes drafts of different lengths, positions do not.
        return alpha_from_per_position(summary.per_position_acceptance)
    histogram = summary.accepted_length_histogram
    if histogram:
        rejections = sum(histogram[:-1])
        accepted = sum(i * n for i, n in enumerate(histogram))
        if accepted + rejections > 0:
            return accepted / (accepted + rejections)
    return alpha_from_mean_accepted(summary.acceptance_rate * summary.k, summary.k) if summary.k else None


def alpha_from_per_position(per_position: Sequence[float]) -> float | None:
    """Geometric-mean acceptance over draft positions (each P(accepted | reached)); None if empty."""
    values = [max(v, 1e-6) for v in per_position]
    if not values:
        return None
    product = 1.0
    for v in values:
        product *= v
    return product ** (1.0 / len(values))


def alpha_from_mean_accepted(mean_accepted: float, k: int) -> float:
    """Solves alpha (1 - alpha^K) / (1 - alpha) = mean accepted drafts per step by bisection."""
    if k <= 0 or mean_accepted <= 0:
        return 0.0
    if mean_accepted >= k:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens_per_step(mid, k) - 1.0 < mean_accepted:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
