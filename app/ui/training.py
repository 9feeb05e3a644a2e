"""Training a draft head from the app: the dialog, the worker's training signals, and the head it attaches."""
from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QObject, Signal

from app.core.head_log import describe, head_choices, head_log_for
from app.core.session import TrainRequest
from app.ui.worker import EngineWorker
from engine.types import ModelInfo, TrainingProgress
from widgets.train_dialog import TrainHeadDialog


def default_head_folder(target_name: str) -> Path:
    """<cache>/heads/<target>: next to the converted models."""
    from engine.models.store import cache_dir

    return cache_dir() / "heads" / (re.sub(r"[^A-Za-z0-9._-]+", "-", target_name).strip("-") or "target")


class HeadTrainingController(QObject):
    """Owns the "Train a draft head" dialog for the loaded target; one training at a time.

    The worker trains on its own thread, as it generates: the chat waits while it runs (`running`).
    """

    running_changed = Signal(bool)
    head_attached = Signal(object)  # ModelInfo with the new head

    def __init__(self, worker: EngineWorker, *, next_request_id: Callable[[], int],
                 target_spec: Callable[[], str | None], parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.worker = worker
        self._next_id = next_request_id
        self._target_spec = target_spec
        self.dialog: TrainHeadDialog | None = None
        self.request_id: int | None = None
        self._info: ModelInfo | None = None
        worker.training_progress.connect(self._on_progress)
        worker.training_finished.connect(self._on_finished)
        worker.training_failed.connect(self._on_failed)
        worker.head_attached.connect(self.head_attached)

    @property
    def running(self) -> bool:
        return self.request_id is not None

    def open(self, info: ModelInfo, parent=None, folder: Path | None = None) -> TrainHeadDialog:
        """Shows the dialog for the loaded target (a new one when the target changed)."""
        if self.dialog is None or (self._info is not None and self._info.target_name != info.target_name
                                   and not self.running):
            if self.dialog is not None:
                self.dialog.deleteLater()
            folder = folder or default_head_folder(info.target_name)
            self.dialog = TrainHeadDialog(info.target_name, str(folder), on_gpu=info.device.startswith("cuda"),
                                          heads=head_choices(info.head_name, folder), parent=parent)
            self.dialog.start_requested.connect(self.start)
            self.dialog.cancel_requested.connect(self.cancel)
            # Before a run of their own, how the head in use was trained (and what a run looks like).
            head = head_log_for(info.head_name, folder)
            if head is not None:
                self.dialog.show_log(head.records, describe(head))
        self._info = info
        self.dialog.show()
        self.dialog.raise_()
        return self.dialog

    def start(self, minutes: float, folder: str, start_from: str = "") -> int | None:
        """start_from: a head folder to continue training ("": a new head)."""
        if self.running or self._info is None:
            return None
        rid = self._next_id()
        self.request_id = rid
        self.worker.train_requested.emit(TrainRequest(rid, self._target_spec(), self._info.device, self._info.dtype,
                                                      minutes, folder, start_from or None))
        self.running_changed.emit(True)
        return rid

    def cancel(self) -> None:
        # A direct call (an Event), not a queued slot: the worker's thread is busy training.
        self.worker.cancel_training()

    def _on_progress(self, rid: int, progress: TrainingProgress) -> None:
        if rid == self.request_id and self.dialog is not None:
            self.dialog.show_progress(progress)

    def _on_finished(self, rid: int, summary: dict) -> None:
        if rid != self.request_id:
            return
        self.request_id = None
        if self.dialog is not None:
            self.dialog.show_finished(summary)
        self.running_changed.emit(False)

    def _on_failed(self, rid: int, message: str) -> None:
        if rid != self.request_id:
            return
        self.request_id = None
        if self.dialog is not None:
            self.dialog.show_failed(message)
        self.running_changed.emit(False)
