"""Is the window responsive while llama.cpp decodes on every core? (real default pair; prints figures)

The real MainWindow loads the packaged pair on the llama.cpp runtime and streams real answers
(standard, then speculative) while a 5 ms timer on the UI thread records the gaps between its
ticks, and the UI thread's own CPU time is read around each answer (its share of one core while
streaming at the CPU's speed); the same answers are then decoded headless on the same engine, so the
cost of the UI to the decode is measured too. llama.cpp's calls release the GIL, so the UI thread only
competes for a core. bench/cpu_beside_a_burner.py streams through the same helpers. Run under the
real-model lock:

    flock /tmp/specdec-real.lock .venv/bin/python bench/window_during_llamacpp.py --threads 2,1
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine  # noqa: E402,F401  (first: the engine's OpenMP settings come before torch)
from record import write_record  # noqa: E402

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# Saved conversations go to a throw-away folder, never the user's.
os.environ.setdefault("SPECDEC_DATA_DIR", tempfile.mkdtemp(prefix="specdec-bench-"))

TARGET_MAX_GAP_MS = 50.0
TARGET_GUI_SHARE = 0.10  # the UI thread's CPU while streaming: at most a tenth of one core
PROBE_MS = 5
PROMPT = "Explain quicksort and write it in Python."
_APP = None


@dataclass
class Streamed:
    """One answer streamed in the window, with what the UI thread did meanwhile."""

    summary: object  # the engine's Summary
    wall_s: float  # from send to the answer's last signal
    gui_cpu_s: float  # CPU time of the UI thread over the same span
    gaps_ms: list[float] = field(default_factory=list)  # between the probe timer's ticks
    at_s: list[float] = field(default_factory=list)  # when each gap ended, seconds after send

    @property
    def gui_share(self) -> float:
        """The UI thread's CPU time as a share of one core."""
        return self.gui_cpu_s / self.wall_s if self.wall_s > 0 else 0.0


def open_window(threads: int, target: str | None = None, draft: str | None = None, size: tuple[int, int] = (1480, 900)):
    """(window, engines) with the pair loaded on llama.cpp; threads 0: the engine's own choice."""
    from PySide6.QtCore import QEventLoop
    from PySide6.QtWidgets import QApplication

    from app.ui.settings import AppSettings
    from app.ui.window import MainWindow
    from app.ui.worker import default_engine_factory
    from engine.settings import ModelChoice, ModelSelection

    global _APP
    _APP = QApplication.instance() or QApplication(["bench_window"])  # kept alive for the whole run
    engines: list = []

    def factory(request, progress):
        engines.append(default_engine_factory(request, progress))
        return engines[-1]

    window = MainWindow(engine_factory=factory, settings=AppSettings(Path(tempfile.mkdtemp()) / "ui.ini"))
    window.resize(*size)
    window.show()
    loop = QEventLoop()
    window.models_loaded.connect(lambda _info: loop.quit())
    window.models_load_failed.connect(lambda message: (print("load failed:", message), loop.quit()))
    window.load_models(ModelSelection(target=ModelChoice.from_spec(target), draft=ModelChoice.from_spec(draft),
                                      runtime="llamacpp", threads=threads))
    loop.exec()
    assert window.info is not None and window.info.runtime == "llamacpp", window.info
    return window, engines


def stream(window, prompt: str = PROMPT, timeout_s: float = 600.0, probe_ms: int | None = PROBE_MS) -> Streamed:
    """Sends `prompt` in a new chat and waits for the answer, probing the UI thread every probe_ms (None: not)."""
    from PySide6.QtCore import QElapsedTimer, QEventLoop, Qt, QTimer

    done: list = []
    finished = QEventLoop()

    def on_finished(_rid, summary) -> None:
        done.append(summary)
        finished.quit()

    window.answer_finished.connect(on_finished)
    gaps: list[float] = []
    at: list[float] = []
    clock = QElapsedTimer()
    probe = QTimer()
    probe.setTimerType(Qt.TimerType.PreciseTimer)
    probe.setInterval(probe_ms or PROBE_MS)
    last = [0]

    def tick() -> None:
        now = clock.nsecsElapsed()
        gaps.append((now - last[0]) / 1e6)
        at.append(now / 1e9)
        last[0] = now

    probe.timeout.connect(tick)
    window.new_chat()
    clock.start()
    if probe_ms:
        probe.start()
    cpu0, wall0 = time.thread_time(), time.perf_counter()  # this is the UI thread
    window.send(prompt)
    QTimer.singleShot(int(timeout_s * 1000), finished.quit)
    finished.exec()
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    probe.stop()
    window.answer_finished.disconnect(on_finished)
    assert done, f"no answer within {timeout_s:.0f} s"
    # With the probe on, its own ticks (200 a second) are part of the UI thread's time: an upper bound.
    return Streamed(done[0], wall, cpu, gaps[1:], at[1:])


def measure(threads: int, max_new_tokens: int, target: str | None, draft: str | None) -> dict:
    import numpy as np

    from app.core.session import build_request, system_messages
    from engine.settings import GenerationSettings
    from engine.types import Message

    window, engines = open_window(threads, target, draft)
    figures: dict = {"threads": window.info.threads, "runtime": window.info.fast_path,
                     "policy": window.info.threads_note}
    print(f"thread policy: {window.info.threads_note}", flush=True)
    for mode in ("standard", "speculative"):
        window.panel.set_values(GenerationSettings(mode=mode, k=5, max_new_tokens=max_new_tokens))
        run = stream(window)
        summary = run.summary
        if len(run.gaps_ms) < 3:
            print(f"{mode}: the answer took {summary.seconds * 1000:.0f} ms, too short to measure", flush=True)
            continue
        gaps_ms = np.array(run.gaps_ms)
        # The same request headless on the same engine: what the window costs the decode.
        settings = window.panel.values()
        request = build_request(settings, system_messages(settings) + (Message("user", PROMPT),))
        headless = engines[-1].generate(request)
        for _ in headless:
            pass
        # Where the worst gaps fell: (ms, seconds into the answer) - a gap at the very end is the
        # window finishing the answer (markdown), not llama.cpp decoding.
        worst = sorted(zip(run.gaps_ms, run.at_s), reverse=True)[:5]
        figures[mode] = {
            "max_gap_ms": float(gaps_ms.max()), "p99_gap_ms": float(np.percentile(gaps_ms, 99)),
            "worst_gaps": [(round(g, 1), round(t, 2)) for g, t in worst], "answer_s": summary.seconds,
            "tok_s_in_window": summary.tokens_per_s, "tok_s_headless": headless.summary.tokens_per_s,
            "tokens": summary.new_tokens, "gui_share": run.gui_share,
        }
        print(f"threads={window.info.threads} {mode}: max UI gap {figures[mode]['max_gap_ms']:.1f} ms "
              f"(p99 {figures[mode]['p99_gap_ms']:.1f} ms; target < {TARGET_MAX_GAP_MS:.0f}), "
              f"UI thread {100 * run.gui_share:.1f}% of a core (target <= {100 * TARGET_GUI_SHARE:.0f}%), "
              f"{summary.tokens_per_s:.1f} tok/s in the window vs {headless.summary.tokens_per_s:.1f} headless; "
              f"worst gaps (ms, s into the {summary.seconds:.1f} s answer): {figures[mode]['worst_gaps']}",
              flush=True)
    window.close()
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="0", help="comma-separated thread counts (0: the engine's own choice)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--target", default=None, help="a .gguf target (default: the packaged pair)")
    parser.add_argument("--draft", default=None, help="a .gguf draft (default: the packaged pair)")
    args = parser.parse_args()
    results = []
    for threads in (int(t) for t in args.threads.split(",")):
        results.append(measure(threads, args.max_new_tokens, args.target, args.draft))
        time.sleep(1)
    if args.json is not None:
        write_record(args.json, {k: str(v) for k, v in vars(args).items()}, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
