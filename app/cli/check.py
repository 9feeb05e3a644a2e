"""`specdec-studio check`: will this draft pay? Every candidate ranked by its predicted speedup before anything runs."""
from __future__ import annotations

import argparse
import copy
import csv
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from app.cli import common
from app.cli import options as opt
from app.cli.arguments import add_model_args
from app.cli.common import CliError
from app.core.export import cell
from engine.limits import MAX_NEW_TOKENS, PROBE_TOKENS
from engine.measure.check_types import CandidateCheck, CheckReport
from engine.types import Sampling

if TYPE_CHECKING:
    from engine.decoding import Engine

HF_CACHE = "hf"  # --scan hf: the local Hugging Face cache
CSV_FIELDS = ("rank", "name", "kind", "status", "params", "size_ratio", "kl", "top1", "greedy_positions",
              "sampled_positions", "first_range", "cost_ratio", "best_k", "tree", "speedup", "speedup_range", "reason")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """The `check` command and its options (the model options are generate's)."""
    p = subparsers.add_parser("check", help="rank drafts, the draft head and n-gram lookup by predicted speedup",
                              conflict_handler="resolve")
    add_model_args(p, decoding=False)
    g = p.add_argument_group("check")
    g.add_argument("--draft", dest="drafts", action="extend", nargs="+", default=None, type=opt.model_spec,
                   metavar="D", help="draft models to check: folders, .gguf files or hub ids already downloaded "
                                     "(default: the packaged Qwen2.5-Coder-0.5B-Instruct unless --scan finds some)")
    g.add_argument("--ngram", action="store_true", help="also check n-gram prompt lookup")
    g.add_argument("--scan", action="append", default=[], type=opt.path, metavar="FOLDER",
                   help="check every model folder and .gguf under FOLDER (read-only); 'hf': the local Hugging Face cache")
    g.add_argument("--prompts", type=opt.path, default=None,
                   help='probe prompts, JSONL {"id", "category", "prompt"} (default: assets/check_prompts.jsonl)')
    g.add_argument("--probe-tokens", type=lambda t: opt.whole(t, 4, MAX_NEW_TOKENS, "probe tokens"),
                   default=PROBE_TOKENS, help=f"tokens of the target's greedy continuation per probe prompt (default {PROBE_TOKENS})")
    g.add_argument("--answer-tokens", type=lambda t: opt.whole(t, 1, MAX_NEW_TOKENS, "answer tokens"), default=None,
                   help="price answers of this many tokens, whose last rounds keep only what is left (default: rounds)")
    g.add_argument("--temperature", type=opt.temperature, default=0.0, help="price acceptance at this temperature")
    g.add_argument("--top-k", type=opt.top_k, default=0, help="0 disables")
    g.add_argument("--top-p", type=opt.top_p, default=1.0, help="1 disables")
    g.add_argument("--json", dest="json_out", type=opt.path, default=None, help="write the report here")
    g.add_argument("--csv", dest="csv_out", type=opt.path, default=None, help="write one row per candidate here")
    return p


def _candidates(args: argparse.Namespace) -> tuple[str | None, list[str | None]]:
    """(target spec, draft specs in order): --draft, then what --scan finds; the packaged draft if neither."""
    from engine.measure.check_load import find_candidates, hf_cache

    target, preset_draft = common.pair_specs(argparse.Namespace(**{**vars(args), "draft": None}))
    drafts: list[str | None] = list(args.drafts or ([preset_draft] if args.preset else []))
    for folder in args.scan:
        where = hf_cache() if str(folder) == HF_CACHE else folder
        if not where.is_dir():
            raise CliError(f"--scan: {where} is not a folder")
        drafts += [d for d in find_candidates(where) if d != target]
    if not drafts and not args.scan:
        drafts = [None]  # the packaged draft
    return target, list(dict.fromkeys(drafts))


def run(args: argparse.Namespace) -> int:
    from engine.measure.bench import read_prompts
    from engine.measure.check import check_engine
    from engine.measure.check_load import tokenizer_refusal

    prompts = read_prompts(args.prompts) if args.prompts is not None else None  # a typo costs no model load
    for out in (o for o in (args.json_out, args.csv_out) if o is not None):
        try:
            opt.check_writable(out)
        except argparse.ArgumentTypeError as e:
            raise CliError(str(e)) from None
    target, drafts = _candidates(args)
    # The first draft the target's tokenizer accepts loads with it (its costs measured with the target's);
    # the rest load beside it, one by one.
    first = next((d for d in drafts if tokenizer_refusal(target, d)[0] is None), "none")
    load_args = copy.copy(args)
    load_args.target, load_args.draft, load_args.preset = target, first, None
    engine = common.load_engine(load_args, needs_draft=first != "none", needs_head=False)
    rest = [d for d in drafts if d != first]

    def load_torch(spec: str) -> Engine:
        other = copy.copy(args)
        other.target, other.draft, other.preset, other.head = spec, None, None, "none"
        return common.load_engine(other, needs_draft=False, runtime="torch", needs_head=False)

    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    report = check_engine(engine, target, rest, sampling=sampling, head=args.head != "none", ngram=args.ngram,
                          prompts=prompts, probe_tokens=args.probe_tokens, progress=_progress(),
                          load_torch=load_torch, answer_tokens=args.answer_tokens)
    print(format_report(report))
    try:
        if args.json_out is not None:
            args.json_out.write_text(json.dumps({"report": report_json(report), **common.environment(engine)},
                                                indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        if args.csv_out is not None:
            write_csv(args.csv_out, report)
    except OSError as e:
        raise CliError(f"cannot write results: {e.strerror or e} ({e.filename})") from None
    return 0


def _progress():
    stream = sys.stderr

    def show(fraction: float, message: str) -> None:
        if stream.isatty():
            stream.write(f"\r{fraction:4.0%} {message[:70]:<70}")
            stream.flush()
            if fraction >= 1.0:
                stream.write("\n")
    return show


def report_json(report: CheckReport) -> dict:
    return {**asdict(report), "best": report.best.name if report.best else None}


def _positions(values: tuple[float, ...], n: int = 4) -> str:
    return " ".join(f"{v:.2f}" for v in values[:n]) or "-"


def _range(bounds: tuple[float, float] | None) -> str:
    return "-" if bounds is None else f"{bounds[0]:.2f}-{bounds[1]:.2f}"


def _num(value: float | None, fmt: str) -> str:
    width = int("".join(ch for ch in fmt.split(".")[0] if ch.isdigit()) or 0)
    return f"{'-':>{width}}" if value is None else format(value, fmt)


def format_report(report: CheckReport) -> str:
    """The ranked table, the verdict and the wall time."""
    t = report.temperature
    head = (f"{'#':>2} {'candidate':<34} {'size':>6} {'KL':>6} {'top-1':>6} {'acc/pos T=0':>20} "
            f"{f'acc/pos T={t:g}':>20} {'cost':>5} {'K':>3} {'speedup':>8} {'90% range':>10}")
    lines = [(f"{report.target} on {report.device} ({report.runtime}); {report.probes} probe prompts, "
              f"{report.probe_tokens} continuation tokens; temperature {t:g}, top-p {report.top_p:g}, "
              f"top-k {report.top_k}; a target forward {report.target_ms:.1f} ms"
              + (f"; speedups of {report.answer_tokens}-token answers" if report.answer_tokens else "")), head]
    for n, c in enumerate(report.candidates, 1):
        if c.status != "ok":
            lines.append(f"{n:>2} {c.name[:34]:<34} refused: {c.reason}")
            continue
        k = f"{c.best_k}{'t' if c.tree else ''}" if c.best_k else "-"
        lines.append(f"{n:>2} {c.name[:34]:<34} {_num(c.size_ratio, '6.0%')} {_num(c.kl, '6.2f')} "
                     f"{_num(c.top1, '6.2f')} {_positions(c.greedy_positions):>20} "
                     f"{_positions(c.sampled_positions):>20} {_num(c.cost_ratio, '5.0%')} {k:>3} "
                     f"{_num(c.speedup, '7.2f') + '×' if c.speedup is not None else '-':>8} "
                     f"{_range(c.speedup_range):>10}")
    lines.append(f"verdict: {report.verdict}")
    host = next((c.round_overhead_ms for c in report.candidates if c.round_overhead_ms is not None), None)
    if host is not None:
        lines.append(f"the head's rounds took {host:.2f} ms each beyond their forwards (host work), priced in")
    phases = ", ".join(f"{name} {s:.0f} s" for name, s in report.phases if s >= 0.5)
    lines.append(f"checked in {report.wall_s:.1f} s after the models loaded{f' ({phases})' if phases else ''}; "
                 "size and cost are over the target's; K: the best draft length, t = a tree; 90% range: the "
                 "speedup predicted from resamples of the probe prompts (acceptance depends on the text)")
    return "\n".join(lines)


def write_csv(path: Path, report: CheckReport) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for n, c in enumerate(report.candidates, 1):
            row = {**asdict(c), "rank": n}
            row["greedy_positions"] = " ".join(f"{v:.4f}" for v in c.greedy_positions)
            row["sampled_positions"] = " ".join(f"{v:.4f}" for v in c.sampled_positions)
            for key in ("first_range", "speedup_range"):
                row[key] = "" if row[key] is None else " ".join(f"{v:.4f}" for v in row[key])
            writer.writerow({k: cell(v) for k, v in row.items()})


def candidate_rows(report: CheckReport) -> list[CandidateCheck]:
    """The candidates that were checked (refused ones left out), best first."""
    return [c for c in report.candidates if c.status == "ok"]
