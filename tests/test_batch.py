"""The batched step: several sequences in one target forward give each one its single-sequence tokens (float32)."""
from __future__ import annotations

import threading

import pytest
import torch

from engine.decoding.batch import BatchEngine
from engine.runners.batched import BatchedDecoder, Part
from engine.types import GenerationRequest, Message, Sampling
from tests.engine_fixtures import tiny_engine


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return tiny_engine(*tiny_pair)


def _alone(engine, request):
    gen = engine.generate(request)
    steps = list(gen)
    return gen, steps


def test_batched_forward_equals_the_model_per_row(engine):
    a, b = [5, 9, 33, 41, 7, 100, 3], [11, 12, 13]
    with torch.inference_mode():
        ref_a, ref_b = (engine.target(torch.tensor([x])).logits[0] for x in (a, b))
    decoder = BatchedDecoder(engine.target, 512, 3)
    decoder.forward([Part(0, tuple(a[:4])), Part(2, tuple(b[:1]))], logits=False)
    got_a, got_b = decoder.forward([Part(0, tuple(a[4:])), Part(2, tuple(b[1:]))])
    torch.testing.assert_close(got_a, ref_a[4:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_b, ref_b[1:], atol=1e-4, rtol=1e-4)
    decoder.rollback(0, 5)  # stale slots past a rollback are masked, then overwritten
    (again,) = decoder.forward([Part(0, tuple(a[5:]))])
    torch.testing.assert_close(again, ref_a[5:], atol=1e-4, rtol=1e-4)


REQUESTS = [
    GenerationRequest(prompt="def add(a, b):", mode="speculative", k=3, max_new_tokens=40),
    GenerationRequest(prompt="class Stack:", mode="standard", max_new_tokens=30),
    GenerationRequest(prompt="hello hello hello hello", mode="speculative", k=4, proposer="ngram", max_new_tokens=35),
    GenerationRequest(messages=(Message("user", "x = [1, 2"),), mode="speculative", k=6, max_new_tokens=50),
]


def test_a_mixed_batch_gives_every_sequence_its_single_sequence_answer(engine):
    alone = [_alone(engine, r) for r in REQUESTS]
    batch = BatchEngine(engine, 4)
    seqs = [batch.add(r, engine.encode(r), threading.Event()) for r in REQUESTS]
    widths = []
    while batch.active:
        widths.append(len(batch.active))
        batch.round()
    assert max(widths) == 4, "all four decoded together"
    for seq, (gen, steps) in zip(seqs, alone):
        assert seq.token_ids == gen.token_ids
        assert seq.summary.text == gen.summary.text
        # The same drafts, accepted as far: the batch drafts and verifies exactly as the loop does.
        assert [(s.proposed, s.accepted) for s in seq.steps] == [(s.proposed, s.accepted) for s in steps]
        assert seq.summary.acceptance_rate == gen.summary.acceptance_rate
        assert "".join(s.text for s in seq.steps) == seq.summary.text


def test_rows_are_reused_and_a_cancelled_sequence_ends(engine):
    batch = BatchEngine(engine, 1)
    cancel = threading.Event()
    seq = batch.add(REQUESTS[0], engine.encode(REQUESTS[0]), cancel)
    batch.round()
    cancel.set()
    assert batch.round() == [(seq, None)] and seq.summary.stop_reason == "cancelled"
    assert batch.free == [0]
    gen, _ = _alone(engine, REQUESTS[1])
    again = batch.add(REQUESTS[1], engine.encode(REQUESTS[1]), threading.Event())
    while batch.active:
        batch.round()
    assert again.token_ids == gen.token_ids


def test_only_what_the_batch_decodes_exactly_is_batched(engine):
    batch = BatchEngine(engine, 2)
    assert batch.supports(REQUESTS[0]) and batch.supports(REQUESTS[1]) and batch.supports(REQUESTS[2])
    assert not batch.supports(GenerationRequest(prompt="x", sampling=Sampling(temperature=0.7)))
    assert not batch.supports(GenerationRequest(prompt="x", mode="auto"))
    assert not batch.supports(GenerationRequest(prompt="x", k=0))
    assert not batch.supports(GenerationRequest(prompt="x", proposer="head"))


def test_a_packed_cpu_model_is_served_one_at_a_time_not_crashed(tiny_pair):
    """Regression: the CPU fast path's packed head made the batch's construction raise AttributeError."""
    from engine.runners.cpu import onednn_available, pack_linears
    from engine.runners.lean import UnsupportedModelError
    from engine.serving.scheduler import Scheduler

    if not onednn_available():
        pytest.skip("needs oneDNN")
    engine = tiny_engine(*tiny_pair)
    pack_linears(engine.target)
    with pytest.raises(UnsupportedModelError):
        BatchEngine(engine, 2)
    scheduler = Scheduler(engine, max_seqs=2)
    try:
        assert scheduler.batch is None
    finally:
        scheduler.close()
