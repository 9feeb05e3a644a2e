"""Benchmarks on the engine: prompt records, timed runs per mode, totals, identical-output checks, the cost model's check.

The CLI's `bench` command is a shell over this module: it reads options, loads the pair, and
writes what `run_bench` returns.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import EngineError, InputError
from engine.types import GenerationRequest

if TYPE_CHECKING:  # heavy imports (torch, transformers) wait until a bench really runs
    from engine.decoding import Engine
    from engine.models.store import LoadedPair

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchPrompt:
    id: str  # the prompt's id from the file (line number when absent)
    category: str  # free-form group, e.g. "code", "chat"
    prompt: str  # the user message


@dataclass(frozen=True)
class RunRecord:
    """One timed generation of one prompt in one mode."""

    prompt_id: str  # BenchPrompt.id
    category: str  # BenchPrompt.category
    mode: str  # key of MODE_RUNNERS
    new_tokens: int  # tokens generated
    seconds: float  # wall time, prefill included
    tokens_per_s: float  # new_tokens / seconds
    target_forwards: int  # target forwards after prefill
    draft_forwards: int  # draft forwards after prefill (0 without a draft)
    drafted: int  # draft tokens proposed
    accepted: int  # draft tokens accepted
    text: str  # generated text
    token_ids: tuple[int, ...] = field(repr=False)  # generated ids, for exactness comparisons
    # Engine modes: the rounds' own time (CUDA: device time between each round's events; CPU: the
    # compute). seconds - round_seconds is what the loop spends outside its rounds (prefill,
    # host work the device waits for); 0 for the hf-* modes, which are not split into rounds.
    round_seconds: float = 0.0


# (prompt text, mode, max_new_tokens) -> the request; the caller owns the settings → request conversion.
RequestFactory = Callable[[str, str, int], GenerationRequest]


@dataclass
class BenchContext:
    """What every mode runner may use: the loaded pair, the engine and how requests are made."""

    pair: LoadedPair | None  # torch models and tokenizer as the engine runs them (None on llama.cpp)
    engine: Engine  # our decoding loop
    make_request: RequestFactory  # the request for one prompt in one mode
    reload_pair: Callable[[], LoadedPair]  # loads the same pair again, as Hugging Face ships it
    # Loads the same pair on another runtime ("torch" / "llamacpp") for side-by-side modes.
    load_runtime: Callable[[str], Engine] | None = None
    _baseline: LoadedPair | None = None  # unmodified models for the hf-* modes, loaded on first use
    _engines: dict[str, Engine] = field(default_factory=dict)  # other runtimes, loaded on first use

    def baseline_pair(self) -> LoadedPair:
        """The models as Hugging Face ships them: the CPU fast path repacks the engine's in place."""
        if self.pair is not None and self.engine.info.fast_path != "cpu-onednn":
            return self.pair
        if self._baseline is None:
            self._baseline = self.reload_pair()
        return self._baseline

    def engine_on(self, runtime: str) -> Engine:
        """The engine on `runtime`: this one if it already runs there, else the same pair loaded beside it."""
        if self.engine.info.runtime == runtime:
            return self.engine
        if runtime not in self._engines:
            if self.load_runtime is None:
                raise InputError(f"this bench cannot load the {runtime} runtime beside the {self.engine.info.runtime} one")
            self._engines[runtime] = self.load_runtime(runtime)
        return self._engines[runtime]


ModeRunner = Callable[[BenchContext, BenchPrompt, int], RunRecord]


@dataclass(frozen=True)
class ModeSpec:
    run: ModeRunner  # (context, prompt, max_new_tokens) -> RunRecord
    needs_draft: bool  # load the draft model for this mode


MODE_RUNNERS: dict[str, ModeSpec] = {}


def register_mode(name: str, *, needs_draft: bool) -> Callable[[ModeRunner], ModeRunner]:
    """Adds a bench mode; later modes (hf, hf-static, hf-assisted) register the same way."""

    def wrap(fn: ModeRunner) -> ModeRunner:
        MODE_RUNNERS[name] = ModeSpec(fn, needs_draft)
        return fn

    return wrap


def engine_run(ctx: BenchContext, prompt: BenchPrompt, max_new_tokens: int, mode: str, *,
               engine: Engine | None = None, request: GenerationRequest | None = None) -> RunRecord:
    """One timed generation on `engine` (the bench's own by default) of `request` (made from the mode)."""
    engine = engine or ctx.engine
    generation = engine.generate(request or ctx.make_request(prompt.prompt, mode, max_new_tokens))
    round_ms = 0.0
    for step in generation:
        round_ms += step.draft_ms + step.verify_ms
    s = generation.summary
    assert s is not None, "a finished generation has a summary"
    return RunRecord(
        prompt_id=prompt.id, category=prompt.category, mode=mode, new_tokens=s.new_tokens,
        seconds=s.seconds, tokens_per_s=s.tokens_per_s, target_forwards=s.target_forwards,
        draft_forwards=s.draft_forwards, drafted=s.drafted, accepted=s.accepted, text=s.text,
        token_ids=tuple(generation.token_ids), round_seconds=round_ms / 1000,
    )


@register_mode("standard", needs_draft=False)
def run_standard(ctx: BenchContext, prompt: BenchPrompt, max_new_tokens: int) -> RunRecord:
    return engine_run(ctx, prompt, max_new_tokens, "standard")


@register_mode("speculative", needs_draft=True)
def run_speculative(ctx: BenchContext, prompt: BenchPrompt, max_new_tokens: int) -> RunRecord:
    return engine_run(ctx, prompt, max_new_tokens, "speculative")


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


@register_mode("hf", needs_draft=False)
def run_hf_plain(ctx: BenchContext, prompt: BenchPrompt, max_new_tokens: int) -> RunRecord:
    return _hf_run(ctx, prompt, max_new_tokens, "hf")


@register_mode("hf-static", needs_draft=False)
def run_hf_static(ctx: BenchContext, prompt: BenchPrompt, max_new_tokens: int) -> RunRecord:
    return _hf_run(ctx, prompt, max_new_tokens, "hf-static")


@register_mode("hf-assisted", needs_draft=True)
def run_hf_assisted(ctx: BenchContext, prompt: BenchPrompt, max_new_tokens: int) -> RunRecord:
    return _hf_run(ctx, prompt, max_new_tokens, "hf-assisted")


def read_prompts(path: Path) -> list[BenchPrompt]:
    """Reads a JSONL prompts file; any problem is a CliError naming the file and line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise InputError(f"cannot read prompts file {path}: {reason}") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise InputError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise InputError(f'{path}:{n}: each line needs a non-empty "prompt" string')
        prompts.append(BenchPrompt(str(row.get("id", f"line{n}")), str(row.get("category", "")), row["prompt"]))
    if not prompts:
        raise InputError(f"prompts file {path} has no prompts")
    return prompts


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
    """Per-mode totals, the speedup, and every standard/speculative divergence (never hidden)."""
    out: dict[str, Any] = {}
    for mode in modes:
        rs = [r for r in runs if r.mode == mode]
        tokens, seconds = sum(r.new_tokens for r in rs), sum(r.seconds for r in rs)
        drafted, accepted = sum(r.drafted for r in rs), sum(r.accepted for r in rs)
        forwards = sum(r.target_forwards for r in rs)
        rounds = sum(r.round_seconds for r in rs)
        out[mode] = {
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "tokens_per_target_forward": tokens / forwards if forwards else 0.0,
            "new_tokens": tokens,
            "seconds": seconds,
            # Share of the wall time spent inside rounds (engine modes only; None for hf-*).
            "in_rounds": rounds / seconds if rounds and seconds > 0 else None,
        }
    if "standard" in out and "speculative" in out:
        base = out["standard"]["tokens_per_s"]
        out["speedup"] = out["speculative"]["tokens_per_s"] / base if base else None
    if "standard" in out:
        base = out["standard"]["tokens_per_s"]
        out["vs_standard"] = {m: out[m]["tokens_per_s"] / base for m in modes if m != "standard" and base}
        # Greedy fidelity: every other mode's output against our own standard decoding.
        out["fidelity"] = {m: compare_outputs(runs, m, tokenizer) for m in modes if m != "standard"}
        if "speculative" in out["fidelity"]:
            spec = out["fidelity"]["speculative"]
            out.update(identical_outputs=spec["identical"], compared=spec["compared"], divergences=spec["divergences"])
    return out


def compare_outputs(runs: Sequence[RunRecord], mode: str, tokenizer) -> dict[str, Any]:
    """How many of `mode`'s outputs equal standard decoding's, and where each other one diverges.

    The hf-* baselines are forced past EOS (equal token counts for fair tok/s), so outputs are
    compared over the standard output's length, without the EOS that ended it.
    """
    by_prompt = {(r.prompt_id, r.mode): r for r in runs}
    identical, compared, divergences = 0, 0, []
    for r in runs:
        if r.mode != "standard" or (r.prompt_id, mode) not in by_prompt:
            continue
        a = r.token_ids
        b = by_prompt[(r.prompt_id, mode)].token_ids
        if mode.startswith("hf"):
            if len(a) < len(b):
                a = a[:-1]  # standard stopped on EOS, which the baselines are not allowed to emit
            b = b[: len(a)]
        compared += 1
        if a == b:
            identical += 1
            continue
        pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        divergences.append({
            "prompt_id": r.prompt_id,
            "position": pos,
            # A missing token means one output stopped earlier than the other.
            "standard_token": tokenizer.decode([a[pos]]) if pos < len(a) else None,
            f"{mode}_token": tokenizer.decode([b[pos]]) if pos < len(b) else None,
        })
    return {"identical": identical, "compared": compared, "divergences": divergences}


def format_table(summary: dict[str, Any], modes: Sequence[str]) -> str:
    rows = [f"{'mode':<14}{'tok/s':>9}{'tokens':>9}{'seconds':>10}{'accept':>9}{'tok/fwd':>9}{'in rounds':>11}"]
    for mode in modes:
        s = summary[mode]
        busy = f"{s['in_rounds']:>11.1%}" if s.get("in_rounds") is not None else f"{'-':>11}"
        rows.append(f"{mode:<14}{s['tokens_per_s']:>9.2f}{s['new_tokens']:>9d}{s['seconds']:>10.2f}"
                    f"{s['acceptance_rate']:>9.1%}{s['tokens_per_target_forward']:>9.2f}{busy}")
    if summary.get("speedup") is not None:
        rows.append(f"speedup (speculative / standard): {summary['speedup']:.2f}x")
    for mode, ratio in summary.get("vs_standard", {}).items():
        if mode != "speculative":
            rows.append(f"{mode} / standard: {ratio:.2f}x")
    for mode, f in summary.get("fidelity", {}).items():
        label = "identical outputs" if mode == "speculative" else f"identical to standard ({mode})"
        rows.append(f"{label}: {f['identical']}/{f['compared']}")
        for d in f["divergences"]:
            rows.append(f"  {d['prompt_id']}: first divergence at token {d['position']}: "
                        f"standard {d['standard_token']!r} vs {mode} {d.get(mode + '_token')!r}")
    cost = summary.get("cost_model")
    if cost:
        rows.append(f"cost model: draft {cost['draft_ms']:.2f} ms, target "
                    + ", ".join(f"w{w} {ms:.2f}" for w, ms in cost["target_ms"].items()) + " ms")
        if cost.get("predicted_speedup") is not None:
            rows.append(f"  predicted speculative/standard at alpha={cost['alpha']:.3f}, K={cost['k']}: "
                        f"{cost['predicted_speedup']:.2f}x (measured {summary.get('speedup') or 0:.2f}x)")
        rows.append(f"  {cost['verdict']}")
    if summary.get("peak_gpu_memory_mb") is not None:
        rows.append(f"peak GPU memory: {summary['peak_gpu_memory_mb']:.0f} MB "
                    f"(first prompt {summary['peak_gpu_memory_first_mb']:.0f} MB, last {summary['peak_gpu_memory_last_mb']:.0f} MB)")
    for e in summary.get("errors", []):
        rows.append(f"error in {e['mode']} on {e['prompt_id']}: {e['message']}")
    return "\n".join(rows)


def cost_model_summary(engine: Engine, k: int, summary: dict[str, Any]) -> dict[str, Any]:
    """Measured forward costs and what they predict for the measured acceptance (the bench's check)."""
    from engine.measure.costmodel import CostModel, alpha_from_mean_accepted

    if not engine.info.target_ms or max(w for w, _ in engine.info.target_ms) < k + 1:
        engine.measure_costs(k_max=k)  # costs at load cover K up to 5 (CPU) / 8 (GPU)
    model = CostModel.from_info(engine.info)
    k_max = model.k_max
    spec = summary["speculative"]
    # Per-token acceptance from the mean tokens per step: E = (1 - a^(K+1)) / (1 - a).
    alpha = alpha_from_mean_accepted(spec["tokens_per_target_forward"] - 1.0, k)
    return {
        "draft_ms": model.draft_ms,
        "target_ms": {str(w): ms for w, ms in sorted(model.target_ms.items())},
        "alpha": alpha,
        "k": k,
        "predicted_speedup": model.predicted_speedup(alpha, k),
        "best_k": model.best_k(alpha, k_max)[0],
        "verdict": model.verdict(alpha, k_max),
    }


@dataclass(frozen=True)
class BenchResult:
    """What one bench run measured."""

    runs: tuple[RunRecord, ...]  # every timed generation, in the order it ran
    summary: dict[str, Any]  # per-mode totals, speedups, fidelity, cost model, memory, errors
    modes: tuple[str, ...]  # the modes that produced at least one run
    wall_s: float  # wall time of the timed part


def run_bench(ctx: BenchContext, prompts: Sequence[BenchPrompt], modes: Sequence[str], *, max_new_tokens: int,
              warmup: int = 1, k: int, cost_model: bool = True, progress=None) -> BenchResult:
    """Times every prompt in every mode (modes in the given order per prompt) after untimed warm-ups.

    `progress(done, total, note)` is called after each run. A failing baseline (hf-*) is recorded
    as an error and does not cost the other modes' figures; a failing engine mode raises.
    """
    import torch

    # Untimed: the first generations pay allocator growth, kernel selection and graph capture.
    for _ in range(max(0, warmup)):
        for mode in modes:
            MODE_RUNNERS[mode].run(ctx, prompts[0], min(max_new_tokens, 32))
    cuda = ctx.engine.device.type == "cuda"
    runs: list[RunRecord] = []
    errors: list[dict[str, str]] = []
    peaks: list[float] = []  # peak GPU memory per prompt (MB), to show there is no growth
    started = time.perf_counter()
    total, done = len(prompts) * len(modes), 0
    for prompt in prompts:
        if cuda:
            torch.cuda.reset_peak_memory_stats(ctx.engine.device)
        for mode in modes:
            try:
                runs.append(MODE_RUNNERS[mode].run(ctx, prompt, max_new_tokens))
            except EngineError:
                raise
            except Exception as e:  # a failing baseline must not cost the other modes' figures
                if mode in ("standard", "speculative"):
                    raise
                log.warning("%s failed on %s: %s", mode, prompt.id, e)
                errors.append({"mode": mode, "prompt_id": prompt.id, "message": f"{type(e).__name__}: {e}"[:300]})
            done += 1
            if progress is not None:
                progress(done, total, f"{prompt.id} {mode}")
        if cuda:
            peaks.append(torch.cuda.max_memory_allocated(ctx.engine.device) / 2**20)
    wall = time.perf_counter() - started
    modes_run = tuple(m for m in modes if any(r.mode == m for r in runs))
    summary = summarize_runs(runs, modes_run, ctx.engine.tokenizer)
    if errors:
        summary["errors"] = errors
    if peaks:
        summary.update(peak_gpu_memory_mb=max(peaks), peak_gpu_memory_first_mb=peaks[0],
                       peak_gpu_memory_last_mb=peaks[-1])
    if "speculative" in modes_run and cost_model:
        summary["cost_model"] = cost_model_summary(ctx.engine, k, summary)
    return BenchResult(tuple(runs), summary, modes_run, wall)


def result_json(result: BenchResult, config: dict[str, Any]) -> str:
    """The full results as JSON text (the bench's --json file)."""
    from dataclasses import asdict

    return json.dumps({"config": config, "runs": [{**asdict(r), "token_ids": list(r.token_ids)} for r in result.runs],
                       "summary": result.summary}, indent=2, ensure_ascii=False)


# The runtime-comparison modes (llamacpp-plain, torch-standard, ...) register themselves on import.
from engine.measure import runtimes as _runtimes  # noqa: E402,F401
