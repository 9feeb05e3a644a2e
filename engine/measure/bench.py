"""Benchmarks on the engine: timed runs per mode, totals, identical-output checks, the cost model's check.

The CLI's `bench` command is a shell over this module: it reads options, loads the pair, and
writes what `run_bench` returns. Prompts, run records, scheduling, the identical-output check and
the speedup come from the one experiment core (experiment.py) that the race and the sweep share.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from engine.errors import EngineError, InputError
from engine.measure.context import BenchContext, ModeSpec, engine_run
from engine.measure.experiment import (
    BenchPrompt,
    RunRecord,
    Task,
    by_category,
    first_difference,
    position_acceptance,
    predicted_speedup,
    read_prompts,
    run_tasks,
    schedule,
    speedup,
    spread,
    totals,
)
from engine.measure.runtimes import RUNTIME_MODES
from engine.measure.costmodel import CostModel, alpha_from_per_position

if TYPE_CHECKING:  # heavy imports (torch, transformers) wait until a bench really runs
    from engine.decoding import Engine

# Re-exported: the CLI, the bench scripts and tests import them from here.
__all__ = ["BenchContext", "BenchPrompt", "RunRecord", "read_prompts"]

log = logging.getLogger(__name__)
ENGINE_MODES = ("standard", "speculative", "auto")  # the modes our own loop runs (the rest are hf-* baselines)


def run_standard(ctx: BenchContext, prompt: BenchPrompt, max_new_tokens: int) -> RunRecord:
    return engine_run(ctx, prompt, max_new_tokens, "standard")


def run_speculative(ctx: BenchContext, prompt: BenchPrompt, max_new_tokens: int) -> RunRecord:
    return engine_run(ctx, prompt, max_new_tokens, "speculative")


def run_auto(ctx: BenchContext, prompt: BenchPrompt, max_new_tokens: int) -> RunRecord:
    return engine_run(ctx, prompt, max_new_tokens, "auto")


def _hf_run(ctx: BenchContext, prompt: BenchPrompt, max_new_tokens: int, variant: str) -> RunRecord:
    """Hugging Face generate() on the same loaded models: the baselines every ratio is measured against."""
    import torch

    from engine.measure.baselines import run_hf

    request = ctx.make_request(prompt.prompt, "standard", max_new_tokens)
    ids = torch.tensor(ctx.engine.encode(request))
    pair = ctx.baseline_pair()
    r = run_hf(pair.target, pair.tokenizer, ids, max_new_tokens, variant,  # type: ignore[arg-type]
               draft=pair.draft, sampling=request.sampling)
    text = ctx.engine.tokenizer.decode(r["token_ids"], skip_special_tokens=True)
    return RunRecord(
        prompt_id=prompt.id, category=prompt.category, mode=variant, new_tokens=r["new_tokens"],
        seconds=r["seconds"], tokens_per_s=r["new_tokens"] / r["seconds"] if r["seconds"] > 0 else 0.0,
        target_forwards=0, draft_forwards=0, drafted=0, accepted=0, text=text, token_ids=tuple(r["token_ids"]),
    )


def run_hf_plain(ctx: BenchContext, prompt: BenchPrompt, max_new_tokens: int) -> RunRecord:
    return _hf_run(ctx, prompt, max_new_tokens, "hf")


def run_hf_static(ctx: BenchContext, prompt: BenchPrompt, max_new_tokens: int) -> RunRecord:
    return _hf_run(ctx, prompt, max_new_tokens, "hf-static")


def run_hf_assisted(ctx: BenchContext, prompt: BenchPrompt, max_new_tokens: int) -> RunRecord:
    return _hf_run(ctx, prompt, max_new_tokens, "hf-assisted")


MODE_RUNNERS: dict[str, ModeSpec] = {  # every mode the bench runs, in the order --modes lists them
    "standard": ModeSpec(run_standard, needs_draft=False),
    "speculative": ModeSpec(run_speculative, needs_draft=True),
    "auto": ModeSpec(run_auto, needs_draft=True),
    "hf": ModeSpec(run_hf_plain, needs_draft=False),
    "hf-static": ModeSpec(run_hf_static, needs_draft=False),
    "hf-assisted": ModeSpec(run_hf_assisted, needs_draft=True),
    **RUNTIME_MODES,
}


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODE_RUNNERS]
    if not modes or unknown:
        names = ", ".join(unknown) or repr(text)
        raise InputError(f"unknown mode(s) {names}: choose from {', '.join(MODE_RUNNERS)}")
    if len(set(modes)) != len(modes):
        raise InputError(f"a mode is listed twice in --modes {text}")
    return modes


def summarize_runs(runs: Sequence[RunRecord], modes: Sequence[str], tokenizer) -> dict[str, Any]:
    """Per-mode totals (with median and spread over repeats), per-category figures, speedups, and
    every divergence from standard decoding (never hidden)."""
    out: dict[str, Any] = {}
    for mode in modes:
        out[mode] = totals([r for r in runs if r.mode == mode])
        repeated = spread(runs, mode)
        if repeated is not None:
            out[mode]["repeats"] = repeated
    if "standard" in out and "speculative" in out:
        out["speedup"] = speedup(out["standard"]["tokens_per_s"], out["speculative"]["tokens_per_s"])
    if "standard" in out:
        base = out["standard"]["tokens_per_s"]
        out["vs_standard"] = {m: speedup(base, out[m]["tokens_per_s"]) for m in modes if m != "standard" and base}
        # Greedy fidelity: every other mode's output against our own standard decoding.
        out["fidelity"] = {m: compare_outputs(runs, m, tokenizer) for m in modes if m != "standard"}
        if "speculative" in out["fidelity"]:
            spec = out["fidelity"]["speculative"]
            out.update(identical_outputs=spec["identical"], compared=spec["compared"], divergences=spec["divergences"])
    out["categories"] = by_category(runs, modes)
    return out


def compare_outputs(runs: Sequence[RunRecord], mode: str, tokenizer) -> dict[str, Any]:
    """How many of `mode`'s outputs equal standard decoding's, and where each other one diverges.

    The hf-* baselines are forced past EOS (equal token counts for fair tok/s), so outputs are
    compared over the standard output's length, without the EOS that ended it. With repeats,
    each repeat is compared with the standard run of the same repeat.
    """
    by_key = {(r.prompt_id, r.mode, r.repeat): r for r in runs}
    identical, compared, divergences = 0, 0, []
    for r in runs:
        other = by_key.get((r.prompt_id, mode, r.repeat))
        if r.mode != "standard" or other is None:
            continue
        a, b = r.token_ids, other.token_ids
        if mode.startswith("hf"):
            if len(a) < len(b):
                a = a[:-1]  # standard stopped on EOS, which the baselines are not allowed to emit
            b = b[: len(a)]
        compared += 1
        pos = first_difference(a, b)
        if pos is None:
            identical += 1
            continue
        divergences.append({
            "prompt_id": r.prompt_id,
            "position": pos,
            # A missing token means one output stopped earlier than the other.
            "standard_token": tokenizer.decode([a[pos]]) if pos < len(a) else None,
            f"{mode}_token": tokenizer.decode([b[pos]]) if pos < len(b) else None,
        })
    return {"identical": identical, "compared": compared, "divergences": divergences}


def format_table(summary: dict[str, Any], modes: Sequence[str]) -> str:
    rows = [f"{'mode':<14}{'tok/s':>9}{'tokens':>9}{'seconds':>10}{'accept':>9}{'tok/fwd':>9}{'K mean':>8}"
            f"{'draft':>7}{'verify':>8}{'other':>7}"]
    for mode in modes:
        s = summary[mode]
        split = s["time_split"]
        engine_mode = s.get("in_rounds") is not None
        shares = (f"{split['draft']:>7.0%}{split['verify']:>8.0%}{split['prefill'] + split['overhead']:>7.0%}"
                  if engine_mode else f"{'-':>7}{'-':>8}{'-':>7}")
        rows.append(f"{mode:<14}{s['tokens_per_s']:>9.2f}{s['new_tokens']:>9d}{s['seconds']:>10.2f}"
                    f"{s['acceptance_rate']:>9.1%}{s['tokens_per_target_forward']:>9.2f}{s['k_mean']:>8.2f}{shares}")
        if s.get("repeats"):
            r = s["repeats"]
            rows.append(f"{'':<14}median {r['median']:.2f} tok/s over {r['repeats']} repeats "
                        f"(min {r['min']:.2f}, max {r['max']:.2f})")
    for mode in modes:
        rates = summary[mode].get("per_position_acceptance")
        if rates and mode != "standard":
            rows.append(f"{mode} acceptance by draft position: " + " ".join(f"{a:.2f}" for a in rates))
    if summary.get("speedup") is not None:
        rows.append(f"speedup (speculative / standard): {summary['speedup']:.2f}x")
    for mode, ratio in summary.get("vs_standard", {}).items():
        if mode != "speculative":
            rows.append(f"{mode} / standard: {ratio:.2f}x")
    categories = summary.get("categories") or {}
    others = [m for m in modes if m != "standard"]
    if len(categories) > 1 and "standard" in modes and others:
        rows.append("per category, over standard: " + "; ".join(
            f"{cat} " + ", ".join(f"{m} {c['vs_standard'][m]:.2f}x" for m in others)
            for cat, c in categories.items()))
    for mode, f in summary.get("fidelity", {}).items():
        label = "identical outputs" if mode == "speculative" else f"identical to standard ({mode})"
        rows.append(f"{label}: {f['identical']}/{f['compared']}")
        for d in f["divergences"]:
            rows.append(f"  {d['prompt_id']}: first divergence at token {d['position']}: "
                        f"standard {d['standard_token']!r} vs {mode} {d.get(mode + '_token')!r}")
    cost = summary.get("cost_model")
    if cost:
        rows.append(f"cost model{' (sampled rounds)' if cost.get('sampled') else ''}: draft {cost['draft_ms']:.2f} ms, target "
                    + ", ".join(f"w{w} {ms:.2f}" for w, ms in cost["target_ms"].items()) + " ms")
        for mode, predicted in cost.get("predicted", {}).items():
            measured = summary.get("vs_standard", {}).get(mode)
            if predicted is not None and measured is not None:
                rows.append(f"  predicted {mode}/standard {predicted:.2f}x, measured {measured:.2f}x "
                            f"(error {predicted / measured - 1:+.0%})")
        rows.append(f"  {cost['verdict']}")
    for line in summary.get("diagnostics", []):
        rows.append(f"diagnosis: {line}")
    if summary.get("peak_gpu_memory_mb") is not None:
        rows.append(f"peak GPU memory: {summary['peak_gpu_memory_mb']:.0f} MB "
                    f"(first prompt {summary['peak_gpu_memory_first_mb']:.0f} MB, last {summary['peak_gpu_memory_last_mb']:.0f} MB)")
    for e in summary.get("errors", []):
        rows.append(f"error in {e['mode']} on {e['prompt_id']}: {e['message']}")
    return "\n".join(rows)


DRAFTER_NAMES = {"draft": "the draft model", "head": "the draft head", "ngram": "n-gram lookup"}


def main_drafter(runs: Sequence[RunRecord]) -> str | None:
    """The proposer that drafted the most tokens over these runs (None: nothing was drafted)."""
    tokens: dict[str, int] = {}
    for r in runs:
        for source, _, n in r.drafted_by:
            tokens[source] = tokens.get(source, 0) + n
    return max(tokens, key=lambda s: tokens[s]) if tokens else None


def cost_model_summary(engine: Engine, runs: Sequence[RunRecord], summary: dict[str, Any],
                       proposer: str = "draft") -> dict[str, Any]:
    """Measured forward costs and what they predict for the measured acceptance (the bench's check)."""
    standard = [r for r in runs if r.mode == "standard"]
    drafting = [m for m in ENGINE_MODES if m != "standard" and m in summary]
    predicted = {m: predicted_speedup(engine.info, [r for r in runs if r.mode == m], standard) for m in drafting}
    spec = [r for r in runs if r.mode in drafting]
    # The verdict weighs what actually drafted (its own measured cost: a draft head's, n-gram's), not what
    # was asked for (auto routes a loaded head beside the draft model), at the bench's sampling: a sampled
    # round's costs when it sampled.
    sampled = any(r.temperature > 0 for r in runs)
    source = main_drafter(spec) or ("draft" if proposer == "draft+ngram" else proposer)
    model = CostModel.from_info(engine.info, source, sampled=sampled)
    alpha = alpha_from_per_position(position_acceptance(spec)) or 0.0
    k = round(summary[drafting[0]]["k_mean"]) if drafting else 0
    return {
        "draft_ms": model.draft_ms,
        "target_ms": {str(w): ms for w, ms in sorted(model.target_ms.items())},
        "proposers": {c.source: {"per_token_ms": c.per_token_ms, "per_proposal_ms": c.per_proposal_ms}
                      for c in engine.info.proposer_costs},
        "sampled": sampled,  # True: draft_ms and target_ms are a sampled round's (temperature > 0)
        "sampled_proposers": {c.source: {"per_token_ms": c.per_token_ms, "per_proposal_ms": c.per_proposal_ms}
                              for c in engine.info.sampled_costs},
        "measure_s": engine.info.measure_s,
        "alpha": alpha,
        "k": k,
        "predicted_speedup": predicted.get("speculative", next(iter(predicted.values()), None)),
        "predicted": predicted,
        "best_k": model.best_k(alpha)[0],
        "drafter": source,
        "verdict": model.verdict(alpha, drafter=DRAFTER_NAMES.get(source, "the draft")),
    }


@dataclass(frozen=True)
class BenchResult:
    """What one bench run measured."""

    runs: tuple[RunRecord, ...]  # every timed generation, in the order it ran
    summary: dict[str, Any]  # per-mode totals, speedups, fidelity, cost model, memory, errors
    modes: tuple[str, ...]  # the modes that produced at least one run
    wall_s: float  # wall time of the timed part


def run_bench(ctx: BenchContext, prompts: Sequence[BenchPrompt], modes: Sequence[str], *, max_new_tokens: int,
              warmup: int = 1, repeat: int = 1, cost_model: bool = True, progress=None,
              proposer: str = "draft") -> BenchResult:
    """Times every prompt in every mode after untimed warm-ups, `repeat` times.

    Each prompt is warmed (a short untimed generation of it) before its first timed run, and the
    mode order rotates per prompt and repeat (experiment.schedule), so no mode pays the first-run
    cost of a prompt for another. `progress(done, total, note)` is called after each run. A
    failing baseline (hf-*) is recorded as an error and does not cost the other modes' figures; a
    failing engine mode raises.
    """
    import torch

    # Untimed: the first generations pay allocator growth, kernel selection and graph capture.
    for _ in range(max(0, warmup)):
        for mode in modes:
            MODE_RUNNERS[mode].run(ctx, prompts[0], min(max_new_tokens, 32))
    cuda = ctx.engine.device.type == "cuda"
    gpus = (ctx.engine.info.devices or (str(ctx.engine.device),)) if cuda else ()  # every GPU of a split target
    errors: list[dict[str, str]] = []
    peaks: dict[tuple[str, int], float] = {}  # peak GPU memory per prompt and repeat (MB, all GPUs), to show there is no growth
    # The warm-up run prefills both models with the prompt when a draft is loaded.
    warm_mode = "speculative" if ctx.engine.draft_runner is not None else "standard"

    def warm(prompt: BenchPrompt) -> None:
        MODE_RUNNERS[warm_mode].run(ctx, prompt, min(max_new_tokens, 4))
        if cuda:
            for gpu in gpus:
                torch.cuda.reset_peak_memory_stats(gpu)

    def run(task: Task) -> RunRecord:
        record = MODE_RUNNERS[task.label].run(ctx, task.prompt, max_new_tokens)
        if cuda:
            peaks[(task.prompt.id, task.repeat)] = sum(torch.cuda.max_memory_allocated(g) for g in gpus) / 2**20
        return replace(record, repeat=task.repeat)

    def failed(task: Task, exc: Exception) -> bool:
        if isinstance(exc, EngineError) or task.label in ENGINE_MODES:
            return False
        log.warning("%s failed on %s: %s", task.label, task.prompt.id, exc)
        errors.append({"mode": task.label, "prompt_id": task.prompt.id, "message": f"{type(exc).__name__}: {exc}"[:300]})
        return True

    started = time.perf_counter()
    runs = run_tasks(schedule(prompts, modes, repeat), run, warm=warm, progress=progress, on_error=failed)
    wall = time.perf_counter() - started
    modes_run = tuple(m for m in modes if any(r.mode == m for r in runs))
    summary = summarize_runs(runs, modes_run, ctx.engine.tokenizer)
    if errors:
        summary["errors"] = errors
    if peaks:
        per_prompt = list(peaks.values())
        summary.update(peak_gpu_memory_mb=max(per_prompt), peak_gpu_memory_first_mb=per_prompt[0],
                       peak_gpu_memory_last_mb=per_prompt[-1])
    if cost_model and any(m in modes_run for m in ENGINE_MODES[1:]) and "standard" in modes_run:
        summary["cost_model"] = cost_model_summary(ctx.engine, runs, summary, proposer)
    return BenchResult(tuple(runs), summary, modes_run, wall)


def result_json(result: BenchResult, config: dict[str, Any]) -> str:
    """The full results as JSON text (the bench's --json file)."""
    from dataclasses import asdict

    return json.dumps({"config": config, "runs": [{**asdict(r), "token_ids": list(r.token_ids)} for r in result.runs],
                       "summary": result.summary}, indent=2, ensure_ascii=False)
