"""Is the window responsive while llama.cpp decodes on every core? (real default pair; prints figures)

The real MainWindow loads the packaged pair on the llama.cpp runtime and streams real answers
(standard, then speculative) while a 5 ms timer on the UI thread records the gaps between its
ticks; the same answers are then decoded headless on the same engine, so the cost of the UI to
the decode is measured too. llama.cpp's calls release the GIL, so the UI thread only competes
for a core. Run under the real-model lock:

    flock /tmp/specdec-real.lock .venv/bin/python bench/window_during_llamacpp.py --threads 2,1
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import write_record  # noqa: E402

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

TARGET_MAX_GAP_MS = 50.0
PROBE_MS = 5
PROMPT = "Explain quicksort and write it in Python."


def measure(threads: int, max_new_tokens: int, target: str | None, draft: str | None) -> dict:
    import numpy as np
    from PySide6.QtCore import QElapsedTimer, QEventLoop, Qt, QTimer
    from PySide6.QtWidgets import QApplication

    from app.core.session import build_request, system_messages
    from app.ui.settings import AppSettings
    from app.ui.window import MainWindow
    from app.ui.worker import default_engine_factory
    from engine.settings import GenerationSettings, ModelChoice, ModelSelection
    from engine.types import Message

    _app = QApplication.instance() or QApplication(["ui_llamacpp"])  # kept alive for the whole run
    engines: list = []

    def factory(request, progress):
        engines.append(default_engine_factory(request, progress))
        return engines[-1]

    window = MainWindow(engine_factory=factory, settings=AppSettings(Path(tempfile.mkdtemp()) / "ui.ini"))
    window.resize(1480, 900)
    window.show()
    loop = QEventLoop()
    window.models_loaded.connect(lambda _info: loop.quit())
    window.models_load_failed.connect(lambda message: (print("load failed:", message), loop.quit()))
    window.load_models(ModelSelection(target=ModelChoice.from_spec(target), draft=ModelChoice.from_spec(draft),
                                      runtime="llamacpp", threads=threads))
    loop.exec()
    assert window.info is not None and window.info.runtime == "llamacpp", window.info
    figures: dict = {"threads": threads, "runtime": window.info.fast_path}
    done: list = []
    finished = QEventLoop()
    window.answer_finished.connect(lambda _rid, s: (done.append(s), finished.quit()))
    for mode in ("standard", "speculative"):
        window.panel.set_values(GenerationSettings(mode=mode, k=5, max_new_tokens=max_new_tokens))
        gaps: list[float] = []
        clock = QElapsedTimer()
        probe = QTimer()
        probe.setTimerType(Qt.TimerType.PreciseTimer)
        probe.setInterval(PROBE_MS)
        last = [0]

        at: list[float] = []

        def tick() -> None:
            now = clock.nsecsElapsed()
            gaps.append((now - last[0]) / 1e6)
            at.append(now / 1e9)
            last[0] = now

        probe.timeout.connect(tick)
        done.clear()
        window.new_chat()
        clock.start()
        last[0] = clock.nsecsElapsed()
        probe.start()
        window.send(PROMPT)
        QTimer.singleShot(600_000, finished.quit)
        finished.exec()
        probe.stop()
        summary = done[0]
        if len(gaps) < 3:
            print(f"{mode}: the answer took {summary.seconds * 1000:.0f} ms, too short to measure", flush=True)
            continue
        gaps_ms = np.array(gaps[1:])
        # The same request headless on the same engine: what the window costs the decode.
        settings = window.panel.values()
        request = build_request(settings, system_messages(settings) + (Message("user", PROMPT),))
        headless = engines[-1].generate(request)
        for _ in headless:
            pass
        # Where the worst gaps fell: (ms, seconds into the answer) - a gap at the very end is the
        # window finishing the answer (markdown), not llama.cpp decoding.
        worst = sorted(zip(gaps[1:], at[1:]), reverse=True)[:5]
        figures[mode] = {
            "max_gap_ms": float(gaps_ms.max()), "p99_gap_ms": float(np.percentile(gaps_ms, 99)),
            "worst_gaps": [(round(g, 1), round(t, 2)) for g, t in worst], "answer_s": summary.seconds,
            "tok_s_in_window": summary.tokens_per_s, "tok_s_headless": headless.summary.tokens_per_s,
            "tokens": summary.new_tokens,
        }
        print(f"threads={threads} {mode}: max UI gap {figures[mode]['max_gap_ms']:.1f} ms "
              f"(p99 {figures[mode]['p99_gap_ms']:.1f} ms; target < {TARGET_MAX_GAP_MS:.0f}), "
              f"{summary.tokens_per_s:.1f} tok/s in the window vs {headless.summary.tokens_per_s:.1f} headless; "
              f"worst gaps (ms, s into the {summary.seconds:.1f} s answer): {figures[mode]['worst_gaps']}",
              flush=True)
    window.close()
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="0", help="comma-separated thread counts (0: the physical cores)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--target", default=None, help="a .gguf target (default: the packaged pair)")
    parser.add_argument("--draft", default=None, help="a .gguf draft (default: the packaged pair)")
    args = parser.parse_args()
    results = []
    for threads in (int(t) for t in args.threads.split(",")):
        if threads == 0:
            from engine.runners.llamacpp import physical_cores

            threads = physical_cores()
        results.append(measure(threads, args.max_new_tokens, args.target, args.draft))
        time.sleep(1)
    if args.json is not None:
        write_record(args.json, {k: str(v) for k, v in vars(args).items()}, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
