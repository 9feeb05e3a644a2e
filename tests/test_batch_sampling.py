"""Batched speculative sampling keeps the target's processed law, and a wrong acceptance rule is caught (chi-square)."""
from __future__ import annotations

import threading

import pytest
import torch
from scipy import stats as scipy_stats

from engine.decoding import verify as verify_module  # the acceptance rule the batch verifies with
from engine.decoding.batch import BatchEngine
from engine.decoding.ngram import NgramProposer
from engine.decoding.sampling import accept_draft, draw, process
from engine.types import GenerationRequest, Sampling
from tests.engine_fixtures import tiny_engine

SAMPLING = Sampling(temperature=1.3, top_k=5, top_p=0.9)  # processed on both sides: p and q
TRIALS = 2000
SLOTS = 64  # sequences per wave: each trial is one sequence with its own seed
# The n-gram drafts a token the target gives 0.2-0.7 here, so a wrong correction shows (checked below).
NGRAM_PROMPT = "world print world print world"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The tiny target with a draft far enough from it (noise 0.6) that q differs from p."""
    from tests.tiny import save_pair

    return tiny_engine(*save_pair(tmp_path_factory.mktemp("far"), noise=0.6, seed=0))


def _exact(engine, ids: list[int]) -> dict[tuple[int, int], float]:
    """The target's processed law of the first two tokens after `ids`, from its own logits."""
    law: dict[tuple[int, int], float] = {}
    with torch.inference_mode():
        p1 = process(engine.target(torch.tensor([ids])).logits[0, -1].float(), SAMPLING)
        for t1 in torch.nonzero(p1).flatten().tolist():
            p2 = process(engine.target(torch.tensor([ids + [t1]])).logits[0, -1].float(), SAMPLING)
            for t2 in torch.nonzero(p2).flatten().tolist():
                law[(t1, t2)] = p1[t1].item() * p2[t2].item()
    return law


def _pvalue(law: dict[tuple[int, int], float], counts: dict[tuple[int, int], int]) -> float:
    assert set(counts) <= set(law), f"sampled {set(counts) - set(law)}, which the processed law never gives"
    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    total = sum(counts.values())
    for key, prob in law.items():  # rare cells pooled: the chi-square approximation wants >= 5 expected
        if prob * total >= 5:
            observed.append(counts.get(key, 0))
            expected.append(prob * total)
        else:
            rest_o, rest_e = rest_o + counts.get(key, 0), rest_e + prob * total
    if rest_e > 0:
        observed.append(rest_o)
        expected.append(rest_e)
    scale = sum(observed) / sum(expected)
    return scipy_stats.chisquare(observed, [e * scale for e in expected]).pvalue


def _batched_counts(engine, ids: list[int], proposer: str, trials: int = TRIALS) -> dict[tuple[int, int], int]:
    """`trials` seeds of a 2-token answer (K = 3), decoded SLOTS at a time in one batch."""
    batch = BatchEngine(engine, SLOTS)
    counts: dict[tuple[int, int], int] = {}
    for first in range(0, trials, SLOTS):
        seqs = [batch.add(GenerationRequest(prompt="-", k=3, max_new_tokens=2, proposer=proposer,
                                            sampling=Sampling(SAMPLING.temperature, SAMPLING.top_k, SAMPLING.top_p,
                                                              seed)), ids, threading.Event())
                for seed in range(first, min(first + SLOTS, trials))]
        while batch.active:
            batch.round()
        for seq in seqs:
            counts[tuple(seq.token_ids)] = counts.get(tuple(seq.token_ids), 0) + 1
    return counts


def _correction_from_p(draft, q, p, greedy, generator):
    """A wrong rule: the token after a rejection drawn from p instead of normalize(max(0, p - q))."""
    accepted, _, accept_prob = accept_draft(draft, q, p, greedy, generator)
    return accepted, draw(p.index_select(0, accepted.view(1)), generator)[0], accept_prob


@pytest.mark.parametrize("proposer,prompt", [("draft", "hello world"), ("ngram", NGRAM_PROMPT)])
@pytest.mark.parametrize("rule", ["leviathan", "correction_from_p"])
def test_batched_speculative_sampling_keeps_the_targets_processed_law(engine, monkeypatch, proposer, prompt, rule):
    """2,000 seeds of the first two tokens against the exact processed law of the target (chi-square)."""
    ids = engine.encode(GenerationRequest(prompt=prompt))
    if proposer == "ngram":
        draft = NgramProposer()
        draft.start(ids)
        with torch.inference_mode():
            p = process(engine.target(torch.tensor([ids])).logits[0, -1].float(), SAMPLING)
        assert 0.2 < p[draft.match(3)[0][0]] < 0.7, "the test needs an n-gram draft the target may reject"
    if rule == "correction_from_p":
        monkeypatch.setattr(verify_module, "accept_draft", _correction_from_p)
    # The wrong rule's bias shows with fewer seeds: plainly for n-gram's point masses, less for the draft's q.
    trials = TRIALS if rule == "leviathan" else {"draft": 1536, "ngram": 768}[proposer]
    pvalue = _pvalue(_exact(engine, ids), _batched_counts(engine, ids, proposer, trials))
    if rule == "leviathan":
        assert pvalue > 1e-3
    else:
        assert pvalue < 1e-3, "the test cannot tell a wrong rule from the right one"
