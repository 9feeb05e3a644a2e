"""The troubleshooting table, live: rules over this session's measured data, each with the number behind it and an action.

Evidence is what was measured: configurations as SweepRows (from a sweep, from a bench, or from
the chat's answers grouped by their settings), per-category speedups (bench, race, sweep), the
memory in use, the forward costs measured at load, and the settings now. Each rule either finds
something (a Diagnosis: the numbers and what to do) or says nothing; engine.measure.explain words
them. Thresholds are here, named, so the tests and the words agree.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.limits import K_AUTO
from engine.measure.costmodel import CostModel, alpha_from_per_position
from engine.types import Diagnosis, ModelInfo, Summary, SweepRow

MIN_DRAFT_STEPS = 20  # drafting steps behind a per-position figure before it says anything
POSITION_ONE_RATIO = 0.7  # position 1 below this fraction of the later positions' mean is suspicious
POSITION_ONE_MAX = 0.5  # ... and below this acceptance in absolute terms
TEMPERATURE_DROP = 0.15  # acceptance this much lower at the hottest temperature than at the coolest
LOSES = 0.97  # a speedup under this loses to standard decoding (3%: beyond run-to-run noise)
BETTER_K = 1.03  # another K must measure this much faster than the current one to be worth a change
MEMORY_FULL = 0.9  # share of memory in use that leaves no room for a longer answer


@dataclass(frozen=True)
class AnswerFacts:
    """One answer of the chat, with the settings that made it."""

    mode: str  # request mode
    proposer: str  # request proposer
    k: int  # request K (K_AUTO: chosen per step)
    temperature: float  # sampling temperature
    summary: Summary  # what it measured


@dataclass(frozen=True)
class Evidence:
    """What this session measured, and where it stands now."""

    sweep: tuple[SweepRow, ...] = ()  # configurations measured against standard decoding
    answers: tuple[AnswerFacts, ...] = ()  # the chat's answers (no standard baseline of their own)
    info: ModelInfo | None = None  # the pair, with the forward costs measured at load
    k: int | None = None  # the K set now (K_AUTO: auto); None when unknown
    proposer: str = "draft"  # the proposer set now
    temperature: float = 0.0  # the temperature set now
    categories: tuple[tuple[str, float], ...] = ()  # (prompt category, speculative tok/s over standard)
    memory_used: float | None = None  # share of the device's (or the machine's) memory in use, 0..1
    memory_total_gib: float | None = None  # how much memory there is


def diagnose(e: Evidence) -> list[Diagnosis]:
    """Every rule that fires, in the order of the troubleshooting table."""
    found: list[Diagnosis] = []
    for rule in (position_one, temperature, draft_cost, best_k, memory, categories):
        found.extend(rule(e))
    return found


# --------------------------------------------------------------------------- the rules

def _drafting_rows(e: Evidence) -> list[SweepRow]:
    return [r for r in e.sweep if r.mode != "standard" and r.acceptance_by_position]


def position_one(e: Evidence) -> list[Diagnosis]:
    """Draft position 1 accepted far less than the later positions: the draft does not see the
    prompt as the target does (chat template or tokenizer mismatch)."""
    # A sweep or bench (whole runs behind each row) when there is one, else the chat's answers.
    weighted: list[tuple[Sequence[float], float]] = [
        (r.acceptance_by_position, float(r.runs)) for r in _drafting_rows(e) if r.proposer != "ngram"]
    if not weighted:
        weighted = [(a.summary.per_position_acceptance, float(sum(a.summary.accepted_length_histogram)))
                    for a in e.answers if a.proposer != "ngram" and a.summary.per_position_acceptance]
        if sum(w for _, w in weighted) < MIN_DRAFT_STEPS:
            return []
    usable = [(p, w) for p, w in weighted if len(p) >= 2 and w > 0]
    if not usable:
        return []
    total = sum(w for _, w in usable)
    first = sum(p[0] * w for p, w in usable) / total
    rest = sum(sum(p[1:4]) / len(p[1:4]) * w for p, w in usable) / total
    if first < POSITION_ONE_MAX and first < POSITION_ONE_RATIO * rest:
        return [Diagnosis("position_one", first, rest, "none")]
    return []


def temperature(e: Evidence) -> list[Diagnosis]:
    """Acceptance falls as the temperature rises."""
    by_t: dict[float, list[float]] = {}
    for r in _drafting_rows(e):
        by_t.setdefault(r.temperature, []).append(r.acceptance)
    for a in e.answers:
        if a.summary.drafted:
            by_t.setdefault(a.temperature, []).append(a.summary.acceptance_rate)
    if len(by_t) < 2:
        return []
    cool, hot = min(by_t), max(by_t)
    low, high = sum(by_t[hot]) / len(by_t[hot]), sum(by_t[cool]) / len(by_t[cool])
    if low < high - TEMPERATURE_DROP:
        return [Diagnosis("temperature", low, high, "lower_temperature", temperature=cool)]
    return []


def draft_cost(e: Evidence) -> list[Diagnosis]:
    """No K with the draft model beats standard decoding: measured in a sweep or bench, or, from the
    chat's acceptance, predicted by the costs measured at load."""
    ratio = _draft_ratio(e.info)
    drafted = [r for r in e.sweep if r.mode == "speculative" and r.proposer == "draft" and not math.isnan(r.speedup)]
    if drafted:
        fastest = max(r.speedup for r in drafted)
        return [Diagnosis("draft_cost", fastest, ratio, "use_auto")] if fastest < LOSES else []
    answers = [a for a in e.answers if a.proposer == "draft" and a.summary.drafted]
    if not answers or e.info is None or not e.info.target_ms or ratio <= 0:
        return []
    alpha = alpha_from_per_position(_mean_positions(answers))
    if alpha is None:
        return []
    k, predicted = CostModel.from_info(e.info).best_k(alpha)
    if k == 0:  # best_k reports (0, 1.0) when nothing pays: say what the best K would give
        model = CostModel.from_info(e.info)
        predicted = max(model.predicted_speedup(alpha, j) for j in range(1, model.k_max + 1))
        return [Diagnosis("draft_cost", predicted, ratio, "use_auto")]
    return []


def best_k(e: Evidence) -> list[Diagnosis]:
    """A fixed K measured clearly faster than the K set now (same proposer and temperature)."""
    if e.k is None:
        return []
    same = [r for r in e.sweep if r.mode == "speculative" and r.proposer == e.proposer
            and r.temperature == e.temperature and not math.isnan(r.speedup)]
    fixed = [r for r in same if r.k != K_AUTO]
    if not fixed:
        return []
    top = max(fixed, key=lambda r: r.speedup)
    current = next((r for r in same if r.k == e.k), None)
    if current is None or top.k == e.k or top.speedup < BETTER_K * current.speedup or top.speedup < LOSES:
        return []
    return [Diagnosis("best_k", top.speedup, current.speedup, "apply_k", k=top.k, temperature=e.temperature)]


def memory(e: Evidence) -> list[Diagnosis]:
    if e.memory_used is None or e.memory_used < MEMORY_FULL:
        return []
    return [Diagnosis("memory", e.memory_used, e.memory_total_gib or 0.0, "none")]


def categories(e: Evidence) -> list[Diagnosis]:
    """Prompt categories where speculative decoding measured slower than standard."""
    return [Diagnosis("category", speedup, 1.0, "use_auto", category=name)
            for name, speedup in e.categories if not math.isnan(speedup) and speedup < LOSES]


# --------------------------------------------------------------------------- evidence from elsewhere

def _draft_ratio(info: ModelInfo | None) -> float:
    if info is None or not info.target_ms or info.draft_ms <= 0:
        return 0.0
    return info.draft_ms / dict(info.target_ms)[1]


def _mean_positions(answers: Sequence[AnswerFacts]) -> list[float]:
    length = max(len(a.summary.per_position_acceptance) for a in answers)
    out = []
    for i in range(length):
        values = [(a.summary.per_position_acceptance[i], a.summary.drafted) for a in answers
                  if i < len(a.summary.per_position_acceptance)]
        weight = sum(w for _, w in values)
        out.append(sum(v * w for v, w in values) / weight if weight else 0.0)
    return out


def from_bench(summary: Mapping[str, Any], info: ModelInfo | None, *, k: int, temperature: float,
               proposer: str = "draft") -> Evidence:
    """Evidence from a bench summary (engine.measure.bench.summarize_runs): its engine modes as
    rows against standard, and its per-category speedups."""
    rows = []
    base = summary.get("standard", {}).get("tokens_per_s", 0.0)
    for mode in ("speculative", "auto"):
        m = summary.get(mode)
        if not m:
            continue
        rows.append(SweepRow(mode, proposer, k if mode == "speculative" else K_AUTO, temperature,  # type: ignore[arg-type]
                             m["tokens_per_s"], m["tokens_per_s"] / base if base else math.nan,
                             m["acceptance_rate"], m["tokens_per_target_forward"],
                             tuple(m.get("per_position_acceptance", ())), m["time_split"]["draft"], None, None, 0,
                             m.get("runs", 1), m.get("k_mean", 0.0)))
    cats = [(name, c["vs_standard"]["speculative"]) for name, c in summary.get("categories", {}).items()
            if "speculative" in c.get("vs_standard", {})]
    return Evidence(sweep=tuple(rows), info=info, k=k, proposer=proposer, temperature=temperature,
                    categories=tuple(cats) if len(cats) > 1 else ())


def category_speedups(pairs: Iterable[tuple[str, float, float]]) -> tuple[tuple[str, float], ...]:
    """(category, standard tok/s, speculative tok/s) measurements → (category, speedup) per category,
    from totals (so categories with more runs are not averaged away)."""
    sums: dict[str, list[float]] = {}
    for category, standard, speculative in pairs:
        if standard > 0 and speculative > 0:
            acc = sums.setdefault(category, [0.0, 0.0])
            acc[0] += 1 / standard  # seconds per token: add times, not rates
            acc[1] += 1 / speculative
    return tuple((c, s[0] / s[1]) for c, s in sums.items())
