"""Headless command line: `generate` streams one answer, `bench` measures, `sweep` tunes, `distill` trains a head."""
from __future__ import annotations

import argparse
import csv
import json
import logging
import platform
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from app.export import cell
from app.session import build_request, runtime_label
from engine.errors import EngineError
from engine.limits import DEFAULT_K, K_AUTO, K_MAX
from engine.measure.bench import MODE_RUNNERS
from engine.settings import GenerationSettings
from engine.types import MODES, PROPOSERS, GenerationRequest, Message, Summary

if TYPE_CHECKING:  # heavy imports (torch, transformers) wait until a command really runs
    from engine.decoding import Engine
    from engine.models.store import LoadProgress

PROG = "specdec-studio"
log = logging.getLogger(__name__)


class CliError(Exception):
    """Bad input found by the CLI itself (arguments, prompt files); reported in one line."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so main() owns the exit code."""

    def error(self, message: str) -> NoReturn:
        if message.endswith("required: command"):
            message = "a command is needed: generate, bench, sweep or distill (see --help)"
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
    """1..K_MAX, or "auto" (K_AUTO: chosen per step)."""
    if text.strip().lower() == "auto":
        return K_AUTO
    try:
        value = _positive_int(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"K (draft tokens per step) {e}, or auto") from None
    if value > K_MAX:
        raise argparse.ArgumentTypeError(f"K (draft tokens per step) must be at most {K_MAX}, or auto")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _add_model_args(p: argparse.ArgumentParser, decoding: bool = True) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--target", default=None,
                   help="model folder, .gguf file or hub id (default: packaged Qwen2.5-Coder-1.5B-Instruct)")
    g.add_argument("--draft", default=None,
                   help="model folder, .gguf file or hub id (default: packaged Qwen2.5-Coder-0.5B-Instruct)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="auto: bf16 on CUDA and on CPUs with native bf16, else float32")
    g.add_argument("--head", default="auto",
                   help="draft head folder for --proposer head; auto: the shipped head trained for this target "
                        "(if any); none: no head")
    g.add_argument("--fast-path", default="auto", choices=["auto", "eager", "static", "compiled"],
                   help="auto: static cache + CUDA graphs where possible, else eager; compiled: also "
                        "torch.compile the per-step forwards for --k (CUDA; minutes of warm-up)")
    g.add_argument("--runtime", default="auto", choices=["auto", "torch", "llamacpp"],
                   help="auto: llama.cpp on the CPU for .gguf files and the packaged pair (when installed), "
                        "torch otherwise; --dtype and --fast-path apply to torch")
    g.add_argument("--threads", type=_positive_int, default=None,
                   help="CPU threads per llama.cpp decode (default: the physical cores)")
    d = p.add_argument_group("decoding")
    d.add_argument("-v", "--verbose", action="store_true", help="log what the engine does (stderr)")
    if not decoding:
        return
    d.add_argument("--k", type=_k, default=DEFAULT_K,
                   help=f"draft tokens proposed per step (1..{K_MAX}), or auto: chosen per step from measured "
                        "costs and acceptance (0 = a standard step)")
    d.add_argument("--temperature", type=_non_negative_float, default=0.0, help="0 = greedy")
    d.add_argument("--top-k", type=int, default=0, help="0 disables")
    d.add_argument("--top-p", type=float, default=1.0, help="1 disables")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--proposer", default="draft", choices=list(PROPOSERS),
                   help="draft, ngram or draft+ngram (in auto mode draft+ngram is routed per step)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Speculative decoding, headless.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate one answer, streaming it to stdout")
    gen.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    gen.add_argument("--raw", action="store_true", help="feed the prompt as-is, without the chat template")
    gen.add_argument("--mode", default="speculative", choices=list(MODES),
                     help="auto: the router, speculative decoding whose K (0 = standard) and proposer are chosen "
                          "per step")
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
    bench.add_argument("--repeat", type=_positive_int, default=1,
                       help="time every prompt in every mode N times: median and spread (mode order rotates)")
    bench.add_argument("--raw", action="store_true", help="feed prompts as-is, without the chat template")
    _add_model_args(bench)

    sweep = sub.add_parser("sweep", help="measure proposer x K x temperature; write sweep.csv and sweep.png")
    sweep.add_argument("--prompts", required=True, type=Path, help='JSONL: {"id", "category", "prompt"} per line')
    sweep.add_argument("--k", dest="ks", default="1,2,3,5,8,12", help="comma-separated K values (1..12, or auto)")
    sweep.add_argument("--temperature", dest="temperatures", default="0", help="comma-separated temperatures")
    sweep.add_argument("--proposer", dest="proposers", default="draft", help="comma-separated: draft, ngram, draft+ngram")
    sweep.add_argument("--auto", action="store_true", help="also measure --mode auto per proposer")
    sweep.add_argument("--repeat", type=_positive_int, default=1, help="time every configuration N times")
    sweep.add_argument("--max-new-tokens", type=_positive_int, default=64)
    sweep.add_argument("--out", required=True, type=Path, help="folder for sweep.csv, sweep.png, sweep.json")
    sweep.add_argument("--raw", action="store_true", help="feed prompts as-is, without the chat template")
    _add_model_args(sweep, decoding=False)

    distill = sub.add_parser("distill", help="train a draft head on the target's own answers (resumable)")
    distill.add_argument("--target", default=None,
                         help="model folder, .gguf file or hub id (default: packaged Qwen2.5-Coder-1.5B-Instruct)")
    distill.add_argument("--out", required=True, type=Path, help="where the head's shards and manifest go")
    distill.add_argument("--minutes", type=_positive_float, default=17.0,
                         help="the whole budget, all calls together: data, training, export (default 17)")
    distill.add_argument("--work", type=Path, default=None,
                         help="work folder (data, checkpoints, log); running again with it resumes (default OUT/work)")
    distill.add_argument("--call-minutes", type=_positive_float, default=None,
                         help="stop this call after so many minutes, exporting what is trained so far")
    distill.add_argument("--prompts", type=Path, default=None,
                         help='extra questions to answer, JSONL {"prompt": ...} (benchmark prompts are refused)')
    distill.add_argument("--seed", type=int, default=0)
    distill.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    distill.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    distill.add_argument("-v", "--verbose", action="store_true", help="log what the engine does (stderr)")
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


def _load(args: argparse.Namespace, needs_draft: bool, runtime: str | None = None,
          needs_head: bool | None = None) -> Engine:
    """needs_head: a draft head will propose (default: --proposer head outside standard mode); the
    head reads the target's hidden states, which llama.cpp does not give, so auto then picks torch."""
    from engine.models.runtime import load_engine

    reporter = _LoadReporter(sys.stderr, args.verbose)
    compile_k = getattr(args, "k", DEFAULT_K) or DEFAULT_K  # K auto: compile the default K's widths
    head = None if args.head == "none" else args.head
    if needs_head is None:
        needs_head = getattr(args, "mode", "standard") != "standard" and getattr(args, "proposer", None) == "head"
    return load_engine(args.target, args.draft, runtime=runtime or args.runtime, device=args.device,
                       dtype=args.dtype, with_draft=needs_draft, fast_path=args.fast_path, threads=args.threads,
                       progress=reporter, compile_k=compile_k, head=head, needs_head=needs_head)


def _settings(args: argparse.Namespace, mode: str, max_new_tokens: int) -> GenerationSettings:
    """The options as the settings a person would pick in the app (no system prompt on the command line)."""
    return GenerationSettings(mode=mode, proposer=args.proposer, k=args.k, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed, max_new_tokens=max_new_tokens,
                              system_prompt="")


def _request(args: argparse.Namespace, prompt: str, mode: str, max_new_tokens: int) -> GenerationRequest:
    settings = _settings(args, mode, max_new_tokens)
    if args.raw:
        return build_request(settings, (), prompt=prompt)
    return build_request(settings, (Message("user", prompt),))


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
    llama = sys.modules.get("llama_cpp")  # imported only when the llama.cpp runtime ran
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "llama_cpp_python": getattr(llama, "__version__", None), "cpu": cpu, "gpu": gpu,
            "python": platform.python_version()}


def _model_config(engine: Engine, args: argparse.Namespace) -> dict[str, Any]:
    info = engine.info
    return {"target": info.target_name, "draft": info.draft_name, "device": info.device, "dtype": info.dtype,
            "fast_path": info.fast_path, "runtime": info.runtime, "threads": info.threads,
            "vocab_size": info.vocab_size, "k": "auto" if args.k == K_AUTO else args.k,
            "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
            "max_new_tokens": args.max_new_tokens, "proposer": args.proposer, "raw": args.raw}


# --------------------------------------------------------------------------- generate

def cmd_generate(args: argparse.Namespace) -> int:
    needs_draft = args.mode != "standard" and args.proposer in ("draft", "draft+ngram")
    engine = _load(args, needs_draft)
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
        print(f"{_summary_line(summary)}; {info.device}, {info.dtype}, {runtime_label(info)}", file=sys.stderr)
    return 0


def _summary_line(s: Summary) -> str:
    from engine.measure.explain import describe_decision, time_split

    line = (f"[{s.mode}] {s.new_tokens} tokens in {s.seconds:.2f} s ({s.tokens_per_s:.1f} tok/s), "
            f"stop: {s.stop_reason}")
    if s.mode != "standard":
        line += (f"; acceptance {s.acceptance_rate:.0%} ({s.accepted}/{s.drafted}), "
                 f"{s.tokens_per_target_forward:.2f} tokens per target forward, mean K {s.k_mean:.1f}")
    line += f"; {time_split(s)}"
    if s.decision is not None and s.decision.reason != "fixed":
        line += f"; {describe_decision(s.decision)}"
    return line


# --------------------------------------------------------------------------- bench

def cmd_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from engine.measure.bench import (
        BenchContext,
        RunRecord,
        format_table,
        parse_modes,
        read_prompts,
        result_json,
        run_bench,
    )
    from engine.models.store import LoadedPair, load_pair

    # Cheap checks first: a typo in a file name should not cost a model load.
    prompts = read_prompts(args.prompts)
    modes = parse_modes(args.modes)
    for out in (args.json_out, args.csv_out):
        if out is not None and not out.parent.exists():
            raise CliError(f"output folder {out.parent} does not exist")
    needs_draft = any(MODE_RUNNERS[m].needs_draft for m in modes) and args.proposer in ("draft", "draft+ngram")
    engine = _load(args, needs_draft)
    # The hf-* baselines run on the engine's own torch models; on llama.cpp they load their own.
    pair = (LoadedPair(engine.target, engine.draft, engine.tokenizer, engine.info, engine.vocab)
            if engine.target is not None else None)
    ctx = BenchContext(
        pair, engine,
        make_request=lambda prompt, mode, max_new: _request(args, prompt, mode, max_new),
        reload_pair=lambda: load_pair(args.target, args.draft, device=args.device, dtype=args.dtype,
                                      with_draft=needs_draft),
        load_runtime=lambda runtime: _load(args, False, runtime, needs_head=False),  # only standard runs there
    )
    total = len(prompts) * len(modes) * args.repeat
    with tqdm(total=total, file=sys.stderr, desc="bench", unit="run", disable=None) as bar:
        def progress(done: int, _total: int, note: str) -> None:
            bar.set_postfix_str(note)
            bar.update(done - bar.n)

        result = run_bench(ctx, prompts, modes, max_new_tokens=args.max_new_tokens, warmup=args.warmup,
                           repeat=args.repeat, progress=progress, proposer=args.proposer)
    result.summary["diagnostics"] = _diagnose(engine, args, result.summary)
    config = {**_model_config(engine, args), "modes": list(result.modes), "prompts": str(args.prompts),
              "warmup": args.warmup, "repeat": args.repeat, "wall_s": result.wall_s, **_environment(engine)}
    table = format_table(result.summary, result.modes)
    try:
        if args.json_out is not None:
            args.json_out.write_text(result_json(result, config), encoding="utf-8")
        if args.csv_out is not None:
            with open(args.csv_out, "w", newline="", encoding="utf-8") as f:
                names = [n for n in RunRecord.__dataclass_fields__ if n != "token_ids"]
                writer = csv.DictWriter(f, fieldnames=names, extrasaction="ignore")
                writer.writeheader()
                writer.writerows({k: cell(v) for k, v in asdict(r).items()} for r in result.runs)
    except OSError as e:
        # The table still goes to stdout, so a long run is not lost to a bad output path.
        print(table)
        raise CliError(f"cannot write results: {e.strerror or e} ({e.filename})") from None
    print(f"{engine.info.target_name} / {engine.info.draft_name or '-'} on {engine.info.device} "
          f"({engine.info.dtype}, {runtime_label(engine.info)}), {len(prompts)} prompts, k={args.k or 'auto'}, "
          f"temperature={args.temperature}, max_new_tokens={args.max_new_tokens}")
    print(table)
    return 0


def _diagnose(engine: Engine, args: argparse.Namespace, summary: dict[str, Any]) -> list[str]:
    """The troubleshooting rules on what this bench measured, as lines to print and keep in the JSON."""
    from engine.measure.diagnostics import diagnose, from_bench
    from engine.measure.explain import describe_diagnosis

    evidence = from_bench(summary, engine.info, k=args.k, temperature=args.temperature, proposer=args.proposer)
    return [" ".join(describe_diagnosis(d)) for d in diagnose(evidence)]


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

    if args.command == "sweep":
        from app.cli_sweep import cmd_sweep as command
    elif args.command == "distill":
        from app.cli_distill import cmd_distill as command
    else:
        command = {"generate": cmd_generate, "bench": cmd_bench}[args.command]
    try:
        return command(args)
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
