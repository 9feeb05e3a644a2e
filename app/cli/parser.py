"""The whole command line: every command and its options."""
from __future__ import annotations

import argparse
from pathlib import Path

from app.cli import check
from app.cli import options as opt
from app.cli import serve as serve_command
from app.cli.arguments import Parser, add_model_args, add_pair_args
from app.cli.common import PROG
from engine.limits import K_MAX, MAX_NEW_TOKENS
from engine.measure.bench import MODE_RUNNERS
from engine.types import MODES


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description="Speculative decoding, headless.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    gen = sub.add_parser("generate", help="generate one answer, streaming it to stdout")
    gen.add_argument("--prompt", required=True, type=opt.prompt, help="the user message (or raw text with --raw)")
    gen.add_argument("--raw", action="store_true", help="feed the prompt as-is, without the chat template")
    gen.add_argument("--mode", default="speculative", choices=list(MODES),
                     help="auto: the router, speculative decoding whose K (0 = standard) and proposer are chosen "
                          "per step")
    gen.add_argument("--max-new-tokens", type=opt.max_new_tokens, default=128, help=f"1 to {MAX_NEW_TOKENS}")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_model_args(gen)
    add_model_args(serve_command.add_parser(sub))  # serve: the model options of generate

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
    add_model_args(bench)

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
    add_model_args(sweep, decoding=False)

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
    distill.add_argument("--data", action="append", default=[], metavar="WORK", type=opt.path,
                         help="the work folder of an earlier distillation of this target: train on its data rounds "
                              "again beside the fresh ones (repeatable)")
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
    add_pair_args(g)
    g.add_argument("--no-draft", action="store_true", help="plan the target alone")
    g.add_argument("--head", default="auto", type=opt.head,
                   help="the draft head a load would attach: auto (the shipped one for this target, if any), "
                        "a head folder, or none")
    plan.add_argument("--max-seqs", type=opt.sequences, default=1,
                      help="sequences decoded together, as serve --max-seqs: each one's cache rows are counted "
                           "(default 1)")
    plan.add_argument("--presets", action="store_true",
                      help="list every preset with its plan at 24, 48 and 80 GiB (or --memory)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("-v", "--verbose", action="store_true", help="log what the planner reads (stderr)")
    check.add_parser(sub)
    return parser
