"""Saves a screenshot of the Models dialog showing a draft check's result, read from a check's --json file.

Nothing loads: the report is the one `specdec-studio check --json FILE` (or bench/check_honesty.py) wrote.
`QT_QPA_PLATFORM=offscreen .venv/bin/python tools/screenshot_check.py --report check.json`
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _report(path: Path):
    from engine.measure.check_types import CandidateCheck, CheckReport

    data = json.loads(path.read_text(encoding="utf-8"))
    raw = data.get("report") or data["check"]
    tuples = ("greedy_positions", "sampled_positions", "speedups", "first_range", "speedup_range")
    rows = tuple(CandidateCheck(**{k: tuple(v) if k in tuples and v is not None else v for k, v in c.items()})
                 for c in raw["candidates"])
    fields = {k: v for k, v in raw.items() if k in CheckReport.__dataclass_fields__ and k != "candidates"}
    fields["phases"] = tuple(tuple(p) for p in fields.get("phases", ()))
    return CheckReport(candidates=rows, **fields)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--report", type=Path, required=True)
    p.add_argument("--out", default=str(ROOT / "assets" / "screenshot-check.png"))
    args = p.parse_args(argv)

    import shiboken6
    from PySide6.QtCore import QEventLoop, QTimer
    from PySide6.QtWidgets import QApplication

    from widgets.model_dialog import ModelDialog
    from widgets.palette import load_stylesheet

    app = QApplication.instance() or QApplication(["specdec-studio"])
    app.setStyle("Fusion")
    app.setStyleSheet(load_stylesheet())
    dialog = ModelDialog()
    dialog.check_view.show()
    dialog.check_view.set_report(_report(args.report))
    dialog.resize(900, dialog.sizeHint().height() + 120)
    dialog.show()
    loop = QEventLoop()
    QTimer.singleShot(800, loop.quit)  # layout settles
    loop.exec()
    dialog.grab().save(args.out)
    print(f"saved {args.out}")
    dialog.close()
    shiboken6.delete(dialog)
    gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
