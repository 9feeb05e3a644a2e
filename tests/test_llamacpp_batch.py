"""Several sequences in llama.cpp's multi-sequence batches, on a tiny GGUF the tests write themselves: each one
answers what it answers alone, the scheduler batches llama.cpp requests."""
from __future__ import annotations

import threading
from dataclasses import replace

import openai
import pytest
import torch

from engine import assemble
from engine.decoding.batch import BatchEngine
from engine.limits import K_AUTO
from engine.loadspec import LoadSpec
from engine.runners.batched import Part
from engine.types import GenerationRequest, Message, Sampling
from tests.serve_fixtures import MODEL, serving

llama_cpp = pytest.importorskip("llama_cpp")

from engine.runners.llamacpp import LlamaCppRunner  # noqa: E402  (after the skip: it needs llama_cpp)
from engine.runners.llamacpp_batch import LlamaCppBatch  # noqa: E402


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    from tests.tiny_gguf import save_gguf_pair

    return save_gguf_pair(tmp_path_factory.mktemp("llamacpp_batch"), noise=0.02, seed=0)


@pytest.fixture(scope="module")
def engine(ggufs, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDEC_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return assemble.build_engine(LoadSpec(str(ggufs[0]), str(ggufs[1]), runtime="llamacpp", threads=1))


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _alone(engine, request):
    """The single-sequence loop's answer: (generation, its steps)."""
    generation = engine.generate(request)
    return generation, list(generation)


def _drain(batch: BatchEngine) -> list[int]:
    """Rounds until every sequence has ended; the number of sequences decoding in each round."""
    widths = []
    while batch.active:
        widths.append(batch.decoding)
        batch.round()
    return widths


# --------------------------------------------------------------------------- the batched forward

def test_one_decode_gives_each_sequence_its_own_logits_and_rolls_back_one(ggufs):
    runner = LlamaCppRunner(ggufs[0], n_ctx=512, threads=1)
    batch = LlamaCppBatch(runner, 3)
    a, b = _ids(20, runner.vocab_size, 0), _ids(9, runner.vocab_size, 1)
    batch.forward([Part(0, tuple(a[:14])), Part(2, tuple(b[:8]))], logits=False)
    got_a, got_b = (x.clone() for x in batch.forward([Part(0, tuple(a[14:])), Part(2, tuple(b[8:]))]))
    assert got_a.shape == (6, runner.vocab_size) and got_b.shape == (1, runner.vocab_size)
    assert [batch.kv_length(s) for s in range(3)] == batch.lengths == [20, 0, 9]
    for ids, got, cut in ((a, got_a, 14), (b, got_b, 8)):
        runner.reset()
        runner.prefill(torch.tensor(ids[:cut]))
        alone = runner.forward(torch.tensor(ids[cut:])).clone()
        assert torch.equal(got.argmax(-1), alone.argmax(-1))
        assert (got - alone).abs().max() < 1e-2 * alone.abs().max()
    batch.rollback(0, 16)  # one sequence's cells past 16 go; its neighbour keeps all of its own
    assert batch.kv_length(0) == 16 and batch.kv_length(2) == 9
    (last,) = batch.forward([Part(0, tuple(a[16:]), outputs=1)])  # only the row that is read
    assert last.shape == (1, runner.vocab_size) and torch.equal(last[0].argmax(), got_a[-1].argmax())
    batch.reset(2)
    assert batch.kv_length(2) == 0 and batch.lengths == [20, 0, 0]


def test_the_pool_grows_and_keeps_every_sequence(ggufs):
    runner = LlamaCppRunner(ggufs[0], n_ctx=512, threads=1)
    batch = LlamaCppBatch(runner, 4)
    seqs = [_ids(400, runner.vocab_size, seed) for seed in range(3)]
    batch.forward([Part(i, tuple(s[:300])) for i, s in enumerate(seqs)], logits=False)
    assert batch.cells == 1024
    batch.forward([Part(i, tuple(s[300:399])) for i, s in enumerate(seqs)], logits=False)  # 1,197 cells
    assert batch.cells == 2048 and [batch.kv_length(s) for s in range(4)] == [399, 399, 399, 0]
    outs = [x.clone() for x in batch.forward([Part(i, (s[399],)) for i, s in enumerate(seqs)])]
    for ids, got in zip(seqs, outs):
        runner.reset()
        runner.prefill(torch.tensor(ids[:399]))
        assert torch.equal(got.argmax(-1), runner.forward(torch.tensor(ids[399:])).argmax(-1))
    runner.set_threads(2)  # the batch's context follows the runner's threads
    batch.forward([Part(3, (5,))])
    assert llama_cpp.llama_n_threads(batch._ctx) == 2


# --------------------------------------------------------------------------- the batched step on llama.cpp

MIXED = [
    GenerationRequest(prompt="def add(a, b):", mode="speculative", k=3, max_new_tokens=24),
    GenerationRequest(prompt="class Stack:", mode="standard", max_new_tokens=5),  # ends first
    GenerationRequest(prompt="hello hello hello hello", mode="speculative", k=4, proposer="ngram", max_new_tokens=20),
    GenerationRequest(messages=(Message("user", "x = [1, 2"),), mode="speculative", k=6, proposer="draft+ngram",
                      max_new_tokens=28),
]
LATE = [  # admitted once the short one has ended: into its row, and into the row left free
    GenerationRequest(prompt="for i in range(10):", mode="speculative", k=2, max_new_tokens=18),
    GenerationRequest(prompt="import os\n", mode="standard", max_new_tokens=12),
]


def test_each_sequence_answers_what_it_answers_alone(engine):
    """Greedy: standard, draft, n-gram and draft+ngram sequences of different K and lengths in one batch, one
    ending early and two admitted midway, each decode the single-sequence loop's tokens, drafts and accepts."""
    batch = BatchEngine(engine, 4)
    assert isinstance(batch.target, LlamaCppBatch) and isinstance(batch.draft, LlamaCppBatch)
    seqs = [batch.add(r, engine.encode(r), threading.Event()) for r in MIXED[:3]]
    widths = []
    while seqs[1].summary is None:
        widths.append(len(batch.active))
        batch.round()
    late = [batch.add(r, engine.encode(r), threading.Event()) for r in (MIXED[3], LATE[0])]
    assert late[0].slot == seqs[1].slot == 1, "the ended sequence's row, the lowest free one, is taken first"
    while not batch.free:
        widths.append(len(batch.active))
        batch.round()
    late.append(batch.add(LATE[1], engine.encode(LATE[1]), threading.Event()))
    widths += _drain(batch)
    assert widths[0] == 3 and max(widths) == 4 and widths[-1] < 4
    for seq in [*seqs, *late]:
        generation, steps = _alone(engine, seq.request)
        assert seq.token_ids == generation.token_ids, seq.request
        assert [(s.proposed, s.accepted) for s in seq.steps] == [(s.proposed, s.accepted) for s in steps]
        assert seq.summary.text == generation.summary.text == "".join(s.text for s in seq.steps)
    assert [s.summary.new_tokens for s in seqs[:2]] == [24, 5]
    assert all(batch.target.kv_length(slot) == 0 for slot in range(4)), "ended sequences leave no cells"


def test_adaptive_k_in_the_batch_stays_the_target_s_answer(engine):
    requests = [GenerationRequest(prompt="def add(a, b):", k=K_AUTO, max_new_tokens=20),
                GenerationRequest(prompt="hello hello hello hello", mode="auto", proposer="draft+ngram",
                                  max_new_tokens=20)]
    batch = BatchEngine(engine, 2)
    seqs = [batch.add(r, engine.encode(r), threading.Event()) for r in requests]
    _drain(batch)
    for seq, request in zip(seqs, requests):
        assert seq.token_ids == _alone(engine, replace(request, mode="standard"))[0].token_ids


SAMPLED = [
    GenerationRequest(prompt="def add(a, b):", mode="speculative", k=3, max_new_tokens=20,
                      sampling=Sampling(temperature=0.8, seed=7)),
    GenerationRequest(prompt="hello hello hello hello", mode="speculative", k=4, proposer="ngram", max_new_tokens=16,
                      sampling=Sampling(temperature=1.0, top_p=0.9, seed=3)),
    GenerationRequest(prompt="class Stack:", mode="standard", max_new_tokens=14,
                      sampling=Sampling(temperature=0.7, top_k=20, seed=11)),
]


def test_a_sampled_sequence_answers_in_a_batch_what_it_answers_alone_in_it(engine):
    """Its random draws come from its own generator: neighbours (greedy or sampled) change nothing."""
    lone = []
    for request in SAMPLED:
        batch = BatchEngine(engine, 1)
        lone.append(batch.add(request, engine.encode(request), threading.Event()))
        _drain(batch)
    batch = BatchEngine(engine, 5)
    together = [batch.add(r, engine.encode(r), threading.Event()) for r in (*SAMPLED, MIXED[0], MIXED[2])]
    assert max(_drain(batch)) == 5
    for seq, alone in zip(together, lone):
        assert seq.token_ids == alone.token_ids
        assert [(s.proposed, s.accepted, s.added) for s in seq.steps] == [(s.proposed, s.accepted, s.added)
                                                                          for s in alone.steps]
    assert together[3].token_ids == _alone(engine, MIXED[0])[0].token_ids  # the greedy neighbours stay exact
    other = BatchEngine(engine, 1)
    reseeded = other.add(replace(SAMPLED[0], sampling=Sampling(temperature=0.8, seed=8)),
                         engine.encode(SAMPLED[0]), threading.Event())
    _drain(other)
    greedy = _alone(engine, replace(SAMPLED[0], sampling=Sampling()))[0]
    assert reseeded.token_ids != lone[0].token_ids != greedy.token_ids


def test_cancelling_one_sequence_leaves_the_others_exact(engine):
    batch = BatchEngine(engine, 3)
    cancel = threading.Event()
    keep = [MIXED[0], MIXED[3]]
    seqs = [batch.add(r, engine.encode(r), e) for r, e in ((keep[0], threading.Event()), (MIXED[2], cancel),
                                                            (keep[1], threading.Event()))]
    batch.round()
    batch.round()
    cancel.set()
    ended = batch.round()
    assert (seqs[1], None) in ended and seqs[1].summary.stop_reason == "cancelled"
    assert batch.target.kv_length(seqs[1].slot) == 0 and seqs[1].slot in batch.free
    _drain(batch)
    for seq, request in zip((seqs[0], seqs[2]), keep):
        assert seq.token_ids == _alone(engine, request)[0].token_ids


# --------------------------------------------------------------------------- the server

def test_the_scheduler_batches_llamacpp_requests(engine):
    """Concurrent requests to `serve` on the llama.cpp runtime are verified together, each answer its own."""
    prompts = ["def add(a, b):", "class Stack:", "import os\n", "hello hello"]
    expected = {p: _alone(engine, GenerationRequest(prompt=p, mode="speculative", k=3, max_new_tokens=12))[0]
                .summary.text for p in prompts}
    got: dict[str, str] = {}
    errors: list[BaseException] = []
    widest = [0]
    forward = LlamaCppBatch.forward

    def spy(decoder, parts, logits=True):
        widest[0] = max(widest[0], len(parts))
        return forward(decoder, parts, logits)

    with serving(engine) as running:
        assert isinstance(running.scheduler.batch.target, LlamaCppBatch)
        client = openai.OpenAI(base_url=running.base_url, api_key="none", max_retries=0, timeout=60.0)

        def ask(p: str) -> None:
            try:
                got[p] = client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        LlamaCppBatch.forward = spy
        try:
            threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60.0)
        finally:
            LlamaCppBatch.forward = forward
    assert not errors and got == expected
    assert widest[0] > 1, "requests in flight together were decoded in one llama_decode"
