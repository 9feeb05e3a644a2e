"""The draft-head proposer: drafts from the target's own hidden states, one cheap layer per token.

Every round first catches the head up on the rows the target verified since it last drafted (their
hidden states, which each verify pass leaves in the target runner's `hidden`, copied at commit, and
the tokens committed after them): no extra target forward. Rounds it did not draft (a standard
round, another proposer's) add their rows to the catch-up, which the head reads a widest catch-up
at a time as they gather (commit), so a long stretch of them costs it one captured replay every 13
rows and its next draft a short catch-up. The last row drafts token 1; K-1 chain steps draft the rest.

Drafts are the head's best tokens, greedy or sampling: they never leave the device (argmax, shown
probability and the next input are written by the step itself, inside its CUDA graph). When
sampling they are point masses to the acceptance rule (q = one-hot: a draft x is accepted with
the target's p(x)), exact whatever the head believes. `SAMPLED_DRAFTS` instead draws each draft
from the head's processed distribution over its reduced vocabulary, mapped back to target ids
(q is zero outside the draft vocabulary), accepted with min(1, p/q): a chain only, and a host
round of sampling work per token.

Proposals may carry `alternatives` next-best tokens beside each draft (Proposal.alts): the loop
then verifies them as a tree (engine/runners/tree.py), which keeps one more token whenever the
target's token, where it rejects the chain, is one of the alternatives. With a TreeDrafter it
grows a dynamic tree of K levels instead (engine/heads/tree.py), and the loop walks it.
"""
from __future__ import annotations

import torch

from engine.decoding.prefill import FeedFn
from engine.decoding.proposers import Offer, Proposal, Proposer
from engine.decoding.sampling import draw, process
from engine.heads.runner import HeadRunner
from engine.heads.tree import TreeDrafter
from engine.runners import Runner, ids_tensor
from engine.types import Sampling

SAMPLED_DRAFTS = False  # when sampling: draw drafts from the head's law (True) or propose its best tokens


class HeadProposer(Proposer):
    """Proposer over a HeadRunner; reads the target runner's hidden rows after each verify."""

    # It reads the target's rows of every round at commit: the loop must not queue the next round
    # (which overwrites them) before this one is committed (ProposerSet.queue_standard).
    reads_target = True

    def __init__(self, head: HeadRunner, target: Runner, sampling: Sampling, vocab: int,
                 generator: torch.Generator | None, alternatives: int = 0, tree: TreeDrafter | None = None) -> None:
        """alternatives: next-best tokens proposed beside each draft (0: a chain); tree: grow dynamic
        trees of K levels instead (then alternatives are not used)."""
        assert target.hidden_layers == head.config.feature_layers, "the target runner must keep the head's layers"
        self.head = head
        self.target = target
        self.sampling = sampling
        self.vocab = vocab  # the loop's vocabulary: q rows are this wide
        self.generator = generator
        self.sampled = SAMPLED_DRAFTS and not sampling.greedy  # drafts drawn from q (chains only)
        self.tree = None if self.sampled else tree
        self.alternatives = 0 if self.sampled or self.tree is not None else alternatives
        self.tree_nodes = self.tree.nodes if self.tree is not None else 0
        self.device = head.device
        self.rows: torch.Tensor | None = None  # [>= n, F] target rows the head has not read yet
        self.next_ids: list[int] = []  # [n] the committed token after each of those rows

    def start(self, prompt: list[int]) -> None:
        self.head.reset()
        # The loop prefilled prompt[:-1]: rows for those positions, each followed by the next prompt token.
        # A copy: the first round (a standard one, say) writes the runner's rows before the head reads them.
        self.rows = self.target.hidden[: len(prompt) - 1].clone() if len(prompt) > 1 else None
        self.next_ids = prompt[1:]

    def read_prompt(self, feed: FeedFn) -> bool:
        """Reads the prompt's rows now, in chunks, but the last widest catch-up's worth (its first draft
        reads those): as commit() reads rows of rounds it does not draft, so it is never far behind."""
        n = len(self.next_ids)
        m = n - (n % self.head.widest_catch_up or self.head.widest_catch_up) if self.rows is not None else 0
        if m <= 0:
            return True
        rows, ids, fed = self.rows, self.next_ids, 0

        def work(start: int, end: int) -> None:
            nonlocal fed
            self.head.catch_up(rows[start:end], ids_tensor(ids[start:end], self.device),
                               self.head.span(self.head.length + end - start))
            fed = end

        done = feed("head", m, work)
        self.rows, self.next_ids = rows[fed:n], ids[fed:]
        return done

    def offer(self, k: int) -> Offer:
        # Nothing to read yet (a one-token prompt): it cannot draft until a round has left rows.
        if self.rows is None:
            k = 0
        elif self.tree is not None:
            # A grown tree is at most max_depth deep: deeper drafts would be a chain, whose acceptance is not the
            # walked paths' that the offer's statistics learn (auto would pick long chains on the tree's figures).
            k = min(k, self.tree.max_depth)
        return Offer("head", k, tree=self.alternatives > 0 or self.tree is not None)

    def propose(self, k: int) -> Proposal:
        head = self.head
        if self.rows is None:  # a one-token prompt: nothing to read yet, the target decodes alone
            return self._proposal(torch.zeros(0, dtype=torch.long, device=self.device), None, None)
        n = len(self.next_ids)
        grow = self._tree_fits(k, n)
        span = head.span(head.length + n + (k * self.tree.frontier if grow else k))
        head.catch_up(self.rows[:n], ids_tensor(self.next_ids, self.device), span)  # drafts token 1
        self.rows = None
        if k == 0:  # a standard step: the catch-up above keeps the head's cache in step
            return self._proposal(torch.zeros(0, dtype=torch.long, device=self.device), None, None)
        if grow:
            tree = self.tree.draft(k, span)
            proposal = self._proposal(tree.tokens, None, tree.q)
            proposal.tree, proposal.forwards = tree, k
            return proposal
        if not self.sampled:
            for _ in range(k - 1):
                head.step(span)
            proposal = self._proposal(head.drafts[:k].clone(), None, head.shown[:k].clone())
            if self.alternatives:
                proposal.alts = head.alts[:k, : self.alternatives].clone()
            return proposal
        q_rows, shown = [], []
        for i in range(k):
            if i:
                head.step(span)
            q_draft = process(head.last_logits, self.sampling)  # [Vd]
            x = draw(q_draft.unsqueeze(0), self.generator)  # [1] draft row
            token = head.head.d2t.index_select(0, x)  # [1] target id
            head.token.copy_(token)  # the next chain step reads the sampled token, not the argmax
            head.drafts[i : i + 1].copy_(token)
            q_rows.append(torch.zeros(self.vocab, device=self.device).index_copy_(0, head.head.d2t, q_draft))
            shown.append(q_draft.gather(0, x))
        return self._proposal(head.drafts[:k].clone(), torch.stack(q_rows), torch.cat(shown))

    def _tree_fits(self, k: int, catch_up: int) -> bool:
        """A tree of k levels is grown when there is one, k is within its depth, and both caches have
        room for it (the head's slots past the catch-up; the target's rows); else a chain drafts."""
        if self.tree is None or not 1 <= k <= self.tree.max_depth:
            return False
        head_end = self.head.length + catch_up + k * self.tree.frontier
        target_end = self.target.length + 1 + self.tree.nodes_at(k)
        return head_end <= self.head.buckets[-1] and target_end <= self.target.max_length

    def _proposal(self, tokens: torch.Tensor, q: torch.Tensor | None, shown: torch.Tensor | None) -> Proposal:
        n = tokens.shape[0]
        return Proposal(tokens=tokens, q=q, sources=("head",) * n, forwards=n, q_display=shown)

    def commit(self, proposal: Proposal, accepted: int, new_tokens: list[int]) -> None:
        # The verify fed [pending, drafts...]; its first len(new_tokens) rows are committed positions,
        # each followed by the committed token at the same index. The next proposal reads them, after
        # any rows of rounds it did not draft (copied: the next round overwrites the runner's rows).
        rows = self.target.hidden[: len(new_tokens)]  # [n, F]
        if self.rows is not None and self.next_ids:
            self.rows = torch.cat([self.rows[: len(self.next_ids)], rows])
            self.next_ids += new_tokens
        else:
            self.rows = rows.clone()
            self.next_ids = list(new_tokens)
        # Rounds it does not draft (standard steps, another proposer's) must not leave it far behind:
        # its next draft would first catch up on all their rows, a cost that kept auto on standard
        # steps once it had stepped off (on an H200 at T = 0.7 with the n-gram beside it, 772 of 2,144
        # steps standard; priced as a catch-up, returning looked worth 0.98x). It reads them as they
        # come instead, a widest catch-up (one captured replay) each time that many have gathered,
        # keeping the last ones for its next draft: about 0.3 ms of an H200 every 13 standard steps.
        widest = self.head.widest_catch_up
        n = len(self.next_ids)
        if n > widest:
            m = n - (n % widest or widest)
            self.head.catch_up(self.rows[:m], ids_tensor(self.next_ids[:m], self.device),
                               self.head.span(self.head.length + m))
            self.rows, self.next_ids = self.rows[m:n], self.next_ids[m:]
