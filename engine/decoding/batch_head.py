"""The draft head in the batched step: every sequence's head drafts in one batched head forward per position.

The single-sequence loop's HeadProposer (engine/decoding/head.py) reads the target runner's hidden rows after
each verify. In a batch the rows are the head's feature layers that the batched forward kept for each
sequence's part: its prompt at admission, its pending token and drafts each round. After a round each
sequence's committed rows (with the token after each) wait here; the next round's one catch-up reads every
sequence's together (engine/heads/batched.py), whether it drafts with the head this round or not, so a row is
never more than one round behind, and those that draft take their chains from the same K-1 chain steps.
Beside a static batched forward (a GPU's) the drafts stay on the device and go into the verify's inputs there,
and the host reads them with the verify's outcome; elsewhere one host sync reads every sequence's drafts. In a
batch the head drafts chains: its dynamic trees need a tree verify of their own, which the batched forward does
not do.
"""
from __future__ import annotations

import time

import torch

from engine.heads.batched import BatchedHeadRunner
from engine.limits import K_MAX


class BatchHeads:
    """The engine's draft head over one cache row per slot of the batch, and what each row has yet to read."""

    def __init__(self, engine, slots: int, max_length: int) -> None:
        head = engine.head_runner.head
        self.layers: tuple[int, ...] = tuple(head.config.feature_layers)
        self.runner = BatchedHeadRunner(head, slots, max_length, K_MAX)
        self.device = self.runner.device
        self.pending: dict[int, tuple[torch.Tensor, list[int]]] = {}  # slot -> rows [w, F], the token after each
        self.ms = 0.0  # the last draft()'s wall time: what a sequence that drafted waited for

    def warmup(self) -> int:
        """Captures the head's graphs (CUDA); returns how many."""
        return self.runner.warmup()

    def start(self, slot: int, rows: torch.Tensor | None, prompt: list[int]) -> None:
        """A new sequence in `slot`: its prompt's rows [len(prompt) - 1, F] (prompt[:-1] as the target read it)
        are read now but the last, which its first round reads (its last row drafts the first token)."""
        self.runner.reset(slot)
        self.pending.pop(slot, None)
        if rows is None or len(prompt) < 2:
            return  # a one-token prompt: nothing to read; it drafts from its second round
        n = len(prompt) - 1
        if n > 1:
            self.runner.prefill(slot, rows[: n - 1], torch.tensor(prompt[1:n], device=self.device))
        self.pending[slot] = (rows[n - 1: n], [prompt[n]])

    def can_draft(self, slot: int) -> bool:
        """Whether the row has rows to read this round (its last one drafts)."""
        return slot in self.pending

    def commit(self, slot: int, rows: torch.Tensor, committed: list[int]) -> None:
        """A round's outcome: the verify's first len(committed) rows [.., F] (each committed position's), each
        followed by the committed token at its index. The next round's catch-up reads them."""
        self.pending[slot] = (rows[: len(committed)], list(committed))

    def draft(self, ks: dict[int, int], on_device: bool = False) -> dict[int, tuple]:
        """Every row with rows to read catches up; each slot of `ks` (all of them rows with rows to read) drafts
        its k tokens: slot -> (draft ids, their shown probabilities), read in one host sync as lists, or with
        `on_device` left on the device as [k] views (valid until the next draft(); no sync)."""
        t0 = time.perf_counter()
        out: dict[int, tuple] = {}
        if self.pending:
            assert set(ks) <= set(self.pending), "a row drafts from rows it has just read"
            most = max(ks.values(), default=1)
            r = self.runner
            r.catch_up(self.pending, most - 1)
            self.pending = {}
            if ks and on_device:
                out = {slot: (r.drafts[slot, :k], r.shown[slot, :k]) for slot, k in ks.items()}
            elif ks:
                values = torch.cat([r.drafts[:, :most].float(), r.shown[:, :most]], dim=1).tolist()  # [S, 2 * most]
                out = {slot: ([int(x) for x in values[slot][:k]], values[slot][most: most + k])
                       for slot, k in ks.items()}
        self.ms = (time.perf_counter() - t0) * 1e3
        return out

    def release(self, slot: int) -> None:
        self.pending.pop(slot, None)
        self.runner.reset(slot)
