"""The draft head in the batched step (engine/decoding/batch_head.py): each sequence's head drafts from its
own part of the batched verify, and every sequence answers what it answers alone (float32)."""
from __future__ import annotations

import threading

import pytest
import torch

from engine.decoding.batch import BatchEngine
from engine.limits import K_AUTO
from engine.runners.batched import BatchedDecoder, Part
from engine.types import GenerationRequest, Sampling
from tests.head_fixtures import head_engine
from tests.test_batch import route
from tests.test_head_decoding import _messages


@pytest.fixture(scope="module")
def engine(tiny_head):
    return head_engine(tiny_head.target, tiny_head.head)


def _alone(engine, request):
    gen = engine.generate(request)
    return gen, list(gen)


def test_the_batched_forward_keeps_the_heads_layers_as_the_lone_runner_does(engine):
    layers = tuple(engine.head_runner.config.feature_layers)
    ids = [5, 9, 33, 41, 7, 100, 3]
    decoder = BatchedDecoder(engine.target, 256, 2)
    decoder.forward([Part(1, tuple(ids[:4]))], logits=False, keep=layers)
    first = decoder.kept[0]
    decoder.forward([Part(0, (11, 12)), Part(1, tuple(ids[4:]))], keep=layers)
    with torch.inference_mode():
        out = engine.target(torch.tensor([ids]), output_hidden_states=True).hidden_states
    ref = torch.cat([out[i + 1][0] for i in layers], dim=1)  # hidden_states[0] is the embedding
    assert first.shape == (4, len(layers) * engine.target.config.hidden_size)
    torch.testing.assert_close(first, ref[:4], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(decoder.kept[1], ref[4:], atol=1e-4, rtol=1e-4)


REQUESTS = [
    GenerationRequest(messages=_messages(1), mode="speculative", k=4, proposer="head", max_new_tokens=40),
    GenerationRequest(messages=_messages(2), mode="standard", max_new_tokens=30),
    GenerationRequest(messages=_messages(3), mode="speculative", k=K_AUTO, proposer="head", max_new_tokens=35),
    GenerationRequest(messages=_messages(4), mode="auto", proposer="ngram", max_new_tokens=45),
    GenerationRequest(messages=_messages(5), mode="speculative", k=6, proposer="head", max_new_tokens=25,
                      sampling=Sampling(temperature=0.8, seed=3)),
]


@pytest.mark.parametrize("how", ["parts", "padded", "all_rows"])  # parts: the CPU's route; all_rows: the GPU's
def test_head_sequences_answer_in_a_batch_what_they_answer_alone(engine, how):
    batch = BatchEngine(engine, 4)
    route(batch.target, how, batch.heads.layers)  # the head reads the kept rows of every route
    assert all(batch.supports(r) for r in REQUESTS)
    greedy = [r for r in REQUESTS if r.sampling.greedy]
    alone = [_alone(engine, r) for r in greedy]
    seqs = [batch.add(r, engine.encode(r), threading.Event()) for r in greedy]
    widths = []
    while batch.active:
        widths.append(len(batch.active))
        batch.round()
    assert max(widths) == len(greedy), "decoded together"
    for seq, (gen, _) in zip(seqs, alone):
        assert seq.token_ids == gen.token_ids
        assert seq.summary.text == gen.summary.text
    # A fixed K: the same drafts, accepted as far, as the loop's own head proposer (its features are the same rows).
    fixed, (_, lone_steps) = seqs[0], alone[0]
    drafted = [s for s in fixed.steps if s.proposed]
    assert drafted and all(set(s.sources) == {"head"} for s in drafted)
    assert [(s.proposed, s.accepted) for s in fixed.steps] == [(s.proposed, s.accepted) for s in lone_steps]


def test_a_sampled_head_sequence_answers_in_a_batch_what_it_answers_beside_others(engine):
    """Its draws come from its own generator, so its neighbours change nothing (a fixed K)."""
    sampled = REQUESTS[-1]
    seqs = []
    for neighbours in ([], REQUESTS[:2]):
        batch = BatchEngine(engine, 3)
        for r in [sampled, *neighbours]:
            seq = batch.add(r, engine.encode(r), threading.Event())
            if r is sampled:
                seqs.append(seq)
        while batch.active:
            batch.round()
    assert seqs[0].token_ids == seqs[1].token_ids
    assert any(s.proposed for s in seqs[0].steps)


def test_without_a_head_the_batch_refuses_head_requests(engine):
    batch = BatchEngine(engine, 2)
    batch.heads = None  # as on llama.cpp, whose batched forward keeps no layers
    assert not batch.supports(REQUESTS[0])
    assert batch.supports(REQUESTS[1])
