"""The fast path (lean forward, static runner), the cost model, n-gram drafts and HF baselines."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from engine.decoding.ngram import CombinedProposer, NgramProposer
from engine.decoding.proposers import Proposal, Proposer
from engine.errors import GenerationError
from engine.measure.costmodel import (
    CostModel,
    alpha_from_mean_accepted,
    alpha_from_per_position,
    estimate_alpha,
    expected_tokens_per_step,
)
from engine.runners import EagerRunner
from engine.runners.graphs import StaticGraphRunner
from engine.runners.lean import LeanDecoder, UnsupportedModelError
from tests.tiny import build_model

VOCAB = 320


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.3,
        rope_theta=10000.0,
    )
    return LlamaForCausalLM(config).eval()


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()  # [T, V]


@pytest.fixture(params=["qwen2", "llama"])
def model(request):
    return build_model(VOCAB, seed=3) if request.param == "qwen2" else tiny_llama(seed=3)


def test_lean_forward_matches_hf_through_steps_and_rollbacks(model):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (40,), generator=g).tolist()
    runner = StaticGraphRunner(model, max_length=128, graph_widths=(1, 2, 4))
    assert runner.name == "static-eager"
    history: list[int] = []

    def feed(new: list[int]) -> None:
        out = runner.forward(torch.tensor(new))
        history.extend(new)
        ref = full_logits(model, history)[-len(new) :]
        assert out.shape == (len(new), runner.vocab_size) and out.dtype == torch.float32
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)

    feed(tokens[:17])  # prefill
    for t in tokens[17:20]:  # single-token steps
        feed([t])
    feed(tokens[20:24])  # a verify-sized block
    # Roll back 3, then write different tokens: stale slots must not leak into attention.
    runner.rollback(runner.length - 3)
    del history[-3:]
    feed(tokens[30:32])
    feed([tokens[35]])
    runner.rollback(10)
    del history[10:]
    feed(tokens[0:5])
    assert runner.length == len(history) == 15


def test_prefill_longer_than_a_chunk_matches_hf():
    model = build_model(VOCAB, seed=1)
    tokens = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    runner = StaticGraphRunner(model, max_length=320, graph_widths=(1,))
    out = runner.forward(torch.tensor(tokens))
    torch.testing.assert_close(out, full_logits(model, tokens), atol=1e-4, rtol=1e-4)
    assert runner.length == 300


@pytest.mark.parametrize("runner_kind", ["static", "eager"])
def test_prefill_fills_the_cache_without_logits(runner_kind):
    """prefill() leaves the cache as forward() would (the next token's logits agree with HF)."""
    model = build_model(VOCAB, seed=2)
    tokens = torch.randint(0, VOCAB, (301,), generator=torch.Generator().manual_seed(2)).tolist()
    runner = (StaticGraphRunner(model, max_length=320, graph_widths=(1,)) if runner_kind == "static"
              else EagerRunner(model, max_length=320))
    assert runner.prefill(torch.tensor(tokens[:-1])) is None  # longer than a prefill chunk
    assert runner.length == 300
    out = runner.forward(torch.tensor(tokens[-1:]))
    torch.testing.assert_close(out[-1], full_logits(model, tokens)[-1], atol=1e-4, rtol=1e-4)
    if runner_kind == "static":
        with pytest.raises(GenerationError, match="cache positions"):
            runner.prefill(torch.arange(20))


@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_attention_spans_and_kernels_match_hf(attention):
    model = build_model(VOCAB, seed=6)
    tokens = torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(6)).tolist()
    runner = StaticGraphRunner(model, max_length=300, graph_widths=(1,), attention=attention, min_bucket=64)
    assert runner.buckets == (64, 128, 256, 320)
    history = tokens[:60]
    runner.forward(torch.tensor(history))
    i = 60
    while i < 140:  # steps of 1 and 4 crossing the 64 and 128 spans
        width = 1 if i % 3 else 4
        new = tokens[i : i + width]
        out = runner.forward(torch.tensor(new))
        history += new
        i += width
        torch.testing.assert_close(out, full_logits(model, history)[-width:], atol=1e-4, rtol=1e-4)
    runner.rollback(62)  # back across a span boundary, then overwrite
    del history[62:]
    out = runner.forward(torch.tensor(tokens[150:153]))
    history += tokens[150:153]
    torch.testing.assert_close(out, full_logits(model, history)[-3:], atol=1e-4, rtol=1e-4)


def test_build_runners_on_cpu():
    from engine.runners.graphs import build_runners

    seen = []
    target, draft = build_model(VOCAB, seed=0), build_model(VOCAB, seed=1, layers=1)
    t, d, name = build_runners(target, draft, max_length=10_000, k_max=4, progress=seen.append)
    assert name == "static-eager" and t.max_length == 512  # capped by max_position_embeddings
    assert t.graph_widths == (1, 2, 3, 4, 5) and d.graph_widths == (1, 2)
    assert seen and seen[-1].stage == "warmup" and seen[-1].fraction == 1.0


def test_shared_weights_leave_hf_model_unchanged():
    model = build_model(VOCAB, seed=2)
    tokens = list(range(12))
    before = full_logits(model, tokens)
    LeanDecoder(model, 64, share_weights=True)
    torch.testing.assert_close(full_logits(model, tokens), before, atol=0, rtol=0)
    q = model.model.layers[0].self_attn.q_proj.weight
    k = model.model.layers[0].self_attn.k_proj.weight
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr(), "q/k should share the fused storage"


def test_greedy_decoding_matches_eager_runner():
    model = build_model(VOCAB, seed=4)
    prompt = [5, 17, 42, 7, 99]
    outs = []
    for runner in (EagerRunner(model, 64), StaticGraphRunner(model, max_length=64, graph_widths=(1,))):
        runner.reset()
        logits = runner.forward(torch.tensor(prompt))
        seq = []
        for _ in range(12):
            nxt = int(logits[-1].argmax())
            seq.append(nxt)
            logits = runner.forward(torch.tensor([nxt]))
        outs.append(seq)
    assert outs[0] == outs[1]


def test_runner_bookkeeping_and_overflow():
    runner = StaticGraphRunner(build_model(VOCAB, seed=0), max_length=16, graph_widths=(1, 3, 99))
    assert runner.graph_widths == (1, 3)  # widths beyond the cache are dropped
    runner.warmup(progress=None)
    assert runner.length == 0
    assert runner.forward(torch.arange(10)).shape == (10, VOCAB)
    runner.rollback(4)
    assert runner.length == 4
    assert runner.forward(torch.arange(3)).shape == (3, VOCAB)
    assert runner.length == 7
    with pytest.raises(AssertionError):
        runner.rollback(8)
    runner.forward(torch.arange(9))
    assert runner.length == 16
    with pytest.raises(GenerationError, match="context is full"):
        runner.forward(torch.arange(1))
    assert runner.length == 16
    runner.reset()
    assert runner.length == 0
    costs = runner.measure_costs([1, 3], iters=2)
    assert set(costs) == {1, 3} and all(v > 0 for v in costs.values())
    assert runner.length == 0


def test_warmup_reports_progress():
    runner = StaticGraphRunner(build_model(VOCAB, seed=0), max_length=32, graph_widths=(1, 2))
    seen = []
    runner.warmup(lambda fraction, message: seen.append((fraction, message)))
    assert seen[-1][0] == 1.0 and runner.length == 0


def test_unsupported_models_raise_for_fallback():
    config = MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=32,
    )
    mistral = MistralForCausalLM(config).eval()
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        StaticGraphRunner(mistral, max_length=64, graph_widths=(1,))
    StaticGraphRunner(mistral, max_length=32, graph_widths=(1,))  # window covers the whole context
    gelu = tiny_llama()
    gelu.config.hidden_act = "gelu"
    with pytest.raises(UnsupportedModelError, match="SiLU"):
        StaticGraphRunner(gelu, max_length=32, graph_widths=(1,))


# -- cost model --------------------------------------------------------------------------------


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.0, 5) == 1.0
    assert expected_tokens_per_step(1.0, 5) == 6.0
    assert math.isclose(expected_tokens_per_step(0.5, 2), 1 + 0.5 + 0.25)


def test_cost_model_speedup_best_k_and_verdict():
    cm = CostModel(draft_ms=1.67, target_ms={1: 2.54, 2: 2.6, 4: 2.7, 8: 3.0})
    assert math.isclose(cm.target_cost(3), 2.65)
    assert math.isclose(cm.target_cost(10), 3.15)  # extrapolated from the last segment
    expected = expected_tokens_per_step(0.8, 3) * 2.54 / (3 * 1.67 + 2.7)
    assert math.isclose(cm.predicted_speedup(0.8, 3), expected)
    assert cm.predicted_speedup(0.8, 0) == 1.0
    assert cm.best_k(0.8)[0] == 1  # 1.8 tokens for 4.27 ms instead of 2 x 2.54 ms
    k, s = cm.best_k(0.6)
    assert k == 0 and s == 1.0
    text = cm.verdict(0.6)
    assert text.startswith("Speculative decoding will not pay here") and "66%" in text and "60%" in text
    assert "K=1 gives 0.95×" in text
    cheap = CostModel(draft_ms=0.1, target_ms={1: 2.5, 2: 2.55, 8: 3.0})
    k, s = cheap.best_k(0.8)
    assert k > 1 and s > 2
    assert "pays" in cheap.verdict(0.8) and f"K={k}" in cheap.verdict(0.8)


def test_cost_model_from_runners():
    from engine.measure.costmodel import measure

    target = StaticGraphRunner(build_model(VOCAB, seed=0), max_length=64, graph_widths=(1,))
    draft = StaticGraphRunner(build_model(VOCAB, seed=1, layers=1), max_length=64, graph_widths=(1,))
    cm = measure(target, draft, k_max=3, iters=2)
    assert sorted(cm.target_ms) == [1, 2, 3, 4] and cm.draft_ms > 0
    assert target.length == draft.length == 0
    assert measure(target, None, k_max=1, iters=1).draft_ms == 0.0


def test_alpha_estimates():
    assert math.isclose(alpha_from_mean_accepted(expected_tokens_per_step(0.7, 4) - 1, 4), 0.7, abs_tol=1e-9)
    assert alpha_from_mean_accepted(0.0, 4) == 0.0 and alpha_from_mean_accepted(4, 4) == 1.0
    assert math.isclose(alpha_from_per_position([0.5, 0.5, 0.5]), 0.5)
    assert alpha_from_per_position([]) is None

    class S:  # the Summary fields estimate_alpha reads
        drafted, k, acceptance_rate = 20, 4, 0.5
        accepted_length_histogram = (1, 1, 0, 1, 2)  # 12 accepted, 3 rejections

    assert math.isclose(estimate_alpha(S()), 12 / 15)


# -- n-gram drafts -----------------------------------------------------------------------------


def test_ngram_prefers_longest_then_most_recent():
    p = NgramProposer(max_ngram=3)
    p.start([1, 2, 3, 9, 9, 2, 3, 7, 8, 1, 2, 3])
    tokens, n = p.match(4)
    assert n == 3 and tokens == [9, 9, 2, 3]  # only [1,2,3] at 0 matches 3 tokens
    p.start([5, 2, 3, 4, 6, 2, 3, 8, 2, 3])
    tokens, n = p.match(2)
    assert n == 2 and tokens == [8, 2]  # most recent earlier [2, 3] is at 5..6


def test_ngram_no_match_cap_and_commit():
    p = NgramProposer()
    p.start([1, 2, 3, 4])
    prop = p.propose(5)
    assert prop.tokens.numel() == 0 and prop.q is None and prop.sources == () and prop.forwards == 0
    p.commit(prop, 0, [1, 2])  # now ... 3 4 1 2: [1, 2] occurred at 0
    prop = p.propose(1)
    assert prop.tokens.tolist() == [3] and prop.sources == ("ngram",)
    prop = p.propose(10)
    assert prop.tokens.tolist() == [3, 4, 1, 2]  # capped by what follows the occurrence
    assert prop.tokens.dtype == torch.long
    assert p.propose(0).tokens.numel() == 0


class FakeDraft(Proposer):
    """Records what the combined proposer tells the draft model."""

    def __init__(self) -> None:
        self.commits: list[tuple[int, int, list[int]]] = []

    def start(self, prompt: list[int]) -> None:
        self.prompt = prompt

    def propose(self, k: int) -> Proposal:
        return Proposal(tokens=torch.full((k,), 7), q=None, sources=("draft",) * k, forwards=k)

    def commit(self, proposal: Proposal, accepted: int, new_tokens: list[int]) -> None:
        self.commits.append((len(proposal.tokens), accepted, new_tokens))


def test_combined_proposer_keeps_draft_in_sync():
    draft = FakeDraft()
    c = CombinedProposer(NgramProposer(), draft, min_match=2)
    c.start([1, 2, 3, 4, 5, 1, 2])
    prop = c.propose(3)
    assert prop.sources == ("ngram",) * 3 and prop.tokens.tolist() == [3, 4, 5]
    c.commit(prop, 2, [3, 4, 9])
    assert draft.commits[-1] == (0, 0, [3, 4, 9])  # empty proposal: the draft fed nothing
    prop = c.propose(3)  # ... 4 9: no 2-gram match, so the draft model drafts
    assert prop.sources == ("draft",) * 3
    c.commit(prop, 1, [7, 1])
    assert draft.commits[-1] == (3, 1, [7, 1])


def test_hf_baselines_on_cpu(tiny_pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.measure.baselines import run_hf

    target_dir, draft_dir = tiny_pair
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    ids = torch.tensor(tok("def add(a, b):")["input_ids"])
    results = {v: run_hf(target, tok, ids, 8, v, draft=draft) for v in ("hf", "hf-static", "hf-assisted")}
    for r in results.values():
        assert r["new_tokens"] == 8 and r["seconds"] > 0
    assert results["hf"]["token_ids"] == results["hf-static"]["token_ids"] == results["hf-assisted"]["token_ids"]


# -- CUDA only ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_graph_replay_matches_eager_on_cuda():
    model = build_model(VOCAB, seed=5).to("cuda", torch.bfloat16)
    graphs = StaticGraphRunner(model, max_length=128, graph_widths=(1, 2, 5))
    graphs.warmup()
    assert graphs.name == "cuda-graphs", graphs.fallback_reason
    eager = StaticGraphRunner(model, max_length=128, graph_widths=(), use_graphs=False)
    prompt = torch.randint(0, VOCAB, (20,), device="cuda")
    for r in (graphs, eager):
        r.forward(prompt)
    for width in (1, 2, 5, 1, 5):
        ids = torch.randint(0, VOCAB, (width,), device="cuda")
        a = graphs.forward(ids).clone()
        b = eager.forward(ids)
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
        graphs.rollback(graphs.length - 1)
        eager.rollback(eager.length - 1)


@pytest.mark.gpu
def test_tree_graph_replay_matches_the_eager_tree_forward_on_cuda():
    from engine.runners.tree import sibling_rows, sibling_tree

    model = build_model(VOCAB, seed=5).to("cuda", torch.bfloat16)
    graphs = StaticGraphRunner(model, max_length=128, graph_widths=(1,))
    graphs.warmup()
    graphs.capture_trees([sibling_rows(3, 2), sibling_rows(5, 2)])
    assert len(graphs.tree_graphs) == 2 * len([b for b in graphs.buckets if b >= sibling_rows(5, 2)])
    eager = StaticGraphRunner(model, max_length=128, graph_widths=(), use_graphs=False)
    prompt = torch.randint(0, VOCAB, (20,), device="cuda")
    for r in (graphs, eager):
        r.forward(prompt)
    for k in (3, 5, 3):
        tree = sibling_tree(k, 2, "cuda")
        ids = torch.randint(0, VOCAB, (tree.width,), device="cuda")
        torch.testing.assert_close(graphs.forward(ids, tree).clone(), eager.forward(ids, tree), atol=2e-2, rtol=2e-2)
        for r in (graphs, eager):
            r.keep_path([0, 1, tree.width - 1])
            r.rollback(r.length - tree.width + 3)
        one = torch.randint(0, VOCAB, (1,), device="cuda")
        torch.testing.assert_close(graphs.forward(one).clone(), eager.forward(one), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("proposer", ["draft", "ngram", "draft+ngram"])
def test_engine_with_static_runners_is_lossless(tiny_pair, proposer):
    """The decoding loop on the fast-path runners: greedy speculative == greedy standard (float32)."""
    from engine.decoding import Engine
    from engine.runners.graphs import build_runners
    from engine.types import GenerationRequest
    from tests.engine_fixtures import tiny_engine

    eager = tiny_engine(*tiny_pair)
    t, d, name = build_runners(eager.target, eager.draft, max_length=256, k_max=6)
    fast = Engine(eager.target, eager.tokenizer, eager.info, draft=eager.draft, target_runner=t, draft_runner=d)
    prompt = "def add(a, b):\n    return a + b\ndef add(a, b):"
    ref = [s for s in eager.generate(GenerationRequest(prompt=prompt, mode="standard", max_new_tokens=40))]
    for k in (1, 4):
        req = GenerationRequest(prompt=prompt, mode="speculative", k=k, max_new_tokens=40, proposer=proposer)
        steps = list(fast.generate(req))
        assert "".join(s.text for s in steps) == "".join(s.text for s in ref)
        assert sum(s.new_tokens for s in steps) == sum(s.new_tokens for s in ref)


@pytest.mark.gpu
def test_engine_on_cuda_graphs_is_lossless_in_float32(tiny_pair):
    from engine.decoding import Engine
    from engine.runners.graphs import build_runners
    from engine.types import GenerationRequest
    from tests.engine_fixtures import tiny_engine

    eager = tiny_engine(*tiny_pair)
    target, draft = eager.target.to("cuda"), eager.draft.to("cuda")
    t, d, name = build_runners(target, draft, max_length=256, k_max=6)
    assert name == "cuda-graphs", t.fallback_reason
    fast = Engine(target, eager.tokenizer, eager.info, draft=draft, target_runner=t, draft_runner=d)
    slow = Engine(target, eager.tokenizer, eager.info, draft=draft)
    prompt = "def add(a, b):\n    return a + b\ndef add(a, b):"
    ref = "".join(s.text for s in slow.generate(GenerationRequest(prompt=prompt, mode="standard", max_new_tokens=40)))
    for proposer in ("draft", "ngram", "draft+ngram"):
        for k in (1, 4, 6):
            req = GenerationRequest(prompt=prompt, mode="speculative", k=k, max_new_tokens=40, proposer=proposer)
            assert "".join(s.text for s in fast.generate(req)) == ref, (proposer, k)


@pytest.mark.gpu
def test_rounds_are_queued_without_host_syncs_on_cuda(tiny_pair, monkeypatch):
    """Launching a round never waits for the device, so the next round overlaps the host's work.

    torch's sync debug mode raises on any blocking call (item(), pageable copies, 0-dim tensor
    indexing); it is on only inside Generation._launch. Queued ahead or not, outputs are identical.
    """
    from engine.decoding import Engine, Generation
    from engine.runners.graphs import build_runners
    from engine.types import GenerationRequest, Sampling
    from tests.engine_fixtures import tiny_engine

    eager = tiny_engine(*tiny_pair)
    target, draft = eager.target.to("cuda"), eager.draft.to("cuda")
    t, d, name = build_runners(target, draft, max_length=256, k_max=6)
    fast = Engine(target, eager.tokenizer, eager.info, draft=draft, target_runner=t, draft_runner=d)
    launch = Generation._launch

    def strict_launch(self, *args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(self, *args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    prompt = "def add(a, b):\n    return a + b\ndef add(a, b):"
    for kw in (
        dict(mode="standard"),
        dict(mode="standard", sampling=Sampling(temperature=1.0, top_k=20, top_p=0.9, seed=2)),
        dict(mode="speculative", k=4),
        dict(mode="speculative", k=4, sampling=Sampling(temperature=0.8, top_p=0.95, seed=2)),
        dict(mode="speculative", k=5, proposer="draft+ngram"),
    ):
        req = GenerationRequest(prompt=prompt, max_new_tokens=40, **kw)
        fast.lookahead = False
        serial = [(s.text, s.proposed, s.accepted) for s in fast.generate(req)]
        fast.lookahead = None  # auto: on, on CUDA
        with monkeypatch.context() as m:
            m.setattr(Generation, "_launch", strict_launch)
            gen = fast.generate(req)
            steps = list(gen)
        assert [(s.text, s.proposed, s.accepted) for s in steps] == serial, kw
        assert all(s.verify_ms > 0 for s in steps)  # device time between the round's events
        assert all(s.draft_ms > 0 for s in steps if s.proposed and "draft" in s.sources)
        assert gen.summary.new_tokens == len(gen.token_ids) and gen.summary.seconds > 0


def test_a_tree_forward_equals_each_branch_fed_as_a_sequence(model):
    from engine.runners.tree import alt_row, sibling_tree

    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, VOCAB, (11,), generator=g).tolist()
    k, s = 3, 2
    tree = sibling_tree(k, s)
    ids = torch.randint(0, VOCAB, (tree.width,), generator=g)
    runner = StaticGraphRunner(model, max_length=128, graph_widths=(1,), hidden_layers=(0, 1))
    runner.prefill(torch.tensor(prefix))
    out = runner.forward(ids, tree).clone()
    hidden = runner.hidden.clone()
    chain = ids[: k + 1].tolist()
    for d in range(k):  # every alternative's logits are those of the chain up to its parent, then it
        for a in range(s):
            row = alt_row(k, s, d, a)
            ref = full_logits(model, prefix + chain[: d + 1] + [int(ids[row])])[-1]
            torch.testing.assert_close(out[row], ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[: k + 1], full_logits(model, prefix + chain)[-(k + 1):], atol=1e-4, rtol=1e-4)
    # Keep the chain's first draft and an alternative at depth 2: the cache then holds that sequence.
    kept = [0, 1, alt_row(k, s, 1, 1)]
    runner.keep_path(kept)
    torch.testing.assert_close(runner.hidden[2], hidden[kept[2]])
    runner.rollback(len(prefix) + len(kept))
    nxt = int(torch.randint(0, VOCAB, (1,), generator=g))
    sequence = prefix + [int(ids[i]) for i in kept] + [nxt]
    torch.testing.assert_close(runner.forward(torch.tensor([nxt]))[0], full_logits(model, sequence)[-1],
                               atol=1e-4, rtol=1e-4)
