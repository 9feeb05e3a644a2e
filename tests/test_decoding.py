"""The engine's math: greedy equality, the output distribution of speculative sampling, rollback."""
from __future__ import annotations

import random
import threading

import pytest
import torch
from scipy import stats as scipy_stats

from engine.decoding.sampling import accept_draft, process
from engine.errors import GenerationError
from engine.limits import K_MAX
from engine.types import GenerationRequest, Message, Sampling
from tests.engine_fixtures import tiny_engine


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return tiny_engine(*tiny_pair)


def _prompt(seed: int) -> str:
    rng = random.Random(seed)
    words = ["def", "add", "quick", "fox", "快速", "排序", "🙂", "hello", "world", "(a, b)", "return", "\n"]
    return " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))


def _run(engine, **kw):
    gen = engine.generate(GenerationRequest(**kw))
    steps = list(gen)
    return gen, steps


@pytest.mark.parametrize("k", range(1, 13))
def test_greedy_speculative_equals_standard(engine, k):
    for seed in range(6):
        prompt = _prompt(seed * 13 + k)
        max_new = 5 + (seed * 7 + k) % 29  # cuts land mid-draft for most K
        std, _ = _run(engine, prompt=prompt, mode="standard", max_new_tokens=max_new)
        spec, steps = _run(engine, prompt=prompt, mode="speculative", k=k, max_new_tokens=max_new)
        assert spec.token_ids == std.token_ids, f"K={k} prompt={prompt!r}"
        assert spec.summary.text == std.summary.text
        assert len(spec.token_ids) == max_new or spec.summary.stop_reason == "eos"
        assert sum(s.new_tokens for s in steps) == len(std.token_ids)


def test_eos_inside_a_draft_stops_both_modes_at_the_same_token(engine):
    hits = 0
    for seed in range(8):
        prompt = _prompt(100 + seed)
        saved = engine.eos_ids
        try:
            engine.eos_ids = set()
            free, _ = _run(engine, prompt=prompt, mode="standard", max_new_tokens=24)
            # Pretend this token is EOS: it is then generated at some position <= 9.
            engine.eos_ids = {free.token_ids[9]}
            std, _ = _run(engine, prompt=prompt, mode="standard", max_new_tokens=24)
            for k in (3, 8, 12):
                spec, steps = _run(engine, prompt=prompt, mode="speculative", k=k, max_new_tokens=24)
                assert spec.token_ids == std.token_ids
                assert spec.summary.stop_reason == "eos" and std.summary.stop_reason == "eos"
                last = steps[-1]
                # EOS accepted inside a draft: the tokens after it, and the target's token, are dropped.
                hits += last.added is None
        finally:
            engine.eos_ids = saved
    assert hits > 0, "no case exercised EOS inside an accepted draft"


def test_chat_messages_use_the_template(engine):
    req = GenerationRequest(messages=(Message("system", "be brief"), Message("user", "hello")), max_new_tokens=4)
    ids = engine.encode(req)
    text = engine.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nbe brief") and text.endswith("<|im_start|>assistant\n")


def test_caches_hold_exactly_the_committed_prefix_after_every_step(engine):
    for k in (1, 4, 9):
        gen = engine.generate(GenerationRequest(prompt=_prompt(k), mode="speculative", k=k, max_new_tokens=40))
        for step in gen:
            committed = len(gen.prompt) + step.total_tokens
            assert engine.target_runner.length == committed - 1
            # The draft may lag by the tokens it feeds first next time (never more than two).
            assert committed - 2 <= engine.draft_runner.length <= committed - 1
        # The rolled-back cache must be as good as a fresh one: the next logits match a full forward.
        ids = gen.prompt + gen.token_ids
        with torch.inference_mode():
            fresh = engine.target(torch.tensor([ids])).logits[0, -1]
            cached = engine.target_runner.forward(torch.tensor(ids[-1:]))[-1]
        torch.testing.assert_close(cached, fresh, atol=1e-4, rtol=1e-4)


def test_standard_steps_are_single_target_tokens(engine):
    _, steps = _run(engine, prompt="hello", mode="standard", max_new_tokens=6)
    assert all(s.new_tokens == 1 and s.tokens[0].status == "target" and not s.proposed for s in steps)


def test_a_standard_step_is_timed_as_standard_decoding_queues_it(engine, monkeypatch):
    """With lookahead (a GPU's default) standard decoding queues rounds two ahead, each fed the token the one
    before left on the device: costs.round_parts times width 1 so, and leaves the target's cache as it was."""
    from engine.decoding import costs
    from engine.decoding.loop import Generation

    fed: list = []
    launch = Generation._launch

    def spy(self, proposers, decision, pending, *args, **kwargs):
        fed.append(pending if isinstance(pending, int) else "on the device")
        return launch(self, proposers, decision, pending, *args, **kwargs)

    monkeypatch.setattr(Generation, "_launch", spy)
    length = engine.target_runner.length
    for lookahead, first in ((True, [1, "on the device", "on the device", "on the device"]), (False, [1] * 4)):
        monkeypatch.setattr(engine, "lookahead", lookahead)
        fed.clear()
        timed = costs.round_parts(engine, [1, 3], 3)
        assert len(timed[1]) == len(timed[3]) == 3 and all(v > 0 for _, v in timed[1])
        assert fed[:4] == first and fed[4:] == [1] * 4  # width 3's rounds each start from the committed state
        assert engine.target_runner.length == length


def test_statuses_and_text_are_consistent(engine):
    gen, steps = _run(engine, prompt="快速 排序 🙂", mode="speculative", k=6, max_new_tokens=60,
                      sampling=Sampling(temperature=0.9, seed=3))
    for s in steps:
        statuses = [t.status for t in s.tokens]
        assert statuses.count("accepted") == s.accepted
        assert statuses.count("rejected") == len(s.proposed) - s.accepted
        assert statuses.count("corrected") + statuses.count("bonus") == (s.added is not None)
        assert "".join(t.text for t in s.tokens if t.status != "rejected") == s.text
    full = engine.tokenizer.decode(gen.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert gen.summary.text == full


def test_sampling_is_reproducible_per_seed(engine):
    req = dict(prompt="the quick", mode="speculative", k=4, max_new_tokens=30)
    a, _ = _run(engine, sampling=Sampling(temperature=1.0, seed=7), **req)
    b, _ = _run(engine, sampling=Sampling(temperature=1.0, seed=7), **req)
    c, _ = _run(engine, sampling=Sampling(temperature=1.0, seed=8), **req)
    assert a.token_ids == b.token_ids != c.token_ids


def test_accept_rule_reproduces_p_exactly():
    """Unit level: with x ~ q, the first output token is distributed as p (chi-square)."""
    g = torch.Generator().manual_seed(0)
    v, trials = 6, 20000
    p = torch.softmax(torch.randn(2, v, generator=g) * 1.5, -1)  # [K+1=2, V]
    q = torch.softmax(torch.randn(1, v, generator=g) * 1.5, -1)  # [K=1, V]
    counts = torch.zeros(v)
    for _ in range(trials):
        x = torch.multinomial(q[0], 1, generator=g)  # [1]
        accepted, added, _ = accept_draft(x, q, p, greedy=False, generator=g)
        first = x[0] if accepted.item() >= 1 else added
        counts[first] += 1
    chi2 = scipy_stats.chisquare(counts.numpy(), (p[0] * trials).numpy())
    assert chi2.pvalue > 1e-3, (counts / trials, p[0])


def test_accept_rule_with_point_mass_drafts_reproduces_p():
    """n-gram drafts are deterministic (q = point mass): still lossless."""
    g = torch.Generator().manual_seed(1)
    v, trials = 5, 20000
    p = torch.softmax(torch.randn(2, v, generator=g), -1)
    x = torch.tensor([2])
    counts = torch.zeros(v)
    for _ in range(trials):
        accepted, added, _ = accept_draft(x, None, p, greedy=False, generator=g)
        counts[x[0] if accepted.item() else added] += 1
    assert scipy_stats.chisquare(counts.numpy(), (p[0] * trials).numpy()).pvalue > 1e-3


def test_speculative_sampling_matches_the_targets_processed_distribution(engine):
    """End to end: the joint law of the first two tokens equals the target's processed law.

    Temperature, top-k and top-p are applied to both models; the exact target law is computed
    from its logits and compared with 2,000 speculative samples (chi-square).
    """
    check_sampling_law(engine, "hello world", proposer="draft")


def check_sampling_law(engine, prompt: str, *, proposer: str, messages: tuple = (), trials: int = 2000,
                       count=None) -> int:
    """Asserts that speculative samples of the first two tokens follow the target's processed law (chi-square).

    Shared by every proposer (draft model, draft head): whatever proposes, the output law is the target's.
    Returns how many rounds kept a tree alternative's next token (Step.extra); `count` is handed each
    trial's steps, for what else a caller wants to know happened.
    """
    sampling = dict(temperature=1.3, top_k=5, top_p=0.9)
    request = dict(messages=messages) if messages else dict(prompt=prompt)
    ids = engine.encode(GenerationRequest(**request))
    exact: dict[tuple[int, int], float] = {}
    with torch.inference_mode():
        p1 = process(engine.target(torch.tensor([ids])).logits[0, -1].float(), Sampling(**sampling))
        for t1 in torch.nonzero(p1).flatten().tolist():
            p2 = process(engine.target(torch.tensor([ids + [t1]])).logits[0, -1].float(), Sampling(**sampling))
            for t2 in torch.nonzero(p2).flatten().tolist():
                exact[(t1, t2)] = p1[t1].item() * p2[t2].item()
    counts = {key: 0 for key in exact}
    extras = 0
    for seed in range(trials):
        gen, steps = _run(engine, mode="speculative", k=3, max_new_tokens=2, proposer=proposer,
                          sampling=Sampling(seed=seed, **sampling), **request)
        extras += sum(s.extra is not None for s in steps)
        if count is not None:
            count(steps)
        key = tuple(gen.token_ids)
        assert key in counts, f"sampled {key}, which the processed target law gives probability 0"
        counts[key] += 1
    keys = list(exact)
    observed = [counts[k_] for k_ in keys]
    expected = [exact[k_] * trials for k_ in keys]
    # Pool rare cells so the chi-square approximation holds (expected count >= 5 per cell).
    obs_p, exp_p, rest_o, rest_e = [], [], 0, 0.0
    for o, e in zip(observed, expected):
        if e >= 5:
            obs_p.append(o)
            exp_p.append(e)
        else:
            rest_o, rest_e = rest_o + o, rest_e + e
    if rest_e > 0:
        obs_p.append(rest_o)
        exp_p.append(rest_e)
    scale = sum(obs_p) / sum(exp_p)
    result = scipy_stats.chisquare(obs_p, [e * scale for e in exp_p])
    assert result.pvalue > 1e-3, (result, len(obs_p))
    return extras


def test_cancellation_between_steps(engine):
    cancel = threading.Event()
    gen = engine.generate(GenerationRequest(prompt="hello", mode="speculative", k=3, max_new_tokens=200), cancel)
    steps = []
    for step in gen:
        steps.append(step)
        if len(steps) == 2:
            cancel.set()
    assert len(steps) == 2 and gen.summary.stop_reason == "cancelled"


def test_stop_string_ends_generation_and_is_not_in_the_text(engine):
    free, _ = _run(engine, prompt="hello", mode="standard", max_new_tokens=30)
    needle = free.summary.text[10:13]
    assert needle
    gen, steps = _run(engine, prompt="hello", mode="speculative", k=4, max_new_tokens=30, stop_strings=(needle,))
    assert gen.summary.stop_reason == "stop_string"
    assert needle not in gen.summary.text and free.summary.text.startswith(gen.summary.text)
    assert steps[-1].stop_reason == "stop_string"


@pytest.mark.parametrize(
    "kw",
    [dict(k=-1), dict(k=13), dict(max_new_tokens=0), dict(sampling=Sampling(top_p=0.0)), dict(prompt="")],
)
def test_bad_requests_fail_before_decoding(engine, kw):
    args = dict(prompt="hello", mode="speculative", k=3, max_new_tokens=5)
    args.update(kw)
    with pytest.raises(GenerationError):
        engine.generate(GenerationRequest(**args))


def test_prompt_longer_than_the_context_is_a_clear_error(engine):
    with pytest.raises(GenerationError, match="context"):
        engine.generate(GenerationRequest(prompt="hello " * 600, mode="standard"))


def test_summary_figures(engine):
    gen, steps = _run(engine, prompt="def add", mode="speculative", k=5, max_new_tokens=50)
    s = gen.summary
    assert s.new_tokens == len(gen.token_ids) == 50
    assert s.drafted == sum(len(x.proposed) for x in steps) and s.accepted == sum(x.accepted for x in steps)
    assert s.target_forwards == len(steps)
    assert sum(s.accepted_length_histogram) == len(steps)
    assert abs(s.tokens_per_target_forward - 50 / len(steps)) < 1e-9
    assert len(s.per_position_acceptance) == 5 and all(0 <= a <= 1 for a in s.per_position_acceptance)


def test_detokenizer_never_emits_half_a_character(engine):
    from engine.decoding.detok import REPLACEMENT, Detokenizer

    tok = engine.tokenizer
    text = "快速排序 🙂 quick 排序✨🚀 def add(a, b): 我们"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text) // 2  # multi-byte characters really are split across tokens
    detok = Detokenizer(tok, tok("prompt", add_special_tokens=False)["input_ids"])
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert all(REPLACEMENT not in p for p in pieces), pieces
    assert "".join(pieces) == tok.decode(ids) == text
    assert "" in pieces  # some tokens carried only part of a character and waited for the next


def _trace(engine, lookahead: bool, cancel_after: int | None = None, **kw):
    """Every step's shown tokens and statuses, the committed ids and the summary's stop reason."""
    saved = engine.lookahead
    engine.lookahead = lookahead
    try:
        cancel = threading.Event()
        gen = engine.generate(GenerationRequest(**kw), cancel)
        steps = []
        for step in gen:
            steps.append([(t.token_id, t.status, t.text, round(t.p, 5)) for t in step.tokens] + [step.text])
            if cancel_after is not None and len(steps) == cancel_after:
                cancel.set()
        return steps, gen.token_ids, gen.summary.stop_reason
    finally:
        engine.lookahead = saved


@pytest.mark.parametrize(
    "kw",
    [
        dict(mode="standard"),
        dict(mode="standard", sampling=Sampling(temperature=1.1, top_k=20, top_p=0.9, seed=4)),
        dict(mode="speculative", k=4),
        dict(mode="speculative", k=3, sampling=Sampling(temperature=0.8, top_p=0.95, seed=5)),
        dict(mode="speculative", k=5, proposer="ngram"),
        dict(mode="speculative", k=4, proposer="draft+ngram", sampling=Sampling(temperature=0.7, seed=1)),
    ],
    ids=["std-greedy", "std-sampled", "spec-greedy", "spec-sampled", "ngram", "combined-sampled"],
)
def test_queueing_the_next_round_ahead_changes_nothing(engine, kw):
    """The CUDA loop queues rounds before describing the last one (two ahead for standard); forced on here.

    Same tokens, statuses, probabilities and texts, the same random draws (the generator is used
    in the same order), and EOS, max_new_tokens, stop strings and cancellation end at the same step.
    """
    prompt = "def add(a, b): return a + b\ndef add(a, b):"
    free = _trace(engine, False, prompt=prompt, max_new_tokens=37, **kw)
    assert len(free[1]) >= 12, "a seed whose text is long enough to cut in the middle and to end at its 12th token"
    assert _trace(engine, True, prompt=prompt, max_new_tokens=37, **kw) == free
    text = "".join(step[-1] for step in free[0])
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # ends the generation mid-way
    stopped = _trace(engine, True, prompt=prompt, max_new_tokens=37, stop_strings=(stop,), **kw)
    assert stopped == _trace(engine, False, prompt=prompt, max_new_tokens=37, stop_strings=(stop,), **kw)
    assert stopped[2] == "stop_string"
    ahead = _trace(engine, True, cancel_after=3, prompt=prompt, max_new_tokens=60, **kw)
    assert ahead == _trace(engine, False, cancel_after=3, prompt=prompt, max_new_tokens=60, **kw)
    assert len(ahead[0]) == 3 and ahead[2] == "cancelled"
    saved = engine.eos_ids
    try:
        engine.eos_ids = {free[1][11]}
        eos_ahead = _trace(engine, True, prompt=prompt, max_new_tokens=30, **kw)
        assert eos_ahead == _trace(engine, False, prompt=prompt, max_new_tokens=30, **kw)
        assert eos_ahead[2] == "eos"
    finally:
        engine.eos_ids = saved


@pytest.fixture
def three_cached(engine):
    """The engine with three tokens in the target's cache; its measured costs restored afterwards."""
    engine.target_runner.reset()
    engine.target_runner.forward(torch.tensor([5, 6, 7]))
    saved = engine.info
    try:
        yield engine
    finally:
        engine.info = saved


def test_measured_costs_cover_every_verify_width_and_each_proposer_and_leave_the_caches(three_cached):
    engine = three_cached
    engine.measure_costs(rounds=2)
    widths = [w for w, _ in engine.info.target_ms]
    assert widths == list(range(1, K_MAX + 2)) and all(ms > 0 for _, ms in engine.info.target_ms)
    costs = {c.source: c for c in engine.info.proposer_costs}
    assert set(costs) == {"draft", "ngram"}
    assert costs["draft"].per_token_ms > 0 and engine.info.draft_ms == costs["draft"].per_token_ms
    # Sampled drafts are timed apart (their own propose(), drawing); sampled verifies only on a GPU.
    sampled = {c.source: c for c in engine.info.sampled_costs}
    assert set(sampled) == {"draft", "ngram"} and sampled["draft"].per_token_ms > 0
    assert engine.info.sampled_target_ms == ()
    assert engine.info.measure_s > 0
    assert engine.target_runner.length == 3  # measured past the cached tokens, then rolled back


def test_measuring_again_pools_a_pass_with_those_before_and_leaves_the_caches(three_cached):
    """On a CPU each pass is kept; measure_again adds one and every figure becomes the median of all."""
    import statistics

    engine = three_cached
    engine.measure_costs(rounds=1)
    first = engine.info.measure_s
    assert len(engine.cost_passes) == 1
    engine.measure_again()
    engine.measure_again()
    assert len(engine.cost_passes) == 3 and engine.info.measure_s > first
    for w, ms in engine.info.target_ms:
        assert ms == statistics.median(t[w] for t, _, _ in engine.cost_passes)
    draft = statistics.median(p["draft"].per_token_ms for _, p, _ in engine.cost_passes)
    assert engine.info.draft_ms == draft
    sampled = {c.source: c for c in engine.info.sampled_costs}
    assert sampled["draft"].per_token_ms == statistics.median(p["draft"].per_token_ms for _, _, p in engine.cost_passes)
    assert engine.target_runner.length == 3
