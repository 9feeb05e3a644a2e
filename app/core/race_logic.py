"""The arithmetic of a race (speedup, identity, first divergence, spread over repeats) and its CSV; no Qt."""
from __future__ import annotations

import csv
import math
import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Literal

from app.core.export import ENCODING, cell, now_iso, restore, write_csv
from engine.measure.verdict import NOISE_FLOOR, is_win, speedup_spread
from engine.measure import experiment
from engine.measure.experiment import BenchPrompt
from engine.types import ModelInfo, Mode, Step, Summary

NEAR_TIE = 0.05  # target probabilities closer than this are a near-tie: rounding can flip argmax
CUSTOM = "custom"  # prompt id and category of a prompt typed by hand

DivergenceKind = Literal["near_tie", "numerics", "length"]


__all__ = ["BenchPrompt"]  # the experiment core's prompt record, re-exported for the race's callers


def load_bench_prompts() -> tuple[BenchPrompt, ...]:
    """assets/bench_prompts.jsonl (a packaged copy of the benchmark prompts), in file order."""
    return experiment.packaged_prompts()


def prompt_meta(text: str, prompts: Sequence[BenchPrompt]) -> BenchPrompt:
    """The bench prompt whose text this is, or a CUSTOM one (the person edited or typed it)."""
    stripped = text.strip()
    for p in prompts:
        if p.prompt.strip() == stripped:
            return p
    return BenchPrompt(CUSTOM, CUSTOM, stripped)


@dataclass(frozen=True)
class Divergence:
    """Where greedy standard and speculative outputs first differ, and the numbers that explain it."""

    index: int  # 0-based index of the first differing committed token
    kind: DivergenceKind  # near_tie / numerics / length (one output is a prefix of the other)
    standard_token: int | None  # token id standard decoding committed there (None: it had ended)
    speculative_token: int | None  # token id speculative decoding committed there (None: it had ended)
    standard_p: float | None  # target p of the standard token, from the standard run
    speculative_p: float | None  # target p of the speculative token, from the verify forward


@dataclass(frozen=True)
class RaceResult:
    """One repeat of a race: the two modes' own Summaries and what comparing them says."""

    race_id: int  # which race (one Race click) this repeat belongs to
    repeat: int  # 0-based repeat index within the race
    prompt_id: str  # bench prompt id, or CUSTOM
    category: str  # bench category, or CUSTOM
    k: int  # draft length of the speculative run
    temperature: float  # sampling temperature of both runs (0 = greedy)
    seed: int  # sampling seed of both runs
    standard: Summary  # the standard (target-only) run, timed by its own Steps
    speculative: Summary  # the speculative run, timed by its own Steps
    speedup: float  # speculative.tokens_per_s / standard.tokens_per_s
    identical: bool | None  # greedy only: same committed token ids; None when sampling
    divergence: Divergence | None  # the first differing token (greedy runs that differ)
    question: str = ""  # the prompt both runs answered
    timestamp: str = ""  # ISO 8601, when the repeat finished
    info: ModelInfo | None = None  # the pair that ran it
    proposer: str = ""  # where the speculative run's drafts came from

    @property
    def divergence_index(self) -> int | None:
        return self.divergence.index if self.divergence is not None else None

    @property
    def reason(self) -> str | None:
        return describe_divergence(self.divergence) if self.divergence is not None else None


@dataclass(frozen=True)
class SpeedupStats:
    """Median and spread of the speedup over the repeats of one race."""

    n: int  # repeats
    median: float
    minimum: float
    maximum: float
    q1: float  # 25th percentile (inclusive method; equals the median for one repeat)
    q3: float  # 75th percentile

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1


@dataclass(frozen=True)
class RaceSummary:
    """A finished race over its repeats: one row of the per-category table."""

    race_id: int
    prompt_id: str
    category: str
    repeats: tuple[RaceResult, ...]  # in the order they ran
    speedup: SpeedupStats  # over repeats
    standard_tokens_per_s: float  # median over repeats
    speculative_tokens_per_s: float  # median over repeats
    acceptance_rate: float  # median over repeats
    tokens_per_target_forward: float  # median over repeats (speculative)
    identical: bool | None  # all repeats identical (greedy); None when sampling
    verdict: str = ""  # in plain words, by the one rule Chat and Tune use (engine.measure.verdict)


# --------------------------------------------------------------------------- comparing two runs

def committed_tokens(steps: Iterable[Step]) -> list[tuple[int, float | None]]:
    """(token id, target p) of every committed token in order: rejected drafts are left out."""
    return [(t.token_id, t.p) for s in steps for t in s.tokens if t.status != "rejected"]


def speedup(standard: Summary, speculative: Summary) -> float:
    """What each mode achieves alone, divided (experiment.speedup): NaN when standard produced nothing."""
    return experiment.speedup(standard.tokens_per_s, speculative.tokens_per_s)


def first_divergence(standard_steps: Sequence[Step], speculative_steps: Sequence[Step]) -> Divergence | None:
    """None when the committed token ids are identical (experiment.first_difference), else the first
    index where they differ, with the target probabilities that explain it."""
    std, spec = committed_tokens(standard_steps), committed_tokens(speculative_steps)
    i = experiment.first_difference([t for t, _ in std], [t for t, _ in spec])
    if i is None:
        return None
    (a, pa), (b, pb) = (std[i] if i < len(std) else (None, None)), (spec[i] if i < len(spec) else (None, None))
    if a is None or b is None:
        return Divergence(i, "length", a, b, pa, pb)
    near = pa is not None and pb is not None and abs(pa - pb) <= NEAR_TIE
    return Divergence(i, "near_tie" if near else "numerics", a, b, pa, pb)


def describe_divergence(d: Divergence) -> str:
    """Why the outputs differ at token d.index, in one plain phrase (the view says where)."""
    if d.kind == "length":
        shorter = "standard" if d.standard_token is None else "speculative"
        return f"the {shorter} output ended there while the other went on"
    probs = ""
    if d.standard_p is not None and d.speculative_p is not None:
        probs = f"target p={d.standard_p:.2f} vs {d.speculative_p:.2f}"
    if d.kind == "near_tie":
        return f"near-tie: {probs} — batched verification in bf16 can flip argmax"
    return "the verify forward's numerics differ from single-token decoding" + (f" ({probs})" if probs else "")


def race_result(
    *,
    race_id: int,
    repeat: int,
    prompt: BenchPrompt,
    k: int,
    temperature: float,
    seed: int,
    standard: tuple[Sequence[Step], Summary],
    speculative: tuple[Sequence[Step], Summary],
    info: ModelInfo | None = None,
    proposer: str = "",
) -> RaceResult:
    """Compares one repeat. Identity is only claimed for greedy runs: sampled outputs differ by design."""
    (std_steps, std), (spec_steps, spec) = standard, speculative
    greedy = temperature <= 0.0
    divergence = first_divergence(std_steps, spec_steps) if greedy else None
    return RaceResult(
        race_id=race_id, repeat=repeat, prompt_id=prompt.id, category=prompt.category, k=k,
        temperature=temperature, seed=seed, standard=std, speculative=spec, speedup=speedup(std, spec),
        identical=(divergence is None) if greedy else None, divergence=divergence, question=prompt.prompt,
        timestamp=now_iso(), info=info, proposer=proposer,
    )


# --------------------------------------------------------------------------- repeats

def speedup_stats(values: Sequence[float]) -> SpeedupStats:
    """Median, min–max and quartiles; NaNs (a standard run with no tokens) are left out."""
    xs = sorted(v for v in values if not math.isnan(v))
    if not xs:
        nan = math.nan
        return SpeedupStats(0, nan, nan, nan, nan, nan)
    if len(xs) == 1:
        q1 = q3 = xs[0]
    else:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return SpeedupStats(len(xs), statistics.median(xs), xs[0], xs[-1], q1, q3)


def summarize_race(results: Sequence[RaceResult]) -> RaceSummary:
    assert results, "a race summary needs at least one repeat"
    first = results[0]

    def median(values: Iterable[float]) -> float:
        xs = [v for v in values if not math.isnan(v)]
        return statistics.median(xs) if xs else math.nan

    flags = [r.identical for r in results]
    return RaceSummary(
        race_id=first.race_id,
        prompt_id=first.prompt_id,
        category=first.category,
        repeats=tuple(results),
        speedup=speedup_stats([r.speedup for r in results]),
        standard_tokens_per_s=median(r.standard.tokens_per_s for r in results),
        speculative_tokens_per_s=median(r.speculative.tokens_per_s for r in results),
        acceptance_rate=median(r.speculative.acceptance_rate for r in results),
        tokens_per_target_forward=median(r.speculative.tokens_per_target_forward for r in results),
        identical=None if any(f is None for f in flags) else all(flags),
        verdict=race_verdict([r.speedup for r in results], median(r.speculative.acceptance_rate for r in results)),
    )


def race_verdict(speedups: Sequence[float], acceptance: float) -> str:
    """Who won, only beyond the spread the repeats show (one repeat: the noise floor), e.g. "No clear winner:
    1.02× is within the ±3% that runs of the same work vary by"."""
    stats = speedup_stats(speedups)
    if stats.n == 0:
        return ""
    spread = speedup_spread([v for v in speedups if not math.isnan(v)])
    margin = f"±{max(spread, NOISE_FLOOR):.0%}"
    if is_win(stats.median, spread, acceptance):
        return f"Speculative decoding is faster here: {stats.median:.2f}×, beyond the {margin} its runs vary by"
    if stats.median > 1 and not acceptance > 0:
        return f"No clear winner: no drafted token was accepted, so {stats.median:.2f}× is noise"
    if 1 - stats.median > max(spread, NOISE_FLOOR):
        return f"Standard decoding is faster here: speculative ran at {stats.median:.2f}×"
    again = "; race again for a firmer answer" if stats.n == 1 else ""
    return f"No clear winner: {stats.median:.2f}× is within the {margin} that runs of the same work vary by{again}"


def run_order(repeat: int) -> tuple[Mode, Mode]:
    """Standard first on even repeats, speculative first on odd ones: slow drift (clocks, heat) cancels."""
    return ("standard", "speculative") if repeat % 2 == 0 else ("speculative", "standard")



# --------------------------------------------------------------------------- CSV

@dataclass(frozen=True)
class RaceRow:
    """One CSV row: one run (one mode) of one repeat of one race."""

    race_id: int
    repeat: int
    prompt_id: str
    category: str
    mode: str  # "standard" or "speculative"
    new_tokens: int
    seconds: float
    tokens_per_s: float
    acceptance_rate: float
    tokens_per_target_forward: float
    target_forwards: int
    draft_forwards: int
    k: int  # the race's K (also on the standard row, which drafts nothing)
    temperature: float
    seed: int
    identical: bool | None  # empty cell when sampling
    first_divergence: int | None  # empty cell when identical or sampling
    speedup: float  # of the repeat, on both rows


RACE_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(RaceRow))


def race_rows(results: Iterable[RaceResult]) -> list[RaceRow]:
    rows = []
    for r in results:
        for summary in (r.standard, r.speculative):
            rows.append(RaceRow(
                race_id=r.race_id, repeat=r.repeat, prompt_id=r.prompt_id, category=r.category, mode=summary.mode,
                new_tokens=summary.new_tokens, seconds=summary.seconds, tokens_per_s=summary.tokens_per_s,
                acceptance_rate=summary.acceptance_rate, tokens_per_target_forward=summary.tokens_per_target_forward,
                target_forwards=summary.target_forwards, draft_forwards=summary.draft_forwards, k=r.k,
                temperature=r.temperature, seed=r.seed, identical=r.identical,
                first_divergence=r.divergence_index, speedup=r.speedup,
            ))
    return rows


def write_race_csv(path: str | os.PathLike[str], results: Iterable[RaceResult]) -> int:
    """Two rows per repeat; returns the row count. Raises OSError (results untouched) if it cannot write."""
    rows = [{c: cell(getattr(row, c)) for c in RACE_COLUMNS} for row in race_rows(results)]
    return write_csv(path, RACE_COLUMNS, rows)


def _parse(kind: str, text: str) -> object:
    if kind.endswith("| None") and text == "":
        return None
    if kind.startswith("bool"):
        return text == "true"
    if kind.startswith("int"):
        return int(text)
    if kind.startswith("float"):
        return float(text)
    return restore(text)


def read_race_csv(path: str | os.PathLike[str]) -> list[RaceRow]:
    """Reads what write_race_csv wrote, with the original types."""
    kinds = {f.name: str(f.type) for f in fields(RaceRow)}
    with open(path, encoding=ENCODING, newline="") as f:
        return [RaceRow(**{c: _parse(kinds[c], raw[c]) for c in RACE_COLUMNS}) for raw in csv.DictReader(f)]
