"""Is the draft check honest? Its predictions against what the bench measures on prompts it never read.

Runs `specdec-studio check` (the probe prompts, assets/check_prompts.jsonl), then the bench core
(engine.measure.bench.run_bench, standard then speculative) for every candidate it priced — the draft,
the draft head, n-gram lookup — at the K the check chose (its best K even when none pays), on the 20
shared prompts (assets/bench_prompts.jsonl), and prints predicted vs measured acceptance per draft
position and speedup. The check prices answers of --max-new-tokens tokens, the length the bench decodes
(their last rounds keep only what is left; no prefill); the measured speedup is given both
in rounds (tokens over the seconds after prefill) and end to end (the bench's tok/s), and what a step spent
by phase (drafting, verify, the host's work between steps), beside its price at load for the head's trees.

CPU, the default pair on llama.cpp (model options as the CLI's):

    .venv/bin/python bench/check_honesty.py --runtime llamacpp \
        --probe-tokens 64 --json bench/results/check_honesty_cpu_llamacpp_probe64.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.cli import options as opt
from app.cli.check import _candidates, format_report, report_json
from app.cli.common import CliError, environment, load_engine, request_for
from app.cli.parser import build_parser
from engine.errors import EngineError


def _decode_rate(runs) -> float:
    tokens = sum(r.new_tokens for r in runs)
    seconds = sum(r.seconds - r.prefill_s for r in runs)
    return tokens / seconds if seconds > 0 else 0.0


def _measure(engine, args, kind: str, k: int, prompts, max_new: int) -> dict:
    from engine.measure.bench import BenchContext, run_bench
    from engine.measure.experiment import round_split

    args.k, args.proposer, args.raw = k, kind, False
    ctx = BenchContext(None, engine, make_request=lambda p, mode, n: request_for(args, p, mode, n),
                       reload_pair=lambda: None)  # type: ignore[arg-type,return-value]  # no hf-* modes here
    result = run_bench(ctx, prompts, ["standard", "speculative"], max_new_tokens=max_new, warmup=1,
                       proposer=kind)
    std = [r for r in result.runs if r.mode == "standard"]
    spec = [r for r in result.runs if r.mode == "speculative"]
    s = result.summary
    return {
        "k": k,
        "per_position_acceptance": list(s["speculative"]["per_position_acceptance"]),
        "speedup_end_to_end": s["speculative"]["tokens_per_s"] / s["standard"]["tokens_per_s"],
        "speedup_in_rounds": _decode_rate(spec) / _decode_rate(std),
        "bench_predicted_speedup": s.get("cost_model", {}).get("predicted_speedup"),
        # What a step spent by phase (ms), to set beside its price: standard decoding's and this candidate's.
        "standard_step_ms": round_split(std), "step_ms": round_split(spec),
        "standard_tok_s": s["standard"]["tokens_per_s"],
        "speculative_tok_s": s["speculative"]["tokens_per_s"],
        "wall_s": result.wall_s,
    }


def _tree_price(info, c, sampling) -> dict:
    """A tree round's price at load by phase (ms; None where it was not measured), as the check priced it."""
    from engine.measure.costmodel import tree_costs_at

    return {"draft": dict(info.tree_draft_ms).get(c.best_k),
            "verify": tree_costs_at(info, not sampling.greedy).get(c.best_k),
            "host": c.round_overhead_ms, "standard": dict(info.target_ms).get(1)}


def _step_line(m: dict, standard: dict, priced: dict | None) -> str:
    """'  a step 4.84 ms: drafting 1.53, verify 3.04, host 0.28; a standard step 2.41 (priced: ...)'."""
    def ms(value) -> str:
        return "-" if value is None else f"{value:.3f}"

    line = (f"  a step {m['all']:.3f} ms: drafting {m['draft']:.3f}, verify {m['verify']:.3f}, host {m['host']:.3f}; "
            f"a standard step {standard['all']:.3f}")
    if priced is not None:
        line += (f" (priced: drafting {ms(priced['draft'])}, verify {ms(priced['verify'])}, host {ms(priced['host'])};"
                 f" a standard step {ms(priced['standard'])})")
    return line


def _inside(value: float | None, bounds: tuple[float, float] | None) -> bool | None:
    """Whether a measured figure lies in the check's range over resamples of its probes (None: no range)."""
    return None if value is None or bounds is None else bounds[0] <= value <= bounds[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench-prompts", type=Path, default=Path("assets/bench_prompts.jsonl"))
    ap.add_argument("--max-new-tokens", type=opt.max_new_tokens, default=64)
    ap.add_argument("--skip", default="", help="comma-separated kinds not to measure: draft, head, ngram")
    ap.add_argument("--json", dest="out", type=Path, required=True)
    own, rest = ap.parse_known_args(argv)
    try:
        args = build_parser().parse_args(["check", "--ngram", *rest])
        unknown = {s.strip() for s in own.skip.split(",") if s.strip()} - {"draft", "head", "ngram"}
        if unknown:
            raise CliError(f"--skip takes draft, head and ngram, not {', '.join(sorted(unknown))}")
        if args.answer_tokens is not None:
            raise CliError("--answer-tokens is --max-new-tokens here: the check prices the answers the bench decodes")
        opt.check_writable(own.out)  # before minutes of loading and timing
    except (CliError, argparse.ArgumentTypeError) as e:
        print(f"check_honesty: {e}", file=sys.stderr)
        return 2
    from engine.measure.bench import read_prompts
    from engine.measure.check import check_engine
    from engine.types import Sampling

    try:
        prompts = read_prompts(own.bench_prompts)
        target, drafts = _candidates(args)
        drafts = [d for d in drafts if d != "none"]  # --draft none: the head and n-gram only, as the check's
        args.target, args.draft = target, drafts[0] if drafts else "none"
        loaded = time.perf_counter()
        engine = load_engine(args, needs_draft=bool(drafts), needs_head=False)
    except (CliError, EngineError) as e:
        print(f"check_honesty: {e}", file=sys.stderr)
        return 2
    print(f"models loaded in {time.perf_counter() - loaded:.1f} s", flush=True)
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    report = check_engine(engine, target, drafts[1:], sampling=sampling, head=args.head != "none", ngram=True,
                          probe_tokens=args.probe_tokens, answer_tokens=own.max_new_tokens)  # the answers it measures
    print(format_report(report), flush=True)
    args.top_k, args.top_p, args.seed = report.top_k, report.top_p, 0
    skip = {s.strip() for s in own.skip.split(",") if s.strip()}
    rows: list[dict] = []

    def write() -> None:  # after the check and after every measured row: a long CPU run keeps what it measured
        # A CPU shared with other work moves every figure: the load average says how shared it was.
        own.out.write_text(json.dumps({"check": report_json(report), "measured": rows,
                                       "max_new_tokens": own.max_new_tokens, "bench_prompts": str(own.bench_prompts),
                                       "argv": rest, "load_average_at_end": os.getloadavg(),
                                       "environment": environment(engine)}, indent=2, ensure_ascii=False) + "\n",
                           encoding="utf-8")

    write()
    for c in report.candidates:
        # Only the engine's own draft decodes through the loop; other drafts were loaded beside it for the check.
        if c.status != "ok" or not c.best_k or c.kind in skip or (
                c.kind == "draft" and c.name != engine.info.draft_name):
            continue
        measured = _measure(engine, args, c.kind, c.best_k, prompts, own.max_new_tokens)
        first = (measured["per_position_acceptance"] or [None])[0]
        row = {"candidate": c.name, "kind": c.kind, "k": c.best_k, "tree": c.tree,
               "predicted_per_position": list(c.sampled_positions), "predicted_speedup": c.speedup,
               "predicted_first_range": c.first_range, "predicted_speedup_range": c.speedup_range, **measured,
               "first_in_range": _inside(first, c.first_range),
               "speedup_in_range": _inside(measured["speedup_in_rounds"], c.speedup_range)}
        if c.kind == "head" and c.tree:
            row["priced_ms"] = _tree_price(engine.info, c, sampling)
        rows.append(row)
        pred = " ".join(f"{v:.2f}" for v in c.sampled_positions[:6])
        meas = " ".join(f"{v:.2f}" for v in measured["per_position_acceptance"][:6])
        ranges = "" if c.speedup_range is None or c.first_range is None else (
            f"; over resamples of the probes the check gives position 1 {c.first_range[0]:.2f}-{c.first_range[1]:.2f}"
            f" ({'inside' if row['first_in_range'] else 'outside'}), speedup {c.speedup_range[0]:.2f}-"
            f"{c.speedup_range[1]:.2f}x ({'inside' if row['speedup_in_range'] else 'outside'})")
        print(f"{c.name} K={c.best_k}: acceptance per position predicted {pred} | measured {meas}; speedup "
              f"predicted {c.speedup:.2f}x, measured {measured['speedup_in_rounds']:.2f}x in rounds "
              f"({measured['speedup_end_to_end']:.2f}x end to end){ranges}", flush=True)
        print(_step_line(measured["step_ms"], measured["standard_step_ms"], row.get("priced_ms")), flush=True)
        write()
    print(f"wrote {own.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
