"""How responsive the real MainWindow stays (prints the UI-thread gaps): answers streaming at 30 and 1,000 tok/s,
a 2,000-token answer with code blocks completing and being rendered as markdown, and a history of 100 saved
conversations of 100 long messages (start, open, scroll; memory over repeated opens)."""
from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# Saved conversations go to a throw-away folder, never the user's.
os.environ.setdefault("SPECDEC_DATA_DIR", tempfile.mkdtemp(prefix="specdec-bench-"))

TARGET_MAX_GAP_MS = 50.0
PROBE_MS = 5  # the UI-thread timer whose gaps we measure


@dataclass(frozen=True)
class Scenario:
    name: str
    k: int  # draft length
    acceptance: float  # per-position acceptance of the synthetic drafts
    delay_s: float  # wall time per step


def long_text(tokens: int) -> str:
    """The demo answer repeated until it has at least `tokens` pieces, then cut to exactly that many."""
    from app.core.demo import DEMO_ANSWER, split_tokens

    pieces: list[str] = []
    while len(pieces) < tokens:
        pieces += split_tokens(DEMO_ANSWER + "\n\n")
    return "".join(pieces[:tokens])


def run(scenario: Scenario, tokens: int) -> dict[str, float]:
    import numpy as np
    import shiboken6
    from PySide6.QtCore import QElapsedTimer, QEventLoop, Qt, QTimer
    from PySide6.QtWidgets import QApplication

    from app.core.demo import ScriptedEngine, scripted_steps
    from app.ui.settings import AppSettings
    from app.ui.window import MainWindow
    from engine.settings import GenerationSettings, ModelSelection
    from widgets.palette import load_stylesheet

    app = QApplication.instance() or QApplication(["ui_responsiveness"])
    app.setStyle("Fusion")
    app.setStyleSheet(load_stylesheet())
    text = long_text(tokens)
    steps = scripted_steps(text, k=scenario.k, acceptance=scenario.acceptance, seed=1)
    per_step = tokens / len(steps)
    engine = ScriptedEngine(text=text, delay_s=scenario.delay_s, acceptance=scenario.acceptance)
    window = MainWindow(engine_factory=lambda _r, _p: engine,
                        settings=AppSettings(Path(tempfile.mkdtemp()) / "bench.ini"))
    window.resize(1480, 900)
    window.show()

    def spin_until(condition, timeout_s: float) -> None:
        deadline = time.perf_counter() + timeout_s
        while not condition() and time.perf_counter() < deadline:
            app.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 20)
            time.sleep(0.001)

    window.load_models(ModelSelection())
    spin_until(lambda: window.info is not None, 30)
    window.panel.set_values(GenerationSettings(k=scenario.k, max_new_tokens=4096))

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
    finished: list[tuple[int, object, float]] = []
    window.answer_finished.connect(lambda rid, s: finished.append((rid, s, time.perf_counter())))
    received = [0]
    window.worker.steps.connect(lambda _rid, batch: received.__setitem__(0, received[0] + len(batch)))

    loop = QEventLoop()
    window.answer_finished.connect(lambda *_: loop.quit())
    clock.start()
    last[0] = clock.nsecsElapsed()
    probe.start()
    started = time.perf_counter()
    rid = window.send("Explain quicksort, in Chinese and English, with code.")
    QTimer.singleShot(int((tokens / max(per_step, 1) * scenario.delay_s + 60) * 1000), loop.quit)
    loop.exec()
    wall = time.perf_counter() - started
    # The answer is rendered as markdown once it ends (off the UI thread); keep probing through that.
    done_at = time.perf_counter()
    spin_until(lambda: window.chat.markdown_view(rid) is not None and window.chat.markdown_view(rid).is_complete(), 30)
    render_s = time.perf_counter() - done_at
    spin_until(lambda: False, 0.3)
    probe.stop()
    assert finished, "the answer did not finish"
    _, summary, _ = finished[0]
    view = window.chat.token_view(rid)
    shown = sum(1 for t in view.tokens() if t.status != "rejected")
    backlog = summary.target_forwards - len(window.records[-1].steps)
    gaps_ms = np.array(gaps[1:])  # the first gap includes send()'s own setup
    figures = {
        "max_gap_ms": float(gaps_ms.max()),
        "p99_gap_ms": float(np.percentile(gaps_ms, 99)),
        "tokens": float(summary.new_tokens),
        "tokens_shown": float(shown),
        "text_ok": float(view.committed_text() == text),
        "rate": summary.new_tokens / wall,
        "backlog": float(backlog),
        "steps": float(summary.target_forwards),
        "worst": sorted(zip(gaps[1:], at[1:]), reverse=True)[:5],  # (gap ms, seconds into the stream)
        "stream_s": wall,
        "render_s": render_s,
        "rendered": float(window.chat.markdown_view(rid) is not None),
        "code_blocks": float(len(window.chat.markdown_view(rid).code_blocks()) if window.chat.markdown_view(rid) else 0),
    }
    window.close()
    shiboken6.delete(window)  # before the QApplication goes, or PySide6 can crash at exit
    gc.collect()
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=3000)
    p.add_argument("--only", choices=["realistic", "fast", "markdown", "history"], default=None)
    p.add_argument("--conversations", type=int, default=100, help="history scenario: saved conversations")
    p.add_argument("--messages", type=int, default=100, help="history scenario: messages in each")
    p.add_argument("--repeat", type=int, default=1, help="runs per scenario (shared machines are noisy)")
    args = p.parse_args(argv)
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"machine: {os.cpu_count()} CPUs, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
          f"(other processes inflate every gap)", flush=True)
    scenarios = [
        # ~3.4 tokens per step (K=5, 80% per position) at ~30 tok/s: a laptop running the default pair.
        Scenario("realistic", k=5, acceptance=0.8, delay_s=0.113),
        # 5 tokens every 5 ms (K=4, all accepted + bonus): 1,000 tok/s, faster than any GPU we have.
        Scenario("fast", k=4, acceptance=1.0, delay_s=0.005),
        # A 2,000-token answer (a dozen code blocks) at ~100 tok/s; what matters is the end: markdown rendering.
        Scenario("markdown", k=5, acceptance=0.8, delay_s=0.03),
    ]
    ok = True
    for scenario in scenarios:
        if args.only and scenario.name != args.only:
            continue
        for _ in range(args.repeat):
            f = run(scenario, 2000 if scenario.name == "markdown" else args.tokens)
            passed = f["max_gap_ms"] < TARGET_MAX_GAP_MS and f["tokens_shown"] == f["tokens"] and f["backlog"] == 0
            ok &= passed
            print(f"[{scenario.name}] max UI gap: {f['max_gap_ms']:.1f} ms (p99 {f['p99_gap_ms']:.1f} ms) "
                  f"while streaming {int(f['tokens'])} tokens at {f['rate']:.0f} tok/s "
                  f"({int(f['steps'])} steps); tokens shown = {int(f['tokens_shown'])} "
                  f"({'no drops' if f['tokens_shown'] == f['tokens'] and f['text_ok'] else 'MISMATCH'}); "
                  f"backlog at end = {int(f['backlog'])}; {'PASS' if passed else 'FAIL'} (target < {TARGET_MAX_GAP_MS:.0f} ms)",
                  flush=True)
            worst = ", ".join(f"{g:.0f} ms at {t:.2f} s" for g, t in f["worst"])
            print(f"    worst gaps: {worst} (stream took {f['stream_s']:.1f} s); rendered as markdown "
                  f"{f['render_s'] * 1000:.0f} ms after the end, {int(f['code_blocks'])} code blocks"
                  f"{'' if f['rendered'] else ' NOT RENDERED'}", flush=True)
            ok &= bool(f["rendered"])
    if args.only in (None, "history"):
        from bench.window_long_history import run_history

        ok &= run_history(args.conversations, args.messages, TARGET_MAX_GAP_MS)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
