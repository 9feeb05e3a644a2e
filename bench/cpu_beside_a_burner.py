"""Does the app stay fast beside another busy program? (real default pair, the window's own path; prints figures)

One run of the real MainWindow with the packaged pair on llama.cpp and the app's default decoding settings:
the same question is answered quiet, beside a CPU-bound burner at nice 19, and beside one at nice 0, the
burner toggled between answers (a child process of this script: `python -c "while True: pass"`), for
--rounds rounds. Prints tok/s of each answer, the median per condition and its ratio to quiet (targets:
>= 0.7x at nice 19, >= 0.4x at nice 0), the UI thread's CPU share of one core while streaming at the CPU's
speed (target <= 10%, from time.thread_time on the UI thread), and the thread policy the engine chose.

    flock /tmp/specdec-real.lock .venv/bin/python bench/cpu_beside_a_burner.py            # ~2 min on 2 cores
    flock /tmp/specdec-real.lock .venv/bin/python bench/cpu_beside_a_burner.py --quick    # ~60 s
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from window_during_llamacpp import TARGET_GUI_SHARE, open_window, stream  # noqa: E402  (sets up engine first)
from record import write_record  # noqa: E402

CONDITIONS = ("quiet", "nice 19", "nice 0")
TARGET_RATIO = {"nice 19": 0.7, "nice 0": 0.4}
PROMPTS = ("Explain quicksort and write it in Python.", "Write a Python function that checks whether a string is a "
           "palindrome, and explain it.")
BURNER = "while True: pass"


@contextmanager
def burner(condition: str):
    """A CPU-bound child process at the condition's nice value while the block runs (none when quiet)."""
    if condition == "quiet":
        yield None
        return
    nice = int(condition.split()[1])
    child = subprocess.Popen([sys.executable, "-c", BURNER], preexec_fn=lambda: os.nice(nice))
    try:
        time.sleep(0.3)  # running before the question is sent
        yield child
    finally:
        child.kill()
        child.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round of short answers (< 90 s on 2 cores)")
    parser.add_argument("--rounds", type=int, default=2, help="quiet / nice 19 / nice 0 cycles (default 2)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=0, help="the Threads setting (0: the engine's own choice)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rounds, tokens = (1, 40) if args.quick else (max(1, args.rounds), args.max_new_tokens)
    started = time.perf_counter()

    from engine.settings import GenerationSettings

    window, _engines = open_window(args.threads)
    info = window.info
    print(f"thread policy: {info.threads_note} (llama.cpp · {info.threads} for a row, {info.threads_batch} for "
          f"prompts); loaded and measured in {time.perf_counter() - started:.0f} s", flush=True)
    settings = GenerationSettings(max_new_tokens=tokens)  # the app's defaults: auto mode, greedy
    window.panel.set_values(settings)
    stream(window, PROMPTS[0], probe_ms=None)  # warm-up: the first answer pays one-time costs
    runs: list[dict] = []
    for r in range(rounds):
        for condition in CONDITIONS:
            prompt = PROMPTS[r % len(PROMPTS)]
            with burner(condition):
                run = stream(window, prompt, probe_ms=None)
            s = run.summary
            runs.append({"round": r, "condition": condition, "tok_s": s.tokens_per_s, "tokens": s.new_tokens,
                         "seconds": s.seconds, "gui_share": run.gui_share, "prompt": r % len(PROMPTS)})
            print(f"round {r + 1} {condition:>7}: {s.tokens_per_s:5.1f} tok/s ({s.new_tokens} tokens in "
                  f"{s.seconds:.1f} s), UI thread {100 * run.gui_share:.1f}% of a core", flush=True)
    window.close()

    # Ratios per round against that round's quiet answer (same prompt), then the median over rounds.
    quiet = {r["round"]: r["tok_s"] for r in runs if r["condition"] == "quiet"}
    summary: dict = {"policy": info.threads_note, "threads": info.threads, "threads_batch": info.threads_batch}
    for condition in CONDITIONS:
        speeds = [r["tok_s"] for r in runs if r["condition"] == condition]
        summary[condition] = {"median_tok_s": statistics.median(speeds)}
        if condition != "quiet":
            ratio = statistics.median(r["tok_s"] / quiet[r["round"]] for r in runs
                                      if r["condition"] == condition and quiet[r["round"]] > 0)
            summary[condition]["ratio"] = ratio
    gui = max(r["gui_share"] for r in runs if r["condition"] == "quiet")
    summary["gui_share_quiet_max"] = gui
    print(f"\nquiet {summary['quiet']['median_tok_s']:.1f} tok/s (median of {rounds})", flush=True)
    for condition, target in TARGET_RATIO.items():
        ratio = summary[condition]["ratio"]
        print(f"{condition:>7}: {summary[condition]['median_tok_s']:.1f} tok/s, {ratio:.2f}x quiet "
              f"(target >= {target:.1f}x: {'met' if ratio >= target else 'NOT met'})")
    print(f"UI thread while streaming quiet: at most {100 * gui:.1f}% of one core "
          f"(target <= {100 * TARGET_GUI_SHARE:.0f}%: {'met' if gui <= TARGET_GUI_SHARE else 'NOT met'})")
    print(f"thread policy: {info.threads_note}")
    print(f"took {time.perf_counter() - started:.0f} s")
    if args.json is not None:
        write_record(args.json, {"quick": args.quick, "rounds": rounds, "max_new_tokens": tokens,
                                 "threads": args.threads}, summary, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
