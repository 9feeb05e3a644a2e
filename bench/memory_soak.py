"""Does GPU memory stay flat over hours? N answers of mixed lengths with both models resident.

Per answer: torch's peak allocation during it, and what the caching allocator holds (reserved)
after it. A healthy allocator (app/main.py sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
unless you did) keeps the last answers' peak within 5% of the first's. Writes JSON and, when
matplotlib imports, a PNG of the curve.

    python3 bench/memory_soak.py --target /root/hf/target --draft /root/hf/draft          # 500 answers, ~5 min, one H200
    python3 bench/memory_soak.py --device cpu --tiny --answers 12                          # smoke run (no CUDA figures)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the app does, before torch
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_probes as qc  # noqa: E402
import torch  # noqa: E402

LENGTHS = (16, 48, 128, 256, 32, 96, 384, 64)  # max new tokens, cycled: short and long answers mixed
MODES = ("speculative", "standard", "auto")


def soak(engine, texts: list[str], answers: int, device: str, report_every: int = 50) -> list[dict]:
    from engine.types import GenerationRequest, Message

    cuda = device.startswith("cuda")
    rows = []
    for i in range(answers):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        request = GenerationRequest(messages=(Message("user", texts[i % len(texts)]),), mode=MODES[i % len(MODES)],
                                    max_new_tokens=LENGTHS[i % len(LENGTHS)])
        generation = engine.generate(request)
        for _ in generation:
            pass
        row = {"answer": i, "new_tokens": generation.summary.new_tokens, "mode": request.mode}
        if cuda:
            torch.cuda.synchronize()
            row.update(peak_gib=torch.cuda.max_memory_allocated() / qc.GiB,
                       reserved_gib=torch.cuda.memory_reserved() / qc.GiB)
        rows.append(row)
        if i % report_every == 0 or i == answers - 1:
            print(f"[{qc.elapsed():5.0f}s] answer {i}: {row}", flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (the JSON has the curve)"
    fig, ax = plt.subplots(figsize=(8, 4))
    x = [r["answer"] for r in rows]
    ax.plot(x, [r["peak_gib"] for r in rows], label="peak allocated during the answer")
    ax.plot(x, [r["reserved_gib"] for r in rows], label="reserved after the answer")
    ax.set_xlabel("answer")
    ax.set_ylabel("GiB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return f"plot: {path}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="/root/hf/target")
    p.add_argument("--draft", default="/root/hf/draft")
    p.add_argument("--device", default="cuda")
    p.add_argument("--answers", type=int, default=500)
    p.add_argument("--target-quant", default="auto")
    p.add_argument("--draft-quant", default="auto")
    p.add_argument("--tiny", action="store_true", help="tiny random pair (a smoke run)")
    args = p.parse_args(argv)
    from engine.assemble import engine_for_pair
    from engine.loadspec import LoadSpec
    from engine.models.loader import load_pair

    if args.tiny:
        import tempfile

        from tests.tiny import save_pair

        args.target, args.draft = (str(x) for x in save_pair(Path(tempfile.mkdtemp()), noise=0.02, seed=0))
    pair = load_pair(LoadSpec(args.target, args.draft, device=args.device, target_precision=args.target_quant,
                              draft_precision=args.draft_quant, head=None))
    engine = engine_for_pair(pair, LoadSpec(head=None))
    rows = soak(engine, qc.prompts(3), args.answers, args.device)
    results = qc.Results(Path(__file__).resolve().parent / "results" / "memory_soak.json")
    summary: dict = {"answers": len(rows), "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                     "fast_path": engine.info.fast_path}
    if rows and "peak_gib" in rows[0]:
        first, worst = rows[0]["peak_gib"], max(r["peak_gib"] for r in rows)
        summary.update(first_peak_gib=first, max_peak_gib=worst, peak_ratio=worst / first,
                       first_reserved_gib=rows[0]["reserved_gib"], max_reserved_gib=max(r["reserved_gib"] for r in rows))
        summary["plot"] = plot(rows, results.path.with_suffix(".png"))
        print(f"peak over {len(rows)} answers {worst:.2f} GiB vs the first answer's {first:.2f} GiB "
              f"({worst / first:.3f}x); reserved {summary['first_reserved_gib']:.2f} -> "
              f"{summary['max_reserved_gib']:.2f} GiB; {summary['plot']}", flush=True)
    else:
        print(f"{len(rows)} answers on {args.device}: no CUDA allocator to measure", flush=True)
    results.data.update(summary=summary, environment={"torch": torch.__version__, "args": vars(args)}, runs=rows)
    results.save()
    print(f"written: {results.path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
