"""The draft head in the batched step: a head cache per row, fed from the batched verify's kept layers.

The single-sequence loop's HeadProposer (engine/decoding/head.py) reads "the target runner's" hidden rows
after each verify. In a batch each sequence gets its own HeadProposer over its own HeadRunner (the
engine's head weights, shared; a cache per row), and a RowHidden in place of the runner: the rows of
the head's feature layers that the batched forward kept for that sequence's part (its prompt at
admission, its pending token and drafts each round). In a batch the head drafts chains: its dynamic
trees need a tree verify of their own, which the batched forward does not do.
"""
from __future__ import annotations

import torch

from engine.decoding.head import HeadProposer
from engine.heads.runner import HeadRunner
from engine.limits import K_MAX
from engine.types import GenerationRequest


class RowHidden:
    """What a batched sequence's HeadProposer reads as its target (chains only: no tree is sized by it)."""

    def __init__(self, layers: tuple[int, ...]) -> None:
        self.hidden_layers = layers
        self.hidden: torch.Tensor | None = None  # [W, F]: this sequence's rows of the last batched forward


class BatchHeads:
    """A HeadRunner per row of the batch, made when a row first drafts with the head and kept for its next ones."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.layers: tuple[int, ...] = tuple(engine.head_runner.config.feature_layers)
        self.runners: dict[int, HeadRunner] = {}

    def proposer(self, slot: int, request: GenerationRequest, generator: torch.Generator | None,
                 max_length: int) -> tuple[HeadProposer, RowHidden]:
        runner = self.runners.get(slot)
        if runner is None:
            runner = HeadRunner(self.engine.head_runner.head, max_length=max_length, k_max=K_MAX)
            runner.warmup()
            self.runners[slot] = runner
        view = RowHidden(self.layers)
        return HeadProposer(runner, view, request.sampling, self.engine.vocab, generator), view  # type: ignore[arg-type]
