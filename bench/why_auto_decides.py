"""Why does auto decode the way it does? Every choice of the K controller, with what it weighed.

A thin shell over `specdec-studio bench --modes standard,auto`: the engine's controllers for auto
answers are wrapped before the bench runs, so each choice records its reason, the K and proposer
chosen, and for every offer the controller's predicted speedup, K and acceptance by position, with
the online timing corrections it used (standard step cost, speculative overhead, verify and
drafting ratios, catch-up); each observed round records what was drafted, accepted and what it
cost. The summary counts standard steps by reason and shows what the best offer was predicted to
pay when auto stood still, so a pessimistic estimate (costs or acceptance) shows. The bench record
goes to --json with the trace's summary under summary.trace_summary; the step-by-step trace (large)
to --trace.

CPU, the packaged pair and its shipped head on torch, T = 0.7:

    python bench/why_auto_decides.py --runtime torch --max-new-tokens 64 --temperature 0.7 --json auto_t07.json

A GPU with a converted target folder (bf16, CUDA graphs):

    python bench/why_auto_decides.py --target path/to/Qwen2.5-Coder-1.5B-Instruct --max-new-tokens 256 \
        --temperature 0.7 --json auto_t07.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from record import read_record, write_record  # noqa: E402


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


def trace(log: list[dict], modes: tuple[str, ...] = ("auto",)) -> None:
    """Wraps every controller any engine makes for `modes` (Engine.make_controller, for this process)."""
    from engine.decoding import Engine

    make = Engine.make_controller
    count = Counter()

    def traced(engine, request):
        inner = make(engine, request)
        if request.mode not in modes:
            return inner
        count[request.mode] += 1
        return TracedController(inner, log, f"{request.mode}#{count[request.mode]}")

    Engine.make_controller = traced


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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="the target (default: the packaged pair's)")
    ap.add_argument("--head", default="auto")
    ap.add_argument("--prompts", type=Path, default=Path("assets/bench_prompts.jsonl"))
    ap.add_argument("--limit", type=int, default=0, help="only the first N prompts (0: all)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", default="0")
    ap.add_argument("--proposer", default="ngram", choices=["ngram", "draft", "draft+ngram", "head"],
                    help="auto's proposers besides the head ('head': the head alone)")
    ap.add_argument("--fast-path", default="auto", choices=["auto", "eager", "static", "compiled"])
    ap.add_argument("--runtime", default="auto", choices=["auto", "torch", "llamacpp"])
    ap.add_argument("--json", type=Path, required=True, help="the bench record, with the trace's summary")
    ap.add_argument("--trace", type=Path, default=None, help="every choice and round, as JSON (large)")
    args = ap.parse_args()

    from app.main import main as cli

    prompts = args.prompts
    if args.limit:
        lines = prompts.read_text(encoding="utf-8").splitlines()[: args.limit]
        prompts = Path(tempfile.mkdtemp(prefix="specdec-trace-")) / prompts.name
        prompts.write_text("\n".join(lines) + "\n", encoding="utf-8")
    log: list[dict] = []
    trace(log)
    argv = ["bench", "--prompts", str(prompts), "--modes", "standard,auto", "--proposer", args.proposer,
            "--head", args.head, "--temperature", args.temperature, "--max-new-tokens", str(args.max_new_tokens),
            "--fast-path", args.fast_path, "--runtime", args.runtime, "--json", str(args.json)]
    if args.target:
        argv += ["--target", args.target]
    code = cli(argv)
    if code != 0:
        return code
    timed = [r for r in log if not r["label"].endswith("#1")]  # the first auto answer is the warm-up
    summary = summarize_trace(timed)
    print_summary(summary)
    record = read_record(args.json)
    record["summary"]["trace_summary"] = summary
    write_record(args.json, record["config"], record["summary"], record["runs"])
    if args.trace is not None:
        args.trace.parent.mkdir(parents=True, exist_ok=True)
        args.trace.write_text(json.dumps(timed, ensure_ascii=False), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
