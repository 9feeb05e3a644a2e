"""The draft check's arithmetic: per-position agreement of two distributions, and rounds of drafts over a continuation.

Expected acceptance of one draft token (Leviathan et al. 2023, section 3.2): a token drawn from the
draft's processed q is kept with probability min(1, p/q), so on average with sum_x min(p(x), q(x))
= 1 - TV(p, q); a point-mass draft x (greedy drafting, n-gram lookup, the head's best token) is
kept with p(x). Under greedy decoding both p and q are one-hot (sampling.process), so the same sum is
top-1 agreement. Positions beyond the first are chained over the continuation itself (`rounds`):
a round starting at t is accepted at draft position i with the measured probability at row t + i,
and where one round ends the next begins, so easy and hard stretches of the text keep their length.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.decoding.sampling import process
from engine.types import Sampling


def agreement(p_logits: torch.Tensor, q_logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """[N] expected acceptance of a draft drawn from q against p: sum_x min(p(x), q(x)) after both are
    processed by `sampling` (temperature, top-k, top-p); under greedy, 1.0 where the argmaxes agree."""
    p = process(p_logits.float(), sampling)  # [N, V]
    q = process(q_logits.float(), sampling)  # [N, V]
    return torch.minimum(p, q).sum(-1).clamp(0.0, 1.0)


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """[N] KL(p || q) in nats of the raw (temperature 1) distributions."""
    log_p = torch.log_softmax(p_logits.float(), -1)  # [N, V]
    log_q = torch.log_softmax(q_logits.float(), -1)  # [N, V]
    return (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)


def point_mass(p_logits: torch.Tensor, tokens: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """[N] acceptance of point-mass drafts `tokens` [N]: the processed target probability p(x)."""
    p = process(p_logits.float(), sampling)  # [N, V]
    return p.gather(-1, tokens.view(-1, 1)).squeeze(-1)


@dataclass(frozen=True)
class Rounds:
    """What drafting rounds of at most K tokens would do over continuations, in expectation."""

    reached: tuple[float, ...]  # expected rounds reaching draft position i (0-based)
    accepted: tuple[float, ...]  # expected rounds accepting draft position i
    rounds: float  # expected rounds (target forwards), standard rounds (nothing drafted) included
    tokens: float  # expected tokens they commit
    drafted: float  # expected draft tokens proposed

    @property
    def per_position(self) -> tuple[float, ...]:
        """P(accepted | reached) per draft position (positions never reached are left off)."""
        return tuple(a / r for a, r in zip(self.accepted, self.reached) if r > 0)

    @property
    def all_accepted(self) -> float:
        """Share of drafting rounds that accepted every draft (their draft then feeds 2 tokens next round)."""
        return self.accepted[-1] / self.reached[0] if self.reached and self.reached[0] > 0 else 0.0

    def __add__(self, other: Rounds) -> Rounds:
        n = max(len(self.reached), len(other.reached))

        def pad(v: tuple[float, ...]) -> list[float]:
            return list(v) + [0.0] * (n - len(v))

        return Rounds(tuple(a + b for a, b in zip(pad(self.reached), pad(other.reached))),
                      tuple(a + b for a, b in zip(pad(self.accepted), pad(other.accepted))),
                      self.rounds + other.rounds, self.tokens + other.tokens, self.drafted + other.drafted)


NO_ROUNDS = Rounds((), (), 0.0, 0.0, 0.0)


def rounds(offers: Sequence[Sequence[float]], k: int) -> Rounds:
    """Rounds of at most k drafts over one continuation of len(offers) tokens.

    offers[t][i]: probability that draft position i of a round starting at row t is accepted once
    reached (the proposal's length there: len(offers[t]), cut at k; empty = a standard round).
    The chance that a round starts at t is carried forward from the rounds before it (exact for
    greedy decoding, where every probability is 0 or 1 and this replays the decoding itself).
    """
    length = len(offers)
    start = [0.0] * (length + k + 2)
    start[0] = 1.0
    reached, accepted = [0.0] * k, [0.0] * k
    n_rounds = tokens = drafted = 0.0
    for t in range(length):
        w = start[t]
        if w <= 0.0:
            continue
        offer = list(offers[t][:k])
        n_rounds += w
        drafted += w * len(offer)
        reach = 1.0
        for i, beta in enumerate(offer):
            reached[i] += w * reach
            accepted[i] += w * reach * beta
            start[t + i + 1] += w * reach * (1.0 - beta)  # rejected at i: the target's token ends the round
            tokens += w * reach * (1.0 - beta) * (i + 1)
            reach *= beta
        start[t + len(offer) + 1] += w * reach  # every draft kept, and the bonus token
        tokens += w * reach * (len(offer) + 1)
    return Rounds(tuple(reached), tuple(accepted), n_rounds, tokens, drafted)


def chained(values: Sequence[float], k_max: int) -> list[list[float]]:
    """offers for a drafter that proposes k_max tokens from every row, position i judged at row t + i
    (a draft model teacher-forced on the continuation)."""
    return [list(values[t:t + k_max]) for t in range(len(values))]


def rescue_rates(rejected: Sequence[float], rescued: Sequence[float]) -> tuple[float, ...]:
    """Per draft position, the share of rejections at which a tree's alternative kept the target's token."""
    return tuple(r / n if n else 0.0 for r, n in zip(rescued, rejected))
