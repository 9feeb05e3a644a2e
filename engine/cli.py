"""Headless command line: `specdec-studio generate` streams one answer, `specdec-studio bench` measures."""
from __future__ import annotations

import argparse
import csv
import json
import logging
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from engine.errors import EngineError
from engine.types import MODES, PROPOSERS, GenerationRequest, Message, Sampling, Summary

if TYPE_CHECKING:  # heavy imports (torch, transformers) wait until a command really runs
    from engine.decoding import Engine
    from engine.store import LoadedPair, LoadProgress

PROG = "specdec-studio"
log = logging.getLogger(__name__)


class CliError(Exception):
    """Bad input found by the CLI itself (arguments, prompt files); reported in one line."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so main() owns the exit code."""

    def error(self, message: str) -> NoReturn:
        if message.endswith("required: command"):
            message = "a command is needed: generate or bench (see --help)"
        raise CliError(message)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _k(text: str) -> int:
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"K (draft tokens per step) {e}") from None


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--target", default=None,
                   help="model folder, .gguf file or hub id (default: packaged Qwen2.5-Coder-1.5B-Instruct)")
    g.add_argument("--draft", default=None,
                   help="model folder, .gguf file or hub id (default: packaged Qwen2.5-Coder-0.5B-Instruct)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="auto: bf16 on CUDA and on CPUs with native bf16, else float32")
    g.add_argument("--fast-path", default="auto", choices=["auto", "eager", "static", "compiled"],
                   help="auto: static cache + CUDA graphs where possible, else eager; compiled: also "
                        "torch.compile the per-step forwards for --k (CUDA; minutes of warm-up)")
    d = p.add_argument_group("decoding")
    d.add_argument("--k", type=_k, default=5, help="draft tokens proposed per step (>= 1)")
    d.add_argument("--temperature", type=_non_negative_float, default=0.0, help="0 = greedy")
    d.add_argument("--top-k", type=int, default=0, help="0 disables")
    d.add_argument("--top-p", type=float, default=1.0, help="1 disables")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--proposer", default="draft", choices=list(PROPOSERS))
    d.add_argument("-v", "--verbose", action="store_true", help="log what the engine does (stderr)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Speculative decoding, headless.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate one answer, streaming it to stdout")
    gen.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    gen.add_argument("--raw", action="store_true", help="feed the prompt as-is, without the chat template")
    gen.add_argument("--mode", default="speculative", choices=list(MODES))
    gen.add_argument("--max-new-tokens", type=_positive_int, default=128)
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _add_model_args(gen)

    bench = sub.add_parser("bench", help="time modes over a prompts file (JSON lines)")
    bench.add_argument("--prompts", required=True, type=Path, help='JSONL: {"id", "category", "prompt"} per line')
    bench.add_argument("--modes", default="standard,speculative",
                       help=f"comma-separated, run in this order per prompt (known: {', '.join(MODE_RUNNERS)})")
    bench.add_argument("--max-new-tokens", type=_positive_int, default=128)
    bench.add_argument("--json", dest="json_out", type=Path, default=None, help="write the full results here")
    bench.add_argument("--csv", dest="csv_out", type=Path, default=None, help="write one row per run here")
    bench.add_argument("--warmup", type=int, default=1, help="untimed warm-up generations per mode")
    bench.add_argument("--raw", action="store_true", help="feed prompts as-is, without the chat template")
    _add_model_args(bench)
    return parser


# --------------------------------------------------------------------------- shared

def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    if not verbose:
        # Per-tensor progress bars from transformers would bury our one-line messages.
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()


class _LoadReporter:
    """Shows the slow, one-time stages (assembling, checking, converting) on stderr."""

    def __init__(self, stream: TextIO, verbose: bool) -> None:
        self.stream = stream
        self.verbose = verbose
        self.last = ""

    def __call__(self, p: LoadProgress) -> None:
        # Only a person at a terminal needs to hear about it; scripts keep stderr for errors.
        interesting = p.stage in ("assemble", "verify", "convert") and self.stream.isatty()
        if (interesting or self.verbose) and p.message != self.last:
            self.last = p.message
            print(f"{PROG}: {p.message}", file=self.stream, flush=True)


def _load(args: argparse.Namespace, needs_draft: bool) -> tuple[LoadedPair, Engine]:
    from engine.decoding import Engine
    from engine.store import load_pair

    reporter = _LoadReporter(sys.stderr, args.verbose)
    pair = load_pair(args.target, args.draft, device=args.device, dtype=args.dtype,
                     progress=reporter, with_draft=needs_draft)
    return pair, Engine.from_pair(pair, fast_path=args.fast_path, progress=reporter, compile_k=args.k)


def _sampling(args: argparse.Namespace) -> Sampling:
    return Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def _request(args: argparse.Namespace, prompt: str, mode: str, max_new_tokens: int) -> GenerationRequest:
    return GenerationRequest(
        messages=() if args.raw else (Message("user", prompt),),
        prompt=prompt if args.raw else None,
        mode=mode,  # type: ignore[arg-type]  # validated by argparse / the mode table
        k=args.k,
        sampling=_sampling(args),
        max_new_tokens=max_new_tokens,
        proposer=args.proposer,
    )


def _environment(engine: Engine) -> dict[str, Any]:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else None
    return {"torch": torch.__version__, "transformers": transformers.__version__, "cpu": cpu, "gpu": gpu,
            "python": platform.python_version()}


def _model_config(engine: Engine, args: argparse.Namespace) -> dict[str, Any]:
    info = engine.info
    return {"target": info.target_name, "draft": info.draft_name, "device": info.device, "dtype": info.dtype,
            "fast_path": info.fast_path, "vocab_size": info.vocab_size, "k": args.k,
            "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
            "max_new_tokens": args.max_new_tokens, "proposer": args.proposer, "raw": args.raw}


# --------------------------------------------------------------------------- generate

def cmd_generate(args: argparse.Namespace) -> int:
    needs_draft = args.mode == "speculative" and args.proposer != "ngram"
    _, engine = _load(args, needs_draft)
    generation = engine.generate(_request(args, args.prompt, args.mode, args.max_new_tokens))
    tokens: list[dict[str, str]] = []
    for step in generation:
        if args.json:
            tokens.extend({"text": t.text, "status": t.status} for t in step.tokens)
        else:
            sys.stdout.write(step.text)
            sys.stdout.flush()
    summary = generation.summary
    assert summary is not None, "a finished generation has a summary"
    if args.json:
        out = {"text": summary.text, "tokens": tokens, "summary": asdict(summary),
               "config": {**_model_config(engine, args), "mode": args.mode, **_environment(engine)}}
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        info = engine.info
        print(f"{_summary_line(summary)}; {info.device}, {info.dtype}, {info.fast_path}", file=sys.stderr)
    return 0


def _summary_line(s: Summary) -> str:
    line = (f"[{s.mode}] {s.new_tokens} tokens in {s.seconds:.2f} s ({s.tokens_per_s:.1f} tok/s), "
            f"stop: {s.stop_reason}")
    if s.mode == "speculative":
        line += (f"; acceptance {s.acceptance_rate:.0%} ({s.accepted}/{s.drafted}), "
                 f"{s.tokens_per_target_forward:.2f} tokens per target forward")
    return line


# --------------------------------------------------------------------------- bench

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


@dataclass
class BenchContext:
    """What every mode runner may use: the loaded pair, the engine and the parsed settings."""

    pair: LoadedPair  # models and tokenizer, as the engine runs them
    engine: Engine  # our decoding loop
    args: argparse.Namespace  # k, sampling, max_new_tokens, raw, ...
    needs_draft: bool = True  # whether the bench loaded a draft
    _baseline: LoadedPair | None = None  # unmodified models for the hf-* modes, loaded on first use

    def baseline_pair(self) -> LoadedPair:
        """The models as Hugging Face ships them: the CPU fast path repacks the engine's in place."""
        if self.engine.info.fast_path != "cpu-onednn":
            return self.pair
        if self._baseline is None:
            from engine.store import load_pair

            a = self.args
            self._baseline = load_pair(a.target, a.draft, device=a.device, dtype=a.dtype, with_draft=self.needs_draft)
        return self._baseline


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


def _engine_run(ctx: BenchContext, prompt: BenchPrompt, max_new_tokens: int, mode: str) -> RunRecord:
    generation = ctx.engine.generate(_request(ctx.args, prompt.prompt, mode, max_new_tokens))
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
    return _engine_run(ctx, prompt, max_new_tokens, "standard")


@register_mode("speculative", needs_draft=True)
def run_speculative(ctx: BenchContext, prompt: BenchPrompt, max_new_tokens: int) -> RunRecord:
    return _engine_run(ctx, prompt, max_new_tokens, "speculative")


def _hf_run(ctx: BenchContext, prompt: BenchPrompt, max_new_tokens: int, variant: str) -> RunRecord:
    """Hugging Face generate() on the same loaded models: the baselines every ratio is measured against."""
    import torch

    from engine.baselines import run_hf

    request = _request(ctx.args, prompt.prompt, "standard", max_new_tokens)
    ids = torch.tensor(ctx.engine.encode(request))
    pair = ctx.baseline_pair()
    r = run_hf(pair.target, pair.tokenizer, ids, max_new_tokens, variant,  # type: ignore[arg-type]
               draft=pair.draft, sampling=request.sampling)
    text = ctx.pair.tokenizer.decode(r["token_ids"], skip_special_tokens=True)
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
        raise CliError(f"cannot read prompts file {path}: {reason}") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise CliError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise CliError(f'{path}:{n}: each line needs a non-empty "prompt" string')
        prompts.append(BenchPrompt(str(row.get("id", f"line{n}")), str(row.get("category", "")), row["prompt"]))
    if not prompts:
        raise CliError(f"prompts file {path} has no prompts")
    return prompts


def _parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODE_RUNNERS]
    if not modes or unknown:
        names = ", ".join(unknown) or repr(text)
        raise CliError(f"unknown mode(s) {names}: choose from {', '.join(MODE_RUNNERS)}")
    if len(set(modes)) != len(modes):
        raise CliError(f"a mode is listed twice in --modes {text}")
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
        out["fidelity"] = {m: _compare(runs, m, tokenizer) for m in modes if m != "standard"}
        if "speculative" in out["fidelity"]:
            spec = out["fidelity"]["speculative"]
            out.update(identical_outputs=spec["identical"], compared=spec["compared"], divergences=spec["divergences"])
    return out


def _compare(runs: Sequence[RunRecord], mode: str, tokenizer) -> dict[str, Any]:
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


def _table(summary: dict[str, Any], modes: Sequence[str]) -> str:
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


def cmd_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    # Cheap checks first: a typo in a file name should not cost a model load.
    prompts = read_prompts(args.prompts)
    modes = _parse_modes(args.modes)
    for out in (args.json_out, args.csv_out):
        if out is not None and not out.parent.exists():
            raise CliError(f"output folder {out.parent} does not exist")
    needs_draft = any(MODE_RUNNERS[m].needs_draft for m in modes) and args.proposer != "ngram"
    pair, engine = _load(args, needs_draft)
    ctx = BenchContext(pair, engine, args, needs_draft=needs_draft)

    # Untimed: the first generations pay allocator growth, kernel selection and graph capture.
    for _ in range(max(0, args.warmup)):
        for mode in modes:
            MODE_RUNNERS[mode].run(ctx, prompts[0], min(args.max_new_tokens, 32))

    import torch

    cuda = engine.device.type == "cuda"
    runs: list[RunRecord] = []
    errors: list[dict[str, str]] = []
    peaks: list[float] = []  # peak GPU memory per prompt (MB), to show there is no growth
    started = time.perf_counter()
    with tqdm(total=len(prompts) * len(modes), file=sys.stderr, desc="bench", unit="run",
              disable=None) as bar:
        for prompt in prompts:
            if cuda:
                torch.cuda.reset_peak_memory_stats(engine.device)
            for mode in modes:
                bar.set_postfix_str(f"{prompt.id} {mode}")
                try:
                    runs.append(MODE_RUNNERS[mode].run(ctx, prompt, args.max_new_tokens))
                except EngineError:
                    raise
                except Exception as e:  # a failing baseline must not cost the other modes' figures
                    if mode in ("standard", "speculative"):
                        raise
                    log.warning("%s failed on %s: %s", mode, prompt.id, e)
                    errors.append({"mode": mode, "prompt_id": prompt.id, "message": f"{type(e).__name__}: {e}"[:300]})
                bar.update(1)
            if cuda:
                peaks.append(torch.cuda.max_memory_allocated(engine.device) / 2**20)
    modes_run = [m for m in modes if any(r.mode == m for r in runs)]
    summary = summarize_runs(runs, modes_run, pair.tokenizer)
    if errors:
        summary["errors"] = errors
    if peaks:
        summary.update(peak_gpu_memory_mb=max(peaks), peak_gpu_memory_first_mb=peaks[0], peak_gpu_memory_last_mb=peaks[-1])
    if "speculative" in modes_run and args.proposer != "ngram":
        summary["cost_model"] = _cost_model(engine, args.k, summary)
    modes = modes_run
    config = {**_model_config(engine, args), "modes": modes, "prompts": str(args.prompts),
              "warmup": args.warmup, "wall_s": time.perf_counter() - started, **_environment(engine)}
    result = {"config": config, "runs": [{**asdict(r), "token_ids": list(r.token_ids)} for r in runs],
              "summary": summary}
    try:
        if args.json_out is not None:
            args.json_out.write_text(json.dumps(result, indent=2, ensure_ascii=False), encoding="utf-8")
        if args.csv_out is not None:
            with open(args.csv_out, "w", newline="", encoding="utf-8") as f:
                names = [n for n in RunRecord.__dataclass_fields__ if n != "token_ids"]
                writer = csv.DictWriter(f, fieldnames=names, extrasaction="ignore")
                writer.writeheader()
                writer.writerows(asdict(r) for r in runs)
    except OSError as e:
        # The table still goes to stdout, so a long run is not lost to a bad output path.
        print(_table(summary, modes))
        raise CliError(f"cannot write results: {e.strerror or e} ({e.filename})") from None
    print(f"{engine.info.target_name} / {engine.info.draft_name or '-'} on {engine.info.device} "
          f"({engine.info.dtype}, {engine.info.fast_path}), {len(prompts)} prompts, k={args.k}, "
          f"temperature={args.temperature}, max_new_tokens={args.max_new_tokens}")
    print(_table(summary, modes))
    return 0


def _cost_model(engine: Engine, k: int, summary: dict[str, Any]) -> dict[str, Any]:
    """Measured forward costs and what they predict for the measured acceptance (the bench's check)."""
    from engine.costmodel import CostModel, alpha_from_mean_accepted

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


# --------------------------------------------------------------------------- entry point

def _fail(message: str) -> int:
    first = (message.strip().splitlines() or ["unknown error"])[0]
    print(f"{PROG}: error: {first}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Runs one command; bad input and engine errors are one stderr line and exit code 2."""
    try:
        args = build_parser().parse_args(argv)
    except CliError as e:
        return _fail(str(e))
    except SystemExit as e:  # --help and --version exit through argparse
        return int(e.code or 0)
    _setup_logging(args.verbose)
    import torch

    try:
        return cmd_generate(args) if args.command == "generate" else cmd_bench(args)
    except (CliError, EngineError) as e:
        return _fail(str(e))
    except torch.OutOfMemoryError:
        return _fail("out of memory while generating: lower --max-new-tokens or --k, use --dtype bfloat16, "
                     "or a smaller model")
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `specdec-studio generate ... | head` closed the pipe: not an error
        return 0


if __name__ == "__main__":
    sys.exit(main())
