"""Loading a model pair from the window: the model dialog, the worker's load signals, what the window shows
while a pair loads and once it is in use, and the draft-head dialog for the loaded target."""
from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import replace

from PySide6.QtCore import QObject, Signal

from app.core.runtime_switch import switch_cost
from app.core.session import ChatSession, device_line, load_request_for, plan_for
from app.ui.context import ContextCounter, counter_for
from app.ui.notices import Notices
from app.ui.settings import AppSettings
from app.ui.status_bar import StatusBarController
from app.ui.training import HeadTrainingController
from app.ui.worker import EngineWorker
from engine.errors import EngineError
from engine.loadspec import LoadSpec
from engine.models.presets import pair_presets
from engine.settings import ModelSelection
from engine.types import ModelInfo
from widgets.chat.view import ChatView
from widgets.model_dialog import ModelDialog
from widgets.remote_box import RemoteChoice
from widgets.settings_panel import SettingsPanel


def choose_models(selection: ModelSelection, notices: Notices, attach_check: Callable[[ModelDialog], None],
                  use_remote: Callable[[RemoteChoice], None] | None = None) -> tuple[ModelSelection, bool] | None:
    """The model dialog, then a question when the memory plan says the pair will not fit:
    (selection, force), or None when the person cancelled or chose a remote server (given to `use_remote`)."""
    dialog = ModelDialog(selection, notices.parent, planner=plan_for, presets=pair_presets())
    attach_check(dialog)
    if dialog.exec() != ModelDialog.DialogCode.Accepted:
        return None
    if use_remote is not None and dialog.remote_choice().use:
        use_remote(dialog.remote_choice())
        return None
    plan = dialog.plan
    force = False
    if plan is not None and not plan.fits:
        force = confirm_load_anyway(notices, plan)
        if not force:
            return None
    return dialog.selection(), force


def confirm_load_anyway(notices: Notices, plan) -> bool:
    """Asks before loading what the memory plan says will not fit."""
    worst = max(plan.devices, key=lambda d: d.total - (d.capacity or 0))
    change = f"\n\nCheapest change that fits: {plan.suggestion.description}." if plan.suggestion else ""
    return notices.confirm(
        "The models will not fit",
        f"The memory plan needs {worst.total / 2**30:.1f} GiB on {worst.device}, which has "
        f"{(worst.capacity or 0) / 2**30:.1f} GiB.{change}\n\nLoad anyway? It will probably run out of memory.",
    )


class LoadingController(QObject):
    """One load at a time: the pair in use stays in use until the new one is ready (or the worker releases
    it first, engine_released). `selection` is what was last loaded successfully (or asked for at start).

    `recount()` brings the context meter up to date at once; `ready_changed()` re-reads what the window
    allows now; `closed()` is True once the window closes (no error box then).
    """

    loaded = Signal(object)  # ModelInfo now in use, after the window shows it
    load_failed = Signal(str)  # the message shown

    def __init__(self, worker: EngineWorker, session: ChatSession, status: StatusBarController, notices: Notices, *,
                 settings: AppSettings, chat: ChatView, panel: SettingsPanel, context: ContextCounter,
                 training: HeadTrainingController, recount: Callable[[], None], ready_changed: Callable[[], None],
                 closed: Callable[[], bool], parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.worker = worker
        self.session = session
        self.status = status
        self.notices = notices
        self.settings = settings
        self.chat = chat
        self.panel = panel
        self.context = context
        self.training = training
        self._recount = recount
        self._ready_changed = ready_changed
        self._closed = closed
        self.selection = settings.models()
        self._loading_selection: ModelSelection | None = None
        self._train_after_load = False  # the pair is reloading on torch to train a head: open its dialog then
        # The worker lives on its own thread: these are queued connections, run on the UI thread.
        worker.load_started.connect(self._on_load_started)
        worker.load_progress.connect(status.load_progress)
        worker.load_finished.connect(self._on_load_finished)
        worker.load_failed.connect(self._on_load_failed)
        worker.engine_released.connect(self._on_engine_released)
        worker.costs.updated.connect(self._on_costs_updated)
        training.head_attached.connect(self._on_head_attached)

    def is_loading(self) -> bool:
        return self._loading_selection is not None

    def load_models(self, selection: ModelSelection, *, force: bool = False) -> None:
        """Loads in the background. The pair in use stays until the new one is ready, except on the CPU or
        when both would not fit: then the worker releases it first (engine_released) and brings it back
        if the new pair fails."""
        self._loading_selection = selection
        self.status.load_started("Checking tokenizers…")
        self._ready_changed()
        self.worker.load_requested.emit(load_request_for(selection, force=force))

    def open_model_dialog(self, attach_check: Callable[[ModelDialog], None],
                          use_remote: Callable[[RemoteChoice], None] | None = None) -> None:
        choice = choose_models(self.selection, self.notices, attach_check, use_remote)
        if choice is not None:
            self.load_models(choice[0], force=choice[1])

    def open_train_dialog(self):
        """The "Train a draft head" dialog for the loaded target (None when no target is loaded yet)."""
        info = self.session.info
        if info is None:
            self.notices.info("Train a draft head", "Load a target first: File ▸ Load models…")
            return None
        if info.runtime == "remote":
            self.notices.info("Train a draft head", "Training a draft head needs the target loaded on this "
                              "machine; the chat uses a remote server now. Load local models first: "
                              "File ▸ Load models… (leave “Remote server” unchecked).")
            return None
        if info.runtime != "torch":  # a head reads the target's hidden states; llama.cpp gives none
            self.offer_torch(info)
            return None
        return self.training.open(info, self.notices.parent)

    def offer_torch(self, info: ModelInfo) -> bool:
        """Asks to reload the pair on torch, saying what that costs here; on Yes loads it, and the head's dialog
        opens once it is ready. False when the person kept llama.cpp."""
        torch_selection = replace(self.selection, runtime="torch")
        plans = []
        for selection in (self.selection, torch_selection):
            try:
                plans.append(plan_for(selection))
            except EngineError:
                plans.append(None)
        if not self.ask_switch(switch_cost(info, plans[0], plans[1])):
            return False
        self._train_after_load = True
        self.load_models(torch_selection)
        return True

    def ask_switch(self, text: str) -> bool:
        """The question of offer_torch (a dialog; tests replace it)."""
        return self.notices.choose("Train a draft head", text, "Switch to torch")

    # --- the worker's signals --------------------------------------------------------------------

    def _on_load_started(self, _request: LoadSpec) -> None:
        self.status.load_started()

    def _on_load_finished(self, info: ModelInfo) -> None:
        self.session.info = info
        if self._loading_selection is not None:
            self.selection = self._loading_selection
            self.settings.set_models(self.selection)
        self._loading_selection = None
        self.status.load_ended("Ready")
        names = info.target_name + (f" + {info.draft_name}" if info.draft_name else " (no draft)")
        self.status.show_pair(info, names)
        self.status.show_costs(info, None)
        self.panel.set_draft_available(info.draft_name is not None, head=info.head_name is not None)
        self.context.set_counter(counter_for(self.worker.engine))
        self._recount()
        note = f" {info.fast_path_note}." if info.fast_path_note else ""
        self.chat.add_system_note(f"Loaded {names} on {device_line(info)}.{note}")
        if info.runtime_note:
            self.chat.add_system_note(f"Running on torch: {info.runtime_note}.")
        self._ready_changed()
        self.status.update_memory()
        # torch + transformers + the models are ~10^6 long-lived objects; a full collection walking
        # them stalls the UI for 100+ ms mid-stream. Collect once now, then exempt them.
        gc.collect()
        gc.freeze()
        self.loaded.emit(info)
        if self._train_after_load:
            self._train_after_load = False
            if info.runtime == "torch":
                self.training.open(info, self.notices.parent)

    def _on_engine_released(self, note: str) -> None:
        # The old pair is gone while the new one loads (on the CPU, or both would not fit). Its
        # tokenizer, held here for counting context, goes too: drafts are estimated meanwhile.
        self.session.info = None
        self.context.set_counter(counter_for(None))
        self.status.show_pair(None)
        self.chat.add_system_note(note)
        self._ready_changed()

    def _on_load_failed(self, message: str) -> None:
        self._loading_selection = None
        self._train_after_load = False
        self.status.load_ended("Load failed" + ("; still using the previous models" if self.session.info else ""))
        self._ready_changed()
        if not self._closed():
            self.notices.error("Could not load the models", message)
        self.load_failed.emit(message)

    def _on_costs_updated(self, info: ModelInfo) -> None:
        # The worker measured the forward costs again after Ready (app/ui/cost_refresh.py): same pair.
        if self.session.info is None or self.is_loading():
            return
        self.session.info = info
        self.status.show_costs(info, None)

    def _on_head_attached(self, info: ModelInfo) -> None:
        self.session.info = info
        self.panel.set_draft_available(info.draft_name is not None, head=info.head_name is not None)
        self.chat.add_system_note(f"Draft head ready: {info.head_name} ({info.head_ms:.2f} ms per draft token). "
                                  "Auto mode weighs it every step; choose the proposer “Draft head” to use "
                                  "it always.")
