"""The prompt read in chunks by a draft head (eager and static runners) and on the llama.cpp runtime: the same
answers and drafts as in one piece, and a Stop between chunks that leaves the engine as a fresh one."""
from __future__ import annotations

import threading

import pytest

from engine.decoding import prefill
from engine.types import GenerationRequest, PrefillProgress
from tests.head_fixtures import head_engine

WORDS = "def add(a, b): return a + b. The quick brown fox jumps over the lazy dog. hello world "


@pytest.fixture
def smallest_chunks(monkeypatch):
    monkeypatch.setattr(prefill, "CHUNK_S", 1e-9)


def _run(engine, request, cancel=None):
    """(committed ids, drafted ids per step, progress events, summary)."""
    events: list[PrefillProgress] = []
    generation = engine.generate(request, cancel, events.append)
    steps = list(generation)
    tokens = [t.token_id for s in steps for t in s.tokens if t.status != "rejected"]
    return tokens, [s.proposed for s in steps], events, generation.summary


def _whole(engine, request):
    with pytest.MonkeyPatch.context() as m:
        m.setattr(prefill, "CHUNK_S", 1e9)
        m.setattr(prefill, "FIRST_CHUNK", 10**9)
        return _run(engine, request)


def _stopped_at(part: str, after: int):
    cancel = threading.Event()

    def watch(progress: PrefillProgress) -> None:
        if progress.part == part and progress.done >= after:
            cancel.set()
    return cancel, watch


# --------------------------------------------------------------------------- the draft head


@pytest.fixture(scope="module", params=["eager", "static"])
def make_head_engine(request, tiny_head):
    return lambda: head_engine(tiny_head.target, tiny_head.head, static=request.param == "static")


def _head_request(prompt: str = WORDS * 4) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, mode="speculative", proposer="head", k=4, max_new_tokens=24)


def test_the_head_drafts_the_same_after_a_prompt_read_in_chunks(make_head_engine, smallest_chunks):
    engine = make_head_engine()
    whole = _whole(engine, _head_request())
    tokens, drafts, events, _ = _run(engine, _head_request())
    assert tokens == whole[0]
    # The same drafts: the head read every prompt row, gathered over the target's chunks.
    assert drafts == whole[1]
    assert sum(e.part == "target" for e in events) > 5 and sum(e.part == "head" for e in events) > 5


@pytest.mark.parametrize("part", ["target", "head"])
def test_a_stop_while_the_head_reads_leaves_a_fresh_engine(make_head_engine, smallest_chunks, part):
    used = make_head_engine()
    cancel, watch = _stopped_at(part, 30)
    generation = used.generate(_head_request(), cancel, watch)
    assert list(generation) == [] and generation.summary.stop_reason == "cancelled"
    fresh = make_head_engine()
    for request in (_head_request(WORDS * 2), _head_request()):
        assert _run(used, request)[:2] == _run(fresh, request)[:2]


# --------------------------------------------------------------------------- llama.cpp


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from tests.tiny_gguf import save_gguf_pair

    return save_gguf_pair(tmp_path_factory.mktemp("llamacpp"), noise=0.02, seed=0)


@pytest.fixture(scope="module")
def make_llamacpp(ggufs, tmp_path_factory):
    import os

    from engine import assemble
    from engine.loadspec import LoadSpec

    os.environ["SPECDEC_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    return lambda: assemble.build_engine(LoadSpec(str(ggufs[0]), str(ggufs[1]), runtime="llamacpp", threads=1))


def _cpp_request(mode: str, prompt: str = WORDS * 4) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, mode=mode, proposer="draft", k=4, max_new_tokens=24)


def test_llamacpp_answers_and_drafts_the_same_in_chunks(make_llamacpp, smallest_chunks):
    engine = make_llamacpp()
    for mode in ("standard", "speculative"):
        whole = _whole(engine, _cpp_request(mode))
        tokens, drafts, events, summary = _run(engine, _cpp_request(mode))
        assert (tokens, drafts) == whole[:2]
        for part in ("target", "draft") if mode == "speculative" else ("target",):
            done = [e.done for e in events if e.part == part]
            assert len(done) > 5 and done[0] == 0 and done[-1] == summary.prompt_tokens - 1
            assert all(b > a for a, b in zip(done, done[1:]))


@pytest.mark.parametrize("part", ["target", "draft"])
def test_a_stop_in_llamacpps_prefill_leaves_a_fresh_engine(make_llamacpp, smallest_chunks, part):
    used = make_llamacpp()
    cancel, watch = _stopped_at(part, 30)
    generation = used.generate(_cpp_request("speculative"), cancel, watch)
    assert list(generation) == [] and generation.summary.stop_reason == "cancelled"
    runner = used.target_runner if part == "target" else used.draft_runner
    assert runner.kv_length() <= 30 + prefill.MIN_CHUNK  # llama.cpp itself holds only what was read
    fresh = make_llamacpp()
    for request in (_cpp_request("speculative", WORDS * 2), _cpp_request("speculative"), _cpp_request("standard")):
        assert _run(used, request)[:2] == _run(fresh, request)[:2]


def test_a_reserved_llamacpp_context_never_grows_while_the_prompt_is_read_in_chunks(ggufs, monkeypatch):
    import torch

    from engine.runners import llamacpp
    from engine.runners.llamacpp import LlamaCppRunner

    monkeypatch.setattr(llamacpp, "ANSWER_ROOM", 0)
    runner = LlamaCppRunner(ggufs[0], threads=1, min_cells=16)
    made = []
    make = runner._make_context
    monkeypatch.setattr(runner, "_make_context", lambda cells: (made.append(cells), make(cells)))
    ids = torch.randint(3, runner.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
    runner.reserve(300)
    for start in range(0, 300, 8):
        runner.prefill(ids[start:start + 8])
    assert made == [512] and runner.kv_length() == 300  # one new context, made before the first chunk
