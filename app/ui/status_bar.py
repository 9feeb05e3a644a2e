"""The window's status bar: the pair in use, its device line, memory (polled), the cost model's verdict,
what auto decides now, and the load's progress."""
from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from PySide6.QtCore import QObject, Qt, QTimer
from PySide6.QtWidgets import QLabel, QProgressBar, QStatusBar

from app.core.session import cost_verdict, device_line
from engine.measure.explain import UNSETTLED, describe_decision, describe_unsettled, plain_decision
from engine.types import Decision, ModelInfo, Summary
from widgets.elided_label import ElidedLabel

log = logging.getLogger(__name__)

MEMORY_REFRESH_MS = 2000


class StatusBarController(QObject):
    """Owns the status bar's labels. `info` gives the pair in use; `on_memory(used, total_gib)` hears of a
    change of diagnosis (memory full or not), never every poll."""

    def __init__(self, status: QStatusBar, *, info: Callable[[], ModelInfo | None],
                 on_memory: Callable[[float, float], None], parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.status = status
        self._info = info
        self._on_memory = on_memory
        self.memory_full = False
        self._prefill_shown = False  # the load label shows a prompt's progress
        # Long texts elide with "…" and keep the whole text (and the figures behind it) in their tooltip.
        self.model_label = ElidedLabel("No model")
        self.device_label = ElidedLabel("")
        self.memory_label = QLabel("")
        self.cost_label = ElidedLabel("")  # the cost model's verdict: does speculation pay on this machine?
        self.decision_label = ElidedLabel("")  # what the K controller decides now, and why
        self.load_label = ElidedLabel("")
        self.load_bar = QProgressBar()
        self.load_bar.setRange(0, 100)
        self.load_bar.setMaximumWidth(160)
        self.load_bar.setMaximumHeight(14)
        self.load_bar.setTextVisible(True)
        self.load_bar.hide()
        for label in (self.model_label, self.device_label, self.memory_label, self.load_label, self.cost_label,
                      self.decision_label):
            label.setTextFormat(Qt.TextFormat.PlainText)
        status.addWidget(self.model_label)
        status.addWidget(self.load_label, 1)
        status.addPermanentWidget(self.load_bar)
        status.addPermanentWidget(self.decision_label, 1)
        status.addPermanentWidget(self.cost_label, 1)
        status.addPermanentWidget(self.device_label)
        status.addPermanentWidget(self.memory_label)
        self.timer = QTimer(self)
        self.timer.setInterval(MEMORY_REFRESH_MS)
        self.timer.timeout.connect(self.update_memory)
        self.timer.start()

    # --- loading -------------------------------------------------------------------------------

    def load_started(self, message: str | None = None) -> None:
        if message is not None:
            self.load_label.setText(message)
            self.load_bar.setValue(0)
        self.load_bar.show()

    def load_progress(self, progress) -> None:
        stage = str(getattr(progress, "stage", "")).capitalize()
        fraction = float(getattr(progress, "fraction", 0.0))
        self.load_bar.setValue(round(100 * fraction))
        self.load_bar.setFormat(f"{stage} %p%")
        self.load_label.setText(str(getattr(progress, "message", "")))

    def load_ended(self, message: str) -> None:
        self.load_bar.hide()
        self.load_label.setText(message)

    def show_prefill(self, text: str) -> None:
        """How far the prompt has been read, where loading shows its progress ("" clears it)."""
        if text or self._prefill_shown:
            self.load_label.setText(text)
        self._prefill_shown = bool(text)

    def show_pair(self, info: ModelInfo | None, names: str = "No model") -> None:
        self.model_label.setText(names)
        if info is not None:
            self.device_label.setText(device_line(info))
            notes = (info.threads_note, info.fast_path_note, info.runtime_note)
            self.device_label.setToolTip("\n".join(n for n in notes if n))

    def show_remote(self, server: str, model: str) -> None:
        """The chat streams from a remote server: which one and which model (no local device or costs)."""
        self.model_label.setText(f"Remote: {model}")
        self.device_label.setText(f"{server} · OpenAI API")
        self.device_label.setToolTip("Answers come from this server; no local models are loaded")
        self.cost_label.setText("")
        self.cost_label.setToolTip("")
        self.decision_label.setText("")
        self.load_label.setText("")

    # --- figures -------------------------------------------------------------------------------

    def show_costs(self, info: ModelInfo | None, summary: Summary | None, proposer: str = "draft") -> None:
        short, full = cost_verdict(info, summary, proposer)
        self.cost_label.setText(short)
        self.cost_label.setToolTip(full)

    def show_decision(self, decision: Decision | None) -> None:
        """What the K controller decided and why; a fixed K or standard decoding leaves the last line."""
        if decision is not None and decision.reason not in ("fixed", "standard"):
            info = self._info()
            unsettled = info is not None and info.costs_state in UNSETTLED
            self.decision_label.setText(describe_unsettled(decision) if unsettled else plain_decision(decision))
            self.decision_label.setToolTip(describe_decision(decision))

    def update_memory(self) -> None:
        # torch only if the engine already imported it: the status bar never pays for a torch import.
        torch = sys.modules.get("torch")
        info = self._info()
        try:
            if torch is not None and info is not None and info.device.startswith("cuda"):
                # Every GPU of a split target (or cuda:1 alone), not whichever device is current.
                devices = info.devices or (info.device,)
                used = [torch.cuda.memory_allocated(d) / 2**30 for d in devices]
                self.memory_label.setText(f"GPU {used[0]:.2f} GiB" if len(used) == 1 else
                                          "GPUs " + " + ".join(f"{u:.2f}" for u in used) + " GiB")
                fullest = min((torch.cuda.mem_get_info(d) for d in devices), key=lambda ft: ft[0] / ft[1])
                self._note_memory(1 - fullest[0] / fullest[1], fullest[1] / 2**30)
                return
            import psutil

            rss = psutil.Process().memory_info().rss / 2**30
            self.memory_label.setText(f"RAM {rss:.2f} GiB")
            machine = psutil.virtual_memory()
            self._note_memory(machine.percent / 100, machine.total / 2**30)
        except Exception as e:  # a status figure is never worth an error dialog
            log.debug("memory figure unavailable: %s", e)
            self.memory_label.setText("")

    def _note_memory(self, used: float, total_gib: float) -> None:
        # Only a change of diagnosis is worth re-running the rules every two seconds.
        full = used >= 0.9
        if full != self.memory_full:
            self.memory_full = full
            self._on_memory(used, total_gib)

    def stop(self) -> None:
        """At close: no more polls."""
        self.timer.stop()
