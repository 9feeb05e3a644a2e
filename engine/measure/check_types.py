"""The draft check's results as plain data: one row per proposer, and the ranked report (engine/measure/check.py)."""
from __future__ import annotations

from dataclasses import dataclass

STOPPED = "The draft check was stopped."  # why a check ends early (Stop, or the app closing)


@dataclass(frozen=True)
class CandidateCheck:
    """One proposer's figures: what it agrees with, what it costs, what it should give here."""

    name: str  # the draft model's name, "draft head <name>" or "n-gram lookup"
    kind: str  # "draft", "head" or "ngram"
    status: str  # "ok", or "refused" (another tokenizer, a runtime that cannot run it) with `reason`
    reason: str = ""  # one line: why it was refused ("" when ok)
    params: int = 0  # its parameters (0: n-gram lookup, or unknown)
    size_ratio: float | None = None  # its parameters over the target's
    kl: float | None = None  # mean KL(target || draft) in nats at T = 1 (None: not a distribution, or refused)
    top1: float | None = None  # top-1 agreement with the target at draft position 1
    greedy_positions: tuple[float, ...] = ()  # expected acceptance per draft position at T = 0, at its best K
    sampled_positions: tuple[float, ...] = ()  # the same at the temperature asked (1 - TV, or p(x) for point masses)
    cost_ratio: float | None = None  # one drafted token over one 1-token target forward (measured here)
    best_k: int = 0  # the K with the highest predicted speedup at the asked temperature (0: not priced)
    speedup: float | None = None  # predicted tokens/s over standard decoding at best_k (below 1: it will not pay)
    speedups: tuple[float, ...] = ()  # predicted speedup for K = 1, 2, ... at the asked temperature
    tree: bool = False  # best_k is verified as a tree of the head's alternatives (measured tree costs)
    round_overhead_ms: float | None = None  # per round beyond its priced forwards, measured on the head's own rounds
    # 90% ranges over resamples of the probe prompts (check_tally.spread): how much the prediction depends on the
    # text read; None where there were too few probes
    first_range: tuple[float, float] | None = None  # acceptance at draft position 1, at the asked temperature
    speedup_range: tuple[float, float] | None = None  # the predicted speedup
    positions_from: str = ""  # how positions beyond the first were obtained
    spec: str = ""  # where a draft model loads from (a folder, .gguf or hub id; "" for the loaded one and the rest)


@dataclass(frozen=True)
class CheckReport:
    """The ranked result of one check, as plain data for the CLI, the app and JSON."""

    target: str  # the target's name
    runtime: str  # "torch" or "llamacpp"
    device: str  # where the forwards ran
    temperature: float  # the sampling the acceptance is priced at (0 = greedy)
    top_p: float  # its top-p (1 disables)
    top_k: int  # its top-k (0 disables)
    probes: int  # probe prompts read
    probe_tokens: int  # continuation tokens compared, over all probes
    target_ms: float  # one 1-token target forward, measured at load
    candidates: tuple[CandidateCheck, ...]  # ranked: best predicted speedup first, refused ones last
    verdict: str  # one line a person can act on
    wall_s: float  # seconds the check took after the models were loaded
    phases: tuple[tuple[str, float], ...] = ()  # (part, seconds): the target's continuations, each candidate
    answer_tokens: int | None = None  # the answer length the speedups are priced for (None: per round)

    @property
    def best(self) -> CandidateCheck | None:
        """The first candidate that pays (predicted speedup above 1), or None."""
        return next((c for c in self.candidates if c.speedup is not None and c.speedup > 1.0), None)
