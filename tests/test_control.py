"""The K controller: greedy output is the target's whatever K sequence is chosen; adaptive K decides from costs."""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

import pytest

from engine.decoding.control import PROBE_EVERY, AdaptiveK, FixedK, StepCosts, TuningMemory
from engine.decoding.proposers import Offer
from engine.limits import K_AUTO, K_MAX, TREE_K_MAX
from engine.types import Decision, GenerationRequest, ProposerCost, Sampling
from tests.engine_fixtures import tiny_engine


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return tiny_engine(*tiny_pair)


class ScriptedK:
    """Chooses a random K in 0..K_MAX (and a random proposer among those offering) every step."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.chosen: list[int] = []  # every K chosen (queued rounds may ask and then wait)
        self.ran: list[int] = []  # the K of every round that ran

    def choose(self, offers: Sequence[Offer], room: int) -> Decision:
        usable = [o for o in offers if o.max_tokens > 0]
        k = self.rng.choice([0, 0, 1, 2, 3, 5, 8, K_MAX])
        if not usable or k == 0:
            self.chosen.append(0)
            return Decision(0, None, "no_gain")
        offer = self.rng.choice(usable)
        k = min(k, room, offer.max_tokens)
        self.chosen.append(k)
        return Decision(k, offer.source, "best")

    def observe(self, decision: Decision, *args, **kw) -> None:
        self.ran.append(decision.k)

    def finish(self) -> None:
        pass


def _generate(engine, controller=None, lookahead: bool | None = False, **kw):
    saved = engine.make_controller, engine.lookahead
    if controller is not None:
        engine.make_controller = lambda request: controller
    engine.lookahead = lookahead
    try:
        gen = engine.generate(GenerationRequest(**kw))
        steps = list(gen)
    finally:
        engine.make_controller, engine.lookahead = saved
    return gen, steps


PROMPTS = ["def add(a, b):\n    return a + b\ndef add(a, b):", "hello world quick fox", "快速 排序 🙂 quick"]


@pytest.mark.parametrize(
    "kw",
    [
        dict(mode="speculative", proposer="draft"),
        dict(mode="speculative", proposer="ngram"),
        dict(mode="speculative", proposer="draft+ngram"),
        dict(mode="auto", proposer="draft+ngram"),
        dict(mode="auto", proposer="draft"),
    ],
    ids=["draft", "ngram", "combined", "auto-routed", "auto-draft"],
)
@pytest.mark.parametrize("lookahead", [False, True], ids=["in-order", "queued"])
def test_greedy_output_is_standard_whatever_k_sequence(engine, kw, lookahead):
    """float32 greedy: random K per step, 0 included (a standard round inside the speculative loop)."""
    ran: list[int] = []
    for seed, prompt in enumerate(PROMPTS):
        max_new = 20 + 7 * seed
        std, _ = _generate(engine, prompt=prompt, mode="standard", max_new_tokens=max_new)
        scripted = ScriptedK(seed)
        spec, steps = _generate(engine, scripted, lookahead, prompt=prompt, max_new_tokens=max_new, **kw)
        assert spec.token_ids == std.token_ids, f"K sequence {scripted.chosen}"
        ran += scripted.ran
        # The steps say what was chosen; a standard round is a standard step with one target token.
        assert [s.decision.k for s in steps] == scripted.ran
        for s in steps:
            if s.decision.k == 0:
                assert s.mode == "standard" and not s.proposed and s.tokens[-1].status == "target"
        assert spec.summary.standard_steps == sum(1 for s in steps if s.decision.k == 0)
    assert ran.count(0) >= 3 and sum(k > 0 for k in ran) >= 3, ran


def test_draft_cache_catches_up_after_standard_rounds(engine):
    """After K = 0 rounds the draft model feeds what it missed: its next proposal equals a fresh one."""
    prompt = "hello world quick fox"
    ks = iter([0, 0, 0, 4, 0, 3] + [2] * 50)

    class Sequence_:
        def choose(self, offers, room):
            k = min(next(ks), room)
            return Decision(k, "draft", "best") if k else Decision(0, None, "no_gain")

        def observe(self, *args, **kw):
            pass

        def finish(self):
            pass

    gen, steps = _generate(engine, Sequence_(), prompt=prompt, mode="speculative", proposer="draft",
                           max_new_tokens=20)
    std, _ = _generate(engine, prompt=prompt, mode="standard", max_new_tokens=20)
    assert gen.token_ids == std.token_ids
    committed = len(gen.prompt) + len(gen.token_ids)
    assert committed - 2 <= engine.draft_runner.length <= committed - 1
    # The first drafting step after three standard ones drafted like a draft that had seen them all.
    fourth = steps[3]
    assert fourth.decision.k == 4 and fourth.accepted >= 1  # noise 0.02: the draft agrees when in sync


@pytest.mark.parametrize("mode, k", [("speculative", K_AUTO), ("auto", 5)])
def test_adaptive_k_is_lossless_and_reports_its_decisions(engine, mode, k):
    for seed, prompt in enumerate(PROMPTS):
        std, _ = _generate(engine, prompt=prompt, mode="standard", max_new_tokens=30)
        gen, steps = _generate(engine, prompt=prompt, mode=mode, k=k, proposer="draft+ngram", max_new_tokens=30)
        assert gen.token_ids == std.token_ids
        assert all(s.decision is not None and s.decision.reason in ("best", "no_gain", "probe", "no_match")
                   for s in steps)
        assert all(0 <= s.decision.k <= K_MAX for s in steps)
        s = gen.summary
        assert s.mode == mode and s.decision == steps[-1].decision
        assert abs(s.k_mean - sum(x.decision.k for x in steps) / len(steps)) < 1e-9


def test_adaptive_k_samples_and_keeps_what_it_learned(engine):
    engine.tuning = TuningMemory()
    # Costs as a real pair measures them (a draft at a tenth of a forward), not the tiny models' own:
    # timing noise on those once made the draft look unable to pay, so it was never tried (1 run in 10).
    measured = engine.info
    engine.info = replace(measured, target_ms=tuple((w, 10.0 + 0.2 * w) for w in range(1, K_MAX + 2)),
                          proposer_costs=(ProposerCost("draft", 1.0, 0.0), ProposerCost("ngram", 0.01, 0.0)))
    try:
        gen, steps = _generate(engine, prompt="def add(a, b):", mode="auto", proposer="draft",
                               sampling=Sampling(temperature=0.8, seed=2), max_new_tokens=40)
    finally:
        engine.info = measured
    assert gen.summary.new_tokens == 40 or gen.summary.stop_reason == "eos"
    assert ("draft", 0.8) in engine.tuning.acceptance  # the next answer at T=0.8 starts from it
    assert engine.tuning.timing.standard_overhead_ms is not None or engine.tuning.timing.overhead_ms is not None


def test_time_split_adds_up(engine):
    gen, steps = _generate(engine, prompt="hello world", mode="speculative", k=3, max_new_tokens=24)
    s = gen.summary
    assert s.prefill_s > 0 and s.draft_s > 0 and s.verify_s > 0 and s.overhead_s >= 0
    assert abs(s.prefill_s + s.draft_s + s.verify_s + s.overhead_s - s.seconds) < 1e-6 or s.overhead_s == 0
    assert all(x.overhead_ms >= 0 for x in steps)
    assert abs(s.draft_s - sum(x.draft_ms for x in steps) / 1000) < 1e-9


def _slow_prefill(runner, seconds: float, monkeypatch) -> None:
    """Makes every prefill of `runner` take `seconds` longer (undone after the test)."""
    import time

    original = runner.prefill

    def prefill(ids):
        time.sleep(seconds)
        original(ids)

    monkeypatch.setattr(runner, "prefill", prefill)


@pytest.mark.parametrize("lookahead", [False, True], ids=["in-order", "queued"])
def test_the_drafts_deferred_prompt_prefill_is_booked_as_prefill_not_drafting(engine, lookahead, monkeypatch):
    """The draft model feeds the prompt at its first proposal: that time is prefill (paid once per
    answer), so the step's draft_ms, the controller's draft timing and the overhead never see it."""
    _slow_prefill(engine.draft_runner, 0.2, monkeypatch)
    observed: list[float] = []
    ks = iter([0, 0] + [3] * 50)  # two standard steps first: the prefill comes with the third

    class Sequence_:
        def choose(self, offers, room):
            k = min(next(ks), room)
            return Decision(k, "draft", "best") if k else Decision(0, None, "no_gain")

        def observe(self, decision, drafted, accepted, draft_ms, verify_ms, wall_ms, **kw):
            observed.append(max(draft_ms, wall_ms - verify_ms))

        def finish(self):
            pass

    gen, steps = _generate(engine, Sequence_(), lookahead=lookahead, prompt="hello world quick fox",
                           mode="speculative", proposer="draft", max_new_tokens=16)
    s = gen.summary
    assert s.prefill_s >= 0.2 and s.draft_s < 0.2
    assert all(x.draft_ms < 200 and x.overhead_ms < 200 for x in steps) and max(observed) < 200
    assert abs(s.prefill_s + s.draft_s + s.verify_s + s.overhead_s - s.seconds) < 1e-6
    # A generation that never drafts never feeds the draft: nothing extra booked.
    std, _ = _generate(engine, prompt="hello world quick fox", mode="standard", max_new_tokens=4)
    assert std.summary.prefill_s < 0.2


def test_measured_proposer_cost_leaves_the_prompt_prefill_out(engine, monkeypatch):
    """measure_proposer restarts from the prompt every round; the draft's deferred prompt prefill is
    done before the clock starts, or it would be charged to every proposal."""
    from engine.decoding.proposers import DraftModelProposer, measure_proposer

    proposer = DraftModelProposer(engine.draft_runner, Sampling(), engine.vocab, None)
    prompt = engine.tokenizer("hello world quick fox, hello world").input_ids
    _slow_prefill(engine.draft_runner, 0.1, monkeypatch)
    cost = measure_proposer(proposer, "draft", prompt, engine.device, iters=1)
    assert cost.per_proposal_ms < 50 and cost.per_token_ms < 50


# --------------------------------------------------------------------------- the decision, on synthetic costs

def _costs(draft_ms: float, target_1: float = 10.0, slope: float = 0.5, ngram_ms: float = 0.01) -> StepCosts:
    target = (0.0, *(target_1 + slope * (w - 1) for w in range(1, K_MAX + 2)))
    return StepCosts(target, {"draft": ProposerCost("draft", draft_ms, 0.0),
                              "ngram": ProposerCost("ngram", 0.0, ngram_ms)})


def _feed(controller: AdaptiveK, offers, rate: float, steps: int, rng: random.Random, wall_extra: float = 0.0):
    """Runs the controller against a simulated draft accepting each token with probability `rate`."""
    chosen = []
    for _ in range(steps):
        d = controller.choose(offers, 1000)
        chosen.append(d)
        if d.k == 0:
            controller.observe(d, 0, 0, 0.0, controller.costs.target_ms[1], controller.costs.target_ms[1] + wall_extra)
            continue
        accepted = 0
        while accepted < d.k and rng.random() < rate:
            accepted += 1
        cost = controller.costs.proposers[d.source]
        draft_ms = cost.per_proposal_ms + d.k * cost.per_token_ms
        verify_ms = controller.costs.target_ms[d.k + 1]
        controller.observe(d, d.k, accepted, draft_ms, verify_ms, draft_ms + verify_ms + wall_extra)
    return chosen


DRAFT = (Offer("draft", K_MAX),)


def test_cheap_draft_and_high_acceptance_draft_long():
    c = AdaptiveK(_costs(draft_ms=1.0))
    chosen = _feed(c, DRAFT, 0.9, 60, random.Random(0))
    late = [d.k for d in chosen[-20:]]
    assert min(late) >= 4 and all(d.reason == "best" for d in chosen[-20:])
    assert chosen[-1].predicted_speedup > 1.5


def test_a_proposer_that_cannot_pay_even_when_always_accepted_is_never_tried():
    """llama.cpp on a CPU: a verify costs about as many forwards as it has tokens and the 0.5B draft 61% of
    a forward (measured, bench/results/cpu_sweep_llamacpp): auto must then cost nothing over standard."""
    per_width = (0.0, 33.0, 61.9, 88.5, 101.3, 124.0, 138.9, 162.1, 215.9, 233.2, 249.3, 262.5, 280.7, 288.4)
    costs = StepCosts(per_width, {"draft": ProposerCost("draft", 20.1, 0.7), "ngram": ProposerCost("ngram", 0.003, 0.0)})
    c = AdaptiveK(costs)
    chosen = _feed(c, DRAFT, 1.0, 300, random.Random(3))
    assert all(d.k == 0 and d.reason == "no_gain" for d in chosen)
    assert chosen[0].best_speedup < 1.0  # the ceiling it judged by, at full acceptance
    # N-gram lookup, nearly free, can still pay on the same costs when it is accepted.
    ngram = AdaptiveK(costs)
    picked = _feed(ngram, (Offer("ngram", K_MAX),), 0.95, 100, random.Random(4))
    assert any(d.k > 0 for d in picked[-20:])


def test_a_gain_inside_the_models_error_is_not_taken():
    """Near break-even the controller decodes standard: a draft runs only when it promises GAIN_MARGIN more."""
    from engine.decoding.control import GAIN_MARGIN

    near_even = []
    for draft_ms in (2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0):
        c = AdaptiveK(_costs(draft_ms=draft_ms))
        chosen = _feed(c, DRAFT, 0.6, 200, random.Random(2))
        assert all(d.predicted_speedup > 1 + GAIN_MARGIN for d in chosen if d.reason == "best")
        near_even += [d for d in chosen if d.reason == "no_gain" and 1.0 < d.best_speedup <= 1 + GAIN_MARGIN]
    assert near_even, "no draft cost put the best K inside the margin: the test does not test it"


def test_expensive_draft_at_low_acceptance_goes_standard_and_probes_less_and_less():
    c = AdaptiveK(_costs(draft_ms=7.0))
    chosen = _feed(c, DRAFT, 0.4, 400, random.Random(1))
    late = chosen[50:]
    standard = [d for d in late if d.k == 0]
    assert len(standard) > 0.95 * len(late)
    assert all(d.reason == "no_gain" and d.best_speedup < 1.0 for d in standard)
    # The first probes explore (one after the other); then probes come after standard stretches.
    probes = [i for i, d in enumerate(chosen) if d.reason == "probe" and chosen[i - 1].k == 0]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert chosen[0].reason == "probe" and len(probes) >= 3
    assert gaps[-1] > gaps[0] >= PROBE_EVERY  # the budget (PROBE_SHARE) spaces out costly probes


def test_k_follows_the_text_within_one_answer():
    """A code block (acceptance 0.95) then prose (0.3): K drops within ~20 steps."""
    c = AdaptiveK(_costs(draft_ms=2.0))
    rng = random.Random(2)
    code = _feed(c, DRAFT, 0.95, 40, rng)
    prose = _feed(c, DRAFT, 0.3, 40, rng)
    assert code[-1].k >= 5
    assert max(d.k for d in prose[-10:]) <= 2


def test_standard_then_a_pay_off_returns_to_drafting():
    """Acceptance rises after a standard stretch: a probe finds it and drafting resumes."""
    c = AdaptiveK(_costs(draft_ms=5.0))
    rng = random.Random(3)
    _feed(c, DRAFT, 0.2, 100, rng)
    later = _feed(c, DRAFT, 0.98, 300, rng)
    assert sum(d.k > 0 for d in later[-50:]) > 45


def test_nearly_free_ngram_is_preferred_when_it_matches_and_skipped_when_it_does_not():
    c = AdaptiveK(_costs(draft_ms=6.0))
    both = (Offer("ngram", 6, key="ngram:3"), Offer("draft", K_MAX))
    chosen = _feed(c, both, 0.8, 60, random.Random(4))
    assert chosen[-1].source == "ngram" and chosen[-1].k >= 4
    nothing = (Offer("ngram", 0, key="ngram:0"),)
    assert c.choose(nothing, 100).reason == "no_match"


def test_measured_overhead_enters_the_decision():
    """A per-step overhead (here 3 ms) makes long drafts relatively cheaper, so K grows."""
    rng = random.Random(5)
    plain, slow = AdaptiveK(_costs(draft_ms=3.0)), AdaptiveK(_costs(draft_ms=3.0))
    k_plain = [d.k for d in _feed(plain, DRAFT, 0.7, 80, rng)][-30:]
    k_slow = [d.k for d in _feed(slow, DRAFT, 0.7, 80, rng, wall_extra=8.0)][-30:]
    assert slow.timing.overhead_ms == pytest.approx(8.0, rel=0.05)
    assert sum(k_slow) > sum(k_plain)


def test_memory_carries_to_the_next_generation():
    memory = TuningMemory()
    first = AdaptiveK(_costs(draft_ms=7.0), memory)
    _feed(first, DRAFT, 0.3, 100, random.Random(6))
    first.finish()
    second = AdaptiveK(_costs(draft_ms=7.0), memory)
    # It already knows the draft does not pay: no probe on its first step.
    assert second.choose(DRAFT, 100).reason == "no_gain"
    fresh = AdaptiveK(_costs(draft_ms=7.0), TuningMemory())
    assert fresh.choose(DRAFT, 100).reason in ("probe", "best")


def test_fixed_k_and_standard():
    assert FixedK(0).choose(DRAFT, 10).k == 0
    d = FixedK(5).choose(DRAFT, 3)
    assert (d.k, d.source, d.reason) == (3, "draft", "fixed")


# --------------------------------------------------------------------------- CUDA only

@pytest.mark.gpu
def test_cuda_graphs_any_k_sequence_is_lossless_and_launches_never_sync(tiny_pair, monkeypatch):
    """On CUDA graphs, rounds queued ahead: random K per round (0 included), K auto and auto mode all
    give float32 greedy standard output, and no launch waits for the device."""
    import torch

    from engine.decoding import Engine, Generation
    from engine.runners.graphs import build_runners

    eager = tiny_engine(*tiny_pair)
    target, draft = eager.target.to("cuda"), eager.draft.to("cuda")
    t, d, name = build_runners(target, draft, max_length=512)
    assert name == "cuda-graphs", t.fallback_reason
    fast = Engine(target, eager.tokenizer, eager.info, draft=draft, target_runner=t, draft_runner=d)
    launch = Generation._launch

    def strict_launch(self, *args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(self, *args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    prompt = "def add(a, b):\n    return a + b\ndef add(a, b):"
    ref_text = "".join(s.text for s in fast.generate(GenerationRequest(prompt=prompt, mode="standard",
                                                                        max_new_tokens=48)))
    fast.measure_costs()
    with monkeypatch.context() as m:
        m.setattr(Generation, "_launch", strict_launch)
        for seed, kw in enumerate((dict(mode="speculative", proposer="draft"), dict(mode="auto", proposer="draft+ngram"))):
            gen, steps = _generate(fast, ScriptedK(seed), lookahead=None, prompt=prompt, max_new_tokens=48, **kw)
            assert "".join(s.text for s in steps) == ref_text, kw
        for kw in (dict(mode="speculative", k=K_AUTO), dict(mode="auto", proposer="draft+ngram")):
            gen, steps = _generate(fast, None, lookahead=None, prompt=prompt, max_new_tokens=48, **kw)
            assert "".join(s.text for s in steps) == ref_text, kw


def test_sampling_with_random_k_per_round_keeps_the_targets_law(engine):
    """K chosen before each round (0 included) from the past only: the first two tokens still follow
    the target's processed law (chi-square against the exact law from the target's logits)."""
    import torch
    from scipy import stats as scipy_stats

    from engine.decoding.sampling import process

    sampling = dict(temperature=1.2, top_k=4)
    prompt = "hello world"
    ids = engine.encode(GenerationRequest(prompt=prompt))
    exact: dict[tuple[int, int], float] = {}
    with torch.inference_mode():
        p1 = process(engine.target(torch.tensor([ids])).logits[0, -1].float(), Sampling(**sampling))
        for t1 in torch.nonzero(p1).flatten().tolist():
            p2 = process(engine.target(torch.tensor([ids + [t1]])).logits[0, -1].float(), Sampling(**sampling))
            for t2 in torch.nonzero(p2).flatten().tolist():
                exact[(t1, t2)] = p1[t1].item() * p2[t2].item()
    trials, counts = 1500, dict.fromkeys(exact, 0)
    for seed in range(trials):
        gen, _ = _generate(engine, ScriptedK(seed), prompt=prompt, mode="speculative", proposer="draft",
                           max_new_tokens=2, sampling=Sampling(seed=seed, **sampling))
        counts[tuple(gen.token_ids)] += 1
    keys = [k for k in exact if exact[k] * trials >= 5]
    observed = [counts[k] for k in keys] + [trials - sum(counts[k] for k in keys)]
    expected = [exact[k] * trials for k in keys] + [trials * (1 - sum(exact[k] for k in keys))]
    assert scipy_stats.chisquare(observed, expected).pvalue > 1e-3


def test_probes_spend_at_most_their_share_of_the_time():
    """The H200 case: each probe of the 0.5B draft first feeds it the standard stretch before it (here 0.25 ms
    a missed token, ~60 ms after 250 steps) against 3 ms a step; probes must then stay within PROBE_SHARE."""
    from engine.decoding.control import PROBE_SHARE

    target = (0.0, *(3.07 + 0.05 * (w - 1) for w in range(1, K_MAX + 2)))
    costs = StepCosts(target, {"draft": ProposerCost("draft", 2.0, 0.0)})
    memory = TuningMemory()
    rng = random.Random(7)
    lost = elapsed = 0.0
    for _answer in range(20):
        c = AdaptiveK(costs, memory)
        missed = 0
        for _ in range(256):
            d = c.choose((Offer("draft", K_MAX, catch_up=missed > 1),), 1000)
            if d.k == 0:
                c.observe(d, 0, 0, 0.0, 3.07, 3.1)
                missed += 1
                elapsed += 3.1
                continue
            accepted = 0
            while accepted < d.k and rng.random() < 0.5:
                accepted += 1
            draft_ms = 2.0 * d.k + 0.25 * missed  # the catch-up of every token it missed
            wall = draft_ms + target[d.k + 1] + 0.05
            c.observe(d, d.k, accepted, draft_ms, target[d.k + 1], wall)
            missed = 0
            elapsed += wall
            if d.reason == "probe":
                lost += max(wall - (accepted + 1) * 3.1, 0.0)
        c.finish()
    first_tries = 3 * (2.0 * 3 + target[4])  # the exploring probes, before any verdict
    # Without the budget these probes lost about 5% of the time (841 of 16,838 ms); with it 1.5%.
    assert lost <= PROBE_SHARE * elapsed + first_tries + 70.0, (lost, elapsed)
    assert memory.probe_spent_ms <= PROBE_SHARE * memory.elapsed_ms + 70.0


# --------------------------------------------------------------------------- n-gram drafts on edit prompts

# The H200 edit sweep (bench/results/h200_edit_sweep): every verify width 1..13 in ms, bf16, CUDA graphs.
# Past one token the width costs almost nothing more, so long n-gram drafts pay whenever they are right.
H200_VERIFY_MS = (0.0, 2.96, 3.45, 3.46, 3.52, 3.53, 3.51, 3.56, 3.55, 3.53, 3.58, 3.58, 3.59, 3.62)
H200_STEP_OVERHEAD_MS = 0.1  # a standard step measured 3.06 ms against its 2.96 ms forward
NGRAM_MS = 0.008  # per draft token, as measured there


def _edit_answer(rng: random.Random, length: int) -> list[tuple[int, int, int]]:
    """An answer to an edit prompt, per output position: (matched suffix length n, tokens the n-gram
    offers, how many of them are right). Spans copied from the prompt (matched on 3 tokens, or 2 right
    after an edit) alternate with edits: new text where a 1-token match is right 20% of the time and,
    once right, goes on 70% of the time, and where a third of the positions match nothing. The H200
    streams have these shapes: 1-token matches right 20% at the first position and 60-100% after it,
    3-token matches 85-90% and more."""
    text: list[tuple[int, int, int]] = []
    while len(text) < length:
        span = rng.randint(3, 30)
        text += [(2 if i < 2 else 3, K_MAX, span - i) for i in range(span)]
        for _ in range(rng.randint(3, 24)):
            if rng.random() < 0.35:
                text.append((0, 0, 0))
                continue
            right = 0
            if rng.random() < 0.2:
                right = 1
                while rng.random() < 0.7:
                    right += 1
            text.append((1, K_MAX, right))
    return text[:length]


def _replay(make_controller, answers: list[list], play) -> float:
    """Replays the answers (one TuningMemory across them, as one engine does): tokens over the time
    the controller's choices cost. play(controller, text, t) -> (tokens committed, wall ms) runs one
    step at position t. No clock: the time is computed from the costs."""
    memory, tokens, ms = TuningMemory(), 0, 0.0
    for text in answers:
        controller, t = make_controller(memory), 0
        while t < len(text):
            committed, wall_ms = play(controller, text, t)
            t += committed
            ms += wall_ms
        controller.finish()
        tokens += len(text)
    return tokens / ms


def _tokens_per_ms(make_controller, answers: list[list[tuple[int, int, int]]]) -> float:
    """The edit answers replayed on the H200 costs."""

    def play(controller, text, t):
        n, offered, right = text[t]
        room = len(text) - t
        d = controller.choose((Offer("ngram", min(offered, room), key=f"ngram:{n}"),), room)
        drafted = min(d.k, offered, room)  # a fixed K drafts what the match offers, and no more
        accepted = min(drafted, right)
        draft_ms, verify_ms = NGRAM_MS * drafted, H200_VERIFY_MS[drafted + 1]
        wall_ms = draft_ms + verify_ms + H200_STEP_OVERHEAD_MS
        controller.observe(d, drafted, accepted, draft_ms, verify_ms, wall_ms)
        return accepted + 1, wall_ms

    return _replay(make_controller, answers, play)


def test_auto_ngram_on_edit_prompts_is_at_least_the_best_fixed_k():
    """Issue 10: on the H200 edit prompts auto measured 1.87x standard and fixed K = 8 1.90x. Each kind
    of match keeps its own statistics, and a 1-token match's later positions were shrunk towards its
    pool of all positions, which its many first-token misses hold near 0.2: its drafts looked worth
    ~1.05x, so auto decoded standard steps where any fixed K drafted and won (~1.3x)."""
    costs = StepCosts(H200_VERIFY_MS, {"ngram": ProposerCost("ngram", NGRAM_MS, 0.0)})
    rng = random.Random(0)
    answers = [_edit_answer(rng, 200) for _ in range(20)]
    standard = _tokens_per_ms(lambda memory: FixedK(0), answers)
    fixed = {k: _tokens_per_ms(lambda memory, k=k: FixedK(k), answers) / standard for k in range(1, K_MAX + 1)}
    auto = _tokens_per_ms(lambda memory: AdaptiveK(costs, memory), answers) / standard
    best_k = max(fixed, key=fixed.get)
    assert fixed[8] > 1.8, "the pattern is not an edit prompt's: n-gram drafts must pay as on the H200"
    assert auto >= fixed[best_k], f"auto {auto:.3f}x against K={best_k} {fixed[best_k]:.3f}x (K=8 {fixed[8]:.3f}x)"


# --------------------------------------------------------------------------- the draft head on the H200

HEAD_MS = 0.242  # per draft token, as an H200 measured the shipped head at load (0.22-0.24 ms)


def _head_answer(rng: random.Random, length: int) -> list[float]:
    """Per output position, the chance that a head draft there is accepted: stretches of text of
    different difficulty (code and math near 0.8, prose 0.5-0.6, a hard patch now and then), which
    on the H200 costs make a fixed K = 4 about 1.45x standard, as the head measured there (1.41x)."""
    text: list[float] = []
    while len(text) < length:
        text += [rng.choice((0.85, 0.75, 0.7, 0.6, 0.5, 0.3))] * rng.randint(10, 60)
    return text[:length]


def _head_tokens_per_ms(make_controller, answers: list[list[float]], seed: int) -> float:
    """The answers replayed on the H200 costs (verify widths, the head's cost, 0.3 ms of host work a
    speculative step and 0.1 a standard one)."""
    rng = random.Random(seed)

    def play(controller, text, t):
        room = len(text) - t
        d = controller.choose((Offer("head", min(K_MAX, room)),), room)
        accepted = 0
        while accepted < d.k and rng.random() < text[min(t + accepted, len(text) - 1)]:
            accepted += 1
        if d.k == 0:
            wall = H200_VERIFY_MS[1] + 0.1
            controller.observe(d, 0, 0, 0.0, H200_VERIFY_MS[1], wall)
        else:
            wall = HEAD_MS * d.k + H200_VERIFY_MS[d.k + 1] + 0.3
            controller.observe(d, d.k, accepted, HEAD_MS * d.k, H200_VERIFY_MS[d.k + 1], wall)
        return accepted + 1, wall

    return _replay(make_controller, answers, play)


def test_auto_with_the_head_comes_back_after_a_hard_patch():
    """On the H200 auto with the head measured 1.27x against the fixed head's 1.55x: after a hard patch
    it decoded standard steps for hundreds of tokens (701 of 2,145 steps), as the probe interval doubled
    on every probe that confirmed the verdict (up to 128 steps) while the head's estimate, fed by no
    new drafts, barely moved. Replayed here: auto 1.32x against the best fixed K 1.45x (0.91) with the
    doubling, 1.40x (0.97) without."""
    costs = StepCosts(H200_VERIFY_MS, {"head": ProposerCost("head", HEAD_MS, 0.0)})
    rng = random.Random(1)
    answers = [_head_answer(rng, 256) for _ in range(20)]
    standard = _head_tokens_per_ms(lambda memory: FixedK(0), answers, 5)
    fixed = {k: _head_tokens_per_ms(lambda memory, k=k: FixedK(k), answers, 5) / standard for k in range(1, 9)}
    auto = _head_tokens_per_ms(lambda memory: AdaptiveK(costs, memory), answers, 5) / standard
    best_k = max(fixed, key=fixed.get)
    assert fixed[best_k] > 1.35, "the pattern is not the head's on the H200"
    assert auto >= 0.93 * fixed[best_k], f"auto {auto:.3f}x against K={best_k} {fixed[best_k]:.3f}x"


# Tree rounds on the H200 (an H200 auto trace at T = 0.7 with the head, info.tree_ms): K -> ms, 2 alternatives.
H200_TREE_MS = {1: 3.59, 2: 3.65, 3: 3.65, 4: 3.69, 5: 3.71, 6: 3.74, 7: 3.75, 8: 3.79}
HEAD_CATCH_MS = 0.3  # one replay of the head's widest catch-up (13 rows), as it reads the rows of rounds it did not draft


def _tree_head_tokens_per_ms(make_controller, answers: list[list[float]], seed: int, rescue: float) -> float:
    """The answers replayed on the H200 costs with the head drafting trees when sampling: at a
    rejection the target's token is one of the two alternatives with probability `rescue` (one more
    token); while it does not draft, the head reads the rows of every 13 tokens in one replay."""
    rng = random.Random(seed)
    behind = 0  # committed tokens the head has not read

    def play(controller, text, t):
        nonlocal behind
        behind = 1 if t == 0 else behind
        room = len(text) - t
        d = controller.choose((Offer("head", min(K_MAX, room), tree=True),), room)
        if d.k == 0:
            behind += 1
            wall = H200_VERIFY_MS[1] + 0.1 + (HEAD_CATCH_MS if behind > K_MAX + 1 else 0.0)
            if behind > K_MAX + 1:  # read in the background: what is left waits for its next draft
                behind = behind % (K_MAX + 1) or K_MAX + 1
            controller.observe(d, 0, 0, 0.0, H200_VERIFY_MS[1], wall)
            return 1, wall
        accepted = 0
        while accepted < d.k and rng.random() < text[min(t + accepted, len(text) - 1)]:
            accepted += 1
        tree = d.k in H200_TREE_MS
        extra = tree and accepted < d.k and rng.random() < rescue
        draft_ms = 0.1 + HEAD_MS * d.k
        verify_ms = H200_TREE_MS[d.k] if tree else H200_VERIFY_MS[d.k + 1]
        wall = draft_ms + verify_ms + 0.3
        controller.observe(d, d.k, accepted, draft_ms, verify_ms, wall, tree=tree, extra=extra)
        behind = accepted + 1 + extra
        return behind, wall

    return _replay(make_controller, answers, play)


def test_auto_credits_the_alternatives_of_a_tree():
    """At T = 0.7 on the H200 auto with the head (trees of 2 alternatives) measured 1.15x against the
    fixed head's 1.43x, standard for 1,482 of 2,464 steps (an H200 auto trace at T = 0.7 with the head):
    it counted the chain's tokens only, where the alternatives added 0.33 a round, so the head looked
    worth 0.99x where it paid. Replayed here on acceptance near the head's at T = 0.7: auto 0.96 of
    the best fixed K, 0.90 without the credit."""
    tree_costs = StepCosts(H200_VERIFY_MS, {"head": ProposerCost("head", HEAD_MS, 0.1)}, H200_TREE_MS)
    rng = random.Random(2)
    answers = [[max(a - 0.15, 0.1) for a in _head_answer(rng, 256)] for _ in range(20)]
    standard = _tree_head_tokens_per_ms(lambda memory: FixedK(0), answers, 7, 0.35)
    fixed = {k: _tree_head_tokens_per_ms(lambda memory, k=k: FixedK(k), answers, 7, 0.35) / standard
             for k in range(1, 9)}
    auto = _tree_head_tokens_per_ms(lambda memory: AdaptiveK(tree_costs, memory), answers, 7, 0.35) / standard
    best_k = max(fixed, key=fixed.get)
    assert fixed[best_k] > 1.3, "the pattern is not the head's at T = 0.7 on the H200"
    assert auto >= 0.93 * fixed[best_k], f"auto {auto:.3f}x against K={best_k} {fixed[best_k]:.3f}x"


def test_a_dynamic_trees_drafting_is_priced_at_its_own_measured_cost():
    """A dynamic tree's level ranks F * F children: on the H200 a 64-node tree drafted 5 levels in 1.86 ms
    where five chain steps of the head cost 1.05. Priced as chain steps, a K looks cheaper than it is."""
    proposers = {"head": ProposerCost("head", HEAD_MS, 0.1)}
    chain = AdaptiveK(StepCosts(H200_VERIFY_MS, proposers, H200_TREE_MS))
    drafting = {k: 0.3 + 0.35 * k for k in H200_TREE_MS}
    tree = AdaptiveK(StepCosts(H200_VERIFY_MS, proposers, H200_TREE_MS, drafting))
    offer = Offer("head", TREE_K_MAX, tree=True)  # a tree is at most TREE_K_MAX deep
    assert tree._draft_ms("head", 5, True) == drafting[5]
    assert chain._draft_ms("head", 5, True) == pytest.approx(0.1 + 5 * HEAD_MS), "sibling trees draft a chain"
    assert tree._draft_ms("head", 5, False) == chain._draft_ms("head", 5, False), "chains keep the chain's price"
    assert tree._best(offer, 1000)[1] < chain._best(offer, 1000)[1]
    # observing a round that cost what was measured leaves the learned draft ratio at 1
    d = tree.choose((offer,), 1000)
    tree.observe(d, d.k, d.k, drafting[d.k], H200_TREE_MS[d.k], drafting[d.k] + H200_TREE_MS[d.k], tree=True)
    assert tree.timing.draft_ratio["head"] == pytest.approx(1.0)
