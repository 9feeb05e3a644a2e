"""What the draft check counts per probe prompt, and how far its prediction could move with other prompts.

Each candidate's counts are kept per probe (Tally), summed for the prediction (merged). Acceptance is a
property of the text as much as of the drafter, n-gram lookup most of all (it accepts what repeats), so the
check also says how much its prediction depends on which prompts it read: a bootstrap over the probes
(resampled with replacement, the same pricing run on each resample) gives the 5th to 95th percentile of the
first draft position's acceptance and of the predicted speedup (each resample's own best K).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from engine.measure.check_math import NO_ROUNDS, Rounds, rounds
from engine.measure.check_types import CandidateCheck

RESAMPLES = 200  # bootstrap resamples of the probes (one matrix product, then the pricing: ~0.1 s a candidate)
LOW, HIGH = 0.05, 0.95  # the range reported: a 90% interval
MIN_PROBES = 5  # fewer probes than this give no range (a resample of 3 says little)


@dataclass
class Tally:
    """One candidate's counts over some probes (mutable while the check runs)."""

    greedy: dict[int, Rounds]  # K -> rounds at T = 0
    sampled: dict[int, Rounds]  # K -> rounds at the asked temperature
    kl_sum: float = 0.0
    top1_sum: float = 0.0
    rows: int = 0
    rejected: list[float] | None = None  # head trees: rejections per position
    rescued: list[float] | None = None  # head trees: rejections where an alternative kept the target's token
    round_ms: float = 0.0  # the head's rounds through the loop: their wall time (draft, verify, host work) summed
    rounds_timed: int = 0  # ... over this many rounds

    @classmethod
    def empty(cls, k_max: int) -> Tally:
        return cls({k: NO_ROUNDS for k in range(1, k_max + 1)}, {k: NO_ROUNDS for k in range(1, k_max + 1)})

    def add_offers(self, greedy: list[list[float]], sampled: list[list[float]]) -> None:
        for k in self.greedy:
            self.greedy[k] = self.greedy[k] + rounds(greedy, k)
            self.sampled[k] = self.sampled[k] + rounds(sampled, k)

    def summary(self) -> dict:
        """What the pricing reads (engine/measure/check_price.py)."""
        return {"greedy": self.greedy, "sampled": self.sampled, "kl": self.kl_sum / self.rows if self.rows else None,
                "top1": self.top1_sum / self.rows if self.rows else None,
                "round_ms": self.round_ms / self.rounds_timed if self.rounds_timed else None}


def _sum(a: list[float] | None, b: list[float] | None) -> list[float] | None:
    if a is None or b is None:
        return a if b is None else list(b)
    n = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0.0] * (n - len(a)), b + [0.0] * (n - len(b)))]


def merged(tallies: Sequence[Tally], k_max: int) -> Tally:
    """The counts of several probes (each of K = 1..k_max) as one tally: they are sums."""
    out = Tally.empty(k_max)
    for t in tallies:
        for k in t.greedy:
            out.greedy[k] = out.greedy[k] + t.greedy[k]
            out.sampled[k] = out.sampled[k] + t.sampled[k]
        out.kl_sum += t.kl_sum
        out.top1_sum += t.top1_sum
        out.rows += t.rows
        out.rejected, out.rescued = _sum(out.rejected, t.rejected), _sum(out.rescued, t.rescued)
        out.round_ms += t.round_ms
        out.rounds_timed += t.rounds_timed
    return out


def _percentiles(values: list[float]) -> tuple[float, float] | None:
    if not values:
        return None
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return pick(LOW), pick(HIGH)


class Stacked:
    """Per-probe counts as one array, so the tallies of many resamples are one matrix product (summing Rounds
    objects probe by probe took seconds a candidate)."""

    def __init__(self, tallies: Sequence[Tally], k_max: int) -> None:
        # Columns: kl, top1, rows; then per table (greedy, sampled) and K: rounds, tokens, drafted, reached by
        # position, accepted by position (0 past a probe's own); then rejected, rescued (head trees); then the
        # head's rounds' wall time and their count (the host work priced beside the forwards).
        self.offsets: dict[tuple[str, int], int] = {}
        width = 3
        for table in ("greedy", "sampled"):
            for k in range(1, k_max + 1):
                self.offsets[table, k] = width
                width += 3 + 2 * k
        self.rejected = max((len(t.rejected or ()) for t in tallies), default=0)
        self.rescued = max((len(t.rescued or ()) for t in tallies), default=0)
        self.trees = any(t.rejected is not None for t in tallies)
        self.counts = np.zeros((len(tallies), width + self.rejected + self.rescued + 2))  # [P, C]
        for i, t in enumerate(tallies):
            row = self.counts[i]
            row[:3] = (t.kl_sum, t.top1_sum, t.rows)
            for (table, k), at in self.offsets.items():
                r: Rounds = getattr(t, table)[k]
                row[at:at + 3] = (r.rounds, r.tokens, r.drafted)
                row[at + 3:at + 3 + len(r.reached)] = r.reached
                row[at + 3 + k:at + 3 + k + len(r.accepted)] = r.accepted
            row[width:width + len(t.rejected or ())] = t.rejected or ()
            row[width + self.rejected:width + self.rejected + len(t.rescued or ())] = t.rescued or ()
            row[-2:] = (t.round_ms, t.rounds_timed)
        self.width = width

    def tallies(self, weights: np.ndarray) -> list[Tally]:
        """The tally of each resample: weights [R, P], how many times each probe is counted."""
        out = []
        for v in (weights @ self.counts).tolist():
            tables: dict[str, dict[int, Rounds]] = {"greedy": {}, "sampled": {}}
            for (table, k), at in self.offsets.items():
                tables[table][k] = Rounds(tuple(v[at + 3:at + 3 + k]), tuple(v[at + 3 + k:at + 3 + 2 * k]),
                                          v[at], v[at + 1], v[at + 2])
            tail = v[self.width:-2]
            out.append(Tally(tables["greedy"], tables["sampled"], v[0], v[1], int(round(v[2])),
                             tail[:self.rejected] if self.trees else None,
                             tail[self.rejected:] if self.trees else None, v[-2], int(round(v[-1]))))
        return out


def spread(checked: CandidateCheck, per_probe: Sequence[Tally], price: Callable[[Tally], CandidateCheck],
           seed: int = 0) -> CandidateCheck:
    """`checked` with the ranges its first position's acceptance and its speedup take over resamples of the probes."""
    if checked.status != "ok" or len(per_probe) < MIN_PROBES:
        return checked
    n = len(per_probe)
    picks = np.random.default_rng(seed).integers(0, n, (RESAMPLES, n))  # the same ranges for the same counts
    weights = np.stack([np.bincount(row, minlength=n) for row in picks]).astype(np.float64)  # [R, P]
    first, speedups = [], []
    for tally in Stacked(per_probe, max(per_probe[0].greedy)).tallies(weights):
        again = price(tally)
        if again.sampled_positions:
            first.append(again.sampled_positions[0])
        if again.speedup is not None:
            speedups.append(again.speedup)
    return replace(checked, first_range=_percentiles(first), speedup_range=_percentiles(speedups))
