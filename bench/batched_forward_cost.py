"""What one batched forward costs by its rows: B sequences x W tokens each, on each route of BatchedDecoder.

Routes, side by side in one run on one model: `parts` (each sequence attends alone: the CPU's route), `rows`
(every cache row in one static forward, eagerly) and `graphs` (the same forward replayed from CUDA graphs,
the GPU's route in serving; once per attention of --attention, `graphs/math/torch-rope` the RoPE and cache writes
as torch ops instead of the fused kernel), beside the lone runner's forward of W tokens (one sequence, its own
graphs). Every
row holds --context tokens; each timed forward is rolled back, so every repeat sees the same cache. Median ms of
--iters forwards after a warm one.

    python bench/batched_forward_cost.py --model MODEL_DIR --json bench/results/h100_batched_forward_cost.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.runners import rope_kernel  # noqa: E402
from engine.runners.batched import ROW_ATTENTION, BatchedDecoder, Part  # noqa: E402
from engine.runners.graphs import StaticGraphRunner  # noqa: E402


def timed(fn, iters: int, device: torch.device) -> float:
    """Median ms of fn() over iters calls (after one untimed)."""
    fn()
    out = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, type=Path, help="a Hugging Face model folder (random weights do)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--rows", default="1,2,4,8", help="sequences per forward")
    ap.add_argument("--widths", default="1,4,6", help="tokens per sequence")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--attention", default=",".join(ROW_ATTENTION),
                    help=f"the graphs route's attentions, comma-separated ({', '.join(ROW_ATTENTION)})")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.json is not None and args.json.is_dir():
        sys.exit(f"--json {args.json} is a folder; give a file path.")
    if not (args.model / "config.json").is_file():
        sys.exit(f"--model {args.model}: no config.json there; give a Hugging Face model folder.")
    try:
        rows, widths = [int(x) for x in args.rows.split(",")], [int(x) for x in args.widths.split(",")]
    except ValueError:
        sys.exit(f"--rows {args.rows!r} / --widths {args.widths!r}: comma-separated whole numbers, e.g. 1,2,4,8.")
    if min(rows + widths) < 1 or args.context < 1 or args.iters < 1:
        sys.exit("--rows, --widths, --context and --iters take numbers of at least 1.")
    attentions = args.attention.split(",")
    if not set(attentions) <= set(ROW_ATTENTION):
        sys.exit(f"--attention {args.attention!r}: comma-separated, of {', '.join(ROW_ATTENTION)}.")
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(device).eval()
    top = min(model.config.vocab_size, 1000)  # prompt ids: any the model has
    max_length = args.context + 64
    lone = StaticGraphRunner(model, max_length=max_length, graph_widths=widths)
    lone.warmup()
    lone.prefill(torch.randint(1, top, (args.context,), device=device))

    def lone_step(w: int) -> None:
        lone.forward(torch.ones(w, dtype=torch.long, device=device))
        lone.rollback(args.context)

    results = {"config": {**{k: str(v) for k, v in vars(args).items()}, "device": str(device),
                          "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else ""},
               "lone_ms": {w: timed(lambda: lone_step(w), args.iters, device) for w in widths}, "batched": []}
    decoder = BatchedDecoder(model, max_length, max(rows), decoder=lone.decoder)
    runs = rope_kernel.runs
    with torch.inference_mode():
        for slot in range(max(rows)):
            ids = tuple(torch.randint(1, top, (args.context,)).tolist())
            decoder.forward([Part(slot, ids)], logits=False)
        captured = 0
        routes = [("parts", "math", True), ("rows", "math", True)]
        if device.type == "cuda":
            routes += [("graphs", a, True) for a in attentions] + [("graphs", "math", False)]
        for how, attention, kernel in routes:
            route = how if how != "graphs" else f"graphs/{attention}" + ("" if kernel else "/torch-rope")
            decoder.all_rows, decoder.attention = None, attention
            rope_kernel.runs = runs if kernel else (lambda x: False)
            if how != "parts":
                captured += decoder.use_all_rows(graphs=how == "graphs")
            for b in rows:
                for w in widths:
                    parts = [Part(slot, tuple(range(1, w + 1))) for slot in range(b)]

                    def step() -> None:
                        decoder.forward(parts)
                        for slot in range(b):
                            decoder.rollback(slot, args.context)
                    ms = timed(step, args.iters, device)
                    results["batched"].append({"route": route, "rows": b, "width": w, "ms": round(ms, 3),
                                               "vs_lone": round(ms / results["lone_ms"][w], 3)})
                    print(f"{route:22s} B={b} W={w:2d}: {ms:7.3f} ms ({ms / results['lone_ms'][w]:.2f}x lone "
                          f"{results['lone_ms'][w]:.3f} ms)", flush=True)
    rope_kernel.runs = runs
    results["graphs_captured"] = captured
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
        print("wrote", args.json)


if __name__ == "__main__":
    main()
