"""Why does auto decode the way it does? Every choice of the K controller, with what it weighed.

Auto mode against standard decoding, side by side (engine.measure.bench.run_bench), with the
adaptive controller of every auto answer wrapped: each choice records its reason, the K and
proposer chosen, and for every offer the controller's predicted speedup, K and acceptance by
position, with the online timing corrections it used (standard step cost, speculative overhead,
verify and drafting ratios, catch-up); each observed round records what was drafted, accepted and
what it cost. The summary counts standard steps by reason and shows what the best offer was
predicted to pay when auto stood still, so a pessimistic estimate (costs or acceptance) shows.

CPU, real default pair and its shipped head, T = 0.7:

    flock /tmp/specdec-real.lock .venv/bin/python bench/auto_trace.py --max-new-tokens 64 \
        --temperature 0.7 --out /tmp/auto_trace.json

On the H200 (bf16, CUDA graphs) with a converted target folder:

    python3 bench/auto_trace.py --target /root/hf/target --head assets/heads/qwen2.5-coder-1.5b-instruct \
        --max-new-tokens 256 --temperature 0.7 --out $OUT/h200_auto_trace_t07.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


class TracedController:
    """A K controller that records what another one chose and weighed (rows appended to `log`)."""

    def __init__(self, inner, log: list[dict], label: str) -> None:
        self.inner, self.log, self.label = inner, log, label

    def choose(self, offers, room: int):
        from engine.decoding.control import AdaptiveK

        decision = self.inner.choose(offers, room)
        row = {"label": self.label, "event": "choose", "reason": decision.reason, "k": decision.k,
               "source": decision.source, "predicted": _r(decision.predicted_speedup),
               "best_k": decision.best_k, "best_speedup": _r(decision.best_speedup)}
        c = self.inner
        if isinstance(c, AdaptiveK):
            standard = 1.0 / c.standard_ms()
            weighed = {}
            for offer in offers:
                if offer.max_tokens <= 0:
                    weighed[offer.key] = {"max_tokens": 0}
                    continue
                k, rate, _ = c._best(offer, room)
                weighed[offer.key] = {"max_tokens": offer.max_tokens, "k": k, "speedup": _r(rate / standard),
                                      "means": [_r(m) for m in c._means(offer)[:6]],
                                      "ceiling": _r(c._ceiling(offer)[1] / standard), "catch_up": offer.catch_up,
                                      "rescue": _r(c._stats(offer.key).rescue()) if offer.tree else None}
            t = c.timing
            row.update(weighed=weighed, standard_ms=_r(c.standard_ms()), overhead_ms=_r(t.overhead_ms),
                       verify_ratio=_r(t.verify_ratio), standard_ratio=_r(t.standard_ratio),
                       draft_ratio={s: _r(v) for s, v in t.draft_ratio.items()},
                       catch_up_ms={s: _r(v) for s, v in t.catch_up_ms.items()}, idle=c.idle)
        self.log.append(row)
        return decision

    def observe(self, decision, drafted: int, accepted: int, draft_ms: float, verify_ms: float, wall_ms: float, *,
                tree: bool = False, extra: bool = False) -> None:
        self.log.append({"label": self.label, "event": "observe", "reason": decision.reason, "k": decision.k,
                         "source": decision.source, "drafted": drafted, "accepted": accepted, "tree": tree,
                         "extra": extra, "draft_ms": _r(draft_ms), "verify_ms": _r(verify_ms), "wall_ms": _r(wall_ms)})
        self.inner.observe(decision, drafted, accepted, draft_ms, verify_ms, wall_ms, tree=tree, extra=extra)

    def finish(self) -> None:
        self.inner.finish()


def trace(engine, log: list[dict], modes: tuple[str, ...] = ("auto",)) -> None:
    """Wraps every controller the engine makes for `modes` (the instance's make_controller)."""
    make = type(engine).make_controller
    count = Counter()

    def traced(request):
        inner = make(engine, request)
        if request.mode not in modes:
            return inner
        count[request.mode] += 1
        return TracedController(inner, log, f"{request.mode}#{count[request.mode]}")

    engine.make_controller = traced


def summarize_trace(log: list[dict]) -> dict:
    """Standard steps by reason, rounds by proposer, and what the best offer promised when auto stood still."""
    chooses = [r for r in log if r["event"] == "choose"]
    observes = [r for r in log if r["event"] == "observe"]
    reasons = Counter(r["reason"] for r in observes)
    by_source: dict[str, dict] = {}
    for r in observes:
        if r["k"]:
            s = by_source.setdefault(r["source"], {"rounds": 0, "drafted": 0, "accepted": 0, "extras": 0,
                                                   "draft_ms": 0.0, "verify_ms": 0.0, "wall_ms": 0.0})
            s["rounds"] += 1
            s["extras"] += bool(r.get("extra"))
            for key in ("drafted", "accepted", "draft_ms", "verify_ms", "wall_ms"):
                s[key] += r[key]
    for s in by_source.values():
        n = s["rounds"]
        s.update(tokens_per_round=(s["accepted"] + s["extras"] + n) / n, draft_ms=s["draft_ms"] / n, verify_ms=s["verify_ms"] / n,
                 wall_ms=s["wall_ms"] / n)
    standard = [r for r in observes if not r["k"]]
    still: dict[str, list[float]] = {}  # offer key -> its predicted speedup whenever auto chose a standard step
    for r in chooses:
        if r["k"] == 0:
            for key, w in (r.get("weighed") or {}).items():
                if w.get("speedup") is not None:
                    still.setdefault(key, []).append(w["speedup"])
    last = next((r for r in reversed(chooses) if "standard_ms" in r), {})
    return {
        "steps": len(observes), "by_reason": dict(reasons),
        "standard_wall_ms": statistics.fmean(r["wall_ms"] for r in standard) if standard else None,
        "by_source": by_source,
        "standing_still": {key: {"steps": len(v), "median_speedup": statistics.median(v), "max_speedup": max(v)}
                           for key, v in still.items()},
        "last_timing": {key: last.get(key) for key in ("standard_ms", "overhead_ms", "verify_ratio", "standard_ratio",
                                                        "draft_ratio", "catch_up_ms")},
    }


def print_summary(s: dict) -> None:
    print(f"steps {s['steps']}: " + ", ".join(f"{k} {v}" for k, v in sorted(s["by_reason"].items())))
    for source, v in s["by_source"].items():
        print(f"  {source}: {v['rounds']} rounds, {v['tokens_per_round']:.2f} tokens a round, drafted {v['drafted']}, "
              f"accepted {v['accepted']}, alternatives kept {v['extras']}, draft {v['draft_ms']:.3f} ms, verify {v['verify_ms']:.3f} ms, "
              f"wall {v['wall_ms']:.3f} ms a round")
    if s["standard_wall_ms"] is not None:
        print(f"  standard steps: wall {s['standard_wall_ms']:.3f} ms a step")
    for key, v in s["standing_still"].items():
        print(f"  when auto stood still, {key} promised {v['median_speedup']:.2f}x (median; max {v['max_speedup']:.2f}x) "
              f"over {v['steps']} steps")
    print(f"  timing at the end: {s['last_timing']}")


def main() -> int:
    from app import cli_options as opt
    from engine.errors import EngineError

    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None, help="a target folder (default: the packaged pair)")
    ap.add_argument("--head", default="auto")
    ap.add_argument("--prompts", default="assets/bench_prompts.jsonl")
    ap.add_argument("--limit", type=lambda t: opt.whole(t, 1, 10**6, "--limit"), default=20, help="first N prompts")
    ap.add_argument("--max-new-tokens", type=lambda t: opt.whole(t, 1, 10**6, "--max-new-tokens"), default=64)
    ap.add_argument("--temperature", type=opt.temperature, default=0.0)
    ap.add_argument("--proposer", default="ngram", choices=["ngram", "draft", "draft+ngram", "head"],
                    help="auto's proposers besides the head ('head': the head alone)")
    ap.add_argument("--fast-path", default="auto", choices=["auto", "eager", "static", "compiled"])
    ap.add_argument("--out", type=Path, default=None, help="the trace and its summary, as JSON")
    args = ap.parse_args()
    try:
        return run(args)
    except EngineError as exc:  # bad input or a model that will not load: one line, as the app's CLI says it
        print(f"auto_trace: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    from app.session import build_request
    from engine.assemble import engine_for_pair
    from engine.measure.bench import BenchContext, format_table, read_prompts, run_bench
    from engine.loadspec import LoadSpec
    from engine.models.loader import load_pair
    from engine.settings import GenerationSettings
    from engine.types import Message

    prompts = read_prompts(Path(args.prompts))[: args.limit]
    pair = load_pair(LoadSpec(args.target, None, with_draft=False))
    engine = engine_for_pair(pair, LoadSpec(head=args.head, fast_path=args.fast_path))
    info = engine.info
    print(f"{info.target_name} on {info.device} ({info.dtype}, {info.fast_path}); head {info.head_name}, "
          f"{info.head_ms:.3f} ms a draft token; T = {args.temperature}", flush=True)

    def request(prompt: str, mode: str, max_new: int):
        settings = GenerationSettings(mode=mode, proposer=args.proposer, k=5, temperature=args.temperature, seed=0,
                                      max_new_tokens=max_new, system_prompt="")
        return build_request(settings, (Message("user", prompt),))

    log: list[dict] = []
    trace(engine, log)
    ctx = BenchContext(pair, engine, make_request=request, reload_pair=lambda: pair)
    result = run_bench(ctx, prompts, ("standard", "auto"), max_new_tokens=args.max_new_tokens, warmup=1,
                       proposer="head")
    print(format_table(result.summary, result.modes))
    timed = [r for r in log if not r["label"].endswith("#1")]  # the first auto answer is the warm-up
    summary = summarize_trace(timed)
    print_summary(summary)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"config": vars(args) | {"out": str(args.out)}, "info": asdict(info),
                                        "bench": result.summary, "trace_summary": summary, "trace": timed},
                                       default=str, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
