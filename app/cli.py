"""Headless command line: `generate` streams one answer, `bench` measures, `sweep` tunes, `distill` trains a head,
`plan` sizes memory."""
from __future__ import annotations

import argparse
import csv
import json
import logging
import platform
import re
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from app import cli_options as opt
from app import cli_serve
from app.export import cell
from app.session import build_request, runtime_label
from engine.errors import EngineError, ModelWontFitError
from engine.limits import DEFAULT_K, K_AUTO, K_MAX, MAX_NEW_TOKENS
from engine.loadspec import LoadSpec
from engine.measure.bench import MODE_RUNNERS
from engine.settings import GenerationSettings
from engine.types import MODES, PROPOSERS, GenerationRequest, Message, Summary

if TYPE_CHECKING:  # heavy imports (torch, transformers) wait until a command really runs
    from engine.decoding import Engine
    from engine.models.loader import LoadedPair
    from engine.loadspec import LoadProgress

PROG = "specdec-studio"
log = logging.getLogger(__name__)


class CliError(Exception):
    """Bad input found by the CLI itself (arguments, prompt files); reported in one line."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so main() owns the exit code."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # "-1GiB" is a value to refuse clearly, not an unknown option ("expected one argument").
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> NoReturn:
        if message.endswith("required: command"):
            message = "a command is needed: generate, bench, sweep, distill, cache, plan, check or serve (see --help)"
        raise CliError(message)


def _positive_int(text: str) -> int:
    return opt.whole(text, 1, 2**31 - 1, "this value")


PRECISION_CHOICES = ["auto", "bfloat16", "float16", "float32", "int8", "nf4", "int8-wo", "fp8"]


def _memory(text: str) -> int:
    return opt.memory(text)


def _add_pair_args(g: argparse._ArgumentGroup) -> None:
    """What a pair is and how it is placed: shared by generate, bench, sweep and plan."""
    g.add_argument("--target", default=None, type=opt.model_spec,
                   help="model folder, .gguf file or hub id (default: packaged Qwen2.5-Coder-1.5B-Instruct)")
    g.add_argument("--draft", default=None, type=opt.model_spec,
                   help="model folder, .gguf file or hub id (default: packaged Qwen2.5-Coder-0.5B-Instruct)")
    g.add_argument("--preset", default=None, type=opt.model_spec,
                   help="a named pair instead of --target/--draft (specdec-studio plan --presets lists them)")
    g.add_argument("--device", default="auto", type=opt.device, help="auto, cpu, cuda or cuda:N (default: auto)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="float dtype of both models (auto: bf16 on CUDA and on CPUs with native bf16, else float32)")
    g.add_argument("--target-quant", "--target-dtype", dest="target_dtype", default="auto", choices=PRECISION_CHOICES,
                   help="the target's precision: int8-wo / fp8 (fast 8-bit), int8 / nf4 (bitsandbytes) or a float dtype "
                        "(default: --dtype)")
    g.add_argument("--draft-quant", "--draft-dtype", dest="draft_dtype", default="auto", choices=PRECISION_CHOICES,
                   help="the draft's precision, as --target-quant")
    g.add_argument("--context", type=_positive_int, default=None,
                   help="positions each KV cache holds (default: 8192, or the model's own limit if smaller)")
    g.add_argument("--gpus", type=_positive_int, default=None,
                   help="GPUs to split the target over (default: one, or as many as the memory plan needs)")
    g.add_argument("--memory", type=_memory, default=None,
                   help="memory per device instead of what is free, e.g. 24GiB (GiB binary, GB decimal)")


def _add_model_args(p: argparse.ArgumentParser, decoding: bool = True) -> None:
    g = p.add_argument_group("models")
    _add_pair_args(g)
    g.add_argument("--force", action="store_true", help="load even when the memory plan says it will not fit")
    g.add_argument("--head", default="auto", type=opt.head,
                   help="draft head folder for --proposer head; auto: the shipped head trained for this target "
                        "(if any); none: no head")
    g.add_argument("--tree", default="auto", choices=["auto", "0", "1", "2", "3"],
                   help="next-best head tokens verified beside each head draft token as a tree (0: chains; "
                        "auto: 2 on a GPU, 0 on a CPU, where a wider verify costs more)")
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
    d.add_argument("--k", type=opt.k, default=DEFAULT_K,
                   help=f"draft tokens proposed per step (1 to {K_MAX}), or auto: chosen per step from measured "
                        "costs and acceptance (0 = a standard step)")
    d.add_argument("--temperature", type=opt.temperature, default=0.0, help="0 = greedy")
    d.add_argument("--top-k", type=opt.top_k, default=0, help="0 disables")
    d.add_argument("--top-p", type=opt.top_p, default=1.0, help="1 disables")
    d.add_argument("--seed", type=opt.seed, default=0, help=f"0 to {opt.MAX_SEED}")
    d.add_argument("--proposer", default="draft", choices=list(PROPOSERS),
                   help="draft, ngram, draft+ngram or head (in auto mode draft+ngram is routed per step, and a "
                        "loaded head always joins them)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Speculative decoding, headless.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate one answer, streaming it to stdout")
    gen.add_argument("--prompt", required=True, type=opt.prompt, help="the user message (or raw text with --raw)")
    gen.add_argument("--raw", action="store_true", help="feed the prompt as-is, without the chat template")
    gen.add_argument("--mode", default="speculative", choices=list(MODES),
                     help="auto: the router, speculative decoding whose K (0 = standard) and proposer are chosen "
                          "per step")
    gen.add_argument("--max-new-tokens", type=opt.max_new_tokens, default=128, help=f"1 to {MAX_NEW_TOKENS}")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _add_model_args(gen)
    _add_model_args(serve := cli_serve.add_parser(sub))  # serve: the model options of generate, and its loader
    serve.set_defaults(load_engine=_load)

    bench = sub.add_parser("bench", help="time modes over a prompts file (JSON lines)")
    bench.add_argument("--prompts", required=True, type=Path, help='JSONL: {"id", "category", "prompt"} per line')
    bench.add_argument("--modes", default="standard,speculative",
                       help=f"comma-separated, run in this order per prompt (known: {', '.join(MODE_RUNNERS)})")
    bench.add_argument("--max-new-tokens", type=opt.max_new_tokens, default=128, help=f"1 to {MAX_NEW_TOKENS}")
    bench.add_argument("--json", dest="json_out", type=Path, default=None, help="write the full results here")
    bench.add_argument("--csv", dest="csv_out", type=Path, default=None, help="write one row per run here")
    bench.add_argument("--warmup", type=opt.warmup, default=1, help="untimed warm-up generations per mode")
    bench.add_argument("--repeat", type=opt.repeat, default=1,
                       help="time every prompt in every mode N times: median and spread (mode order rotates)")
    bench.add_argument("--raw", action="store_true", help="feed prompts as-is, without the chat template")
    _add_model_args(bench)

    sweep = sub.add_parser("sweep", help="measure proposer x K x temperature; write sweep.csv and sweep.png")
    sweep.add_argument("--prompts", required=True, type=opt.path, help='JSONL: {"id", "category", "prompt"} per line')
    sweep.add_argument("--k", dest="ks", type=opt.k_list, default="1,2,3,5,8,12",
                       help=f"comma-separated K values (1..{K_MAX}, or auto)")
    sweep.add_argument("--temperature", dest="temperatures", type=opt.temperature_list, default="0",
                       help="comma-separated temperatures (finite, >= 0)")
    sweep.add_argument("--proposer", dest="proposers", default="draft",
                       help="comma-separated: draft, ngram, draft+ngram, head")
    sweep.add_argument("--auto", action="store_true", help="also measure --mode auto per proposer")
    sweep.add_argument("--repeat", type=opt.repeat, default=1, help="time every configuration N times")
    sweep.add_argument("--max-new-tokens", type=opt.max_new_tokens, default=64, help=f"1 to {MAX_NEW_TOKENS}")
    sweep.add_argument("--out", required=True, type=opt.path, help="folder for sweep.csv, sweep.png, sweep.json")
    sweep.add_argument("--raw", action="store_true", help="feed prompts as-is, without the chat template")
    _add_model_args(sweep, decoding=False)

    distill = sub.add_parser("distill", help="train a draft head on the target's own answers (resumable)")
    distill.add_argument("--target", default=None, type=opt.model_spec,
                         help="model folder, .gguf file or hub id (default: packaged Qwen2.5-Coder-1.5B-Instruct)")
    distill.add_argument("--out", required=True, type=opt.path, help="where the head's shards and manifest go")
    distill.add_argument("--minutes", type=opt.minutes, default=17.0,
                         help="the whole budget, all calls together: data, training, export (default 17)")
    distill.add_argument("--work", type=opt.path, default=None,
                         help="work folder (data, checkpoints, log); running again with it resumes (default OUT/work)")
    distill.add_argument("--call-minutes", type=opt.minutes, default=None,
                         help="stop this call after so many minutes, exporting what is trained so far")
    distill.add_argument("--prompts", type=opt.path, default=None,
                         help='extra questions to answer, JSONL {"prompt": ...} (benchmark prompts are refused)')
    distill.add_argument("--seed", type=opt.seed, default=0, help=f"0 to {opt.MAX_SEED}")
    distill.add_argument("--init", type=opt.path, default=None,
                         help="a head folder trained for this target to continue from (fresh data, its vocabulary)")
    distill.add_argument("--plan", action="append", default=[], metavar="KEY=VALUE", type=opt.key_value,
                         help="change one setting of the plan, e.g. answer_segment=128 or train.lr=3e-4 (repeatable)")
    distill.add_argument("--device", default="auto", type=opt.device, help="auto, cpu, cuda or cuda:N (default: auto)")
    distill.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    distill.add_argument("-v", "--verbose", action="store_true", help="log what the engine does (stderr)")

    cache = sub.add_parser("cache", help="show, check or free the converted-model cache")
    cache.add_argument("action", choices=["info", "clean", "verify"],
                       help="info: what is there; clean: remove leftovers and assembled GGUFs; "
                            "verify: hash every converted file (damaged models are removed and converted again)")
    cache.add_argument("--all", action="store_true", help="clean: converted models too (converted again on next use)")
    cache.add_argument("-v", "--verbose", action="store_true", help="log what the cache does (stderr)")

    plan = sub.add_parser("plan", help="the memory plan of a pair: what it needs on each device, whether it fits")
    g = plan.add_argument_group("models")
    _add_pair_args(g)
    g.add_argument("--no-draft", action="store_true", help="plan the target alone")
    plan.add_argument("--presets", action="store_true",
                      help="list every preset with its plan at 24, 48 and 80 GiB (or --memory)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("-v", "--verbose", action="store_true", help="log what the planner reads (stderr)")
    from app import cli_check  # it builds on this module's options, as every command module does

    cli_check.add_parser(sub)
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
        interesting = p.stage in ("wait", "assemble", "verify", "convert") and self.stream.isatty()
        # A damaged cache is news for scripts too: what was loaded is not what was converted.
        if (interesting or p.stage == "repair" or self.verbose) and p.message != self.last:
            self.last = p.message
            print(f"{PROG}: {p.message}", file=self.stream, flush=True)


def _pair_specs(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """--target/--draft, or a preset's pair."""
    if args.preset is None:
        return args.target, args.draft
    if args.target is not None or args.draft is not None:
        raise CliError("give either --preset or --target/--draft, not both")
    from engine.models.presets import preset

    p = preset(args.preset)
    return p.target.spec, p.draft.spec


def _load(args: argparse.Namespace, needs_draft: bool, runtime: str | None = None,
          needs_head: bool | None = None) -> Engine:
    """needs_head: a draft head will propose (default: --proposer head outside standard mode); the
    head reads the target's hidden states, which llama.cpp does not give, so auto then picks torch."""
    from engine.assemble import build_engine

    if needs_head is None:
        needs_head = getattr(args, "mode", "standard") != "standard" and getattr(args, "proposer", None) == "head"
    spec = replace(load_spec(args, needs_draft), runtime=runtime or args.runtime, needs_head=needs_head)
    engine = build_engine(spec, _LoadReporter(sys.stderr, args.verbose))
    tree = getattr(args, "tree", "auto")
    if tree != "auto" and engine.head_runner is not None:
        engine.set_tree(int(tree))
    return engine


def load_spec(args: argparse.Namespace, needs_draft: bool) -> LoadSpec:
    """The one LoadSpec the command's options say (the same value the Models dialog makes)."""
    target, draft = _pair_specs(args)
    return LoadSpec(target=target, draft=draft, with_draft=needs_draft, runtime=args.runtime, device=args.device,
                    dtype=args.dtype, target_precision=args.target_dtype, draft_precision=args.draft_dtype,
                    fast_path=args.fast_path,
                    compile_k=getattr(args, "k", DEFAULT_K) or DEFAULT_K,  # K auto: compile the default K's widths
                    head=None if args.head == "none" else args.head, threads=args.threads, context=args.context,
                    gpus=args.gpus, memory=args.memory, force=args.force)


def _load_pair(args: argparse.Namespace, needs_draft: bool) -> LoadedPair:
    """The pair as Hugging Face ships it (the hf baselines; the engine's own pair packs while loading)."""
    from engine.models.loader import load_pair

    return load_pair(load_spec(args, needs_draft))


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
            "target_precision": info.target_precision or info.dtype, "draft_precision": info.draft_precision or None,
            "devices": list(info.devices), "context": args.context, "fast_path": info.fast_path,
            "fast_path_note": info.fast_path_note, "runtime": info.runtime, "threads": info.threads,
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
        print(f"{_summary_line(summary)}; {info.device}, {_precisions(info)}, {runtime_label(info)}", file=sys.stderr)
        if info.fast_path_note:
            print(f"{PROG}: {info.fast_path_note}", file=sys.stderr)
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
    from engine.models.loader import LoadedPair

    # Cheap checks first: a typo in a file name should not cost a model load.
    prompts = read_prompts(args.prompts)
    modes = parse_modes(args.modes)
    if "hf-assisted" in modes and args.proposer not in ("draft", "draft+ngram"):
        raise CliError("the hf-assisted baseline needs the draft model: use --proposer draft or drop that mode")
    outputs = [out for out in (args.json_out, args.csv_out) if out is not None]
    if len(outputs) == 2 and outputs[0].resolve() == outputs[1].resolve():
        raise CliError(f"--json and --csv name the same file {outputs[0]}")
    for out in outputs:
        try:
            opt.check_writable(out)
        except argparse.ArgumentTypeError as e:
            raise CliError(str(e)) from None
    needs_draft = any(MODE_RUNNERS[m].needs_draft for m in modes) and args.proposer in ("draft", "draft+ngram")
    engine = _load(args, needs_draft)
    # The hf-* baselines run on the engine's own torch models; on llama.cpp they load their own.
    pair = (LoadedPair(engine.target, engine.draft, engine.tokenizer, engine.info, engine.vocab)
            if engine.target is not None else None)
    ctx = BenchContext(
        pair, engine,
        make_request=lambda prompt, mode, max_new: _request(args, prompt, mode, max_new),
        reload_pair=lambda: _load_pair(args, needs_draft),
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
        where = e.filename or " or ".join(str(o) for o in outputs)  # a failed write() names no file
        raise CliError(f"cannot write results: {e.strerror or e} ({where})") from None
    print(f"{engine.info.target_name} / {engine.info.draft_name or '-'} on {engine.info.device} "
          f"({_precisions(engine.info)}, {runtime_label(engine.info)}), {len(prompts)} prompts, k={args.k or 'auto'}, "
          f"temperature={args.temperature}, max_new_tokens={args.max_new_tokens}")
    print(table)
    return 0


def _diagnose(engine: Engine, args: argparse.Namespace, summary: dict[str, Any]) -> list[str]:
    """The troubleshooting rules on what this bench measured, as lines to print and keep in the JSON."""
    from engine.measure.diagnostics import diagnose, from_bench
    from engine.measure.explain import describe_diagnosis

    evidence = from_bench(summary, engine.info, k=args.k, temperature=args.temperature, proposer=args.proposer)
    return [" ".join(describe_diagnosis(d)) for d in diagnose(evidence)]


def _precisions(info) -> str:
    target = info.target_precision or info.dtype
    draft = info.draft_precision or info.dtype
    return target if not info.draft_name or draft == target else f"target {target}, draft {draft}"


# --------------------------------------------------------------------------- entry point

def _fail(message: str) -> int:
    first = (message.strip().splitlines() or ["unknown error"])[0]
    # A file name or prompt can carry control characters (NUL, terminal escapes): show them, never send them.
    first = "".join(c if c.isprintable() else repr(c)[1:-1] for c in first)
    print(f"{PROG}: error: {first}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Runs one command; bad input and engine errors are one stderr line and exit code 2."""
    try:
        args = build_parser().parse_args(argv)
        opt.check_devices(args)
    except CliError as e:
        return _fail(str(e))
    except argparse.ArgumentTypeError as e:
        return _fail(str(e))
    except SystemExit as e:  # --help and --version exit through argparse
        return int(e.code or 0)
    if args.command == "cache":  # no torch, no transformers: answers in a moment
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                            format="%(levelname)s %(name)s: %(message)s")
        from app.cli_cache import cmd_cache

        try:
            return cmd_cache(args)
        except (CliError, EngineError) as e:
            return _fail(str(e))
        except OSError as e:
            return _fail(f"cannot use the cache: {e.strerror or e} ({e.filename})")
    _setup_logging(args.verbose)
    import torch

    if args.command == "sweep":
        from app.cli_sweep import cmd_sweep as command
    elif args.command == "distill":
        from app.cli_distill import cmd_distill as command
    elif args.command == "plan":
        from app.cli_plan import cmd_plan as command
    elif args.command == "check":
        from app.cli_check import run as command
    else:
        command = {"generate": cmd_generate, "bench": cmd_bench, "serve": cli_serve.run}[args.command]
    try:
        return command(args)
    except ModelWontFitError as e:
        from engine.models.plan import format_plan

        print(format_plan(e.plan), file=sys.stderr)  # type: ignore[arg-type]  # a MemoryPlan
        return _fail(f"{e} (--force loads it anyway)")
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
    except OSError as e:  # a file or folder the checks above could not foresee (a full disk, a vanished file)
        log.debug("OSError", exc_info=True)
        return _fail(f"{e.strerror or e}" + (f": {e.filename}" if e.filename else ""))
    except Exception as e:  # a bug: still one line for the person (the details with -v), never a traceback
        log.info("internal error", exc_info=True)
        what = (str(e).strip().splitlines() or [""])[0][:200]
        return _fail(f"internal error ({type(e).__name__}: {what}); run again with -v for the details, and "
                     f"please report it")


if __name__ == "__main__":
    # Run as the package's module, not as __main__: the command modules import app.cli, and a second
    # copy would make their CliError another class (a clear one-line error would read as internal).
    from app.cli import main as package_main

    sys.exit(package_main())
