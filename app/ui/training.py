"""Training a draft head from the app: the dialog, the worker's training signals, and the head it attaches."""
from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QObject, Signal

from app.core.earlier_data import (
    WORK,
    earlier_data,
    fresh_head_folder,
    head_family,
    holds_finished_head,
    kept_by,
    next_head_folder,
)
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
        self._anchor: Path | None = None  # the target's default head folder: its family holds earlier runs' data
        self._start_from = ""  # the head folder the dialog would continue ("": a new head)
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
            # A new head goes where no finished head is (a new run never replaces one: distill refuses it).
            self.dialog = TrainHeadDialog(info.target_name, str(fresh_head_folder(folder)),
                                          on_gpu=info.device.startswith("cuda"),
                                          heads=head_choices(info.head_name, folder), parent=parent)
            self.dialog.start_requested.connect(self.start)
            self.dialog.cancel_requested.connect(self.cancel)
            self.dialog.start_from_changed.connect(self._on_start_from)
            self._anchor, self._start_from = folder, ""
            # Before a run of their own, how the head in use was trained (and what a run looks like).
            head = head_log_for(info.head_name, folder)
            if head is not None:
                self.dialog.show_log(head.records, describe(head))
        self._info = info
        if not self.running:
            self._count_earlier()  # runs elsewhere (the CLI, another window) may have written data since
        self.dialog.show()
        self.dialog.raise_()
        return self.dialog

    def start(self, minutes: float, folder: str, start_from: str = "", reuse: bool = False) -> int | None:
        """start_from: a head folder to continue training ("": a new head); reuse: train on the answers earlier
        runs wrote too. A folder whose run stopped before its end goes on with the data it was started with."""
        if self.running or self._info is None:
            return None
        data = kept_by(Path(folder))
        if data is None:
            found = earlier_data(self._data_folders(start_from), exclude=Path(folder) / WORK) if reuse else None
            data = tuple(str(w) for w in found.works) if found is not None else ()
        rid = self._next_id()
        self.request_id = rid
        self.worker.train_requested.emit(TrainRequest(rid, self._target_spec(), self._info.device, self._info.dtype,
                                                      minutes, folder, start_from or None, data))
        self.running_changed.emit(True)
        return rid

    def cancel(self) -> None:
        # A direct call (an Event), not a queued slot: the worker's thread is busy training.
        self.worker.cancel_training()

    def _on_progress(self, rid: int, progress: TrainingProgress) -> None:
        if rid == self.request_id and self.dialog is not None:
            self.dialog.show_progress(progress)

    def _data_folders(self, start_from: str) -> list[Path]:
        """Head folders whose work folders may hold this target's data: the dialog's and the one a run continues."""
        folders = head_family(self._anchor) if self._anchor is not None else []
        return folders + ([Path(start_from)] if start_from else [])

    def _count_earlier(self) -> None:
        if self.dialog is not None:
            found = earlier_data(self._data_folders(self._start_from))
            self.dialog.set_earlier_data(found.describe() if found is not None else None)

    def _on_start_from(self, start_from: str) -> None:
        self._start_from = start_from
        self._count_earlier()

    def _on_finished(self, rid: int, summary: dict) -> None:
        if rid != self.request_id:
            return
        self.request_id = None
        if self.dialog is not None:
            self.dialog.show_finished(summary)
            self._count_earlier()  # the run's own rounds are earlier data for the next one
            chosen = Path(self.dialog.chosen_folder())
            if holds_finished_head(chosen):
                self.dialog.suggest_folder(str(next_head_folder(chosen)))  # the next new head goes beside it
        self.running_changed.emit(False)

    def _on_failed(self, rid: int, message: str) -> None:
        if rid != self.request_id:
            return
        self.request_id = None
        if self.dialog is not None:
            self.dialog.show_failed(message)
        self.running_changed.emit(False)
