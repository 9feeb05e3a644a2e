"""What does batching buy? Aggregate and per-stream tok/s of the batched step at 1, 2, 4, 8 concurrent streams.

For each concurrency C the prompts run C at a time, decoded together (engine/decoding/batch.py), a new one admitted
as soon as one ends (as `serve` admits them),
standard decoding and speculative decoding (--proposer, --k, auto included) in the same run, greedy or
sampled (--temperature, --top-k, --top-p; prompt i is seeded --seed + i). Every output is checked: greedy
ones against single-stream standard decoding, sampled ones (fixed K) against the same mode's output at the
first concurrency level (a sequence's random draws are its own: its neighbours change nothing). With
--one-at-a-time each mode also runs through the single-sequence loop, one request after another (how a
server without batching answers concurrent requests: its aggregate is this at any concurrency). Model
options after `--` are `generate`'s; on the llama.cpp runtime the batch is llama.cpp's multi-sequence one.

    python bench/serve_batch.py --max-new-tokens 256 --json bench/results/serve_batch_h200.json \
        -- --target /root/hf/target --draft /root/hf/draft --dtype bfloat16 --k 3
    python bench/serve_batch.py ... -- ... --k 3 --temperature 0.7 --top-p 0.95
    python bench/serve_batch.py --limit 8 --max-new-tokens 48 --concurrency 1,2,4 --one-at-a-time \
        --json bench/results/serve_batch_cpu_llamacpp.json -- --runtime llamacpp --k 3
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.cli.common import environment, load_engine  # noqa: E402  (a thin shell over the CLI's loader)
from app.cli.parser import build_parser  # noqa: E402
from engine.decoding.batch import BatchEngine  # noqa: E402
from engine.limits import K_AUTO  # noqa: E402
from engine.runners.batched import ROW_ATTENTION  # noqa: E402
from engine.types import GenerationRequest, Message, Sampling  # noqa: E402


def run_streams(batch: BatchEngine, engine, requests: list[GenerationRequest],
                c: int) -> tuple[float, list[list[int]], list[float]]:
    """Seconds for all requests with c in flight (a new one is admitted as soon as one ends, as a server does),
    every sequence's tokens, and each one's own tok/s (its tokens over its time from admission to its end)."""
    outputs: list[list[int] | None] = [None] * len(requests)
    speeds: list[float] = [0.0] * len(requests)
    waiting = list(enumerate(requests))
    running: dict[int, tuple[int, float]] = {}  # id(seq) -> (request index, admitted at)
    t0 = time.perf_counter()
    while waiting or batch.active:
        while waiting and batch.decoding < c:
            i, r = waiting.pop(0)
            seq = batch.add(r, engine.encode(r), threading.Event())
            running[id(seq)] = (i, time.perf_counter())
        for seq, _ in batch.round():
            if seq.summary is not None:
                i, admitted = running.pop(id(seq))
                outputs[i] = seq.token_ids
                speeds[i] = len(seq.token_ids) / (time.perf_counter() - admitted)
    if engine.device.type == "cuda":
        import torch

        torch.cuda.synchronize(engine.device)
    return time.perf_counter() - t0, [o or [] for o in outputs], speeds


def run_alone(engine, requests: list[GenerationRequest]) -> tuple[float, list[list[int]]]:
    """Seconds for all requests through the single-sequence loop, one after another, and their tokens."""
    outputs: list[list[int]] = []
    t0 = time.perf_counter()
    for request in requests:
        generation = engine.generate(request)
        for _ in generation:
            pass
        outputs.append(generation.token_ids)
    return time.perf_counter() - t0, outputs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=Path, default=ROOT / "assets" / "bench_prompts.jsonl")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="also each mode through the single-sequence loop, one request after another")
    ap.add_argument("--row-attention", choices=ROW_ATTENTION, default=None,
                    help="how the batched forward attends (default: its own choice)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("model_args", nargs="*")
    args = ap.parse_args()
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        ap.error(f"--concurrency takes whole numbers of at least 1, comma-separated (got {args.concurrency!r})")
    cli = build_parser().parse_args(["generate", "--prompt", "-", *args.model_args])
    engine = load_engine(cli, needs_draft=cli.proposer in ("draft", "draft+ngram"))
    prompts = [json.loads(line)["prompt"] for line in args.prompts.read_text(encoding="utf-8").splitlines()
               if line.strip()][: args.limit]
    batch = BatchEngine(engine, max(levels), args.row_attention)
    modes = {"standard": dict(mode="standard"), "speculative": dict(mode="speculative", k=cli.k, proposer=cli.proposer)}
    rows, reference = [], {}
    greedy = cli.temperature <= 0
    for name, kw in modes.items():
        requests = [GenerationRequest(messages=(Message("user", p),), max_new_tokens=args.max_new_tokens,
                                      sampling=Sampling(cli.temperature, cli.top_k, cli.top_p, cli.seed + i), **kw)
                    for i, p in enumerate(prompts)]
        # Sampled with K auto, the K chosen depends on timings, and with it the order of the random draws.
        checked = "standard" if greedy else (name if name == "standard" or cli.k != K_AUTO else None)
        assert batch.supports(requests[0]), f"the batched step cannot take {name} with these options"
        run_streams(batch, engine, requests[: max(levels)], max(levels))  # warm-up: every row once
        runs = [(c, True) for c in levels] + ([(1, False)] if args.one_at_a_time else [])
        for c, batched in runs:
            rounds, spent = batch.rounds, dict(batch.spent_ms)
            if batched:
                seconds, outputs, speeds = run_streams(batch, engine, requests, c)
            else:
                (seconds, outputs), speeds = run_alone(engine, requests), []
            reference.setdefault(name, outputs)
            tokens = sum(len(o) for o in outputs)
            same = sum(a == b for a, b in zip(outputs, reference[checked])) if checked else None
            rows.append({"mode": name, "streams": c, "batched": batched, "tokens": tokens, "seconds": seconds,
                         "aggregate_tok_s": tokens / seconds, "per_stream_tok_s": tokens / seconds / c,
                         "identical": same, "identical_to": checked, "compared": len(outputs)})
            if batched:  # each request's own speed, and where the batch's rounds spent their time
                n = batch.rounds - rounds
                rows[-1].update(mean_request_tok_s=sum(speeds) / len(speeds), rounds=n,
                                tokens_per_round=tokens / n,
                                ms_per_round={k: (v - spent[k]) / n for k, v in batch.spent_ms.items()})
            r = rows[-1]
            check = f"identical to {checked} at the first level {same}/{len(outputs)}" if checked else "not checked"
            how = f"streams={c}" if batched else "one at a time"
            phases = " ".join(f"{k} {v:.2f}" for k, v in r.get("ms_per_round", {}).items())
            per_round = f", {r['tokens_per_round']:.2f} tokens a round (ms: {phases})" if batched else ""
            print(f"{name:12s} {how:14s}: {r['aggregate_tok_s']:8.1f} tok/s aggregate, "
                  f"{r['per_stream_tok_s']:7.1f} per stream{per_round}, {check}", flush=True)
    if args.json is not None:
        info = engine.info
        args.json.write_text(json.dumps({"rows": rows, "target": info.target_name, "draft": info.draft_name,
                                         "device": info.device, "dtype": info.dtype, "runtime": info.runtime,
                                         "threads": info.threads, "environment": environment(engine), "k": cli.k,
                                         "temperature": cli.temperature, "top_k": cli.top_k, "top_p": cli.top_p,
                                         "proposer": cli.proposer, "max_new_tokens": args.max_new_tokens,
                                         "row_attention": getattr(batch.target, "attention", None),
                                         "batched_graphs": {role: len(d.all_rows.graphs) for role, d in
                                                            (("target", batch.target), ("draft", batch.draft))
                                                            if getattr(d, "all_rows", None) is not None},
                                         "prompt_graphs": {role: len(d.all_rows.prefill_graphs) for role, d in
                                                           (("target", batch.target), ("draft", batch.draft))
                                                           if getattr(d, "all_rows", None) is not None}},
                                        indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
