"""Where drafts come from: a small interface (propose K tokens with their q; learn what was kept)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.decoding.sampling import draw, process
from engine.runners import Runner, ids_tensor
from engine.types import DraftSource, Sampling


@dataclass
class Proposal:
    tokens: torch.Tensor  # [n] long on the loop's device; n <= k (an n-gram miss gives n = 0)
    q: torch.Tensor | None  # [n, V] processed draft distributions; None = point masses on tokens
    sources: tuple[DraftSource, ...]  # proposer of each token
    forwards: int  # draft-model forwards spent on this proposal
    q_display: torch.Tensor | None = None  # [n] q(x) to show people (softmax at T=1 under greedy)


class Proposer(Protocol):
    def start(self, prompt: list[int]) -> None:
        """A new generation begins with these prompt ids."""

    def propose(self, k: int) -> Proposal:
        """Up to k draft tokens continuing the committed text."""

    def commit(self, proposal: Proposal, accepted: int, new_tokens: list[int]) -> None:
        """The step kept `accepted` proposed tokens; `new_tokens` is everything it committed."""


class DraftModelProposer:
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

    def start(self, prompt: list[int]) -> None:
        self.runner.reset()
        if len(prompt) > 1:
            self.runner.prefill(ids_tensor(prompt[:-1], self.device))
        self.cached = len(prompt) - 1
        self.pending = prompt[-1:]

    @torch.inference_mode()
    def propose(self, k: int) -> Proposal:
        greedy = self.sampling.greedy
        tokens, q_rows, shown = [], [], []
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
