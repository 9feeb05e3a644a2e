"""The prompt read in chunks: the same output as in one piece, progress that ends at the total, and a Stop
between chunks that leaves every cache as a fresh engine's (torch runtime, tiny models)."""
from __future__ import annotations

import threading

import pytest
import torch

from engine.decoding import prefill
from engine.decoding.prefill import Feed
from engine.types import GenerationRequest, ModelInfo, PrefillProgress
from tests.engine_fixtures import tiny_engine

WORDS = "def add(a, b): return a + b. The quick brown fox jumps over the lazy dog. 快速排序 🙂 for i in range(10): "
PROMPT = WORDS * 5  # about 200 tokens of the tiny tokenizer


@pytest.fixture
def smallest_chunks(monkeypatch):
    """Every chunk as small as it gets (MIN_CHUNK tokens): many chunks even on a tiny, fast model."""
    monkeypatch.setattr(prefill, "CHUNK_S", 1e-9)


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return tiny_engine(*tiny_pair)


REQUESTS = {
    "standard": dict(mode="standard"),
    "draft": dict(mode="speculative", proposer="draft", k=4),
    "draft+ngram": dict(mode="speculative", proposer="draft+ngram", k=3),
    "sampled": dict(mode="speculative", proposer="draft", k=4, sampling={"temperature": 0.8, "seed": 3}),
}


def _request(name: str, prompt: str = PROMPT, max_new: int = 24) -> GenerationRequest:
    from engine.types import Sampling

    kw = dict(REQUESTS[name])
    sampling = Sampling(**kw.pop("sampling", {}))
    return GenerationRequest(prompt=prompt, max_new_tokens=max_new, sampling=sampling, **kw)


def _run(engine, request, cancel=None) -> tuple[list[int], list[PrefillProgress], object]:
    events: list[PrefillProgress] = []
    generation = engine.generate(request, cancel, events.append)
    tokens = [t.token_id for s in generation for t in s.tokens if t.status != "rejected"]
    return tokens, events, generation.summary


def _whole(engine, request) -> list[int]:
    rates = dict(engine.prefill_rates)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(prefill, "CHUNK_S", 1e9)
        m.setattr(prefill, "FIRST_CHUNK", 10**9)
        tokens, events, _ = _run(engine, request)
    engine.prefill_rates.clear()
    engine.prefill_rates.update(rates)
    assert len([e for e in events if e.part == "target"]) == 2, "one chunk: the start and the end"
    return tokens


@pytest.mark.parametrize("name", list(REQUESTS))
def test_output_in_chunks_equals_the_whole_prompt_at_once(engine, smallest_chunks, name):
    request = _request(name)
    whole = _whole(engine, request)
    tokens, events, summary = _run(engine, request)
    assert tokens == whole
    assert sum(e.part == "target" for e in events) > 8, "the prompt was read in many chunks"
    if name != "standard":
        assert any(e.part == "draft" for e in events), "the draft model read the prompt in chunks too"
    assert summary.stop_reason != "cancelled"


def test_progress_is_monotone_from_zero_to_the_total_for_each_model(engine, smallest_chunks):
    request = _request("draft")
    _, events, summary = _run(engine, request)
    total = summary.prompt_tokens - 1  # the last prompt token is fed by the first step
    for part in ("target", "draft"):
        done = [e.done for e in events if e.part == part]
        assert done[0] == 0 and done[-1] == total
        assert all(b > a for a, b in zip(done, done[1:])), done
        assert {e.total for e in events if e.part == part} == {total}
    # The target reads first, the draft before its first draft.
    assert [e.part for e in events].index("draft") > max(i for i, e in enumerate(events) if e.part == "target")


def _cancel_at(part: str, after: int):
    cancel = threading.Event()

    def watch(progress: PrefillProgress) -> None:
        if progress.part == part and progress.done >= after:
            cancel.set()
    return cancel, watch


@pytest.mark.parametrize("part,name", [("target", "standard"), ("target", "draft"), ("draft", "draft"),
                                       ("draft", "draft+ngram")])
def test_a_stop_between_chunks_ends_it_and_the_next_answer_is_a_fresh_engines(tiny_pair, smallest_chunks,
                                                                              part, name):
    used = tiny_engine(*tiny_pair)
    cancel, watch = _cancel_at(part, 40)
    events: list[PrefillProgress] = []

    def progress(p: PrefillProgress) -> None:
        events.append(p)
        watch(p)

    generation = used.generate(_request(name), cancel, progress)
    steps = list(generation)
    assert generation.summary.stop_reason == "cancelled"
    if name != "draft+ngram":  # there n-gram rounds may come before the draft model first drafts
        assert steps == [] and generation.summary.new_tokens == 0
    mine = [e for e in events if e.part == part]
    assert mine[-1].done < mine[-1].total, "stopped before the prompt was read"
    assert mine[-1].done <= 40 + prefill.MIN_CHUNK, "stopped at the next chunk"
    # Another prompt, and the same one again, on the used engine: exactly a fresh engine's answers.
    fresh = tiny_engine(*tiny_pair)
    for request in (_request("draft", prompt=WORDS * 3), _request(name), _request("standard")):
        assert _run(used, request)[0] == _run(fresh, request)[0]


def test_a_stop_before_the_first_chunk_reads_nothing(engine):
    cancel = threading.Event()
    cancel.set()
    tokens, events, summary = _run(engine, _request("draft"), cancel)
    assert tokens == [] and summary.stop_reason == "cancelled"
    assert [(e.part, e.done) for e in events] == [("target", 0)]


def test_time_to_first_token_is_in_the_summary_and_the_lines(engine):
    from app.cli.common import summary_line
    from widgets.stats_line import format_stats_line

    request = _request("draft")
    _, _, summary = _run(engine, request)
    assert 0 < summary.prefill_s <= summary.first_token_s <= summary.seconds
    assert f"first token after {summary.first_token_s:.2f} s" in summary_line(summary)
    assert f"first token {summary.first_token_s:.1f} s" in format_stats_line(summary, request)


# --------------------------------------------------------------------------- chunk sizes


def test_chunks_take_about_half_a_second_at_the_measured_speed():
    feed = Feed({"target": 1000.0}, torch.device("cpu"))
    assert feed.chunk("target", 5000) == 500  # 0.5 s at 1,000 tokens/s
    assert feed.chunk("target", 700) == 700  # under 1.5 chunks left: all of it, no short tail
    assert feed.chunk("draft", 5000) == prefill.FIRST_CHUNK  # nothing measured for the draft
    fast = Feed({"target": 50_000.0}, torch.device("cpu"))  # a GPU: the whole prompt at once
    assert fast.chunk("target", 4449) == 4449


def test_the_first_chunk_is_sized_from_the_costs_measured_at_load(engine):
    info = ModelInfo(target_name="t", draft_name="d", device="cpu", dtype="float32", fast_path="eager",
                     vocab_size=10, draft_ms=4.0, target_ms=tuple((w, 10.0 * w) for w in range(1, 14)))
    saved = engine.info
    try:
        engine.info = info
        assert engine.prefill_estimate("target") == pytest.approx(100.0)  # 13 rows in 130 ms
        assert engine.prefill_estimate("draft") == pytest.approx(250.0)
        assert engine.prefill_estimate("head") is None
    finally:
        engine.info = saved


def test_the_speed_measured_is_kept_for_the_next_prompt(engine):
    engine.prefill_rates.clear()
    _run(engine, _request("draft"))
    assert engine.prefill_rates["target"] > 0 and engine.prefill_rates["draft"] > 0
