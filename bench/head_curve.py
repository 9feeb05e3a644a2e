"""Does more data still pay the draft head? Held-out acceptance by position against the answer tokens it has seen.

Reads a head's training log (`distill` writes OUT/train_log.jsonl; a run continued with --init appends
to it): every "data" line adds the fresh answer tokens the target wrote for it (a round equal to one of an earlier
run adds none: that run trains again on old answers, and its points say so), every "eval" line is the
head's held-out greedy acceptance per draft position at that point. Each run holds out answers of its own
fresh data, so a continued run's first evaluation (step 0, before it trains) is the head it starts from
measured on the new held-out answers: that point, not the last one of the run before, is what the run
improved on. Prints the curve, writes its points as JSON and a plot (PNG, rendered offscreen with the
app's own plotting library).

    .venv/bin/python bench/head_curve.py assets/heads/qwen2.5-coder-1.5b-instruct/train_log.jsonl \\
        --json bench/results/head_curve.json --png bench/results/head_curve.png
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from app.core.head_log import mark_repeats


def curve(lines: list[dict]) -> list[dict]:
    """One point per held-out evaluation: the fresh answer tokens the target wrote so far, the answer tokens
    trained on so far (a continued run's counts added to the runs before it), and acceptance by position.
    A continued run's evaluation before it trains is kept with "start": true (a fresh run's is a random head)."""
    written, trained, before, points, continued, repeat = 0, 0, 0, [], False, False
    lines = list(lines)
    mark_repeats(lines)  # a round equal to one of an earlier run is no fresh data, and its run says so
    for record in lines:
        kind = record.get("kind") if isinstance(record, dict) else None
        if kind == "data" and not record.get("repeat"):
            written += int(record.get("answer_tokens", 0))
        elif kind == "continue":
            before = trained  # a run continued from the head so far: its counts start again from 0
            continued = True
            repeat = "with" if record.get("repeat") and record.get("fresh") else bool(record.get("repeat"))
        elif kind == "train":
            trained = before + int(record.get("tokens", 0))
        elif kind == "eval" and (record.get("step", 0) > 0 or continued):
            step = int(record.get("step", 0))
            point = {"answer_tokens": written, "trained_tokens": trained, "step": step,
                     "acceptance": [float(a) for a in record["acceptance"]]}
            if repeat:
                point["repeat"] = repeat  # True: only data an earlier run wrote; "with": fresh data beside it
            points.append({**point, "start": True} if step == 0 else point)
            continued = False
    return points


def write_png(points: list[dict], path: Path) -> None:
    if not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    import pyqtgraph as pg
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication(["head-curve"])
    widget = pg.PlotWidget(background="w")
    widget.resize(900, 480)
    plot = widget.getPlotItem()
    plot.setTitle("held-out acceptance by draft position against answer tokens trained on", color="k")
    plot.setLabel("bottom", "answer tokens trained on, every pass counted (millions)")
    plot.setLabel("left", "greedy acceptance")
    plot.getAxis("left").enableAutoSIPrefix(False)
    plot.getAxis("bottom").enableAutoSIPrefix(False)
    plot.showGrid(x=True, y=True, alpha=0.3)
    plot.addLegend(offset=(-10, -10))  # bottom right, below the curves
    depth = max(len(p["acceptance"]) for p in points)
    x = [p["trained_tokens"] / 1e6 for p in points]
    for i in range(depth):
        colour = pg.intColor(i, hues=depth, values=1, maxValue=200)
        plot.plot(x, [p["acceptance"][i] if i < len(p["acceptance"]) else float("nan") for p in points],
                  pen=pg.mkPen(colour, width=2), symbol="o", symbolSize=5, symbolBrush=colour,
                  name=f"position {i + 1}")
    app.processEvents()
    if not widget.grab().save(str(path), "PNG"):
        raise OSError(f"could not write {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path, help="a head's train_log.jsonl")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--png", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        lines = [json.loads(line) for line in args.log.read_text(encoding="utf-8").splitlines() if line.strip()]
        points = curve(lines)
    except (OSError, ValueError, TypeError, KeyError) as e:  # unreadable, not JSON lines, no figures or numbers
        print(f"head_curve: cannot read {args.log} as a training log: {e}", file=sys.stderr)
        return 2
    if not points:
        print(f"head_curve: {args.log} holds no held-out evaluation after training began", file=sys.stderr)
        return 2
    print(f"{'written':>12}{'trained on':>14}{'step':>7}  acceptance by position")
    for p in points:
        print(f"{p['answer_tokens']:>12,}{p['trained_tokens']:>14,}{p['step']:>7}  "
              + " ".join(f"{a:.2f}" for a in p["acceptance"])
              + ("  (the head it continues, on this run's held-out answers)" if p.get("start") else "")
              + ("  (with data of an earlier run again)" if p.get("repeat") == "with" else
                 "  (data of an earlier run again)" if p.get("repeat") else ""))
    if args.json is not None:
        args.json.write_text(json.dumps({"log": str(args.log), "points": points}, indent=1) + "\n", encoding="utf-8")
    if args.png is not None:
        write_png(points, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
