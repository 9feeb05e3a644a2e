"""What serving several sequences at once adds to memory: the plan's batch lines against the RAM they take.

`serve --max-seqs N` decodes N sequences together (engine/decoding/batch.py): on llama.cpp a multi-sequence
context per model whose KV pool grows up to N × the context, on torch a BatchedDecoder per model with a
cache row of the whole context per sequence (and a head cache per sequence). The memory plan counts them
(engine/models/plan.py batch_items, engine/runners/llamacpp_plan.py batch_pool_items). Each runtime runs in
its own process: load the default pair as serve does (LoadSpec.sequences = N), note the anonymous RSS, build
the batch, grow every pool to its largest size (llama.cpp: the size a full context per sequence reaches),
run one batched verify of K + 1 tokens per sequence, and note the RSS again. Measured = the growth of
anonymous memory; planned = the plan's lines for the served sequences.

    flock /tmp/specdec-real.lock .venv/bin/python bench/serve_memory_plan.py --json bench/results/serve_memory_plan_cpu.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_memory_plan import status  # noqa: E402
from record import write_record  # noqa: E402

GiB = 2**30
SERVED = ("served sequences", "batch logits")  # the plan lines that serving several sequences adds


def child(runtime: str, sequences: int, context: int) -> dict:
    import torch

    from engine.assemble import build_engine, plan_load
    from engine.decoding.batch import BatchEngine
    from engine.limits import K_MAX
    from engine.loadspec import LoadSpec
    from engine.runners.batched import Part
    from engine.runners.llamacpp_batch import LlamaCppBatch
    from engine.types import GenerationRequest

    spec = LoadSpec(device="cpu", runtime=runtime, context=context, sequences=sequences, with_draft=True,
                    needs_head=runtime == "torch")
    plan = plan_load(spec)
    engine = build_engine(spec)
    before = status()["RssAnon"]
    t0 = time.perf_counter()
    batch = BatchEngine(engine, sequences)
    if batch.heads is not None:  # a head runner per row, as each row's first head round makes it
        request = GenerationRequest(prompt="x", mode="speculative", proposer="head")
        for slot in range(sequences):
            batch.heads.proposer(slot, request, None, batch.target.max_length)
    for decoder in (batch.target, batch.draft):
        if isinstance(decoder, LlamaCppBatch):
            decoder._grow(decoder.slots * decoder.max_length)  # the largest pool: every row's context full
        if decoder is not None:
            with torch.inference_mode():
                decoder.forward([Part(slot, (0,) * (K_MAX + 1)) for slot in range(sequences)])
                for slot in range(sequences):
                    decoder.reset(slot)
    after = status()["RssAnon"]
    lines = {i.label: i.bytes for d in plan.devices for i in d.items if any(s in i.label for s in SERVED)}
    planned = sum(lines.values())
    measured = after - before
    return {"runtime": runtime, "sequences": sequences, "context": context, "fast_path": engine.info.fast_path,
            "planned_gib": planned / GiB, "measured_gib": measured / GiB, "error": planned / measured - 1,
            "lines_gib": {k: round(v / GiB, 4) for k, v in lines.items()},
            "pool_cells": {name: getattr(d, "cells", None) for name, d in (("target", batch.target),
                                                                           ("draft", batch.draft)) if d is not None},
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runtimes", default="llamacpp,torch")
    p.add_argument("--max-seqs", type=int, default=4)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", dest="out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.max_seqs, args.context)))
        return 0
    rows = []
    for runtime in args.runtimes.split(","):
        out = subprocess.run([sys.executable, __file__, "--child", runtime, "--max-seqs", str(args.max_seqs),
                              "--context", str(args.context), "--json", "-"], capture_output=True, text=True,
                             cwd=ROOT)
        line = next((x for x in reversed(out.stdout.splitlines()) if x.startswith("{")), None)
        if line is None:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        row = json.loads(line)
        rows.append(row)
        print(f"{runtime:>9} ({row['fast_path']}), {args.max_seqs} sequences, context {args.context:,}: plan "
              f"{row['planned_gib']:.3f} GiB vs measured {row['measured_gib']:.3f} GiB ({100 * row['error']:+.1f}%)",
              flush=True)
        for label, gib in row["lines_gib"].items():
            print(f"    {label:<58}{gib:8.3f} GiB")
    write_record(args.out, {"runtimes": args.runtimes, "max_seqs": args.max_seqs, "context": args.context},
                 {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
