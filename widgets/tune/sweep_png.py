"""sweep.png for the CLI: the Tune tab's own plots, rendered offscreen (no display needed)."""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from engine.types import SweepRow

SIZE = (1400, 560)  # pixels: two plots side by side


def write_sweep_png(rows: Sequence[SweepRow], path: Path, size: tuple[int, int] = SIZE) -> None:
    """Renders speedup and acceptance against K (a line per temperature and proposer) to `path`."""
    if not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication(["specdec-studio-sweep"])
    from widgets.tune.plots import SweepPlots

    plots = SweepPlots()
    plots.resize(*size)
    plots.show_rows(rows)
    plots.graphics.ci.layout.activate()
    app.processEvents()
    if not plots.grab().save(str(path), "PNG"):
        raise OSError(f"could not write {path}")
    plots.deleteLater()
    app.processEvents()
