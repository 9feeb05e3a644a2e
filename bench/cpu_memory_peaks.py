"""Peak resident memory of a model pair on the CPU: after loading, while generating, and across an app reload.

It loads real models, so run ONE configuration at a time, under the shared lock:

    flock /tmp/specdec-real.lock .venv/bin/python bench/cpu_memory_peaks.py --dtype bfloat16 --phase load
    flock /tmp/specdec-real.lock .venv/bin/python bench/cpu_memory_peaks.py --dtype float32 --phase load
    flock /tmp/specdec-real.lock .venv/bin/python bench/cpu_memory_peaks.py --dtype bfloat16 --phase reload

`load`: engine.assemble.load_pair_packed + engine_for_pair (the CPU fast path packs weights) and a 16-token speculative
generation. `reload`: the app's worker loads the pair, then loads it again, as File > Load models
does. Peaks come from the kernel's high-water mark (VmHWM), reset before each phase, so a brief
spike counts. Prints one JSON object (GB = 10^9 bytes); --json also writes it as a bench record.
Runs against whichever code is on PYTHONPATH (compare a branch with main by pointing it there).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import write_record  # noqa: E402

GB = 1e9


def _status() -> dict[str, float]:
    """Resident memory now and its peak since the last reset, from /proc (Linux), in GB."""
    fields = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) * 1024 / GB
    return {"rss": fields["VmRSS"], "peak": fields["VmHWM"], "anon": fields["RssAnon"], "file": fields["RssFile"]}


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _round(d: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 2) for k, v in d.items()}


def phase_load(args: argparse.Namespace) -> dict:
    import torch

    from engine.assemble import engine_for_pair, load_pair_packed
    from engine.loadspec import LoadSpec
    from engine.types import GenerationRequest, Message

    torch.set_num_threads(args.threads)
    out: dict = {"baseline": _round(_status())}
    _reset_peak()
    started = time.perf_counter()
    # As the CLI and the app load: packed as each model loads (where this code can), then the engine.
    spec = LoadSpec(args.target, args.draft, device="cpu", dtype=args.dtype, fast_path=args.fast_path)
    pair = load_pair_packed(spec)
    out["after_load_pair"] = _round(_status())
    engine = engine_for_pair(pair, spec)
    del pair
    out["after_engine"] = _round(_status())
    out["load_s"] = round(time.perf_counter() - started, 1)
    out["fast_path"] = engine.info.fast_path
    _reset_peak()
    request = GenerationRequest(messages=(Message("user", "Write a Python function that reverses a string."),),
                                max_new_tokens=args.tokens, k=5)
    generation = engine.generate(request)
    for _ in generation:
        pass
    out["generated_tokens"] = generation.summary.new_tokens
    out["during_generation"] = _round(_status())
    return out


def phase_reload(args: argparse.Namespace) -> dict:
    import torch
    from PySide6.QtCore import QCoreApplication

    import engine.decoding  # noqa: F401  (imported before the baseline: libraries are not the pair)
    import engine.models.store  # noqa: F401
    from app.core.session import LoadRequest
    from app.ui.worker import EngineWorker

    torch.set_num_threads(args.threads)
    app = QCoreApplication.instance() or QCoreApplication([])
    worker = EngineWorker()
    failures: list[str] = []
    notes: list[str] = []
    worker.load_failed.connect(failures.append)
    worker.load_progress.connect(lambda p: notes.append(p.message) if p.stage == "release" else None)
    request = LoadRequest(target=args.target, draft=args.draft, device="cpu", dtype=args.dtype,
                          fast_path=args.fast_path)
    out: dict = {"baseline": _round(_status())}
    _reset_peak()
    worker._on_load_requested(request)  # the slot, run here: what the worker thread runs
    out["first_load"] = _round(_status())
    _reset_peak()
    started = time.perf_counter()
    worker._on_load_requested(request)
    out["second_load"] = _round(_status())
    out["reload_s"] = round(time.perf_counter() - started, 1)
    one_pair = out["first_load"]["rss"] - out["baseline"]["rss"]
    out["reload_peak_over_one_pair"] = round((out["second_load"]["peak"] - out["baseline"]["rss"]) / one_pair, 2)
    out["release_notes"] = notes
    out["failures"] = failures
    del app
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase", choices=["load", "reload"], default="load")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--target", default=None, help="model folder, .gguf or hub id (default: the packaged pair)")
    p.add_argument("--draft", default=None)
    p.add_argument("--fast-path", default="auto", choices=["auto", "eager"])
    p.add_argument("--tokens", type=int, default=16, help="new tokens generated in the load phase")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = p.parse_args(argv)
    if not os.path.exists("/proc/self/clear_refs"):
        print("bench/cpu_memory_peaks.py reads Linux's /proc; it cannot run here", file=sys.stderr)
        return 2
    from engine.errors import EngineError

    try:
        phase = phase_load(args) if args.phase == "load" else phase_reload(args)
    except EngineError as e:
        print(f"cpu_memory_peaks: {e}", file=sys.stderr)
        return 2
    result = {"phase": args.phase, "dtype": args.dtype, "fast_path_asked": args.fast_path,
              "pythonpath": os.environ.get("PYTHONPATH", ""), **phase}
    text = json.dumps(result)
    print(text)
    if args.json is not None:
        write_record(args.json, {"phase": args.phase, "dtype": args.dtype, "fast_path": args.fast_path}, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
