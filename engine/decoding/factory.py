"""Which proposers a request drafts from, built for one engine: the draft model, n-gram lookup, the head."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.decoding.head import HeadProposer
from engine.decoding.ngram import CombinedProposer, NgramProposer
from engine.decoding.proposers import DraftModelProposer, Proposer, ProposerSet
from engine.types import DraftSource, GenerationRequest, Sampling

if TYPE_CHECKING:  # annotations only: the Engine builds its proposers through here
    from engine.decoding.engine import Engine


def make_proposer(engine: Engine, source: DraftSource, sampling: Sampling,
                  generator: torch.Generator | None) -> Proposer:
    """One proposer of `source` over the engine's runners."""
    if source == "draft":
        assert engine.draft_runner is not None, "the draft proposer needs a draft model"
        return DraftModelProposer(engine.draft_runner, sampling, engine.vocab, generator)
    if source == "head":
        assert engine.head_runner is not None, "generate() checks that a head is loaded"
        return HeadProposer(engine.head_runner, engine.target_runner, sampling, engine.vocab, generator,
                            alternatives=engine.alternatives(), tree=engine.tree_drafter)
    assert source == "ngram", f"unknown proposer {source!r}"
    return NgramProposer(device=engine.device)


def make_proposers(engine: Engine, request: GenerationRequest, generator: torch.Generator | None) -> ProposerSet:
    """Standard: none. Speculative: the request's proposer (draft+ngram by CombinedProposer's rule).
    Auto: each of the request's proposers on its own, and the draft head whenever one is loaded
    (auto picks what is fastest: on an H200 the head measured 1.55x where the 0.5B draft could
    not pay), the controller choosing one per step."""
    kinds = request.proposer.kinds
    if request.mode == "standard":
        parts: tuple[Proposer, ...] = ()
    elif request.mode == "auto":
        sources = kinds + (("head",) if engine.head_runner is not None and "head" not in kinds else ())
        parts = tuple(engine.proposer(s, request.sampling, generator) for s in sources)
    elif len(kinds) > 1:
        assert set(kinds) == {"draft", "ngram"}, f"no combination of {kinds}"
        parts = (CombinedProposer(NgramProposer(device=engine.device),
                                  engine.proposer("draft", request.sampling, generator)),)
    else:
        parts = (engine.proposer(kinds[0], request.sampling, generator),)
    return ProposerSet(parts, engine.device)
