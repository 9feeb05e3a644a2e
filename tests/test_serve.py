"""`serve` against the official openai client, on loopback, with the tiny random pair (float32)."""
from __future__ import annotations

import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.serve.stops import StopCutter
from engine.decoding.batch import BatchEngine
from engine.runners.batched import BatchedDecoder
from engine.types import GenerationRequest, Message, Sampling
from tests.engine_fixtures import tiny_engine
from tests.serve_fixtures import MODEL, serving, wait_until
from tests.serve_fixtures import Slow as _Slow

QUESTION = "def add(a, b):"
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return tiny_engine(*tiny_pair)


@pytest.fixture(scope="module")
def server(engine):
    with serving(engine) as running:
        yield running


def _client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=kw.pop("api_key", "none"), max_retries=0,
                         timeout=TIMEOUT, **kw)


def _alone(engine, *, prompt: str | None = None, messages=(), max_new_tokens: int = 32) -> str:
    """The engine's greedy answer served by nobody: what every served answer must equal."""
    gen = engine.generate(GenerationRequest(messages=messages, prompt=prompt, mode="speculative", k=3,
                                            max_new_tokens=max_new_tokens, sampling=Sampling()))
    for _ in gen:
        pass
    return gen.summary.text


def _metrics(server) -> dict[str, float]:
    text = httpx.get(f"{server.root}/metrics", timeout=TIMEOUT).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(sample.labels.items())
                                        if k != "model_name")
            out[key] = sample.value
    return out


# --------------------------------------------------------------------------- answers

def test_chat_whole_answer_equals_the_engine_alone(server, engine):
    reply = _client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                                    max_tokens=24, temperature=0)
    assert reply.choices[0].message.content == _alone(engine, messages=(Message("user", QUESTION),),
                                                      max_new_tokens=24)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens == len(engine.encode(GenerationRequest(messages=(Message("user", QUESTION),))))
    extra = reply.model_extra
    assert {"draft_n", "draft_n_accepted", "prompt_n", "prompt_ms", "prompt_per_second", "predicted_n",
            "predicted_ms", "predicted_per_second"} <= set(extra["timings"])
    assert 0 <= extra["timings"]["draft_n_accepted"] <= extra["timings"]["draft_n"]
    assert extra["specdec"]["tokens_per_target_forward"] >= 1.0


def test_chat_stream_carries_the_same_text_and_every_token_status(server, engine):
    chunks = list(_client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=24, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == _alone(engine, messages=(Message("user", QUESTION),), max_new_tokens=24)
    steps = [c.model_extra["specdec"] for c in chunks if c.choices and "tokens" in (c.model_extra.get("specdec") or {})]
    assert steps and {t["status"] for s in steps for t in s["tokens"]} <= {"accepted", "rejected", "corrected",
                                                                         "bonus", "target"}
    assert any(t["q"] is not None for s in steps for t in s["tokens"]), "drafted tokens carry q"
    # A draft tree's fields are there for every step and token (0 and null for this chain-drafting pair).
    assert all(s["tree_width"] == s["tree_depth"] == 0 for s in steps)
    assert all("branch" in t and "source" in t for s in steps for t in s["tokens"])
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1 and "draft_n" in final[0].model_extra["timings"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_stop_strings_cut_the_same_when_steps_come_a_round_late(server, engine):
    """As on a GPU (the batch describes each round in the next): a stop string cancels the sequence while its
    Step waits; the summary comes with that Step, once."""
    server.scheduler.batch.overlap = True  # the worker is idle between tests
    try:
        test_stop_strings_cut_exactly_across_token_boundaries(server, engine)
    finally:
        server.scheduler.batch.overlap = False


def test_completions_whole_and_streamed(server, engine):
    client = _client(server)
    whole = client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=20)
    streamed = "".join(c.choices[0].text for c in client.completions.create(model=MODEL, prompt=QUESTION,
                                                                             max_tokens=20, stream=True))
    assert whole.choices[0].text == streamed == _alone(engine, prompt=QUESTION, max_new_tokens=20)


def test_stop_strings_cut_exactly_across_token_boundaries(server, engine):
    full = _alone(engine, prompt=QUESTION, max_new_tokens=32)
    stop = full[7:11]
    assert len(stop) == 4 and full.index(stop) == 7
    client = _client(server)
    whole = client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=32, stop=[stop, "\x00never"])
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=QUESTION, max_tokens=32, stop=stop, stream=True))
    assert whole.choices[0].text == streamed == full[:7]
    assert whole.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("pieces", [["ab", "cS", "TOPd"], ["abcS", "T", "O", "P"], ["abc", "STOP"], ["abcSTO", "P!"]])
def test_stop_cutter_holds_back_what_may_start_a_stop(pieces):
    cut = StopCutter(("STOP",))
    sent = "".join(cut.feed(p) for p in pieces) + cut.flush()
    assert sent == "abc" and cut.stopped


def test_stop_cutter_releases_a_false_start():
    cut = StopCutter(("STOP", "xyz"))
    assert cut.feed("aST") == "a"
    assert cut.feed("Ox") == "STO"  # "STOx" cannot become STOP; "x" may start xyz
    assert cut.feed("q") == "xq"
    assert cut.feed("xy") == "" and cut.flush() == "xy" and not cut.stopped


def test_concurrent_requests_each_get_their_single_request_answer(server, engine):
    prompts = [QUESTION, "class Stack:", "import os\n", "for i in range(10):", "hello", "x = [1, 2"]
    expected = {p: _alone(engine, prompt=p, max_new_tokens=16) for p in prompts}
    got: dict[str, str] = {}
    errors: list[BaseException] = []

    def ask(p: str) -> None:
        try:
            got[p] = _client(server).completions.create(model=MODEL, prompt=p, max_tokens=16).choices[0].text
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    widest = [0]
    forward = BatchedDecoder.forward

    def spy(decoder, parts, logits=True):
        widest[0] = max(widest[0], len(parts))
        return forward(decoder, parts, logits)

    BatchedDecoder.forward = spy
    try:
        threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
    finally:
        BatchedDecoder.forward = forward
    assert not errors and got == expected
    assert widest[0] > 1, "requests in flight together were verified in one forward"


def test_a_sampled_request_is_decoded_in_the_batch(server, engine):
    """temperature > 0 is batched too: it answers what the batch answers it alone, whatever runs beside it."""
    batch = server.scheduler.batch
    added: list[GenerationRequest] = []
    add = batch.add
    batch.add = lambda request, *a: added.append(request) or add(request, *a)
    try:
        client = _client(server)
        greedy = threading.Thread(target=lambda: client.completions.create(model=MODEL, prompt=QUESTION,
                                                                           max_tokens=30))
        greedy.start()
        sampled = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "import os"}],
                                                 max_tokens=16, temperature=0.8, top_p=0.95, seed=7)
        greedy.join(TIMEOUT)
    finally:
        del batch.add
    request = next(r for r in added if not r.sampling.greedy)
    assert request.sampling == Sampling(temperature=0.8, top_p=0.95, seed=7) and request.mode == "speculative"
    alone = BatchEngine(engine, 1)
    seq = alone.add(request, engine.encode(request), threading.Event())
    while alone.active:
        alone.round()
    assert sampled.choices[0].message.content == seq.summary.text
    assert sampled.choices[0].finish_reason in ("stop", "length")
    assert sampled.usage.completion_tokens == seq.summary.new_tokens > 0
    assert sampled.model_extra["timings"]["draft_n"] > 0


def test_metrics_count_what_the_answers_report(server):
    before = _metrics(server)
    reply = _client(server).completions.create(model=MODEL, prompt="class Stack:", max_tokens=24)
    after = _metrics(server)
    timings = reply.model_extra["timings"]

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("vllm:spec_decode_num_draft_tokens_total") == timings["draft_n"] > 0
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == timings["draft_n_accepted"]
    assert delta("specdec:draft_n_total") == timings["draft_n"]
    by_pos = sum(delta(f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}") for i in range(12))
    assert by_pos == timings["draft_n_accepted"]
    assert delta("vllm:generation_tokens_total") == reply.usage.completion_tokens
    assert delta("llamacpp:prompt_tokens_total") == reply.usage.prompt_tokens
    assert after["vllm:num_requests_waiting"] == 0 and "llamacpp:requests_processing" in after


def test_models_and_health(server):
    assert [m.id for m in _client(server).models.list()] == [MODEL]
    assert httpx.get(f"{server.root}/health", timeout=TIMEOUT).json() == {"status": "ok"}


# --------------------------------------------------------------------------- refusals

def test_malformed_json_is_a_400_with_an_openai_error_body(server):
    r = httpx.post(f"{server.base_url}/chat/completions", content=b'{"model": "tiny-target", "messages": [',
                   headers={"content-type": "application/json"}, timeout=TIMEOUT)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error" and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{server.base_url}/chat/completions", json={"messages": [], "max_tokens": -3}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["message"]


def test_a_prompt_over_the_context_is_a_400(server):
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).completions.create(model=MODEL, prompt="hello " * 2000, max_tokens=8)
    assert e.value.code == "context_length_exceeded"


def test_an_unknown_model_is_a_404(server):
    with pytest.raises(openai.NotFoundError) as e:
        _client(server).chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "model_not_found"


def test_unsupported_fields_are_refused_not_ignored(server):
    with pytest.raises(openai.BadRequestError):
        _client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2)


def test_the_api_key_is_checked(engine):
    with serving(engine, api_key="sesame") as running:
        with pytest.raises(openai.AuthenticationError):
            _client(running, api_key="wrong").models.list()
        reply = _client(running, api_key="sesame").completions.create(model=MODEL, prompt="hi", max_tokens=4)
        assert reply.choices[0].text is not None
        assert httpx.get(f"{running.root}/health", timeout=TIMEOUT).status_code == 200


def test_a_client_that_disconnects_cancels_its_generation(engine):
    tickets = []
    with _Slow(engine, 0.05), serving(engine) as running:
        submit = running.scheduler.submit
        running.scheduler.submit = lambda *a: tickets.append(submit(*a)) or tickets[-1]
        with httpx.stream("POST", f"{running.base_url}/completions", timeout=TIMEOUT,
                          json={"model": MODEL, "prompt": QUESTION, "max_tokens": 400, "stream": True}) as r:
            next(r.iter_lines())  # the answer has started
        wait_until(lambda: tickets and tickets[0].summary is not None)
        summary = tickets[0].summary
        assert summary.stop_reason == "cancelled" and summary.new_tokens < 400
        wait_until(lambda: running.scheduler.running == 0)
        assert _metrics(running)["specdec:requests_cancelled_total"] == 1


def test_a_full_queue_answers_429(engine):
    gate = threading.Event()
    with _Slow(engine, 0.0, gate), serving(engine, max_seqs=1, queue=0) as running:
        first = threading.Thread(target=lambda: _client(running).completions.create(model=MODEL, prompt=QUESTION,
                                                                                    max_tokens=8))
        first.start()
        wait_until(lambda: running.scheduler.running == 1)  # the one place is taken
        try:
            with pytest.raises(openai.RateLimitError) as e:
                _client(running).completions.create(model=MODEL, prompt="hi", max_tokens=4)
            assert e.value.code == "queue_full"
        finally:
            gate.set()
            first.join(TIMEOUT)
        wait_until(lambda: running.scheduler.waiting == 0 and running.scheduler.running == 0)
        assert _client(running).completions.create(model=MODEL, prompt="hi", max_tokens=4).choices[0].text is not None


# --------------------------------------------------------------------------- the command

def test_serve_bad_options_are_one_line(capsys):
    from app.cli import main

    assert main(["serve", "--port", "70000"]) == 2
    assert main(["serve", "--api-key", "two words"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("specdec-studio: error:") for line in err)


def test_a_taken_port_is_one_line_before_any_model_loads(capsys):
    import socket

    from app.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--target", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"specdec-studio: error: cannot listen on 127.0.0.1:{port}: Address already in use"]


def test_only_loopback_addresses_count_as_this_machine():
    from app.cli.serve import _loopback

    assert _loopback("127.0.0.1") and _loopback("::1") and _loopback("localhost")
    assert not _loopback("0.0.0.0") and not _loopback("192.168.1.4") and not _loopback("example.org")


def test_a_client_that_gives_up_on_a_whole_answer_cancels_it_too(engine):
    tickets = []
    with _Slow(engine, 0.05), serving(engine) as running:
        submit = running.scheduler.submit
        running.scheduler.submit = lambda *a: tickets.append(submit(*a)) or tickets[-1]
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{running.base_url}/completions", timeout=1.0,
                       json={"model": MODEL, "prompt": QUESTION, "max_tokens": 400})
        wait_until(lambda: tickets and tickets[0].summary is not None)
        assert tickets[0].summary.stop_reason == "cancelled" and tickets[0].summary.new_tokens < 400


def test_a_lone_request_runs_through_the_loop_and_the_next_ones_join_the_batch(engine):
    """alone_in_loop (an option; off by default): a request to an idle server takes the single-sequence loop;
    requests arriving while it runs are batched beside it."""
    from engine.serving.scheduler import Scheduler

    prompts = [QUESTION, "class Stack:", "x = [1, 2"]
    expected = {p: _alone(engine, prompt=p, max_new_tokens=16) for p in prompts}
    scheduler = Scheduler(engine, max_seqs=4, alone_in_loop=True)
    batch, added, got = scheduler.batch, [], {}
    add = batch.add
    batch.add = lambda request, *a: added.append(request.prompt) or add(request, *a)

    def submit(p: str):
        request = GenerationRequest(prompt=p, mode="speculative", k=3, max_new_tokens=16, sampling=Sampling())
        return scheduler.submit(request, lambda kind, payload: got.__setitem__(p, payload) if kind != "step" else None)

    try:
        submit(prompts[0])
        wait_until(lambda: prompts[0] in got)
        assert added == [] and got.pop(prompts[0]).text == expected[prompts[0]]
        gate = threading.Event()
        with _Slow(engine, 0.0, gate):
            submit(prompts[0])
            wait_until(lambda: scheduler.running == 1)  # the lone one, held at its first forward
            for p in prompts[1:]:
                submit(p)
            gate.set()
            wait_until(lambda: len(got) == len(prompts))
    finally:
        del batch.add
        scheduler.close()
    assert added == prompts[1:], "the requests that came while it ran were batched"
    assert {p: s.text for p, s in got.items()} == expected
