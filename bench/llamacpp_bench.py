"""The CPU on llama.cpp, measured side by side in one process (prints figures; JSON in bench/results).

1. First start from an empty cache, in a child process: seconds to "Ready" (assembling the
   packaged GGUFs, SHA-256, the tokenizer built from the GGUF, loading, cost measurement), a
   second (warm) start, and the child's memory with the default pair against the GGUF files' size.
2. In this process, every prompt in turn, greedy, K fixed: the engine's standard decoding on
   llama.cpp; a plain llama-cpp-python greedy loop on the same GGUF (Llama.generate); speculative
   decoding with the draft model and with n-gram lookup; the engine's standard decoding on torch
   (the same pair, converted, loaded beside); auto mode (K and draft/n-gram chosen per step from
   the costs measured at load: where a verify costs as much as its tokens decoded one by one, it
   decodes standard steps). Then tok/s, the ratios against their targets, identical counts with
   every first divergence, the cost model's predictions and its verdict.

    .venv/bin/python bench/llamacpp_bench.py                       # the full run (20 prompts x 64)
    .venv/bin/python bench/llamacpp_bench.py --limit 2 --max-new-tokens 16 --skip-torch   # a probe
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGETS = {"standard / llamacpp-plain": 0.95, "standard / torch-standard": 4.0, "rss / gguf": 1.3, "ready_s": 60.0}


def _memory_mb() -> dict[str, float]:
    """Resident memory now and at its peak (VmRSS / VmHWM), in MB."""
    out = {}
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
    return {"rss_mb": out.get("VmRSS", 0.0), "peak_rss_mb": out.get("VmHWM", 0.0)}


def child_start(target: str | None, draft: str | None, threads: int | None, max_new_tokens: int) -> None:
    """Runs in a fresh process (SPECDEC_CACHE_DIR set by the parent): load, answer once, report as JSON."""
    started = time.perf_counter()
    from engine.assemble import build_engine
    from engine.loadspec import LoadSpec
    from engine.models.packaged import DEFAULT_MODELS
    from engine.types import GenerationRequest, Message

    stages: list[tuple[float, str]] = []
    engine = build_engine(LoadSpec(target, draft, runtime="llamacpp", threads=threads),
                          lambda p: stages.append((round(time.perf_counter() - started, 2), p.message)))
    ready = time.perf_counter() - started
    loaded = _memory_mb()
    for mode in ("standard", "speculative"):
        generation = engine.generate(GenerationRequest(messages=(Message("user", "Write quicksort in Python."),),
                                                       mode=mode, max_new_tokens=max_new_tokens))
        for _ in generation:
            pass
    gguf_bytes = sum(Path(p).stat().st_size if p else m.size for p, m in zip((target, draft), (DEFAULT_MODELS["target"], DEFAULT_MODELS["draft"])))
    print(json.dumps({"ready_s": ready, "stages": stages, "loaded": loaded, "after_answers": _memory_mb(),
                      "gguf_bytes": gguf_bytes, "info": {"dtype": engine.info.dtype, "threads": engine.info.threads,
                                                         "draft_ms": engine.info.draft_ms,
                                                         "target_ms": engine.info.target_ms}}))


def starts(args: argparse.Namespace) -> dict:
    """A first start from an empty cache, then a second start on what it cached; each in a new process."""
    cache = Path(tempfile.mkdtemp(prefix="specdec-cold-"))
    env = {**os.environ, "SPECDEC_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, __file__, "--child-start", "--max-new-tokens", str(args.max_new_tokens)]
    for flag, value in (("--threads", args.threads), ("--target", args.target), ("--draft", args.draft)):
        if value:
            command += [flag, str(value)]
    runs = {}
    try:
        for label in ("first_start_empty_cache", "second_start"):
            out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
            if out.returncode != 0:
                raise SystemExit(f"{label} failed:\n{out.stderr[-2000:]}")
            runs[label] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{label}: Ready in {runs[label]['ready_s']:.1f} s; RSS {runs[label]['after_answers']['rss_mb']:.0f} MB "
                  f"(peak {runs[label]['after_answers']['peak_rss_mb']:.0f} MB)", flush=True)
    finally:
        if not args.keep_cold_cache:
            shutil.rmtree(cache, ignore_errors=True)
        else:
            print(f"(cache kept in {cache})")
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=Path, default=ROOT / "assets" / "bench_prompts.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--limit", type=int, default=0, help="only the first N prompts (0: all)")
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: physical cores)")
    parser.add_argument("--target", default=None, help="a .gguf target (default: the packaged pair)")
    parser.add_argument("--draft", default=None, help="a .gguf draft (default: the packaged pair)")
    parser.add_argument("--skip-torch", action="store_true", help="no torch side (it converts the pair once)")
    parser.add_argument("--skip-starts", action="store_true", help="no cold/warm start measurement")
    parser.add_argument("--keep-cold-cache", action="store_true")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "cpu_llamacpp.json")
    parser.add_argument("--child-start", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_start:
        child_start(args.target, args.draft, args.threads, args.max_new_tokens)
        return 0

    import logging

    logging.basicConfig(level=logging.WARNING)
    result: dict = {"config": vars(args) | {"prompts": str(args.prompts), "json": str(args.json)}}
    if not args.skip_starts:
        result["starts"] = starts(args)

    from app.cli import _environment, _request, build_parser
    from engine.measure.bench import BenchContext, format_table, read_prompts, run_bench
    from engine.measure.costmodel import CostModel, alpha_from_mean_accepted
    from engine.assemble import build_engine
    from engine.loadspec import LoadSpec
    from engine.models.loader import load_pair

    prompts = read_prompts(args.prompts)[: args.limit or None]
    cli_args = build_parser().parse_args(["bench", "--prompts", str(args.prompts), "--k", str(args.k)])
    t0 = time.perf_counter()
    engine = build_engine(LoadSpec(args.target, args.draft, runtime="llamacpp", threads=args.threads))
    print(f"llama.cpp engine ready in {time.perf_counter() - t0:.1f} s: {engine.info}", flush=True)
    def make_request(prompt: str, mode: str, max_new: int):
        request = _request(cli_args, prompt, mode, max_new)
        # Auto mode: the controller picks K (0 = a standard step) and draft or n-gram per step.
        return replace(request, proposer="draft+ngram") if mode == "auto" else request

    ctx = BenchContext(
        None, engine,
        make_request=make_request,
        reload_pair=lambda: load_pair(LoadSpec(args.target, args.draft)),
        load_runtime=lambda runtime: build_engine(LoadSpec(args.target, None, with_draft=False, runtime=runtime)),
    )
    modes = ["standard", "llamacpp-plain", "speculative", "speculative-ngram", "auto"] + (
        [] if args.skip_torch else ["torch-standard"])
    bench = run_bench(ctx, prompts, modes, max_new_tokens=args.max_new_tokens, warmup=1,
                      progress=lambda done, total, note: print(f"  {done}/{total} {note}", flush=True))
    summary = bench.summary
    s = summary
    ratios = {"standard / llamacpp-plain": s["standard"]["tokens_per_s"] / s["llamacpp-plain"]["tokens_per_s"]}
    if "torch-standard" in s:
        ratios["standard / torch-standard"] = s["standard"]["tokens_per_s"] / s["torch-standard"]["tokens_per_s"]
    model = CostModel.from_info(engine.info)
    predictions = {}
    for mode, draft_ms in (("speculative", model.draft_ms), ("speculative-ngram", 0.0)):
        runs = [r for r in bench.runs if r.mode == mode]
        counts = [sum(getattr(r, f) for r in runs) for f in ("new_tokens", "target_forwards", "drafted", "draft_forwards")]
        alpha = alpha_from_mean_accepted(s[mode]["tokens_per_target_forward"] - 1.0, args.k)
        m = CostModel(draft_ms=draft_ms, target_ms=model.target_ms)
        predictions[mode] = {"alpha": alpha, "predicted": m.predicted_from_counts(*counts),
                             "measured": s[mode]["tokens_per_s"] / s["standard"]["tokens_per_s"],
                             "mean_draft": counts[2] / max(counts[1], 1),
                             "best_k": m.best_k(alpha, model.k_max)[0], "verdict": m.verdict(alpha, model.k_max)}
    result.update(summary=summary, ratios=ratios, cost_predictions=predictions, wall_s=bench.wall_s,
                  info=engine.info.__dict__, environment=_environment(engine),
                  runs=[{**r.__dict__, "token_ids": list(r.token_ids)} for r in bench.runs])

    print(f"\n{engine.info.target_name} / {engine.info.draft_name} on llama.cpp ({engine.info.dtype}, "
          f"{engine.info.threads} threads), {len(prompts)} prompts x {args.max_new_tokens}, greedy, K={args.k}")
    print(format_table(summary, bench.modes))
    print("\nagainst the issue's targets:")
    for name, value in ratios.items():
        print(f"  {name}: {value:.2f}x (target >= {TARGETS[name]}x)")
    starts_ = result.get("starts")
    if starts_:
        first = starts_["first_start_empty_cache"]
        rss = first["after_answers"]["rss_mb"] * 2**20 / first["gguf_bytes"]
        print(f"  first start, empty cache -> Ready: {first['ready_s']:.1f} s (target < 60 s); second start "
              f"{starts_['second_start']['ready_s']:.1f} s")
        print(f"  RSS with the default pair: {first['after_answers']['rss_mb']:.0f} MB = {rss:.2f}x the GGUF files "
              f"({first['gguf_bytes'] / 2**20:.0f} MB; target <= 1.3x); peak {first['after_answers']['peak_rss_mb']:.0f} MB")
    print("cost model (measured at load): draft %.1f ms; target %s" % (
        model.draft_ms, ", ".join(f"w{w} {ms:.1f}" for w, ms in sorted(model.target_ms.items()))))
    for mode, p in predictions.items():
        print(f"  {mode}: {p['mean_draft']:.2f} drafts per step, alpha {p['alpha']:.2f}; predicted "
              f"{p['predicted']:.2f}x from the run's counts, measured {p['measured']:.2f}x. {p['verdict']}")
    auto_runs = [r for r in bench.runs if r.mode == "auto"]
    if auto_runs:
        steps = sum(sum(r.drafted_steps) for r in auto_runs)
        standard_steps = sum(r.drafted_steps[0] for r in auto_runs if r.drafted_steps)
        print(f"  auto: {s['auto']['tokens_per_s'] / s['standard']['tokens_per_s']:.2f}x standard; "
              f"{standard_steps} of {steps} steps standard, {sum(r.drafted for r in auto_runs)} tokens drafted")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2, ensure_ascii=False, default=str), encoding="utf-8")
    print(f"\nJSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
