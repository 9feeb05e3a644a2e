"""The options several commands share (the pair, its placement, decoding) and the parser that raises
instead of exiting, so that `run.main` owns the exit code."""
from __future__ import annotations

import argparse
import re
from typing import Any, NoReturn

from app.cli import options as opt
from app.cli.common import PROG, CliError
from engine.limits import DEFAULT_K, K_MAX, TREE_FRONTIER
from engine.types import PROPOSERS

__all__ = ["PROG", "Parser", "add_model_args", "add_pair_args", "positive_int", "memory_size"]


class Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so main() owns the exit code."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # "-1GiB" is a value to refuse clearly, not an unknown option ("expected one argument").
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> NoReturn:
        if message.endswith("required: command"):
            message = "a command is needed: generate, bench, sweep, distill, cache, plan, check or serve (see --help)"
        raise CliError(message)


def positive_int(text: str) -> int:
    return opt.whole(text, 1, 2**31 - 1, "this value")


PRECISION_CHOICES = ["auto", "bfloat16", "float16", "float32", "int8", "nf4", "int8-wo", "fp8"]


def memory_size(text: str) -> int:
    return opt.memory(text)


def add_pair_args(g: argparse._ArgumentGroup) -> None:
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
    g.add_argument("--context", type=positive_int, default=None,
                   help="positions each KV cache holds (default: 8192, or the model's own limit if smaller)")
    g.add_argument("--gpus", type=positive_int, default=None,
                   help="GPUs to split the target over (default: one, or as many as the memory plan needs)")
    g.add_argument("--memory", type=memory_size, default=None,
                   help="memory per device instead of what is free, e.g. 24GiB (GiB binary, GB decimal)")


def add_model_args(p: argparse.ArgumentParser, decoding: bool = True) -> None:
    g = p.add_argument_group("models")
    add_pair_args(g)
    g.add_argument("--force", action="store_true", help="load even when the memory plan says it will not fit")
    g.add_argument("--head", default="auto", type=opt.head,
                   help="draft head folder for --proposer head; auto: the shipped head trained for this target "
                        "(if any); none: no head")
    g.add_argument("--tree", default="auto", type=opt.tree,
                   help="how head drafts are verified: 0..3 next-best tokens beside each draft token (0: chains), "
                        "or dN: a dynamic tree of the head's N likeliest continuations, K levels deep (e.g. d48); "
                        "auto: a dynamic tree of 64 nodes on a GPU, 16 on a CPU, halved while its verify costs "
                        "over 1.15x a chain's here (measured at load), chains when 16 nodes cost over 1.25x")
    g.add_argument("--tree-frontier", default=TREE_FRONTIER, type=opt.tree_frontier,
                   help=f"a dynamic tree's nodes expanded per level (default {TREE_FRONTIER})")
    g.add_argument("--fast-path", default="auto", choices=["auto", "eager", "static", "compiled"],
                   help="auto: static cache + CUDA graphs where possible, else eager; compiled: also "
                        "torch.compile the per-step forwards for --k (CUDA; minutes of warm-up)")
    g.add_argument("--runtime", default="auto", choices=["auto", "torch", "llamacpp"],
                   help="auto: llama.cpp on the CPU for .gguf files and the packaged pair (when installed), "
                        "torch otherwise; --dtype and --fast-path apply to torch")
    g.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads per decode, llama.cpp and torch on a CPU (default: chosen for the "
                        "physical cores)")
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
