"""What every command shares: the one-line error, logging, turning options into a LoadSpec and an engine,
requests from options, and the facts about the machine and the models that results carry.

Commands call these through the module (`common.load_engine(...)`), so a test can replace the loader once.
"""
from __future__ import annotations

import argparse
import logging
import platform
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TextIO

from app.core.session import build_request
from engine.limits import DEFAULT_K, K_AUTO, TREE_FRONTIER
from engine.loadspec import LoadSpec
from engine.settings import GenerationSettings
from engine.types import GenerationRequest, Message, Summary

if TYPE_CHECKING:  # heavy imports (torch, transformers) wait until a command really runs
    from engine.decoding import Engine
    from engine.loadspec import LoadProgress
    from engine.models.loader import LoadedPair

PROG = "specdec-studio"


class CliError(Exception):
    """Bad input found by the CLI itself (arguments, prompt files); reported in one line."""


def fail(message: str) -> int:
    first = (message.strip().splitlines() or ["unknown error"])[0]
    # A file name or prompt can carry control characters (NUL, terminal escapes): show them, never send them.
    first = "".join(c if c.isprintable() else repr(c)[1:-1] for c in first)
    print(f"{PROG}: error: {first}", file=sys.stderr)
    return 2



def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    if not verbose:
        # Per-tensor progress bars from transformers would bury our one-line messages.
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()


class LoadReporter:
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


def pair_specs(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """--target/--draft, or a preset's pair."""
    if args.preset is None:
        return args.target, args.draft
    if args.target is not None or args.draft is not None:
        raise CliError("give either --preset or --target/--draft, not both")
    from engine.models.presets import preset

    p = preset(args.preset)
    return p.target.spec, p.draft.spec


def load_engine(args: argparse.Namespace, needs_draft: bool, runtime: str | None = None,
          needs_head: bool | None = None, keep_costs: bool = False, sequences: int = 1) -> Engine:
    """needs_head: a draft head will propose (default: --proposer head outside standard mode); the
    head reads the target's hidden states, which llama.cpp does not give, so auto then picks torch.
    keep_costs: forward costs kept for this machine and pair are used, as the app does (a command that
    answers); the measuring commands (bench, sweep, check) measure their own.
    sequences: decoded together (serve --max-seqs): the memory plan counts their caches."""
    from engine.assemble import build_engine

    if needs_head is None:
        needs_head = getattr(args, "mode", "standard") != "standard" and getattr(args, "proposer", None) == "head"
    spec = replace(load_spec(args, needs_draft), runtime=runtime or args.runtime, needs_head=needs_head,
                   keep_costs=keep_costs, sequences=sequences)
    engine = build_engine(spec, LoadReporter(sys.stderr, args.verbose))
    tree = getattr(args, "tree", "auto")
    if tree.startswith("d") and engine.head_runner is not None:
        engine.set_dynamic_tree(int(tree[1:]), getattr(args, "tree_frontier", TREE_FRONTIER))
    elif tree != "auto" and engine.head_runner is not None:
        engine.set_tree(int(tree))
    return engine


def load_spec(args: argparse.Namespace, needs_draft: bool) -> LoadSpec:
    """The one LoadSpec the command's options say (the same value the Models dialog makes)."""
    target, draft = pair_specs(args)
    return LoadSpec(target=target, draft=draft, with_draft=needs_draft, runtime=args.runtime, device=args.device,
                    dtype=args.dtype, target_precision=args.target_dtype, draft_precision=args.draft_dtype,
                    fast_path=args.fast_path,
                    compile_k=getattr(args, "k", DEFAULT_K) or DEFAULT_K,  # K auto: compile the default K's widths
                    head=None if args.head == "none" else args.head, threads=args.threads, context=args.context,
                    gpus=args.gpus, memory=args.memory, force=args.force)


def load_pair(args: argparse.Namespace, needs_draft: bool) -> LoadedPair:
    """The pair as Hugging Face ships it (the hf baselines; the engine's own pair packs while loading)."""
    from engine.models.loader import load_pair

    return load_pair(load_spec(args, needs_draft))


def settings_for(args: argparse.Namespace, mode: str, max_new_tokens: int) -> GenerationSettings:
    """The options as the settings a person would pick in the app (no system prompt on the command line)."""
    return GenerationSettings(mode=mode, proposer=args.proposer, k=args.k, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed, max_new_tokens=max_new_tokens,
                              system_prompt="")


def request_for(args: argparse.Namespace, prompt: str, mode: str, max_new_tokens: int) -> GenerationRequest:
    settings = settings_for(args, mode, max_new_tokens)
    if args.raw:
        return build_request(settings, (), prompt=prompt)
    return build_request(settings, (Message("user", prompt),))


def environment(engine: Engine) -> dict[str, Any]:
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


def model_config(engine: Engine, args: argparse.Namespace) -> dict[str, Any]:
    info = engine.info
    return {"target": info.target_name, "draft": info.draft_name, "device": info.device, "dtype": info.dtype,
            "target_precision": info.target_precision or info.dtype, "draft_precision": info.draft_precision or None,
            "devices": list(info.devices), "context": args.context, "fast_path": info.fast_path,
            "fast_path_note": info.fast_path_note, "runtime": info.runtime, "threads": info.threads,
            "vocab_size": info.vocab_size, "k": "auto" if args.k == K_AUTO else args.k,
            "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
            "max_new_tokens": args.max_new_tokens, "proposer": args.proposer, "raw": args.raw}


def summary_line(s: Summary) -> str:
    from engine.measure.explain import describe_decision, time_split

    line = (f"[{s.mode}] {s.new_tokens} tokens in {s.seconds:.2f} s ({s.tokens_per_s:.1f} tok/s), "
            f"stop: {s.stop_reason}")
    if s.new_tokens:
        line += f"; first token after {s.first_token_s:.2f} s ({s.prompt_tokens} prompt tokens read in {s.prefill_s:.2f} s)"
    if s.mode != "standard":
        line += (f"; acceptance {s.acceptance_rate:.0%} ({s.accepted}/{s.drafted}), "
                 f"{s.tokens_per_target_forward:.2f} tokens per target forward, mean K {s.k_mean:.1f}")
    line += f"; {time_split(s)}"
    if s.decision is not None and s.decision.reason != "fixed":
        line += f"; {describe_decision(s.decision)}"
    return line



def precisions(info) -> str:
    target = info.target_precision or info.dtype
    draft = info.draft_precision or info.dtype
    return target if not info.draft_name or draft == target else f"target {target}, draft {draft}"
