"""Can a person watch and stop a long prompt being read? (real default pair, llama.cpp; prints figures)

Loads the packaged pair on the llama.cpp runtime (its forward costs measured at load, as in the app),
then sends a ~4k-token chat message the way the app's worker does (Engine.generate with a
cancel Event and a progress callback) and prints:
  - the time from the call until the first progress event (0 / N) and until the first chunk is read,
  - the time to read the whole prompt and the time to first token (the Summary's),
  - Stop latency: a second send of the same prompt is cancelled ~2 s into its prefill; the time from
    cancel.set() until the generation has returned,
  - that the answer after the stop is the answer of the first run (the caches were left consistent).

    flock /tmp/specdec-real.lock .venv/bin/python bench/long_prompt.py [--tokens 4449] [--json out.json]
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import write_record  # noqa: E402


def long_text(tokenizer, tokens: int) -> str:
    """The project's own docs, repeated and cut to `tokens` tokens: a long paste of real prose and code."""
    sources = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in sources)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    while len(ids) < tokens:
        ids = ids + ids
    return tokenizer.decode(ids[:tokens])


def timed_send(engine, request, cancel_after_s: float | None = None) -> dict:
    """One send as the app's worker makes it; the figures of its prefill (and of a stop, when asked)."""
    cancel = threading.Event()
    events: list[tuple[float, object]] = []
    t0 = time.perf_counter()
    generation = engine.generate(request, cancel, lambda p: events.append((time.perf_counter() - t0, p)))
    stopped_at: list[float] = []
    if cancel_after_s is not None:
        def stop() -> None:
            stopped_at.append(time.perf_counter())
            cancel.set()
        timer = threading.Timer(cancel_after_s, stop)
        timer.start()
    tokens = [t.token_id for step in generation for t in step.tokens if t.status != "rejected"]
    returned = time.perf_counter()
    s = generation.summary
    target = [(t, p) for t, p in events if p.part == "target"]
    out = {
        "prompt_tokens": s.prompt_tokens, "stop_reason": s.stop_reason, "new_tokens": s.new_tokens,
        "first_progress_s": target[0][0] if target else None,
        "first_chunk_s": next((t for t, p in target if p.done > 0), None),
        "first_chunk_tokens": next((p.done for _, p in target if p.done > 0), None),
        "progress_events": len(events), "read": max((p.done for _, p in target), default=0),
        "prefill_s": s.prefill_s, "first_token_s": s.first_token_s, "seconds": s.seconds,
        "tokens_per_s": s.tokens_per_s, "tokens": tokens,
    }
    if stopped_at:
        out["stop_latency_s"] = returned - stopped_at[0]
        out["stopped_after_s"] = stopped_at[0] - t0
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4449, help="prompt length in tokens (the text is cut to it)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--stop-at", type=float, default=2.0, help="seconds into the second send when Stop is pressed")
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: the physical cores)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures as a bench record")
    args = parser.parse_args()

    from engine import assemble
    from engine.loadspec import LoadSpec
    from engine.settings import GenerationSettings
    from engine.types import GenerationRequest, Message

    t = time.perf_counter()
    engine = assemble.build_engine(LoadSpec(runtime="llamacpp", threads=args.threads))
    load_s = time.perf_counter() - t  # with the cost measurement the app makes at load (the first chunk's size)
    settings = GenerationSettings()  # the app's defaults: auto mode, draft+ngram
    text = long_text(engine.tokenizer, args.tokens)
    request = GenerationRequest(messages=(Message("user", text),), mode=settings.mode, proposer=settings.proposer,
                                max_new_tokens=args.max_new_tokens)
    info = engine.info
    print(f"{info.target_name} + {info.draft_name} on {info.runtime}, {info.threads} threads; "
          f"loaded and costs measured in {load_s:.1f} s ({info.measure_s:.1f} s of it measuring)")

    full = timed_send(engine, request)
    print(f"prompt {full['prompt_tokens']:,} tokens (mode {settings.mode}): first progress after "
          f"{full['first_progress_s']:.3f} s, first chunk ({full['first_chunk_tokens']} tokens) read after "
          f"{full['first_chunk_s']:.2f} s, {full['progress_events']} progress events")
    print(f"prompt read in {full['prefill_s']:.1f} s ({full['prompt_tokens'] / full['prefill_s']:.0f} tokens/s); "
          f"time to first token {full['first_token_s']:.1f} s; {full['new_tokens']} tokens in {full['seconds']:.1f} s")

    stopped = timed_send(engine, request, cancel_after_s=args.stop_at)
    print(f"Stop {stopped['stopped_after_s']:.1f} s into the prefill ({stopped['read']:,} / "
          f"{stopped['prompt_tokens']:,} tokens read): generate returned {stopped['stop_latency_s']:.3f} s later "
          f"({stopped['stop_reason']}, {stopped['new_tokens']} tokens)")

    again = timed_send(engine, request)
    same = again["tokens"] == full["tokens"]
    print(f"after the stop, the same prompt again: {'the same answer' if same else 'A DIFFERENT ANSWER'} "
          f"({again['new_tokens']} tokens, time to first token {again['first_token_s']:.1f} s)")
    if args.json is not None:
        config = {"target": info.target_name, "draft": info.draft_name, "runtime": info.runtime,
                  "threads": info.threads, "mode": settings.mode, "proposer": settings.proposer,
                  "tokens": args.tokens, "stop_at_s": args.stop_at}
        runs = [{k: v for k, v in r.items() if k != "tokens"} | {"run": name}
                for name, r in (("full", full), ("stopped", stopped), ("again", again))]
        write_record(args.json, config, {"same_answer_after_stop": same, "load_s": load_s,
                                        "measure_s": info.measure_s}, runs)
    return 0 if same and stopped["stop_reason"] == "cancelled" else 1


if __name__ == "__main__":
    sys.exit(main())
