"""The batched step: several sequences in one target forward give each one its single-sequence tokens (float32)."""
from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from engine.decoding.batch import BatchEngine, priced
from engine.decoding.control import AdaptiveK, StepCosts
from engine.limits import K_AUTO, K_MAX
from engine.runners.batched import ROW_ATTENTION, BatchedDecoder, Part, RowCosts
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
    decoder.rollback(0, 5)
    last, whole = decoder.forward([Part(0, tuple(a[5:]), outputs=1), Part(1, tuple(b))])  # only the rows read
    torch.testing.assert_close(last, ref_a[-1:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(whole, ref_b, atol=1e-4, rtol=1e-4)


REQUESTS = [
    GenerationRequest(prompt="def add(a, b):", mode="speculative", k=3, max_new_tokens=40),
    GenerationRequest(prompt="class Stack:", mode="standard", max_new_tokens=30),
    GenerationRequest(prompt="hello hello hello hello", mode="speculative", k=4, proposer="ngram", max_new_tokens=35),
    GenerationRequest(messages=(Message("user", "x = [1, 2"),), mode="speculative", k=6, max_new_tokens=50),
]


def route(decoder: BatchedDecoder, how: str, keep: tuple[int, ...] = ()) -> None:
    """Sets a batched decoder's route: each part alone (the CPU's), the parts padded into one call, or every row
    in one static forward (the GPU's, whose CUDA graphs replay that forward); "all_rows-bmm" and "all_rows-sdpa"
    with that attention (ROW_ATTENTION)."""
    how, _, attention = how.partition("-")
    decoder.vectorised = how == "padded"
    decoder.attention = attention or "math"
    if how == "all_rows":
        decoder.use_all_rows(keep)


@pytest.mark.parametrize("attention", ROW_ATTENTION)
def test_every_row_in_one_static_forward_equals_the_model_per_row(engine, attention):
    a, b, c = [5, 9, 33, 41, 7, 100, 3], [11, 12, 13], [40, 41, 42, 43]
    with torch.inference_mode():
        ref_a, ref_b, ref_c = (engine.target(torch.tensor([x])).logits[0] for x in (a, b, c))
    decoder = BatchedDecoder(engine.target, 512, 4)
    decoder.attention = attention
    decoder.forward([Part(0, tuple(a[:4])), Part(2, tuple(b[:1])), Part(3, tuple(c[:2]))], logits=False)
    decoder.use_all_rows()
    got_a, got_b = decoder.forward([Part(0, tuple(a[4:])), Part(2, tuple(b[1:]))])  # row 3 sits this one out
    assert decoder.all_rows.forwards == 1
    torch.testing.assert_close(got_a, ref_a[4:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_b, ref_b[1:], atol=1e-4, rtol=1e-4)
    assert decoder.lengths == [7, 0, 3, 2], "a row that took no part keeps its length; its padding lies past it"
    (got_c,) = decoder.forward([Part(3, tuple(c[2:]), outputs=1)])
    torch.testing.assert_close(got_c, ref_c[-1:], atol=1e-4, rtol=1e-4)
    decoder.rollback(0, 5)  # stale slots past a rollback (and padding) are masked, then overwritten
    (again,) = decoder.forward([Part(0, tuple(a[5:]))])
    torch.testing.assert_close(again, ref_a[5:], atol=1e-4, rtol=1e-4)
    assert torch.isfinite(decoder.kv).all(), "no row is ever masked whole (that would leave NaN keys behind)"
    assert decoder.forward([Part(1, tuple(range(1, 20)))]) and decoder.all_rows.forwards == 4 - 1, \
        "wider than the widest captured width: the per-part forward"


def test_a_static_forward_runs_the_rows_up_to_the_highest_part_only(engine):
    """Row buckets (1, 2, 4 of 4): parts in rows 0 and 1 run those two rows; rows 2 and 3 are not touched."""
    from engine.runners.batched_graphs import row_buckets

    assert row_buckets(4) == (1, 2, 4) and row_buckets(3) == (1, 2, 3) and row_buckets(1) == (1,)
    a, b = [5, 9, 33, 41, 7], [11, 12, 13]
    with torch.inference_mode():
        ref_a, ref_b = (engine.target(torch.tensor([x])).logits[0] for x in (a, b))
    decoder = BatchedDecoder(engine.target, 512, 4)
    decoder.forward([Part(3, (1, 2, 3))], logits=False)
    decoder.use_all_rows()
    untouched = decoder.kv[:, :, 2:].clone()
    ran = []
    forward_rows = decoder.forward_rows
    decoder.forward_rows = lambda ids, *args, **kw: ran.append(ids.shape[0]) or forward_rows(ids, *args, **kw)
    got_a, got_b = decoder.forward([Part(0, tuple(a)), Part(1, tuple(b))])
    (got_a1,) = decoder.forward([Part(0, (4,))])
    assert ran == [2, 1]
    torch.testing.assert_close(got_a, ref_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_b, ref_b, atol=1e-4, rtol=1e-4)
    with torch.inference_mode():
        ref = engine.target(torch.tensor([a + [4]])).logits[0, -1:]
    torch.testing.assert_close(got_a1, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(decoder.kv[:, :, 2:], untouched) and decoder.lengths == [6, 3, 0, 3]


@pytest.mark.parametrize("how", ["parts", "padded", "all_rows", "all_rows-bmm", "all_rows-sdpa"])  # parts: the CPU's
def test_a_mixed_batch_gives_every_sequence_its_single_sequence_answer(engine, how):
    alone = [_alone(engine, r) for r in REQUESTS]
    batch = BatchEngine(engine, 4)
    batch.overlap = how.startswith("all_rows")  # the GPU's route describes each round in the next
    for decoder in (batch.target, batch.draft):
        route(decoder, how)
    seqs = [batch.add(r, engine.encode(r), threading.Event()) for r in REQUESTS]
    alone_verifies = []
    verify = batch._verify
    batch._verify = lambda *a: alone_verifies.append(1) or verify(*a)
    widths = []
    while batch.active:
        widths.append(len(batch.active))
        batch.round()
    assert max(widths) == 4, "all four decoded together"
    assert not how.startswith("all_rows") or batch.target.all_rows.forwards and batch.draft.all_rows.forwards
    assert not how.startswith("all_rows") or batch.target.all_rows.prefills == len(REQUESTS), "prompts in its rows"
    # Greedy rows of a static forward verify all at once (verify_rows_greedy), the per-part route row by row.
    assert bool(alone_verifies) != how.startswith("all_rows")
    for seq, (gen, steps) in zip(seqs, alone):
        assert seq.token_ids == gen.token_ids
        assert seq.summary.text == gen.summary.text
        # The same drafts, accepted as far: the batch drafts and verifies exactly as the loop does.
        assert [(s.proposed, s.accepted) for s in seq.steps] == [(s.proposed, s.accepted) for s in steps]
        assert seq.summary.acceptance_rate == gen.summary.acceptance_rate
        assert "".join(s.text for s in seq.steps) == seq.summary.text


@pytest.mark.parametrize("overlap", [False, True])  # True: a GPU's, each round's Steps described in the next
def test_rows_are_reused_and_a_cancelled_sequence_ends(engine, overlap):
    batch = BatchEngine(engine, 1)
    batch.overlap = overlap
    cancel = threading.Event()
    seq = batch.add(REQUESTS[0], engine.encode(REQUESTS[0]), cancel)
    first = batch.round()
    assert first == [] if overlap else [(seq, seq.steps[0])], "with overlap a round's Steps come out of the next"
    batch.round()
    cancel.set()
    (ended, step), = batch.round()  # with overlap the round before's Step, and the summary with it
    assert ended is seq and seq.summary.stop_reason == "cancelled" and not batch.active
    assert step is (seq.steps[-1] if overlap else None)
    assert batch.free == [0]
    gen, _ = _alone(engine, REQUESTS[1])
    again = batch.add(REQUESTS[1], engine.encode(REQUESTS[1]), threading.Event())
    while batch.active:
        batch.round()
    assert again.token_ids == gen.token_ids


def test_what_the_batch_takes(engine):
    batch = BatchEngine(engine, 2)
    assert all(batch.supports(r) for r in REQUESTS)
    assert batch.supports(GenerationRequest(prompt="x", sampling=Sampling(temperature=0.7)))
    assert batch.supports(GenerationRequest(prompt="x", k=K_AUTO))
    assert batch.supports(GenerationRequest(prompt="x", mode="auto", proposer="draft+ngram"))
    assert batch.supports(GenerationRequest(prompt="x", k=2, proposer="draft+ngram"))
    assert not batch.supports(GenerationRequest(prompt="x", proposer="head"))
    assert not batch.supports(GenerationRequest(prompt="x", stop_strings=("\n",)))
    head, engine.head_runner = engine.head_runner, object()  # auto mode drafts from a loaded head too: the loop's
    try:
        assert not batch.supports(GenerationRequest(prompt="x", mode="auto", proposer="ngram"))
    finally:
        engine.head_runner = head
    batch.draft = None  # an engine without a draft model
    assert not batch.supports(REQUESTS[0]) and batch.supports(REQUESTS[2])


# Sampled requests beside greedy ones, with different K, proposers and processing.
SAMPLED = [
    GenerationRequest(prompt="def add(a, b):", mode="speculative", k=3, max_new_tokens=40,
                      sampling=Sampling(temperature=0.8, seed=7)),
    GenerationRequest(prompt="hello hello hello hello", mode="speculative", k=4, proposer="ngram", max_new_tokens=30,
                      sampling=Sampling(temperature=1.0, top_p=0.9, seed=3)),
    GenerationRequest(prompt="class Stack:", mode="standard", max_new_tokens=30,
                      sampling=Sampling(temperature=0.7, top_k=20, seed=11)),
    GenerationRequest(prompt="x = [1, 2", mode="speculative", k=2, proposer="draft+ngram", max_new_tokens=35,
                      sampling=Sampling(temperature=1.2, top_k=8, seed=5)),
]


def _batched(engine, requests, slots):
    batch = BatchEngine(engine, slots)
    seqs = [batch.add(r, engine.encode(r), threading.Event()) for r in requests]
    widths = []
    while batch.active:
        widths.append(len(batch.active))
        batch.round()
    return seqs, max(widths)


def test_a_sampled_sequence_answers_in_a_batch_what_it_answers_alone(engine):
    """Its random draws come from its own generator: its neighbours change nothing."""
    alone = [_batched(engine, [r], 1)[0][0] for r in SAMPLED]
    seqs, widest = _batched(engine, [SAMPLED[0], REQUESTS[1], SAMPLED[1], REQUESTS[0], SAMPLED[2], SAMPLED[3]], 6)
    assert widest == 6
    together = [seqs[0], seqs[2], seqs[4], seqs[5]]
    for seq, lone in zip(together, alone):
        assert seq.token_ids == lone.token_ids and seq.summary.text == lone.summary.text
        assert [(s.proposed, s.accepted, s.added) for s in seq.steps] == [(s.proposed, s.accepted, s.added)
                                                                          for s in lone.steps]
    assert seqs[1].token_ids == _alone(engine, REQUESTS[1])[0].token_ids  # the greedy neighbours are still exact
    assert seqs[3].token_ids == _alone(engine, REQUESTS[0])[0].token_ids
    # It sampled: another seed answers otherwise, and so does greedy decoding.
    other = _batched(engine, [replace(SAMPLED[0], sampling=Sampling(temperature=0.8, seed=8))], 1)[0][0]
    greedy = _alone(engine, replace(SAMPLED[0], sampling=Sampling()))[0]
    assert other.token_ids != alone[0].token_ids != greedy.token_ids
    drafted = [t for s in seqs[0].steps for t in s.tokens if t.draft_pos is not None]
    assert drafted and all(0.0 <= t.accept_prob <= 1.0 and t.q > 0 for t in drafted)


def test_k_auto_and_auto_mode_decode_in_the_batch_priced_for_it(engine):
    """Adaptive controllers in a batch: lossless (greedy), re-priced for the batched verify, their timing kept apart."""
    timing = engine.tuning.timing.copy()
    auto = [GenerationRequest(prompt="def add(a, b):", k=K_AUTO, max_new_tokens=30),
            GenerationRequest(prompt="hello hello hello hello", mode="auto", proposer="draft+ngram", max_new_tokens=30),
            GenerationRequest(prompt="class Stack:", k=K_AUTO, proposer="ngram", max_new_tokens=20,
                              sampling=Sampling(temperature=0.9, seed=2))]
    batch = BatchEngine(engine, 5)
    seqs = [batch.add(r, engine.encode(r), threading.Event()) for r in [*auto, REQUESTS[1], REQUESTS[0]]]
    observed: list[float] = []
    observe = seqs[0].controller.observe
    seqs[0].controller.observe = lambda *a, **kw: observed.append(a[4]) or observe(*a, **kw)
    while batch.active:
        batch.round()
    assert all(isinstance(s.controller, AdaptiveK) for s in seqs[:3])
    for seq, request in zip(seqs[:2], auto):  # greedy: whatever K it chose, the target's own answer
        assert seq.token_ids == _alone(engine, replace(request, mode="standard"))[0].token_ids
    assert seqs[2].summary.stop_reason in ("max_new_tokens", "eos") and seqs[2].summary.text
    # It observed the batched verify (every sequence's rows), and priced its K against what the batch measured.
    assert observed == [s.verify_ms for s in seqs[0].steps]
    lone, priced = seqs[0].lone_costs.target_ms, seqs[0].controller.costs.target_ms
    assert priced != lone and batch.costs.measured
    assert engine.tuning.timing == timing, "a batch's timing is not a lone sequence's"


def test_row_costs_scale_the_lone_shape_to_what_the_batch_measured():
    lone = (0.0, *(2.0 + 0.1 * w for w in range(1, K_MAX + 2)))  # a lone verify of w tokens: 2 + 0.1 w ms
    costs = RowCosts(0.15)
    assert costs.ms(lone, 5) == lone[5]
    assert costs.ms(lone, K_MAX + 8) == pytest.approx(lone[K_MAX + 1] + 0.1 * 7)  # past the widest: its slope
    costs.observe(8, 6.0)
    assert costs.ms(lone, 8) == 6.0 and costs.ms(lone, 9) == pytest.approx(6.0 * lone[9] / lone[8])
    costs.observe(8, 7.0)  # a decayed mean: the newest forward moves it
    assert 6.0 < costs.ms(lone, 8) < 7.0
    # A sequence's verify of w tokens is priced as the batched forward of w + its neighbours' rows.
    assert priced(costs, StepCosts(lone, {}), 3).target_ms == (0.0, *(costs.ms(lone, 3 + w)
                                                                     for w in range(1, K_MAX + 2)))


def test_a_packed_cpu_model_batches_with_its_packed_linears(tiny_pair):
    """The CPU fast path packs every linear for oneDNN, the output head included: the batched forward calls
    them as they are, so a torch server on a CPU batches (each answer the loop's own)."""
    from engine.runners.cpu import onednn_available, pack_linears
    from engine.serving.scheduler import Scheduler

    if not onednn_available():
        pytest.skip("needs oneDNN")
    engine = tiny_engine(*tiny_pair)
    alone = [_alone(engine, r)[0].token_ids for r in REQUESTS]
    pack_linears(engine.target)
    pack_linears(engine.draft)
    seqs, widest = _batched(engine, REQUESTS, len(REQUESTS))
    assert widest == len(REQUESTS)
    assert [s.token_ids for s in seqs] == alone
    scheduler = Scheduler(engine, max_seqs=2)
    try:
        assert scheduler.batch is not None
    finally:
        scheduler.close()


@pytest.mark.gpu
def test_a_mixed_sampled_batch_on_cuda_graph_runners(tiny_pair):
    """On CUDA, beside the graph runners the server uses: greedy answers equal the loop's, each sampled one
    is the same alone and in the batch, and K auto decodes."""
    from engine.decoding import Engine
    from engine.runners.graphs import build_runners

    eager = tiny_engine(*tiny_pair)
    target, draft = eager.target.to("cuda"), eager.draft.to("cuda")
    t, d, name = build_runners(target, draft, max_length=512)
    assert name == "cuda-graphs", t.fallback_reason
    fast = Engine(target, eager.tokenizer, eager.info, draft=draft, target_runner=t, draft_runner=d)
    requests = [*SAMPLED, *REQUESTS, GenerationRequest(prompt="def add(a, b):", k=K_AUTO, max_new_tokens=30,
                                                       sampling=Sampling(temperature=0.7, seed=1))]
    seqs, widest = _batched(fast, requests, len(requests))
    assert widest == len(requests)
    for seq, request in zip(seqs[: len(SAMPLED)], SAMPLED):
        assert seq.token_ids == _batched(fast, [request], 1)[0][0].token_ids
    for seq, request in zip(seqs[len(SAMPLED): -1], REQUESTS):
        assert seq.token_ids == _alone(fast, request)[0].token_ids
    assert seqs[-1].summary.text and isinstance(seqs[-1].controller, AdaptiveK)
    # Every row went through the batched forward's own CUDA graphs (runners/batched_graphs.py).
    batch = BatchEngine(fast, 4)
    assert batch.target.all_rows.graphs and batch.draft.all_rows.graphs, "captured per (width, span)"
    seqs = [batch.add(r, fast.encode(r), threading.Event()) for r in REQUESTS]
    while batch.active:
        batch.round()
    assert batch.target.all_rows.forwards and batch.draft.all_rows.forwards
    assert [s.token_ids for s in seqs] == [_alone(fast, r)[0].token_ids for r in REQUESTS]


def test_greedy_rows_verify_as_verify_chain_verifies_each_row():
    """verify_rows_greedy (every row of a static forward at once) gives each row verify_chain's values."""
    from engine.decoding.verify import chain_values, verify_chain, verify_rows_greedy

    torch.manual_seed(0)
    rows, width, vocab = 5, 6, 50
    logits = torch.randn(rows, width, vocab)
    best = logits.argmax(-1)
    ids = torch.randint(0, vocab, (rows, width))
    ids[1, 1:] = best[1, :-1]  # a chain accepted whole
    ids[2, 1:3] = best[2, :2]  # two accepted, then a rejection
    ids[3, 1:] = best[3, :-1]  # accepted, but only 2 of its rows are drafts (the rest is padding)
    n = torch.tensor([5, 5, 4, 2, 0])  # row 4: a standard step
    q = torch.rand(rows, width - 1)
    table = verify_rows_greedy(logits, ids, n, q).tolist()
    for r in range(rows):
        k = int(n[r])
        want = verify_chain(logits[r, : k + 1], ids[r, 1: k + 1], None, q[r, :k], Sampling(), None).tolist()
        assert chain_values(table[r], width, k) == want, r
    assert [int(table[r][4 * (width - 1)]) for r in range(rows)] == [0, 5, 2, 2, 0]
