"""Calibrates the memory plan on a CPU: the real default pair's plan against the measured peak RAM.

Each precision runs in its own process (a clean RSS): load the pair the app's way (CPU fast path
included), decode one prompt until the context is nearly full, and sample /proc/self/status every
20 ms. Measured = the peak of anonymous memory (the Python process included: the plan's runtime
line) + the weights that stay file-backed (a bf16 checkpoint loaded in bf16 is mapped, not
copied; the tensors the model still uses are counted, not the clean pages of weights it has
repacked, which the kernel reclaims under pressure). The peak RSS with every mapped page is
reported beside it.

    flock /tmp/specdec-real.lock .venv/bin/python bench/cpu_memory_plan.py            # ~2-3 min on 2 cores
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import write_record  # noqa: E402

GiB = 2**30


def status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("RssAnon", "RssFile", "VmHWM", "VmRSS"):
                out[key] = int(line.split()[1]) * 1024
    return out


def child(dtype: str, context: int, new_tokens: int) -> dict:
    import torch  # noqa: F401  # the runtime the plan counts: Python with torch and transformers imported
    import transformers  # noqa: F401

    from engine.assemble import engine_for_pair
    from engine.loadspec import LoadSpec
    from engine.models.loader import load_pair
    from engine.types import GenerationRequest

    base = status()
    peak = {"total": 0, "anon": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            s = status()
            peak["anon"] = max(peak["anon"], s["RssAnon"])
            peak["total"] = max(peak["total"], s["RssAnon"] + max(0, s["RssFile"] - base["RssFile"]))
            time.sleep(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    pair = load_pair(LoadSpec(None, None, device="cpu", dtype=dtype, context=context))
    engine = engine_for_pair(pair, LoadSpec(head=None))
    prompt = ("def quicksort(items):\n    " * 200)  # a long raw prompt: the cache fills towards the context
    ids = engine.tokenizer(prompt, add_special_tokens=False)["input_ids"][: context - new_tokens - 8]
    text = engine.tokenizer.decode(ids)
    generation = engine.generate(GenerationRequest(prompt=text, mode="speculative", k=5, max_new_tokens=new_tokens))
    for _ in generation:
        pass
    stop.set()
    thread.join()
    s = status()
    peak["anon"] = max(peak["anon"], s["RssAnon"])
    # bf16 safetensors loaded in bf16 on a CPU are zero-copy: the model's parameters are the file's pages.
    mapped = 0
    if dtype == "bfloat16":
        models = [m for m in (pair.target, pair.draft) if m is not None]
        mapped = sum(t.numel() * t.element_size() for m in models for t in m.parameters())
    measured_total = peak["anon"] + mapped
    plan = pair.plan
    dev = plan.devices[0]
    return {
        "dtype": dtype, "context": context, "prompt_tokens": len(engine.encode(GenerationRequest(prompt=text))),
        "fast_path": engine.info.fast_path, "seconds": round(time.perf_counter() - t0, 1),
        "plan_gib": dev.total / GiB, "measured_gib": measured_total / GiB,
        "error": dev.total / measured_total - 1,
        "baseline_anon_gib": base["RssAnon"] / GiB, "peak_anon_gib": peak["anon"] / GiB,
        "file_backed_in_use_gib": mapped / GiB, "peak_rss_beyond_libraries_gib": peak["total"] / GiB,
        "vm_hwm_gib": s["VmHWM"] / GiB, "items": {i.label: round(i.bytes / GiB, 4) for i in dev.items},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "cpu_memory_plan.json"))
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.context, args.new_tokens)))
        return 0
    rows = []
    for dtype in args.dtypes.split(","):
        out = subprocess.run([sys.executable, __file__, "--child", dtype, "--context", str(args.context),
                              "--new-tokens", str(args.new_tokens)], capture_output=True, text=True, cwd=ROOT)
        line = next((x for x in reversed(out.stdout.splitlines()) if x.startswith("{")), None)
        if line is None:
            print(out.stderr[-2000:], file=sys.stderr)
            return 1
        row = json.loads(line)
        rows.append(row)
        print(f"{dtype:>9}: plan {row['plan_gib']:.2f} GiB vs measured {row['measured_gib']:.2f} GiB "
              f"({100 * row['error']:+.1f}%); peak anon {row['peak_anon_gib']:.2f} + mapped weights "
              f"{row['file_backed_in_use_gib']:.2f}, peak RSS {row['peak_rss_beyond_libraries_gib']:.2f}, "
              f"start {row['baseline_anon_gib']:.2f} GiB; {row['fast_path']}, {row['seconds']} s", flush=True)
    write_record(Path(args.json), {"dtypes": args.dtypes, "context": args.context, "new_tokens": args.new_tokens},
                 {"precisions": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
