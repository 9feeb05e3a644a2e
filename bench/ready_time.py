"""How long after the models load is the app Ready, on a first start and on a second one? (prints figures)

Each start is a fresh process that loads the app's own load request (app.core.session.load_request_for
of the default selection: the packaged pair on the default runtime, llama.cpp on a CPU, with the
forward costs kept in the cache folder) through engine.assemble.build_engine, as the app's worker
does. "Load finished" is the first progress event of the warm-up stage (llama.cpp: "Models loaded";
torch: packing or graphs), Ready is build_engine's return.

Three starts: the first only makes sure the next one finds no kept costs for this machine and pair
(it forgets them, and warms the page cache); the second is a first start (one pass of the costs
before Ready; then, as the app does while idle, the rest measured and judged, and kept when they
hold: its seconds and outcome are printed too); the third a second start (kept costs used, nothing
measured before Ready). The cost file's other entries stay.

    python bench/ready_time.py --json bench/results/ready_time_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from record import write_record  # noqa: E402

TARGETS = {"first start": 60.0, "second start": 15.0}  # seconds from load finished to Ready (issue 27)


def one_start(forget: bool) -> dict:
    """In the child: one load as the app loads, timed; then what the app measures after Ready while idle
    (Engine.refresh_costs until it is done), timed; with `forget`, its kept costs are dropped instead."""
    from app.core.session import load_request_for
    from engine.assemble import build_engine
    from engine.decoding.kept_costs import cost_key, forget as forget_costs
    from engine.settings import ModelSelection

    marks: dict[str, float] = {}
    began = time.perf_counter()

    def progress(p) -> None:
        if p.stage == "warmup":
            marks.setdefault("loaded", time.perf_counter())

    engine = build_engine(load_request_for(ModelSelection()), progress)
    ready = time.perf_counter()
    loaded = marks.get("loaded", ready)
    info = engine.info
    if forget:
        forget_costs(cost_key(engine))
        return {}
    after = time.perf_counter()
    while engine.cost_check is not None and not engine.cost_check.done:
        engine.refresh_costs()
    settled = engine.info
    return {"load_s": loaded - began, "to_ready_s": ready - loaded, "costs_state": info.costs_state,
            "costs_note": info.costs_note, "measure_s": info.measure_s, "runtime": info.runtime,
            "threads": info.threads, "after_ready_s": time.perf_counter() - after,
            "settled_state": settled.costs_state, "settled_note": settled.costs_note,
            "target_ms_1": dict(settled.target_ms).get(1), "draft_ms": settled.draft_ms}


def start(forget: bool) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--child"] + (["--forget"] if forget else [])
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the start failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="write the figures as a bench record")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--forget", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_start(args.forget)))
        return 0
    load = os.getloadavg()[0]
    start(forget=True)
    figures = {"first start": start(forget=False), "second start": start(forget=False)}
    print(f"load average {load:.2f} at the start ({os.cpu_count()} CPUs)")
    for label, f in figures.items():
        verdict = "within" if f["to_ready_s"] <= TARGETS[label] else "OVER"
        print(f"{label}: Ready {f['to_ready_s']:.1f} s after the models loaded ({verdict} the {TARGETS[label]:.0f} s "
              f"target); loading took {f['load_s']:.1f} s; costs {f['costs_state'] or 'not judged'}"
              + (f" ({f['costs_note']})" if f["costs_note"] else "")
              + f"; after Ready {f['after_ready_s']:.1f} s of measuring while idle: {f['settled_state']}"
              + (f" ({f['settled_note']})" if f["settled_note"] else "")
              + f"; 1-token forward {f['target_ms_1'] or 0:.1f} ms, draft {f['draft_ms']:.1f} ms")
    if args.json is not None:
        config = {"command": "python bench/ready_time.py", "runtime": figures["first start"]["runtime"],
                  "threads": figures["first start"]["threads"],
                  "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                  "load_average": load}
        write_record(args.json, config, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
