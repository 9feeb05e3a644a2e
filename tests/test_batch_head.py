"""The draft head in the batched step (engine/decoding/batch_head.py): each sequence's head drafts from its
own part of the batched verify, and every sequence answers what it answers alone (float32)."""
from __future__ import annotations

import threading

import pytest
import torch

from engine.decoding.batch import BatchEngine
from engine.heads.batched import BatchedHeadRunner
from engine.heads.runner import HeadRunner
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


def test_the_batched_head_drafts_for_each_row_what_a_lone_head_drafts(engine):
    _drafts_match_lone_heads(engine.head_runner.head)


def test_a_two_layer_head_drafts_in_a_batch_what_it_drafts_alone(tiny_head, tiny_two_layer_head):
    _drafts_match_lone_heads(head_engine(tiny_head.target, tiny_two_layer_head).head_runner.head)


def _drafts_match_lone_heads(head) -> BatchedHeadRunner:
    """Rows of different widths, a row that sits out a round and a free row, in one catch-up and chain steps each
    round: every row drafts exactly the tokens a HeadRunner of its own drafts from the same rows (float32)."""
    f = head.config.features
    dev = head.lm_rows.device
    gen = torch.Generator().manual_seed(0)
    batched = BatchedHeadRunner(head, slots=4, max_length=256, k_max=5)
    batched.warmup()  # CUDA graphs on a GPU (nothing elsewhere)
    lone = {slot: HeadRunner(head, max_length=256, k_max=5) for slot in (0, 1, 3)}  # slot 2 stays free
    for runner in lone.values():
        runner.warmup()
    prompts = {0: 30, 1: 3, 3: 11}  # rows each row reads at admission (a prompt's)
    for slot, n in prompts.items():
        feats, ids = torch.randn(n, f, generator=gen).to(dev), torch.randint(0, 200, (n,), generator=gen).to(dev)
        batched.prefill(slot, feats, ids)
        lone[slot].catch_up(feats, ids, lone[slot].span(n))
    for widths, k in (({0: 1, 1: 6, 3: 3}, 5), ({0: 4, 3: 2}, 3), ({0: 2, 1: 1, 3: 6}, 1), ({1: 5}, 6)):
        rows = {slot: (torch.randn(w, f, generator=gen).to(dev), torch.randint(0, 200, (w,), generator=gen).tolist())
                for slot, w in widths.items()}
        batched.catch_up(rows, k - 1)
        for slot, (feats, ids) in rows.items():
            runner = lone[slot]
            span = runner.span(runner.length + len(ids) + k)
            runner.catch_up(feats, torch.tensor(ids, device=dev), span)
            for _ in range(k - 1):
                runner.step(span)
            assert batched.drafts[slot, :k].tolist() == runner.drafts[:k].tolist(), (widths, slot)
            torch.testing.assert_close(batched.shown[slot, :k], runner.shown[:k], atol=1e-5, rtol=1e-4)
            assert batched.lengths[slot] == runner.length
    assert batched.lengths[2] == 0
    # Rows up to the highest slot with new rows run (row buckets 1, 2, 4): a round of slot 1 alone leaves 3 as it was.
    untouched = batched.k_cache[2:].clone()
    batched.catch_up({1: (torch.randn(2, f, generator=gen).to(dev), [3, 4])}, 2)
    assert torch.equal(batched.k_cache[2:], untouched)
    return batched


@pytest.mark.gpu
@pytest.mark.parametrize("layers", [1, 2])
def test_the_batched_heads_cuda_graphs_draft_what_lone_heads_draft_and_serve_head_requests(tiny_head, request, layers):
    from tests.head_fixtures import cuda_head_engine

    folder = tiny_head.head if layers == 1 else request.getfixturevalue("tiny_two_layer_head")
    fast = cuda_head_engine(tiny_head.target, folder)
    assert fast.head_runner.head.config.layers == layers
    assert _drafts_match_lone_heads(fast.head_runner.head).graphs, "captured per (width, span)"
    batch = BatchEngine(fast, 4)
    assert batch.heads.runner.graphs and batch.target.all_rows.graphs
    greedy = [r for r in REQUESTS if r.sampling.greedy]
    seqs = [batch.add(r, fast.encode(r), threading.Event()) for r in greedy]
    while batch.active:
        batch.round()
    assert [s.token_ids for s in seqs] == [_alone(fast, r)[0].token_ids for r in greedy]
    assert any(st.proposed for st in seqs[0].steps)


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
    assert all(a.proposed_q == pytest.approx(b.proposed_q, abs=1e-4) for a, b in zip(fixed.steps, lone_steps)), \
        "each draft's q(x) as the head drafted it"


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


def test_a_one_token_prompt_drafts_with_the_head_from_its_second_round(engine):
    request = GenerationRequest(messages=_messages(1), mode="speculative", k=3, proposer="head", max_new_tokens=12)
    batch = BatchEngine(engine, 2)
    other = batch.add(REQUESTS[0], engine.encode(REQUESTS[0]), threading.Event())
    seq = batch.add(request, [7], threading.Event())
    while batch.active:
        batch.round()
    assert not seq.steps[0].proposed and any(s.proposed for s in seq.steps[1:])
    assert other.summary is not None and len(seq.token_ids) == 12


def test_without_a_head_the_batch_refuses_head_requests(engine):
    batch = BatchEngine(engine, 2)
    batch.heads = None  # as on llama.cpp, whose batched forward keeps no layers
    assert not batch.supports(REQUESTS[0])
    assert batch.supports(REQUESTS[1])


def test_head_only_rows_show_each_drafts_q_as_the_lone_head_does(engine):
    """Every sequence drafting with the head (the static forward's route): the verify reads q(x) from the head's own
    buffer; each Step shows what the loop's head proposer shows."""
    from dataclasses import replace

    batch = BatchEngine(engine, 4)
    route(batch.target, "all_rows", batch.heads.layers)
    batch.overlap = True  # as on a GPU: each round's Steps described while the next one's forwards run
    requests = [REQUESTS[0], replace(REQUESTS[0], messages=_messages(6), k=3)]
    alone = [_alone(engine, r) for r in requests]
    seqs = [batch.add(r, engine.encode(r), threading.Event()) for r in requests]
    while batch.active:
        batch.round()
    for seq, (gen, steps) in zip(seqs, alone):
        assert seq.token_ids == gen.token_ids
        assert [(s.proposed, s.accepted) for s in seq.steps] == [(s.proposed, s.accepted) for s in steps]
        assert all(a.proposed_q == pytest.approx(b.proposed_q, abs=1e-4) for a, b in zip(seq.steps, steps))
        assert any(s.proposed_q and max(s.proposed_q) < 1 for s in seq.steps), "softmax values, not point masses"
