"""Decoding with a draft head as the proposer: lossless greedy output, the sampling law, cache lengths."""
from __future__ import annotations

import random

import pytest
import torch

from engine.errors import GenerationError
from engine.types import GenerationRequest, Message, Sampling
from tests.head_fixtures import head_engine
from tests.test_decoding import check_sampling_law

WORDS = ["def", "add", "quick", "fox", "快速", "排序", "🙂", "hello", "world", "(a, b)", "return", "\n"]


@pytest.fixture(scope="module")
def engine(tiny_head):
    return head_engine(tiny_head.target, tiny_head.head)


def _messages(seed: int) -> tuple[Message, ...]:
    rng = random.Random(seed)
    return (Message("user", " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 10)))),)


def _run(engine, **kw):
    gen = engine.generate(GenerationRequest(**kw))
    steps = list(gen)
    return gen, steps


@pytest.mark.parametrize("k", range(1, 13))
def test_greedy_with_the_head_equals_standard(engine, k):
    accepted = 0
    for seed in range(5):
        messages = _messages(seed * 13 + k)
        max_new = 5 + (seed * 7 + k) % 29  # cuts land mid-draft for most K
        std, _ = _run(engine, messages=messages, mode="standard", max_new_tokens=max_new)
        spec, steps = _run(engine, messages=messages, mode="speculative", proposer="head", k=k, max_new_tokens=max_new)
        assert spec.token_ids == std.token_ids, f"K={k} messages={messages!r}"
        assert spec.summary.text == std.summary.text
        assert all(t.source == "head" for s in steps for t in s.tokens if t.draft_pos is not None)
        accepted += spec.summary.accepted
    assert accepted > 0, "the trained head never had a draft accepted: the test would not exercise acceptance"


def test_max_new_tokens_inside_an_accepted_draft(engine):
    cut = 0
    saved = engine.eos_ids
    engine.eos_ids = set()  # only max_new_tokens ends these generations
    try:
        for seed in range(12):
            messages = _messages(200 + seed)
            for max_new in (3, 7, 11):
                std, _ = _run(engine, messages=messages, mode="standard", max_new_tokens=max_new)
                spec, steps = _run(engine, messages=messages, mode="speculative", proposer="head", k=6,
                                   max_new_tokens=max_new)
                assert spec.token_ids == std.token_ids and len(spec.token_ids) == max_new
                cut += steps[-1].added is None  # the draft ran past max_new_tokens: tail and target's token dropped
    finally:
        engine.eos_ids = saved
    assert cut > 0, "no case cut the generation inside an accepted draft"


def test_eos_inside_a_draft_stops_both_modes_at_the_same_token(engine):
    """EOS set to a token the head drafted and the target accepted mid-draft: both modes stop there."""
    hits = 0
    saved = engine.eos_ids
    try:
        for seed in range(10):
            messages = _messages(100 + seed)
            engine.eos_ids = set()
            for k in (3, 8, 12):
                free, steps = _run(engine, messages=messages, mode="speculative", proposer="head", k=k,
                                   max_new_tokens=24)
                # An accepted draft token that is not its step's last committed token, first of its id.
                done, candidate = 0, None
                for step in steps:
                    for i in range(step.accepted if step.added is not None else 0):
                        token = free.token_ids[done + i]
                        if candidate is None and token not in free.token_ids[: done + i]:
                            candidate = token
                    done += step.new_tokens
                if candidate is None:
                    continue
                engine.eos_ids = {candidate}
                std, _ = _run(engine, messages=messages, mode="standard", max_new_tokens=24)
                spec, spec_steps = _run(engine, messages=messages, mode="speculative", proposer="head", k=k,
                                        max_new_tokens=24)
                engine.eos_ids = set()
                assert spec.token_ids == std.token_ids
                assert spec.summary.stop_reason == std.summary.stop_reason == "eos"
                hits += spec_steps[-1].added is None  # EOS accepted inside a draft: the rest is dropped
    finally:
        engine.eos_ids = saved
    assert hits > 0, "no case exercised EOS inside an accepted draft"


def test_head_cache_holds_exactly_the_committed_prefix_after_every_step(engine):
    head = engine.head_runner
    for k in (1, 4, 9):
        gen = engine.generate(GenerationRequest(messages=_messages(k), mode="speculative", proposer="head", k=k,
                                                max_new_tokens=40))
        for step in gen:
            committed = len(gen.prompt) + step.total_tokens
            assert engine.target_runner.length == committed - 1
            # The head reads the last verify's committed rows at the start of the next round.
            assert head.length + step.new_tokens == engine.target_runner.length
        # Rolled back and caught up, the head's cache is as good as a fresh one over the same rows.
        ids = gen.prompt + gen.token_ids
        rows = step.new_tokens  # the last verify's committed rows, not yet read by the head
        target = engine.target_runner
        with torch.inference_mode():
            target.rollback(len(ids) - 1 - rows)
            target.forward(torch.tensor(ids[len(ids) - 1 - rows : -1]))
            head.catch_up(target.hidden, torch.tensor(ids[-rows:]), head.span(len(ids)))
            assert head.length == len(ids) - 1
            cached = head.last_logits.clone()
            target.reset()
            target.prefill(torch.tensor(ids[:-1]))
            head.reset()
            head.catch_up(target.hidden, torch.tensor(ids[1:]), head.span(len(ids)))
        torch.testing.assert_close(cached, head.last_logits, atol=1e-4, rtol=1e-4)


def test_a_long_catch_up_replays_the_captured_widths_and_drafts_as_one_forward(engine):
    """Rows of a stretch the head did not draft (more than its widest captured catch-up) go through
    captured widths, the last chunk drafting, not one eager forward (milliseconds of launches on a
    GPU). The graphs are stood in for by their eager bodies here: the cache and the draft must be
    those of one catch-up over all the rows."""
    head, target = engine.head_runner, engine.target_runner
    gen = engine.generate(GenerationRequest(messages=_messages(5), mode="standard", max_new_tokens=40))
    list(gen)
    ids = gen.prompt + gen.token_ids
    widest = head.k_max + 1
    n = len(ids) - 1
    assert n > 2 * widest + 1, "the rows must span several captured widths and a remainder"
    span = head.span(len(ids))

    class Replay:  # what a captured catch-up graph of width w replays
        def __init__(self, w: int) -> None:
            self.w = w

        def replay(self) -> None:
            head._catch_up_body(head.feat_in[self.w], head.ids_in[self.w], span)

    def catch_up() -> tuple[torch.Tensor, int, int]:
        head.reset()
        head.catch_up(target.hidden[:n], torch.tensor(ids[1:]), span)
        return head.last_logits.clone(), int(head.drafts[0]), head.length

    with torch.inference_mode():
        target.reset()
        target.prefill(torch.tensor(ids[:-1]))
        one = catch_up()
        for w in range(1, widest + 1):
            head.feat_in[w] = torch.zeros(w, head.config.features, dtype=head.dtype)
            head.ids_in[w] = torch.zeros(w, dtype=torch.long)
            head.graphs[("catch", w, span)] = Replay(w)
        try:
            chunked = catch_up()
        finally:
            head.graphs.clear()
            head.feat_in.clear()
            head.ids_in.clear()
            target.reset()
    assert chunked[1:] == one[1:] == (chunked[1], n)
    torch.testing.assert_close(chunked[0], one[0], atol=1e-4, rtol=1e-4)


def test_sampling_with_the_head_matches_the_targets_processed_distribution(engine):
    """Chi-square of the first two sampled tokens against the target's exact processed law."""
    check_sampling_law(engine, "", proposer="head", messages=(Message("user", "hello world"),), trials=1500)


def test_sampled_drafts_come_from_the_draft_vocabulary(engine):
    gen, steps = _run(engine, messages=_messages(3), mode="speculative", proposer="head", k=4, max_new_tokens=30,
                      sampling=Sampling(temperature=0.8, seed=2))
    vocab = set(engine.head_runner.head.d2t.tolist())
    proposed = [t for s in steps for t in s.proposed]
    assert proposed and set(proposed) <= vocab
    assert all(0 < q <= 1 for s in steps for q in s.proposed_q)


def test_proposer_head_without_a_head_is_a_clear_error(tiny_pair):
    from tests.engine_fixtures import tiny_engine

    engine = tiny_engine(*tiny_pair)
    with pytest.raises(GenerationError, match="No draft head"):
        engine.generate(GenerationRequest(prompt="hello", mode="speculative", proposer="head"))


def test_a_head_on_a_target_split_over_gpus_is_refused_in_one_line(tiny_head):
    """Its embeddings and output rows sit on different GPUs: refused when named, skipped for "auto"."""
    from dataclasses import replace

    from engine.assemble import engine_for_pair
    from engine.errors import IncompatibleModelsError
    from engine.loadspec import LoadSpec
    from engine.models.loader import load_pair

    pair = load_pair(LoadSpec(str(tiny_head.target), None, device="cpu", dtype="float32", with_draft=False))
    split = replace(pair, info=replace(pair.info, devices=("cuda:0", "cuda:1")))
    with pytest.raises(IncompatibleModelsError, match="split over cuda:0, cuda:1"):
        engine_for_pair(split, LoadSpec(fast_path="eager", head=str(tiny_head.head)))
    assert engine_for_pair(split, LoadSpec(fast_path="eager", head="auto")).head_runner is None


def test_standard_steps_inside_a_head_generation_keep_it_in_step(engine):
    """K = 0 rounds (a controller routing to standard decoding) still feed the head the target's rows."""
    from engine.decoding.head import HeadProposer

    messages = _messages(7)
    std, _ = _run(engine, messages=messages, mode="standard", max_new_tokens=20)
    gen = engine.generate(GenerationRequest(messages=messages, mode="speculative", proposer="head", k=3,
                                            max_new_tokens=20))
    ks = iter([3, 0, 2, 0, 0, 4] * 10)
    original = HeadProposer.propose
    try:
        HeadProposer.propose = lambda self, k: original(self, min(k, next(ks)))
        list(gen)
    finally:
        HeadProposer.propose = original
    assert gen.token_ids == std.token_ids


def test_cli_generates_with_a_head_and_refuses_one_for_another_target(tiny_head, tiny_pair, capsys):
    import json

    from app.cli import main

    code = main(["generate", "--prompt", "hello world", "--target", str(tiny_head.target), "--head",
                 str(tiny_head.head), "--proposer", "head", "--k", "4", "--max-new-tokens", "24", "--device", "cpu",
                 "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    result = json.loads(out.out)
    assert result["summary"]["accepted"] > 0 and result["config"]["proposer"] == "head"
    code = main(["generate", "--prompt", "x", "--target", str(tiny_pair[0]), "--head", str(tiny_head.head),
                 "--proposer", "head", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "was trained for a target with layer count" in err and len(err.strip().splitlines()) == 1


def test_cli_distill_writes_a_head_and_a_log(tiny_head, tmp_path, monkeypatch, capsys):
    import json

    import engine.heads.distill as distill_module
    from app.cli import main
    from tests.head_fixtures import quick_plan

    monkeypatch.setattr(distill_module, "CPU_PLAN", quick_plan(max_rounds=1, max_steps=12))
    code = main(["distill", "--target", str(tiny_head.target), "--out", str(tmp_path / "head"), "--minutes", "30",
                 "--device", "cpu", "--dtype", "float32"])
    out = capsys.readouterr()
    assert code == 0, out.err
    summary = json.loads(out.out)
    assert summary["finished"] and summary["steps"] == 12
    assert (tmp_path / "head" / "manifest.json").exists() and (tmp_path / "head" / "train_log.jsonl").exists()
    assert (tmp_path / "head" / "work" / "state.json").exists()


@pytest.mark.parametrize("lookahead", [False, True], ids=["in-order", "queued"])
def test_any_k_sequence_and_auto_mode_with_the_head_are_lossless(engine, lookahead):
    """The K controller's rounds, 0 included, with the head: rows of rounds it did not draft are
    caught up later (no standard round is queued ahead of the head's commit); auto mode too."""
    from tests.test_control import ScriptedK

    drafted = 0
    for seed in range(4):
        messages = _messages(40 + seed)
        std, _ = _run(engine, messages=messages, mode="standard", max_new_tokens=30)
        scripted = ScriptedK(seed)
        sets = []
        make = engine.make_proposers
        engine.make_proposers = lambda request, generator: sets.append(make(request, generator)) or sets[-1]
        try:
            gen = engine.generate(GenerationRequest(messages=messages, mode="speculative", proposer="head",
                                                    max_new_tokens=30))
            saved, engine.make_controller, engine.lookahead = engine.make_controller, lambda r: scripted, lookahead
            steps = []
            for step in gen:
                steps.append(step)
                # Every committed position is in the head's cache or waiting in its catch-up (with
                # lookahead the next round has already run by now, so only in order).
                head = sets[-1].parts[0]
                if not lookahead:
                    assert engine.head_runner.length + len(head.next_ids) == engine.target_runner.length
        finally:
            engine.make_proposers, engine.make_controller, engine.lookahead = make, saved, None
        assert gen.token_ids == std.token_ids, scripted.ran
        assert 0 in scripted.ran
        drafted += sum(s.accepted for s in steps)
        auto, _ = _run(engine, messages=messages, mode="auto", proposer="head", max_new_tokens=30)
        assert auto.token_ids == std.token_ids
    assert drafted > 0, "no head draft was accepted: the test would not exercise the catch-up"


def test_standard_stretches_do_not_leave_the_head_behind(engine):
    """The head reads the rows of rounds it does not draft as they come, a widest catch-up at a time:
    after a long standard stretch its next draft catches up on a few rows, not on the whole stretch
    (which kept auto on standard steps on the H200), and the output stays the target's."""
    from engine.types import Decision

    class Stretches:  # 30 standard steps, then the head drafts 3, again and again
        def __init__(self) -> None:
            self.n = 0

        def choose(self, offers, room):
            self.n += 1
            return Decision(min(3, room), "head", "best") if self.n % 31 == 0 else Decision(0, None, "no_gain")

        def observe(self, *args, **kw):
            pass

        def finish(self):
            pass

    messages = _messages(44)  # an answer that runs to max_new_tokens
    std, _ = _run(engine, messages=messages, mode="standard", max_new_tokens=90)
    assert len(std.token_ids) == 90
    widest = engine.head_runner.k_max + 1
    sets, lags = [], []
    make, saved = engine.make_proposers, engine.make_controller
    engine.make_proposers = lambda request, generator: sets.append(make(request, generator)) or sets[-1]
    engine.make_controller, engine.lookahead = lambda request: Stretches(), False
    try:
        gen = engine.generate(GenerationRequest(messages=messages, mode="speculative", proposer="head",
                                                max_new_tokens=90))
        drafted = 0
        for step in gen:
            head = sets[-1].parts[0]
            lags.append(len(head.next_ids))
            drafted += len(step.proposed)
            assert engine.head_runner.length + len(head.next_ids) == engine.target_runner.length
    finally:
        engine.make_proposers, engine.make_controller, engine.lookahead = make, saved, None
    assert gen.token_ids == std.token_ids
    assert max(lags) <= widest < 30, lags
    assert drafted >= 6, f"the head must draft after the stretches ({len(gen.token_ids)} tokens, {gen.summary})"


def test_cli_head_on_a_target_packed_while_loading(tiny_head, tmp_path, capsys):
    """The CPU fast path packs the target inside load_pair; the head binds to its output rows first.

    The target is saved in bfloat16 and run in float32 (as the cache's converted models are): its
    linear weights are still bfloat16 when the head binds, and its input embedding is kept in exact
    bfloat16 after packing (CompactEmbedding); the head still drafts in float32 and stays lossless.
    """
    import json

    from app.cli import main
    from tests.head_fixtures import load_target

    model, tok = load_target(tiny_head.target)
    folder = tmp_path / "bf16-target"
    model.to(torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)
    common = ["--prompt", "hello world", "--target", str(folder), "--head", str(tiny_head.head), "--proposer",
              "head", "--k", "4", "--max-new-tokens", "24", "--device", "cpu", "--dtype", "float32", "--json"]
    results = {}
    for mode in ("speculative", "standard"):
        code = main(["generate", "--mode", mode, *common])
        out = capsys.readouterr()
        assert code == 0, out.err
        results[mode] = json.loads(out.out)
    spec = results["speculative"]
    assert spec["config"]["fast_path"] == "cpu-onednn" and spec["summary"]["accepted"] > 0
    assert spec["text"] == results["standard"]["text"]


@pytest.fixture(scope="module")
def tree_engine(tiny_head):
    return head_engine(tiny_head.target, tiny_head.head, static=True)


@pytest.mark.parametrize("alternatives", [1, 2, 3])
def test_greedy_with_a_tree_of_drafts_equals_standard(tree_engine, alternatives):
    """K 1..12 (above TREE_K_MAX the drafts verify as chains), cuts by max_new_tokens mid-tree; and the
    alternatives do get picked, each time with the target's next token from the same forward."""
    engine = tree_engine
    engine.set_tree(alternatives)
    extras = 0
    try:
        for k in range(1, 13):
            for seed in range(3):
                messages = _messages(seed * 17 + k + 100 * alternatives)
                max_new = 6 + (seed * 5 + k) % 27
                std, _ = _run(engine, messages=messages, mode="standard", max_new_tokens=max_new)
                spec, steps = _run(engine, messages=messages, mode="speculative", proposer="head", k=k,
                                   max_new_tokens=max_new)
                assert spec.token_ids == std.token_ids, f"K={k} S={alternatives} messages={messages!r}"
                assert spec.summary.text == std.summary.text
                for step in steps:
                    if step.extra is not None:
                        extras += 1
                        assert step.accepted < len(step.proposed) and step.added_status == "corrected"
                        assert [v.status for v in step.tokens][-2:] == ["corrected", "bonus"]
                        assert step.new_tokens == step.accepted + 2
    finally:
        engine.set_tree(None)
    assert extras > 0, "no alternative was ever picked: the test would not exercise the tree"


def test_tree_rounds_leave_both_caches_at_the_committed_prefix(tree_engine):
    engine = tree_engine
    engine.set_tree(3)
    try:
        check_caches_follow_the_committed_text(engine, GenerationRequest(
            messages=_messages(5), mode="speculative", proposer="head", k=5, max_new_tokens=60))
    finally:
        engine.set_tree(None)


def check_caches_follow_the_committed_text(engine, request: GenerationRequest):
    """After every step both caches hold the committed prefix, and at the end the target's cache gives the
    logits a fresh prefill of the same text gives. Returns the generation and its step count."""
    head = engine.head_runner
    gen = engine.generate(request)
    steps = 0
    for step in gen:
        assert engine.target_runner.length == len(gen.prompt) + step.total_tokens - 1
        assert head.length + step.new_tokens == engine.target_runner.length
        steps += 1
    ids = gen.prompt + gen.token_ids
    target = engine.target_runner
    with torch.inference_mode():
        after = target.forward(torch.tensor(ids[-1:]))[0].clone()
        target.reset()
        target.prefill(torch.tensor(ids[:-1]))
        fresh = target.forward(torch.tensor(ids[-1:]))[0]
    torch.testing.assert_close(after, fresh, atol=1e-4, rtol=1e-4)
    return gen, steps


def test_sampling_through_a_tree_keeps_the_targets_law(tree_engine):
    """Sampled rounds verify the head's best tokens and their alternatives as one tree: a draft is
    accepted with the target's p(x), the correction is drawn from p without it, and a picked
    alternative's next token from its own row. The output law stays the target's (chi-square), and
    the alternatives do get picked, so the test exercises that path."""
    engine = tree_engine
    engine.set_tree(2)
    try:
        # A prompt whose second token the head often misses where one of its alternatives is right.
        extras = check_sampling_law(engine, "", proposer="head", messages=(Message("user", "def add"),),
                                    trials=1200)
        assert extras > 50, extras
        _, steps = _run(engine, messages=_messages(3), mode="speculative", proposer="head", k=4, max_new_tokens=30,
                        sampling=Sampling(temperature=0.8, seed=2))
        for step in steps:
            assert all(0 < q <= 1 for q in step.proposed_q) and all(0 <= p <= 1 for p in step.proposed_p)
            if step.extra is not None:
                assert step.accepted < len(step.proposed) and step.new_tokens == step.accepted + 2
    finally:
        engine.set_tree(None)


def test_the_heads_sampled_drafts_are_timed_through_its_own_propose(engine):
    """Greedy head drafts are priced by the runner's own round (ModelInfo.head_ms); sampled ones, which
    draw on the host between the head's steps, are timed apart, as the loop runs them, and the head
    is left ready for the next generation."""
    saved = engine.info
    try:
        engine.measure_costs(rounds=1)
        greedy = {c.source: c for c in engine.info.proposer_costs}
        sampled = {c.source: c for c in engine.info.sampled_costs}
        assert greedy["head"].per_token_ms == engine.info.head_ms
        assert set(sampled) == {"ngram", "head"} and sampled["head"].per_token_ms > 0
    finally:
        engine.info = saved
    gen, steps = _run(engine, prompt="def add(a, b):", max_new_tokens=12, proposer="head", k=3,
                      sampling=Sampling(temperature=0.8, seed=1))
    assert gen.summary.new_tokens == 12 and gen.summary.drafted > 0


def test_tree_rounds_are_measured_for_the_prediction(tree_engine):
    from engine.decoding.costs import measure_trees
    from engine.limits import TREE_K_MAX

    engine = tree_engine
    saved, length = engine.info, engine.target_runner.length
    try:
        engine.set_tree(2)
        measure_trees(engine, iters=1)
        assert engine.info.tree_alternatives == 2
        assert [k for k, _ in engine.info.tree_ms] == list(range(1, TREE_K_MAX + 1))
        assert all(ms > 0 for _, ms in engine.info.tree_ms)
        assert engine.target_runner.length == length  # the canned rounds leave the cache as it was
        engine.set_tree(0)
        measure_trees(engine)
        assert engine.info.tree_ms == () and engine.info.tree_alternatives == 0
    finally:
        engine.set_tree(None)
        engine.info = saved


@pytest.mark.gpu
def test_a_tree_of_drafts_on_cuda_graphs_is_lossless_in_float32(tiny_head):
    from tests.head_fixtures import cuda_head_engine

    engine = cuda_head_engine(tiny_head.target, tiny_head.head)
    runner = engine.target_runner
    engine.set_tree(2)
    assert engine.alternatives() == 2 and runner.tree_graphs
    extras = 0
    for seed in range(6):
        messages = _messages(300 + seed)
        std, _ = _run(engine, messages=messages, mode="standard", max_new_tokens=40)
        for k in (2, 5, 8):
            spec, steps = _run(engine, messages=messages, mode="speculative", proposer="head", k=k, max_new_tokens=40)
            assert spec.token_ids == std.token_ids, (seed, k)
            extras += sum(s.extra is not None for s in steps)
    assert extras > 0


def test_auto_mode_weighs_the_loaded_head_whatever_proposers_were_asked_for(engine):
    """Auto picks what is fastest: a loaded head joins the request's proposers (the app's default
    asks for draft+ngram), and greedy output stays the target's own."""
    from engine.decoding.head import HeadProposer
    from engine.decoding.ngram import NgramProposer

    request = GenerationRequest(messages=_messages(4), mode="auto", proposer="ngram", max_new_tokens=30)
    parts = engine.make_proposers(request, None).parts
    assert [type(p) for p in parts] == [NgramProposer, HeadProposer]
    head_only = GenerationRequest(messages=_messages(4), mode="auto", proposer="head", max_new_tokens=30)
    assert [type(p) for p in engine.make_proposers(head_only, None).parts] == [HeadProposer]
    speculative = GenerationRequest(messages=_messages(4), mode="speculative", proposer="ngram")
    assert [type(p) for p in engine.make_proposers(speculative, None).parts] == [NgramProposer]
    std, _ = _run(engine, messages=_messages(4), mode="standard", max_new_tokens=30)
    auto, _ = _run(engine, messages=_messages(4), mode="auto", proposer="ngram", max_new_tokens=30)
    assert auto.token_ids == std.token_ids
