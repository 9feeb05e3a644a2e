"""The troubleshooting rules, on synthetic evidence: each fires when it should and stays silent otherwise."""
from __future__ import annotations

import math

import pytest

from engine.limits import K_AUTO
from engine.measure import diagnostics as dx
from engine.measure.explain import describe_diagnosis
from engine.measure.stats import summarize
from engine.types import ModelInfo, ProposerCost, Step, SweepRow


def row(k: int, speedup: float, *, proposer: str = "draft", t: float = 0.0, acceptance: float = 0.7,
        positions: tuple[float, ...] = (0.8, 0.75, 0.7), mode: str = "speculative") -> SweepRow:
    return SweepRow(mode, proposer, k, t, 10 * speedup, speedup, acceptance, 2.0, positions, 0.3, None,  # type: ignore[arg-type]
                    None, 0, 4, float(k))


def info(draft_ms: float = 3.0, target_ms: float = 10.0) -> ModelInfo:
    widths = tuple((w, target_ms + 0.5 * (w - 1)) for w in range(1, 14))
    return ModelInfo("t", "d", "cpu", "float32", "eager", 100, draft_ms=draft_ms, target_ms=widths,
                     proposer_costs=(ProposerCost("draft", draft_ms, 0.0),))


def answer(positions: tuple[int, ...], *, t: float = 0.0, proposer: str = "draft", steps: int = 30) -> dx.AnswerFacts:
    """An answer whose every step drafted len(positions)... with acceptance pattern: accepted counts cycle."""
    out = []
    for i in range(steps):
        accepted = positions[i % len(positions)]
        out.append(Step(i, "speculative", (1, 2, 3, 4), (0.5,) * 4, (0.5,) * 4, ("draft",) * 4, accepted, 7,
                        "corrected", (), "", accepted + 1, 0, 1.0, 9.0, 0.01 * i))
    return dx.AnswerFacts("speculative", proposer, 4, t, summarize(out, mode="speculative", k=4, prompt_tokens=3,
                                                                   seconds=1.0, stop_reason="eos"))


def kinds(evidence: dx.Evidence) -> list[str]:
    return [d.kind for d in dx.diagnose(evidence)]


def test_nothing_measured_nothing_said():
    assert dx.diagnose(dx.Evidence()) == []


def test_position_one_far_below_the_rest():
    bad = dx.Evidence(sweep=(row(3, 1.1, positions=(0.3, 0.8, 0.8)),))
    [d] = [d for d in dx.diagnose(bad) if d.kind == "position_one"]
    assert d.value == pytest.approx(0.3) and d.reference == pytest.approx(0.8)
    assert "position 1" in describe_diagnosis(d)[0] and "chat template" in describe_diagnosis(d)[1]
    assert "position_one" not in kinds(dx.Evidence(sweep=(row(3, 1.1, positions=(0.7, 0.8, 0.8)),)))
    # n-gram drafts are not a second model: position 1 says nothing about templates there.
    assert "position_one" not in kinds(dx.Evidence(sweep=(row(3, 1.1, proposer="ngram", positions=(0.2, 0.9)),)))
    # From the chat: a pattern that rejects position 1 most of the time, and too few steps to say so.
    chat = answer((0, 0, 0, 4))
    assert chat.summary.per_position_acceptance[0] < 0.3 < chat.summary.per_position_acceptance[1]
    assert "position_one" in kinds(dx.Evidence(answers=(chat,)))
    assert "position_one" not in kinds(dx.Evidence(answers=(answer((0, 0, 0, 4), steps=8),)))


def test_acceptance_falling_with_temperature():
    rows = (row(3, 1.2, t=0.0, acceptance=0.78), row(3, 1.0, t=1.0, acceptance=0.41))
    [d] = [d for d in dx.diagnose(dx.Evidence(sweep=rows)) if d.kind == "temperature"]
    assert (d.value, d.reference, d.temperature, d.action) == (0.41, 0.78, 0.0, "lower_temperature")
    assert "41%" in describe_diagnosis(d)[0] and "78%" in describe_diagnosis(d)[0]
    flat = (row(3, 1.2, t=0.0, acceptance=0.78), row(3, 1.2, t=1.0, acceptance=0.7))
    assert "temperature" not in kinds(dx.Evidence(sweep=flat))
    assert "temperature" not in kinds(dx.Evidence(sweep=rows[:1]))  # one temperature alone


def test_draft_costing_more_than_it_saves():
    losing = dx.Evidence(sweep=tuple(row(k, s) for k, s in ((1, 0.92), (2, 0.94), (3, 0.91))), info=info(7.0))
    [d] = [d for d in dx.diagnose(losing) if d.kind == "draft_cost"]
    assert d.value == pytest.approx(0.94) and d.reference == pytest.approx(0.7) and d.action == "use_auto"
    assert "0.94x" in describe_diagnosis(d)[0] and "n-gram" in describe_diagnosis(d)[1]
    paying = dx.Evidence(sweep=(row(1, 0.95), row(2, 1.08)), info=info(7.0))
    assert "draft_cost" not in kinds(paying)
    # From the chat's acceptance and the costs at load: at 25% acceptance an expensive draft cannot pay...
    low = dx.Evidence(answers=(answer((0, 0, 0, 1)),), info=info(draft_ms=9.0))
    assert "draft_cost" in kinds(low)
    # ... a cheap one at high acceptance does.
    high = dx.Evidence(answers=(answer((4, 3, 4, 4)),), info=info(draft_ms=1.0))
    assert "draft_cost" not in kinds(high)


def test_best_k_differs_from_the_current_one():
    rows = (row(1, 1.05), row(3, 1.25), row(5, 1.15))
    [d] = [d for d in dx.diagnose(dx.Evidence(sweep=rows, k=5)) if d.kind == "best_k"]
    assert (d.k, d.value, d.reference, d.action) == (3, 1.25, 1.15, "apply_k")
    assert "Apply K=3" in describe_diagnosis(d)[1]
    assert "best_k" not in kinds(dx.Evidence(sweep=rows, k=3))  # already the best
    assert "best_k" not in kinds(dx.Evidence(sweep=(row(3, 1.25), row(5, 1.24)), k=5))  # within noise
    assert "best_k" not in kinds(dx.Evidence(sweep=rows, k=5, proposer="ngram"))  # other proposer's sweep
    assert "best_k" not in kinds(dx.Evidence(sweep=rows, k=5, temperature=0.7))  # other temperature
    assert "best_k" not in kinds(dx.Evidence(sweep=rows))  # nothing set to compare with
    auto = (row(3, 1.25), row(K_AUTO, 1.1))
    assert [d.k for d in dx.diagnose(dx.Evidence(sweep=auto, k=K_AUTO)) if d.kind == "best_k"] == [3]


def test_memory_close_to_the_limit():
    [d] = dx.diagnose(dx.Evidence(memory_used=0.94, memory_total_gib=24.0))
    assert (d.kind, d.value, d.reference) == ("memory", 0.94, 24.0)
    assert "94%" in describe_diagnosis(d)[0]
    assert dx.diagnose(dx.Evidence(memory_used=0.6, memory_total_gib=24.0)) == []


def test_a_category_where_speculation_loses():
    found = dx.diagnose(dx.Evidence(categories=(("code", 1.4), ("chat", 0.9), ("math", math.nan))))
    assert [(d.kind, d.category, d.value, d.action) for d in found] == [("category", "chat", 0.9, "use_auto")]
    assert "chat" in describe_diagnosis(found[0])[1]
    assert dx.diagnose(dx.Evidence(categories=(("code", 1.4), ("chat", 0.98)))) == []


def test_category_speedups_add_times_not_rates():
    pairs = [("code", 10.0, 20.0), ("code", 10.0, 10.0), ("chat", 10.0, 9.0)]
    got = dict(dx.category_speedups(pairs))
    assert got["code"] == pytest.approx((0.1 + 0.1) / (0.05 + 0.1)) and got["chat"] == pytest.approx(0.9)


def test_from_bench_turns_a_bench_summary_into_evidence():
    summary = {
        "standard": {"tokens_per_s": 10.0},
        "speculative": {"tokens_per_s": 9.0, "acceptance_rate": 0.4, "tokens_per_target_forward": 1.8,
                        "per_position_acceptance": (0.3, 0.8, 0.8), "time_split": {"draft": 0.4}, "runs": 20,
                        "k_mean": 5.0},
        "categories": {"code": {"vs_standard": {"speculative": 1.2}}, "chat": {"vs_standard": {"speculative": 0.8}}},
    }
    found = kinds(dx.from_bench(summary, info(7.0), k=5, temperature=0.0))
    assert found == ["position_one", "draft_cost", "category"]
