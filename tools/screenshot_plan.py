"""Saves a screenshot of the Models dialog planning a pair that does not fit, with the cheapest change, or (with
--runtime) the packaged default pair on that runtime, e.g. `--runtime llamacpp --out /tmp/plan-llamacpp.png`.

Offline: the plan reads the preset's shipped config; nothing loads. Run under a display, e.g.
`Xvfb :99 & DISPLAY=:99 .venv/bin/python tools/screenshot_plan.py`.
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=str(ROOT / "assets" / "screenshot-plan.png"))
    p.add_argument("--preset", default="qwen3-32b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--memory-gib", type=float, default=24.0, help="the GPU to plan for (0: this device's free memory)")
    p.add_argument("--runtime", default="", choices=["", "auto", "torch", "llamacpp"],
                   help="plan the packaged default pair on this runtime and this machine instead of --preset")
    args = p.parse_args(argv)

    import shiboken6
    from PySide6.QtCore import QEventLoop, QTimer
    from PySide6.QtWidgets import QApplication

    from app.core.session import plan_for
    from engine.models.presets import pair_presets
    from engine.settings import ModelSelection
    from widgets.model_dialog import ModelDialog
    from widgets.palette import load_stylesheet

    app = QApplication.instance() or QApplication(["specdec-studio"])
    app.setStyle("Fusion")
    app.setStyleSheet(load_stylesheet())
    presets = pair_presets()
    chosen = next(x for x in presets if x.name == args.preset)
    selection = ModelSelection(target=chosen.target, draft=chosen.draft, device=args.device,
                               memory_gib=args.memory_gib)
    if args.runtime:
        selection = ModelSelection(runtime=args.runtime)
    dialog = ModelDialog(selection, planner=plan_for, presets=presets)
    if not args.runtime:
        dialog.preset.setCurrentIndex(1 + presets.index(chosen))
    dialog.show()
    loop = QEventLoop()
    QTimer.singleShot(800, loop.quit)  # layout and the plan settle
    loop.exec()
    dialog.grab().save(args.out)
    print(f"saved {args.out}: {'fits' if dialog.plan and dialog.plan.fits else 'does not fit'}; "
          f"{dialog.plan.suggestion.description if dialog.plan and dialog.plan.suggestion else ''}")
    dialog.close()
    shiboken6.delete(dialog)
    gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
