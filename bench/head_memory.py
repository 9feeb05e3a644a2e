"""What attaching the draft head costs on the GPU, step by step, against the memory plan's head line.

Loads the pair (the plan made before loading, with the head asked for), reads and binds the head,
builds the engine without it, then attaches it as Engine.attach_head does, one step at a time:
the target's graphs recaptured to keep the head's layers, the head's runner (cache, buffers), its
graphs, its cost measured, the tree's graphs. After each step: memory allocated now, the step's
peak allocation, reserved, and what lives outside torch's allocator (CUDA context, graph
executables). Last, answers with the head, and the plan against the measured process peak.

    python3 bench/head_memory.py --target path/to/Qwen2.5-Coder-1.5B-Instruct --draft path/to/Qwen2.5-Coder-0.5B-Instruct --json head_memory.json   # ~1 min, one GPU
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_probes as qc
import torch

HEAD = "assets/heads/qwen2.5-coder-1.5b-instruct"
GiB = 2**30


def snapshot(step: str, rows: list[dict]) -> None:
    if not torch.cuda.is_available():  # a CPU smoke run of the steps: no figures
        rows.append({"step": step, "allocated_gib": 0.0, "step_peak_gib": 0.0, "reserved_gib": 0.0,
                     "outside_allocator_gib": 0.0})
        print(f"  {step}", flush=True)
        return
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    row = {"step": step, "allocated_gib": torch.cuda.memory_allocated() / GiB,
           "step_peak_gib": torch.cuda.max_memory_allocated() / GiB, "reserved_gib": reserved / GiB,
           "outside_allocator_gib": (total - free - reserved) / GiB}
    rows.append(row)
    print(f"  {step:44s} allocated {row['allocated_gib']:6.3f}  step peak {row['step_peak_gib']:6.3f}  "
          f"reserved {row['reserved_gib']:6.3f}  outside {row['outside_allocator_gib']:6.3f} GiB", flush=True)
    torch.cuda.reset_peak_memory_stats()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--head", default=HEAD)
    p.add_argument("--precision", default="bfloat16", help="target and draft precision (bfloat16, int8-wo, fp8)")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--answers", type=int, default=3)
    p.add_argument("--json", type=Path, default=Path("head_memory.json"))
    p.add_argument("--device", default="cuda", help="cuda; cpu runs the steps without figures (a smoke run)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("this bench measures GPU memory: it needs CUDA (--device cpu runs the steps without figures)")

    from engine.errors import EngineError

    try:
        return measure(args)
    except EngineError as exc:  # a bad folder or a head for another target: one line
        print(f"head_memory: {exc}", file=sys.stderr)
        return 2


def measure(args) -> int:
    from engine.assemble import engine_for_pair
    from engine.decoding.engine import K_MAX
    from engine.errors import ModelLoadError
    from engine.heads.runner import HeadRunner
    from engine.heads.shards import resolve_head
    from engine.loadspec import LoadSpec
    from engine.models.loader import load_pair

    rows: list[dict] = []
    qc.reset_peaks()
    spec = LoadSpec(args.target, args.draft, device=args.device, target_precision=args.precision,
                    draft_precision=args.precision, context=args.context, force=True, head=args.head)
    pair = load_pair(spec)
    snapshot("pair loaded", rows)
    found = resolve_head(pair.target, args.head)  # before a CPU packs the target's output head
    if found is None:
        raise ModelLoadError(f"no draft head to attach ({args.head})")
    head = found[0]
    if args.precision in ("int8-wo", "fp8"):
        head.quantize(args.precision)
    snapshot("head read and bound (weights, output rows)", rows)
    engine = engine_for_pair(pair, LoadSpec(head=None, draft_precision=args.precision))
    snapshot("engine without the head (graphs, costs)", rows)
    head.bind_inputs(engine.target)
    engine.target_runner.keep_hidden(head.config.feature_layers)
    snapshot("target graphs recaptured keeping its layers", rows)
    runner = HeadRunner(head, max_length=engine.target_runner.max_length, k_max=K_MAX)
    snapshot("head runner (cache, buffers)", rows)
    runner.warmup()
    snapshot("head graphs", rows)
    runner.measure_ms(iters=20 if args.device == "cuda" else 2)
    engine.head_runner = runner
    snapshot("head cost measured", rows)
    engine.set_tree(None)
    snapshot("tree graphs", rows)
    texts = qc.prompts(args.answers)
    out = qc.run_prompts(engine, texts, 64, proposer="head")["speculative"]
    snapshot(f"{args.answers} answers with the head ({out['tok_s']:.1f} tok/s)", rows)
    plan_rows = []
    if torch.cuda.is_available():
        measured = [qc.cuda_measure(0)]
        measured[0]["peak_allocated"] = max(r["step_peak_gib"] for r in rows) * GiB
        measured[0]["process_peak"] = measured[0]["peak_allocated"] + measured[0]["outside_allocator"]
        plan_rows = qc.compare_plan(pair.plan, measured)
        print(f"  {qc.plan_line(plan_rows)}")
    for item in pair.plan.devices[0].items:
        print(f"    plan: {item.label:52s} {item.bytes / GiB:6.3f} GiB")
    results = qc.Results(args.json)
    results.data["runs"].append({"precision": args.precision, "steps": rows, "plan_vs_measured": plan_rows,
                         "plan_items": [{"label": i.label, "gib": i.bytes / GiB} for i in pair.plan.devices[0].items]})
    results.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
