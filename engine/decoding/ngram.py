"""Nearly free drafts: prompt lookup (n-gram matching against the text so far) and its combination with a draft model.

Prompt lookup decoding (Saxena 2023): if the last n tokens occurred earlier, propose the tokens
that followed that occurrence. Code edits, quoting and summarising repeat long spans, where this
is accepted often at no draft-model cost. Proposals are point masses (q = None): the loop's
acceptance test then keeps a token with probability p(x), which stays lossless.
"""
from __future__ import annotations

import torch

from engine.decoding.prefill import FeedFn, feed_all
from engine.decoding.proposers import Offer, Proposal, Proposer
from engine.runners import ids_tensor


class NgramProposer(Proposer):
    """Matches the last n tokens (n = max_ngram down to min_ngram; longest, then most recent wins).

    An index from each n-gram to the end of its latest occurrence is updated as tokens are
    committed, so a proposal costs a few dict lookups regardless of the context length.
    """

    def __init__(self, device: torch.device | str = "cpu", *, max_ngram: int = 3, min_ngram: int = 1) -> None:
        assert 1 <= min_ngram <= max_ngram, f"bad n-gram range {min_ngram}..{max_ngram}"
        self.device = torch.device(device)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence with a successor
        self.indexed = 0  # n-grams ending before this position are in the index

    def start(self, prompt: list[int]) -> None:
        self.tokens = list(prompt)
        self.index = {}
        self.indexed = 0
        self._update_index()

    def _update_index(self) -> None:
        # An occurrence ending at `end` is useful only once a token follows it: end <= len - 1.
        # Later occurrences overwrite earlier ones, so the index always holds the most recent.
        for end in range(max(self.indexed, 1), len(self.tokens)):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self.index[tuple(self.tokens[end - n : end])] = end
        self.indexed = max(self.indexed, len(self.tokens))

    def match(self, k: int) -> tuple[list[int], int]:
        """(up to k continuation tokens, length n of the matched suffix); ([], 0) when nothing matches."""
        if k <= 0:
            return [], 0
        length = len(self.tokens)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            end = self.index.get(tuple(self.tokens[length - n :]))
            if end is not None:
                return self.tokens[end : end + k], n
        return [], 0

    def offer(self, k: int) -> Offer:
        # Acceptance depends on how long a suffix matched: each length keeps its own statistics.
        tokens, n = self.match(k)
        return Offer("ngram", len(tokens), key=f"ngram:{n}")

    def propose(self, k: int) -> Proposal:
        tokens, _ = self.match(k)
        return self._proposal(tokens)

    def _proposal(self, tokens: list[int]) -> Proposal:
        return Proposal(
            tokens=ids_tensor(tokens, self.device),  # [n]
            q=None,
            sources=("ngram",) * len(tokens),
            forwards=0,
        )

    def commit(self, proposal: Proposal, accepted: int, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)
        self._update_index()


class CombinedProposer(Proposer):
    """N-gram lookup when the context repeats (a match of at least `min_match` tokens), the draft model otherwise.

    Both are told every step's committed tokens. The draft model is told with an empty proposal
    when the n-gram drafted, so it feeds those tokens as pending on its next proposal and its
    cache stays in sync.
    """

    def __init__(self, ngram: NgramProposer, draft: Proposer, *, min_match: int = 2) -> None:
        self.ngram = ngram
        self.draft = draft
        self.min_match = min_match

    def start(self, prompt: list[int]) -> None:
        self.ngram.start(prompt)
        self.draft.start(prompt)

    def offer(self, k: int) -> Offer:
        tokens, n = self.ngram.match(k)
        if tokens and n >= self.min_match:
            return Offer("ngram", len(tokens), key=f"ngram:{n}")
        return self.draft.offer(k)

    def prepare(self, source: str, feed: FeedFn = feed_all) -> bool:
        """The draft model's one-off prompt prefill, when it is the one about to propose."""
        return self.draft.prepare(source, feed) if source == "draft" else False

    def propose(self, k: int) -> Proposal:
        tokens, n = self.ngram.match(k)
        if tokens and n >= self.min_match:
            return self.ngram._proposal(tokens)
        return self.draft.propose(k)

    def commit(self, proposal: Proposal, accepted: int, new_tokens: list[int]) -> None:
        self.ngram.commit(proposal, accepted, new_tokens)
        if proposal.sources and proposal.sources[0] == "draft":
            self.draft.commit(proposal, accepted, new_tokens)
        else:  # the draft model fed nothing this step: an empty proposal says so
            self.draft.commit(self.ngram._proposal([]), 0, new_tokens)
