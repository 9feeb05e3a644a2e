"""Sweeps over proposer × K × temperature on the experiment core: one row per configuration, with its own standard baseline.

Every temperature gets a standard configuration measured in the same run, prompt by prompt
between the others (experiment.schedule), so each speedup is over standard decoding at that
temperature on the same machine state. The CLI writes the rows as CSV and a PNG; the app's Tune
tab runs the same sweep in its worker and plots the rows as they fill in.
"""
from __future__ import annotations

import csv
import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from engine.errors import InputError
from engine.limits import K_AUTO, K_MAX
from engine.measure.csvsafe import safe_cell
from engine.measure.verdict import is_win, speedup_spread
from engine.measure.experiment import (
    BenchPrompt,
    RunRecord,
    Task,
    by_category,
    first_difference,
    position_acceptance,
    predicted_speedup,
    record_run,
    run_tasks,
    schedule,
    speedup,
    totals,
)
from engine.types import PROPOSERS, GenerationRequest, ModelInfo, SweepRow

if TYPE_CHECKING:
    from engine.decoding import Engine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SweepConfig:
    """One configuration to measure."""

    mode: str  # "standard", "speculative" or "auto"
    proposer: str | None  # "draft", "ngram", "draft+ngram"; None for standard
    k: int  # fixed K, K_AUTO for adaptive, 0 for standard
    temperature: float  # 0 = greedy

    @property
    def label(self) -> str:
        """The run label in records: unique per configuration."""
        if self.mode == "standard":
            return f"standard T={self.temperature:g}"
        if self.mode == "auto":
            return f"auto {self.proposer} T={self.temperature:g}"
        return f"{self.proposer} K={self.k or 'auto'} T={self.temperature:g}"


# (prompt text, configuration, max_new_tokens) -> the request; the caller owns settings → request.
RequestFactory = Callable[[str, SweepConfig, int], GenerationRequest]


def parse_list(text: str, kind: Callable[[str], object], name: str) -> list:
    """"1,2,3" → [1, 2, 3]; a bad item is one InputError naming the option."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise InputError(f"--{name} needs at least one value")
    try:
        values = [kind(t) for t in items]
    except ValueError:
        raise InputError(f"--{name}: cannot read {text!r}") from None
    if len(set(values)) != len(values):
        raise InputError(f"--{name}: a value is listed twice in {text!r}")
    return values


def parse_k(text: str) -> int:
    """A K of a sweep: 1..K_MAX or "auto"."""
    if text.strip().lower() == "auto":
        return K_AUTO
    k = int(text)
    if not 1 <= k <= K_MAX:
        raise ValueError(text)
    return k


def plan(proposers: Sequence[str], ks: Sequence[int], temperatures: Sequence[float], *,
         auto: bool = False) -> list[SweepConfig]:
    """Standard at each temperature, then every proposer × K (and auto per proposer when asked)."""
    unknown = [p for p in proposers if p not in PROPOSERS]
    if unknown:
        raise InputError(f"unknown proposer(s) {', '.join(unknown)}: choose from {', '.join(PROPOSERS)}")
    if any(t < 0 or not math.isfinite(t) for t in temperatures):
        raise InputError("temperatures must be finite and >= 0")
    configs = []
    for t in temperatures:
        configs.append(SweepConfig("standard", None, 0, t))
        for p in proposers:
            configs += [SweepConfig("speculative", p, k, t) for k in ks]
            if auto:
                configs.append(SweepConfig("auto", p, K_AUTO, t))
    return configs


def needs_draft(configs: Sequence[SweepConfig]) -> bool:
    return any(c.proposer in ("draft", "draft+ngram") for c in configs)


def run_sweep(engine: Engine, prompts: Sequence[BenchPrompt], configs: Sequence[SweepConfig], *,
              make_request: RequestFactory, max_new_tokens: int, repeat: int = 1,
              progress: Callable[[int, int, RunRecord], None] | None = None,
              cancel: threading.Event | None = None) -> list[RunRecord]:
    """Times every configuration on every prompt, `repeat` times; `progress(done, total, record)` after each.

    Each prompt is warmed first (a short untimed generation that prefills both models; on a CPU
    also one more pass of the cost measurement, Engine.measure_again, so the predictions use
    costs measured in the same minutes as the runs), and the configuration order rotates per
    prompt and repeat. When `cancel` is set the run in progress
    stops at its next step and is dropped; every run finished before it is returned.
    """
    cancel = cancel or threading.Event()
    by_label = {c.label: c for c in configs}
    warm_config = next((c for c in configs if c.proposer not in (None, "ngram")), configs[0])

    measure_again = getattr(engine, "measure_again", None)

    def warm(prompt: BenchPrompt) -> None:
        list(engine.generate(make_request(prompt.prompt, warm_config, min(max_new_tokens, 4)), cancel))
        if measure_again is not None:  # costs measured beside the runs, for the prediction (CPU only)
            measure_again()

    records: list[RunRecord] = []  # kept as they come, so a stopped sweep keeps every finished run

    def run(task: Task) -> RunRecord:
        generation = engine.generate(make_request(task.prompt.prompt, by_label[task.label], max_new_tokens), cancel)
        steps = list(generation)
        if cancel.is_set():
            raise _Stopped
        records.append(record_run(generation, steps, task.prompt, task.label, task.repeat))
        return records[-1]

    def report(done: int, total: int, _note: str) -> None:
        if progress is not None:
            progress(done, total, records[-1])

    tasks = schedule(prompts, [c.label for c in configs], repeat)
    try:
        run_tasks(tasks, run, warm=warm, progress=report)
    except _Stopped:
        log.info("sweep stopped after %d of %d runs", len(records), len(tasks))
    return records


class _Stopped(Exception):
    """Raised between runs when the sweep is cancelled."""


def rows(records: Sequence[RunRecord], configs: Sequence[SweepConfig], info: ModelInfo | None) -> list[SweepRow]:
    """One row per configuration with runs so far (partial sweeps give partial rows)."""
    out = []
    for config in configs:
        runs = [r for r in records if r.mode == config.label]
        if not runs:
            continue
        base = [r for r in records if r.mode == SweepConfig("standard", None, 0, config.temperature).label]
        # Like with like: the baseline over the same prompts and repeats as this configuration.
        keys = {(r.prompt_id, r.repeat) for r in runs}
        base = [r for r in base if (r.prompt_id, r.repeat) in keys]
        t, b = totals(runs), totals(base)
        greedy = config.temperature <= 0
        by_key = {(r.prompt_id, r.repeat): r for r in base}
        pairs = [(by_key[(r.prompt_id, r.repeat)], r) for r in runs if (r.prompt_id, r.repeat) in by_key]
        identical = sum(first_difference(a.token_ids, c.token_ids) is None for a, c in pairs) if greedy else None
        out.append(SweepRow(
            mode=config.mode,  # type: ignore[arg-type]
            proposer=config.proposer,  # type: ignore[arg-type]
            k=config.k,
            temperature=config.temperature,
            tokens_per_s=t["tokens_per_s"],
            speedup=speedup(b["tokens_per_s"], t["tokens_per_s"]) if base else math.nan,
            acceptance=t["acceptance_rate"],
            tokens_per_target_forward=t["tokens_per_target_forward"],
            acceptance_by_position=position_acceptance(runs),
            drafting_share=t["time_split"]["draft"],
            predicted_speedup=(predicted_speedup(info, runs, base) if info is not None and base
                               and config.mode != "standard" else None),
            identical=identical,
            compared=len(pairs) if greedy else 0,
            runs=len(runs),
            k_mean=t["k_mean"],
            spread=speedup_spread([c.tokens_per_s / a.tokens_per_s for a, c in pairs if a.tokens_per_s > 0]),
        ))
    return out


def category_speedups(records: Sequence[RunRecord], configs: Sequence[SweepConfig]) -> dict[str, dict[str, float]]:
    """Per configuration label: its speedup over standard (same temperature) in each prompt category."""
    out: dict[str, dict[str, float]] = {}
    for config in configs:
        if config.mode == "standard":
            continue
        base = SweepConfig("standard", None, 0, config.temperature).label
        table = by_category([r for r in records if r.mode in (base, config.label)], [base, config.label], base=base)
        out[config.label] = {cat: entry[f"vs_{base}"][config.label] for cat, entry in table.items()
                             if f"vs_{base}" in entry}
    return out


def label_of(row: SweepRow, configs: Sequence[SweepConfig]) -> str:
    """The run label of the configuration a row describes."""
    return next(c.label for c in configs if (c.mode, c.proposer, c.k, c.temperature)
                == (row.mode, row.proposer, row.k, row.temperature))


def best(sweep: Sequence[SweepRow], *, fixed_only: bool = False) -> SweepRow | None:
    """The fastest configuration that beat standard decoding beyond the measured spread (and accepted
    drafted tokens); else standard decoding itself (the fastest of its rows): noise is never a win."""
    candidates = [r for r in sweep if not fixed_only or (r.mode != "auto" and (r.k or r.mode == "standard"))]
    candidates = [r for r in candidates if not math.isnan(r.speedup)]
    wins = [r for r in candidates if r.mode != "standard" and is_win(r.speedup, r.spread, r.acceptance)]
    if wins:
        return max(wins, key=lambda r: r.speedup)
    standard = [r for r in candidates if r.mode == "standard"]
    return max(standard, key=lambda r: r.tokens_per_s, default=None)


CSV_COLUMNS = ("proposer", "k", "temperature", "mode", "tokens_per_s", "speedup", "predicted_speedup",
               "prediction_error", "acceptance", "tokens_per_target_forward", "acceptance_by_position",
               "drafting_share", "identical", "compared", "runs", "k_mean")


def csv_row(row: SweepRow) -> dict[str, object]:
    """One CSV row: the configuration, its figures, and how far the prediction was off."""
    values = {f.name: getattr(row, f.name) for f in fields(SweepRow)}
    values["proposer"] = row.proposer or "standard"
    values["k"] = "auto" if row.mode != "standard" and row.k == K_AUTO else row.k
    values["acceptance_by_position"] = ";".join(f"{a:.4f}" for a in row.acceptance_by_position)
    error = (row.predicted_speedup / row.speedup - 1) if row.predicted_speedup and row.speedup else None
    values["prediction_error"] = error
    values["identical"] = "" if row.identical is None else row.identical
    values["predicted_speedup"] = "" if row.predicted_speedup is None else row.predicted_speedup
    return {c: ("" if values[c] is None else values[c]) for c in CSV_COLUMNS}


def write_csv(path: str | os.PathLike[str], sweep: Sequence[SweepRow]) -> None:
    """Writes to a temp file then renames, so a failed write leaves no half file (sweep.json keeps csv_row's raw text)."""
    tmp = f"{os.fspath(path)}.partial"
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(CSV_COLUMNS))
        writer.writeheader()
        # Text cells are neutralised (the OWASP rule): a spreadsheet never runs them as formulas.
        writer.writerows({c: safe_cell(v) for c, v in csv_row(r).items()} for r in sweep)
    os.replace(tmp, path)


def format_rows(sweep: Sequence[SweepRow]) -> str:
    """The table the CLI prints."""
    lines = [f"{'configuration':<22}{'T':>5}{'tok/s':>9}{'speedup':>9}{'predicted':>10}{'accept':>8}"
             f"{'tok/fwd':>8}{'drafting':>9}{'identical':>10}"]
    top = best(sweep)
    for r in sweep:
        predicted = f"{r.predicted_speedup:>9.2f}x" if r.predicted_speedup is not None else f"{'-':>10}"
        identical = f"{r.identical}/{r.compared}" if r.identical is not None else "-"
        mark = " <- best" if r is top else ""
        lines.append(f"{r.label:<22}{r.temperature:>5g}{r.tokens_per_s:>9.2f}{r.speedup:>8.2f}x{predicted}"
                     f"{r.acceptance:>8.0%}{r.tokens_per_target_forward:>8.2f}{r.drafting_share:>9.0%}"
                     f"{identical:>10}{mark}")
    return "\n".join(lines)
