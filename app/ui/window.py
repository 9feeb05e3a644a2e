"""The main window: wires the engine worker to the chat, charts, settings panel, menus and status bar."""
from __future__ import annotations

import gc
import logging
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import QByteArray, QSignalBlocker, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QActionGroup, QCloseEvent, QKeySequence
from PySide6.QtWidgets import (
    QFileDialog,
    QFrame,
    QLabel,
    QMainWindow,
    QMessageBox,
    QProgressBar,
    QScrollArea,
    QSplitter,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.ui.check import CheckLink
from app.ui.context import ContextCounter, ContextGuard, ask_overflow, counter_for
from app.core.conversations import ConversationStore, default_folder
from app.ui.conversations import ConversationsController
from app.core.export import write_session_csv, write_trace_csv
from app.ui.race import RaceController
from app.core.session import (
    ChatSession,
    answer_header,
    cost_verdict,
    device_line,
    load_request_for,
    plan_for,
)
from app.ui.settings import AppSettings
from app.ui.training import HeadTrainingController
from app.ui.tune import TuneController
from app.ui.worker import EngineFactory, HeadTrainer, WorkerHost, default_engine_factory, default_head_trainer
from engine.loadspec import LoadSpec
from engine.measure.diagnostics import AnswerFacts, category_speedups
from engine.measure.explain import describe_decision
from engine.settings import GenerationSettings, ModelSelection
from engine.types import Message, ModelInfo, Step, Summary
from widgets.charts import LiveCharts
from widgets.chat.view import ChatView
from widgets.context_meter import ContextMeter
from widgets.chat.conversation_list import ConversationList
from widgets.legend import Legend
from widgets.model_dialog import ModelDialog
from widgets.chat.prompt_box import PromptBox
from widgets.race.view import RaceView
from widgets.settings_panel import DisplaySettings, SettingsPanel
from widgets.stats_line import format_stats_line
from widgets.theme import ThemeManager
from widgets.tune.view import TuneView

log = logging.getLogger(__name__)

APP_NAME = "SpecDec Studio"
DEFAULT_SIZE = (1480, 900)
DEFAULT_SPLITTER = [290, 780, 410]  # settings | chat | charts
DEFAULT_SIDEBAR = 230  # the conversations sidebar, left of everything
MEMORY_REFRESH_MS = 2000
_NOT_READY = "Models are loading; Send is enabled once they are ready."
_NO_MODEL = "No model loaded: File ▸ Load models… (Ctrl+L)."


def _open_store() -> ConversationStore | None:
    """The user's conversations folder; without one (a read-only home) the app still works, unsaved."""
    try:
        return ConversationStore(default_folder())
    except OSError as e:
        log.warning("conversations will not be saved: %s", e)
        return None


class MainWindow(QMainWindow):
    """SpecDec Studio: a view of a ChatSession (the conversation and its requests); the models live in the worker.

    Its own signals fire on the UI thread after the window has handled the worker's (for tests and plugins).
    """

    models_loaded = Signal(object)  # ModelInfo now in use
    models_load_failed = Signal(str)  # the message shown; the previous pair stays in use
    answer_finished = Signal(int, object)  # request_id, Summary (stop included)
    answer_failed = Signal(int, str)  # request_id, message

    def __init__(
        self,
        *,
        engine_factory: EngineFactory = default_engine_factory,
        settings: AppSettings | None = None,
        store: ConversationStore | None = None,
        head_trainer: HeadTrainer = default_head_trainer,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle(APP_NAME)
        self.settings = settings or AppSettings()
        self.host = WorkerHost(engine_factory, self, head_trainer=head_trainer)
        self.worker = self.host.worker
        self.session = ChatSession(store or _open_store(), on_save_error=self._on_save_error_thread)
        self.selection = self.settings.models()  # what was last loaded successfully (or asked for)
        self._loading_selection: ModelSelection | None = None
        self._closed = False
        self._sizes_with_charts: list[int] = []

        self.themes = ThemeManager(self.settings.theme(), self)
        self.themes.apply(force=True)  # cheap when the app already has this theme's palette and stylesheet
        self.context = ContextCounter(self)  # counts off the UI thread; ContextGuard decides what to do
        self._build_ui()
        self._build_menus()
        self._build_status_bar()
        self._connect_worker()
        # The race shares the worker and the request-id counter, and takes the panel's settings.
        self.race = RaceController(
            self.worker, self.race_view, next_request_id=self.session.allocate_request_id,
            current_settings=self.panel.values,
            parent=self,
        )
        self.race.running_changed.connect(lambda _running: self._set_ready_state())
        self.race.race_finished.connect(lambda _summary: self._update_evidence())
        # The Tune tab sweeps through the same worker; Apply puts a configuration into the panel.
        self.tune = TuneController(
            self.worker, self.tune_view, current_settings=self.panel.values, apply_settings=self._apply_settings,
            info=lambda: self.info, parent=self,
        )
        self.tune.running_changed.connect(lambda _running: self._set_ready_state())
        self.training = HeadTrainingController(
            self.worker, next_request_id=self.session.allocate_request_id,
            target_spec=lambda: self.selection.target.spec(), parent=self,
        )
        self.training.running_changed.connect(lambda _running: self._set_ready_state())
        self.training.head_attached.connect(self._on_head_attached)
        self.check_link = CheckLink(self.worker, loaded=lambda: self.selection, current_settings=self.panel.values,
                                    apply_settings=self._apply_settings, parent=self)
        self._restore_saved()
        self.conversations = ConversationsController(self)
        self.guard = ContextGuard(self)
        self._apply_stored("window layout", self._restore_layout)
        self._set_ready_state()
        self.guard.update()

        self._memory_timer = QTimer(self)
        self._memory_timer.setInterval(MEMORY_REFRESH_MS)
        self._memory_timer.timeout.connect(self._update_memory)
        self._memory_timer.start()
        self._update_memory()

    # --- construction ---------------------------------------------------------------------------

    def _build_ui(self) -> None:
        self.panel = SettingsPanel()
        panel_scroll = QScrollArea()
        panel_scroll.setObjectName("settingsScroll")
        panel_scroll.setWidgetResizable(True)
        panel_scroll.setFrameShape(QFrame.Shape.NoFrame)
        panel_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        panel_scroll.setWidget(self.panel)
        panel_scroll.setMinimumWidth(240)

        centre = QWidget()
        centre.setObjectName("chatColumn")
        column = QVBoxLayout(centre)
        column.setContentsMargins(8, 8, 8, 8)
        column.setSpacing(8)
        self.legend = Legend(centre)
        column.addWidget(self.legend)
        self.chat = ChatView(centre)
        column.addWidget(self.chat, 1)
        self.prompt = PromptBox(centre)
        column.addWidget(self.prompt)
        self.context_meter = ContextMeter(centre)
        column.addWidget(self.context_meter)

        self.charts = LiveCharts()
        self.charts.setMinimumWidth(280)

        self.splitter = QSplitter(Qt.Orientation.Horizontal, self)
        self.splitter.setObjectName("mainSplitter")
        self.splitter.addWidget(panel_scroll)
        self.splitter.addWidget(centre)
        self.splitter.addWidget(self.charts)
        self.splitter.setChildrenCollapsible(False)
        self.splitter.setStretchFactor(0, 0)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setStretchFactor(2, 0)
        self.race_view = RaceView()
        self.tune_view = TuneView()
        self.tabs = QTabWidget(self)
        self.tabs.setObjectName("mainTabs")
        self.tabs.setDocumentMode(True)
        self.sidebar = ConversationList()
        self.sidebar.setMinimumWidth(170)
        self.outer = QSplitter(Qt.Orientation.Horizontal, self)
        self.outer.setObjectName("outerSplitter")
        self.outer.addWidget(self.sidebar)
        self.outer.addWidget(self.splitter)
        self.outer.setChildrenCollapsible(False)
        self.outer.setStretchFactor(0, 0)
        self.outer.setStretchFactor(1, 1)
        self.tabs.addTab(self.outer, "Chat")
        self.tabs.addTab(self.race_view, "Race: standard vs speculative")
        self.tabs.addTab(self.tune_view, "Tune")
        self.setCentralWidget(self.tabs)

        self.prompt.send_requested.connect(self.send)
        self.prompt.stop_requested.connect(self.stop)
        self.chat.regenerate_requested.connect(self.regenerate)
        self.chat.edit_submitted.connect(self.edit_and_resend)
        self.chat.branch_requested.connect(self.show_branch)
        self.panel.settings_changed.connect(self._on_settings_changed)
        self.themes.changed.connect(self._on_theme_changed)
        self.panel.display_changed.connect(self._on_display_changed)

    def _build_menus(self) -> None:
        bar = self.menuBar()

        def action(menu, text: str, slot, shortcut: QKeySequence | str | None = None,
                   checkable: bool = False) -> QAction:
            act = QAction(text, self)
            if shortcut is not None:
                act.setShortcut(QKeySequence(shortcut))
            act.setCheckable(checkable)
            (act.toggled if checkable else act.triggered).connect(slot)
            menu.addAction(act)
            return act

        file_menu = bar.addMenu("&File")
        self.load_action = action(file_menu, "&Load models…", self.open_model_dialog, "Ctrl+L")
        self.train_head_action = action(file_menu, "&Train a draft head…", self.open_train_dialog)
        file_menu.addSeparator()
        self.export_action = action(file_menu, "&Export session CSV…", lambda: self.export_session(), "Ctrl+E")
        self.export_trace_action = action(file_menu, "Export step &trace CSV…", lambda: self.export_trace())
        self.export_md_action = action(file_menu, "Export conversation as &Markdown…",
                                       lambda: self.conversations.export(None, "markdown"))
        self.export_json_action = action(file_menu, "Export conversation as &JSON…",
                                         lambda: self.conversations.export(None, "json"))
        file_menu.addSeparator()
        self.quit_action = action(file_menu, "&Quit", self.close, QKeySequence.StandardKey.Quit)
        self.quit_action.setShortcut(QKeySequence("Ctrl+Q"))

        chat_menu = bar.addMenu("&Chat")
        self.new_chat_action = action(chat_menu, "&New chat", self.new_chat, "Ctrl+N")
        self.regenerate_action = action(chat_menu, "&Regenerate", self.regenerate, "Ctrl+R")
        self.stop_action = action(chat_menu, "&Stop", self.stop, "Esc")

        view_menu = bar.addMenu("&View")
        self.colouring_action = action(view_menu, "&Colour tokens", self._on_colouring_toggled, checkable=True)
        self.ghosts_action = action(view_menu, "Show rejected &ghosts", self._on_ghosts_toggled, checkable=True)
        self.charts_action = action(view_menu, "C&harts", self._on_charts_toggled, checkable=True)
        self.markdown_action = action(view_menu, "&Format finished answers (markdown)", self._on_markdown_toggled,
                                      "Ctrl+M", checkable=True)
        theme_menu = view_menu.addMenu("&Theme")
        self.theme_actions: dict[str, QAction] = {}
        group = QActionGroup(self)
        for name, label in (("system", "Follow the &system"), ("light", "&Light"), ("dark", "&Dark")):
            act = action(theme_menu, label, lambda on, n=name: on and self.set_theme(n), checkable=True)
            group.addAction(act)
            self.theme_actions[name] = act
        with QSignalBlocker(self.theme_actions[self.themes.preference()]):
            self.theme_actions[self.themes.preference()].setChecked(True)

        help_menu = bar.addMenu("&Help")
        action(help_menu, "&About SpecDec Studio", self._about)

    def _build_status_bar(self) -> None:
        status = self.statusBar()
        self.model_label = QLabel("No model")
        self.device_label = QLabel("")
        self.memory_label = QLabel("")
        self.cost_label = QLabel("")  # the cost model's verdict: does speculation pay on this machine?
        self.decision_label = QLabel("")  # what the K controller decides now, and why
        self.load_label = QLabel("")
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
        status.addPermanentWidget(self.decision_label)
        status.addPermanentWidget(self.cost_label)
        status.addPermanentWidget(self.device_label)
        status.addPermanentWidget(self.memory_label)

    def _connect_worker(self) -> None:
        # The worker lives on its own thread: these are queued connections, run on the UI thread.
        w = self.worker
        w.load_started.connect(self._on_load_started)
        w.load_progress.connect(self._on_load_progress)
        w.load_finished.connect(self._on_load_finished)
        w.load_failed.connect(self._on_load_failed)
        w.engine_released.connect(self._on_engine_released)
        w.steps.connect(self._on_steps)
        w.generation_finished.connect(self._on_generation_finished)
        w.generation_failed.connect(self._on_generation_failed)

    def _restore_saved(self) -> None:
        """Applies the stored generation, display and markdown settings (the layout comes once the view is built)."""
        self._apply_stored("generation settings", lambda: self.panel.set_values(self.settings.generation()))
        self._apply_stored("display settings", lambda: self.panel.set_display(self.settings.display()))
        self._apply_display(self.panel.display())
        self._apply_stored("markdown setting", self._restore_markdown)

    def _restore_markdown(self) -> None:
        on = self.settings.render_markdown()
        self.chat.set_render_markdown(on)
        self.markdown_action.setChecked(on)

    def _apply_stored(self, what: str, apply: Callable[[], object]) -> None:
        """AppSettings validates every value; should one still fail to apply, it is dropped with a
        warning: a settings file must never stop the app."""
        try:
            apply()
        except Exception:
            log.exception("ignoring stored %s that could not be applied", what)

    def _restore_layout(self) -> None:
        geometry = self.settings.geometry()
        if geometry is None or not self.restoreGeometry(geometry):
            self.resize(*DEFAULT_SIZE)
        sizes = self.settings.splitter_sizes() or DEFAULT_SPLITTER
        sidebar = self.settings.sidebar_width() or DEFAULT_SIDEBAR
        self.outer.setSizes([sidebar, max(400, self.width() - sidebar)])
        self.splitter.setSizes(sizes)
        self._sizes_with_charts = sizes
        visible = self.settings.charts_visible()
        self.charts.setVisible(visible)
        self.charts_action.setChecked(visible)

    # --- models ---------------------------------------------------------------------------------

    def load_models(self, selection: ModelSelection, *, force: bool = False) -> None:
        """Loads in the background. The pair in use stays until the new one is ready, except on the CPU or
        when both would not fit: then the worker releases it first (engine_released) and brings it back
        if the new pair fails."""
        self._loading_selection = selection
        self.load_label.setText("Checking tokenizers…")
        self.load_bar.setValue(0)
        self.load_bar.show()
        self._set_ready_state()
        self.worker.load_requested.emit(load_request_for(selection, force=force))

    def open_model_dialog(self) -> None:
        from engine.models.presets import pair_presets

        dialog = ModelDialog(self.selection, self, planner=plan_for, presets=pair_presets())
        self.check_link.attach(dialog)
        if dialog.exec() != ModelDialog.DialogCode.Accepted:
            return
        selection = dialog.selection()
        plan = dialog.plan
        force = False
        if plan is not None and not plan.fits:
            force = self._confirm_load_anyway(plan)
            if not force:
                return
        self.load_models(selection, force=force)

    def _confirm_load_anyway(self, plan) -> bool:
        """Asks before loading what the memory plan says will not fit."""
        worst = max(plan.devices, key=lambda d: d.total - (d.capacity or 0))
        change = f"\n\nCheapest change that fits: {plan.suggestion.description}." if plan.suggestion else ""
        answer = QMessageBox.question(
            self, "The models will not fit",
            f"The memory plan needs {worst.total / 2**30:.1f} GiB on {worst.device}, which has "
            f"{(worst.capacity or 0) / 2**30:.1f} GiB.{change}\n\nLoad anyway? It will probably run out of memory.",
            QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No, QMessageBox.StandardButton.No,
        )
        return answer == QMessageBox.StandardButton.Yes

    def open_train_dialog(self):
        """The "Train a draft head" dialog for the loaded target (None when no target is loaded yet)."""
        if self.info is None:
            self._show_info("Train a draft head", "Load a target first: File ▸ Load models…")
            return None
        if self.info.runtime != "torch":  # a head reads the target's hidden states; llama.cpp gives none
            self._show_info("Train a draft head", "A draft head reads the target's hidden states, which the "
                            f"{self.info.fast_path} runtime does not give: load the models with Runtime "
                            "torch (File ▸ Load models…) to train and use one.")
            return None
        return self.training.open(self.info, self)

    def _on_head_attached(self, info: ModelInfo) -> None:
        self.session.info = info
        self.panel.set_draft_available(info.draft_name is not None, head=info.head_name is not None)
        self.chat.add_system_note(f"Draft head ready: {info.head_name} ({info.head_ms:.2f} ms per draft token). "
                                  "Auto mode weighs it every step; choose the proposer “Draft head” to use "
                                  "it always.")

    def is_loading(self) -> bool:
        return self._loading_selection is not None

    def _on_load_started(self, _request: LoadSpec) -> None:
        self.load_bar.show()

    def _on_load_progress(self, progress) -> None:
        stage = str(getattr(progress, "stage", "")).capitalize()
        fraction = float(getattr(progress, "fraction", 0.0))
        message = str(getattr(progress, "message", ""))
        self.load_bar.setValue(round(100 * fraction))
        self.load_bar.setFormat(f"{stage} %p%")
        self.load_label.setText(message)

    @property
    def info(self) -> ModelInfo | None:
        """The pair in use (None before the first load)."""
        return self.session.info

    @property
    def active_request(self) -> int | None:
        return self.session.active_request

    @property
    def records(self):
        return self.session.records

    def _on_load_finished(self, info: ModelInfo) -> None:
        self.session.info = info
        if self._loading_selection is not None:
            self.selection = self._loading_selection
            self.settings.set_models(self.selection)
        self._loading_selection = None
        self.load_bar.hide()
        self.load_label.setText("Ready")
        names = info.target_name + (f" + {info.draft_name}" if info.draft_name else " (no draft)")
        self.model_label.setText(names)
        self.device_label.setText(device_line(info))
        self.device_label.setToolTip("\n".join(n for n in (info.fast_path_note, info.runtime_note) if n))
        self._show_costs(info, None)
        self.panel.set_draft_available(info.draft_name is not None, head=info.head_name is not None)
        self.context.set_counter(counter_for(self.worker.engine))
        self.guard.update(now=True)
        note = f" {info.fast_path_note}." if info.fast_path_note else ""
        self.chat.add_system_note(f"Loaded {names} on {device_line(info)}.{note}")
        if info.runtime_note:
            self.chat.add_system_note(f"Running on torch: {info.runtime_note}.")
        self._set_ready_state()
        self._update_memory()
        # torch + transformers + the models are ~10^6 long-lived objects; a full collection walking
        # them stalls the UI for 100+ ms mid-stream. Collect once now, then exempt them.
        gc.collect()
        gc.freeze()
        self.models_loaded.emit(info)

    def _on_engine_released(self, note: str) -> None:
        # The old pair is gone while the new one loads (on the CPU, or both would not fit). Its
        # tokenizer, held here for counting context, goes too: drafts are estimated meanwhile.
        self.session.info = None
        self.context.set_counter(counter_for(None))
        self.model_label.setText("No model")
        self.chat.add_system_note(note)
        self._set_ready_state()

    def _on_load_failed(self, message: str) -> None:
        self._loading_selection = None
        self.load_bar.hide()
        self.load_label.setText("Load failed" + ("; still using the previous models" if self.info else ""))
        self._set_ready_state()
        if not self._closed:
            self._show_error("Could not load the models", message)
        self.models_load_failed.emit(message)

    # --- chat -----------------------------------------------------------------------------------

    def send(self, text: str) -> int | None:
        """Adds a question and asks for the answer; returns the request id (None if not sent)."""
        text = text.strip()
        if not text or not self._can_chat():
            return None
        drop = self.guard.room_for(text)
        if drop is None:
            self.prompt.set_text(text)  # nothing is lost: the question goes back into the box
            return None
        return self._submit(self.session.send(text, self.panel.values(), drop))

    def regenerate(self, request_id: int | None = None) -> int | None:
        """A new version of an answer (the last one by default); the old one stays as another version."""
        if not self._can_chat():
            return None
        turn = self.conversations.bubble_turn.get(request_id) if request_id is not None else None
        started = self.session.regenerate(self.panel.values(), turn, self.guard.drop_count())
        return self._submit(started[0]) if started is not None else None

    def edit_and_resend(self, turn_id: str, text: str) -> int | None:
        """The edited question replaces the old one on a new branch, and is answered."""
        if not self._can_chat() or turn_id not in self.session.conversation.turns:
            return None
        return self._submit(self.session.edit(turn_id, text, self.panel.values(), self.guard.drop_count()))

    def show_branch(self, turn_id: str, delta: int) -> None:
        """Shows the previous / next version of a message (not while an answer streams)."""
        if self.active_request is not None or turn_id not in self.session.conversation.turns:
            return
        self.session.switch(turn_id, delta)
        self.conversations.sync_chat()
        self._set_ready_state()
        self.guard.update()

    def new_chat(self) -> None:
        self._leave(self.session.new_chat())
        self.conversations.refresh()
        self._set_ready_state()
        self.guard.update()

    def open_conversation(self, conversation_id: str) -> bool:
        """Shows a saved conversation; False (and one line saying why) if it cannot be read."""
        if conversation_id == self.session.conversation.id:
            return True
        try:
            streaming = self.session.open(conversation_id)
        except (OSError, ValueError) as e:
            self._show_error("Could not open the conversation", f"{e}. The other conversations are not affected.")
            self.conversations.refresh()
            return False
        self._leave(streaming)
        self.conversations.sync_chat()
        self.conversations.refresh()
        self._set_ready_state()
        self.guard.update()
        return True

    def stop(self) -> None:
        if self.active_request is not None:
            self.worker.stop(self.active_request)

    def history(self) -> list[Message]:
        return self.session.history

    def messages_for_request(self) -> tuple[Message, ...]:
        return self.session.messages_for(self.panel.values(), self.guard.drop_count())

    def allocate_request_id(self) -> int:
        """One counter for chat and race: the worker cancels by id, so ids must never repeat."""
        return self.session.allocate_request_id()

    def _leave(self, streaming: int | None) -> None:
        # The shown conversation changed: a streaming answer is stopped (it is saved to its own conversation).
        if streaming is not None:
            self.worker.stop(streaming)
        self.chat.clear()
        self.conversations.bubble_turn.clear()
        self.charts.reset()

    def _can_chat(self) -> bool:
        return (self.active_request is None and self.info is not None and not self.is_loading()
                and not self.race.running and not self.tune.running)

    def _submit(self, request) -> int:
        rid = request.request_id
        turn_id = self.session.turn_of(rid)
        self.conversations.sync_chat(until=turn_id)  # the question (and a fork) shown, then the new answer's bubble
        siblings = self.session.conversation.siblings(turn_id) if turn_id else []
        self.conversations.bubble_turn[rid] = turn_id or ""
        self.chat.begin_assistant_message(rid, answer_header(request, self.info), turn_id or "",
                                          (max(0, len(siblings) - 1), max(1, len(siblings))))
        self.charts.reset()
        self._set_ready_state()
        self.conversations.touch_current()
        self.worker.generate_requested.emit(request)
        return rid

    def _on_steps(self, request_id: int, steps: tuple[Step, ...]) -> None:
        # The hot path: one edit block in one bubble, ring-buffer appends for the charts (drawn by their timer).
        if not self.session.add_steps(request_id, steps):
            return
        self.chat.append_steps(request_id, steps)
        if request_id == self.active_request:
            self.charts.push_steps(steps)
            decision = steps[-1].decision
            if decision is not None and decision.reason not in ("fixed", "standard"):
                self.decision_label.setText(describe_decision(decision))

    def _on_generation_finished(self, request_id: int, summary: Summary) -> None:
        request = self.session.request(request_id)
        if request is None:
            return
        self.chat.finish_assistant_message(request_id, summary,
                                           self.check_link.annotate(format_stats_line(summary, request), summary, request))
        record = self.session.finish(request_id, summary)
        if summary.mode == "speculative" and request.proposer in ("draft", "head") and record is not None:
            self._show_costs(record.info, summary, request.proposer)
        if summary.decision is not None and summary.decision.reason not in ("fixed", "standard"):
            self.decision_label.setText(describe_decision(summary.decision))
        self._update_evidence()
        self._set_ready_state()
        self.conversations.touch_current()
        self.guard.update()
        self.answer_finished.emit(request_id, summary)

    def _on_generation_failed(self, request_id: int, message: str) -> None:
        if not self.session.fail(request_id, message):
            return
        self.chat.fail_assistant_message(request_id, message)
        self._set_ready_state()
        self.answer_failed.emit(request_id, message)

    def _set_ready_state(self) -> None:
        generating = self.active_request is not None
        racing = self.race.running or self.tune.running
        self.prompt.set_generating(generating)
        if self.is_loading():
            self.prompt.set_ready(False, _NOT_READY)
        elif self.info is None:
            self.prompt.set_ready(False, _NO_MODEL)
        elif self.tune.running:
            self.prompt.set_ready(False, "A sweep is running in the Tune tab")
        elif racing:
            self.prompt.set_ready(False, "A race is running in the Race tab")
        elif self.training.running:
            self.prompt.set_ready(False, "A draft head is training (cancel it in its window)")
        else:
            self.prompt.set_ready(True)
        can_chat = not generating and self.info is not None and not self.is_loading() and not self.training.running
        reason = (_NOT_READY if self.is_loading() else _NO_MODEL if self.info is None
                  else "A draft head is training" if self.training.running else "An answer is streaming in the chat")
        self.race_view.set_race_enabled(can_chat and not self.tune.running,
                                        "A sweep is running in the Tune tab" if self.tune.running else reason)
        self.tune_view.set_enabled(can_chat and not self.race.running,
                                   "A race is running in the Race tab" if self.race.running else reason)
        self.stop_action.setEnabled(generating)
        self.chat.set_busy(generating)
        self.regenerate_action.setEnabled(can_chat and not racing and self.session.can_regenerate())
        self.load_action.setEnabled(not self.is_loading() and not self.training.running)
        self.train_head_action.setEnabled(self.info is not None and not self.is_loading())

    # --- settings and view ----------------------------------------------------------------------

    def _on_settings_changed(self, settings: GenerationSettings) -> None:
        self.settings.set_generation(settings)
        self.guard.update()  # the system prompt and K change what a request needs
        self._update_evidence()

    def _apply_settings(self, settings: GenerationSettings) -> None:
        """From the Tune tab: the panel shows (and the next answer uses) a measured configuration."""
        self.panel.set_values(settings)
        self._on_settings_changed(self.panel.values())

    def _update_evidence(self) -> None:
        """Everything this session measured, for the Tune tab's diagnoses."""
        answers = tuple(AnswerFacts(r.request.mode, r.request.proposer, r.request.k, r.request.sampling.temperature,
                                    r.summary) for r in self.records if r.summary.new_tokens)
        categories = category_speedups((r.category, r.standard.tokens_per_s, r.speculative.tokens_per_s)
                                       for r in self.race.results if r.category != "custom")
        changes: dict[str, object] = {"answers": answers}
        if len(categories) > 1:  # one category alone says nothing about where speculation loses
            changes["categories"] = categories
        self.tune.update_evidence(**changes)

    def ask_overflow(self, count) -> str:
        """"new", "drop" or "cancel" when the conversation no longer fits (a dialog; tests replace it)."""
        return ask_overflow(self, count)

    # --- theme and formatting ---------------------------------------------------------------------

    def set_theme(self, preference: str) -> None:
        """"system", "light" or "dark"; remembered."""
        self.themes.set_preference(preference)
        self.settings.set_theme(preference)
        with QSignalBlocker(self.theme_actions[preference]):
            self.theme_actions[preference].setChecked(True)

    def _on_theme_changed(self, _theme: str) -> None:
        self.chat.refresh_theme()
        self.tune_view.refresh_theme()
        self.charts.refresh_theme()
        self.legend.refresh_palette()
        self.race_view.refresh_theme()

    def _on_markdown_toggled(self, on: bool) -> None:
        self.chat.set_render_markdown(on)
        self.settings.set_render_markdown(on)

    def _on_save_error_thread(self, _conversation_id: str, message: str) -> None:
        # Called on the writer thread: a queued single-shot brings it to the UI thread.
        QTimer.singleShot(0, self, lambda: self.statusBar().showMessage(
            f"Could not save the conversation: {message}. It stays open; the next change tries again.", 10000))

    def _on_display_changed(self, display: DisplaySettings) -> None:
        self._apply_display(display)
        self.settings.set_display(display)

    def _apply_display(self, display: DisplaySettings) -> None:
        for view in (self.chat, self.race_view):
            view.set_colouring(display.colouring)
            view.set_show_rejected(display.show_rejected)
        for act, on in ((self.colouring_action, display.colouring), (self.ghosts_action, display.show_rejected)):
            act.blockSignals(True)  # the panel is the source here; do not echo back into it
            act.setChecked(on)
            act.blockSignals(False)
        self.legend.set_visible_statuses(
            [s for s in ("accepted", "rejected", "corrected", "bonus", "target")
             if s != "rejected" or display.show_rejected]
        )

    def _on_colouring_toggled(self, on: bool) -> None:
        self.panel.set_display(replace(self.panel.display(), colouring=on))
        self._on_display_changed(self.panel.display())

    def _on_ghosts_toggled(self, on: bool) -> None:
        self.panel.set_display(replace(self.panel.display(), show_rejected=on))
        self._on_display_changed(self.panel.display())

    def _on_charts_toggled(self, on: bool) -> None:
        if not on:
            self._sizes_with_charts = self.splitter.sizes()
        self.charts.setVisible(on)
        if on and self._sizes_with_charts:
            self.splitter.setSizes(self._sizes_with_charts)
        self.settings.set_charts_visible(on)

    def _splitter_sizes(self) -> list[int]:
        # With the charts hidden, remember the layout they had, so showing them again restores it.
        return self.splitter.sizes() if self.charts_action.isChecked() or not self._sizes_with_charts \
            else self._sizes_with_charts

    # --- export ---------------------------------------------------------------------------------

    def export_session(self, path: str | None = None) -> bool:
        """Writes one row per answer; asks for a file when `path` is None. False if nothing was written."""
        return self._export(path, "Export session CSV", "specdec-session.csv", write_session_csv)

    def export_trace(self, path: str | None = None) -> bool:
        """Writes one row per decoding step of every answer."""
        return self._export(path, "Export step trace CSV", "specdec-steps.csv", write_trace_csv)

    def _export(self, path: str | None, title: str, default_name: str, write) -> bool:
        if not self.records:
            self._show_info(title, "Nothing to export yet: generate an answer first.")
            return False
        if path is None:
            path, _ = QFileDialog.getSaveFileName(self, title, str(Path.home() / default_name),
                                                  "CSV files (*.csv);;All files (*)")
            if not path:
                return False
        try:
            rows = write(path, self.records)
        except OSError as e:
            reason = e.strerror or str(e)
            log.warning("export to %s failed: %s", path, e)
            self._show_error("Export failed", f"Could not write {path}: {reason}. The session is kept; "
                                              "choose another location.")
            return False
        self.statusBar().showMessage(f"Exported {rows} rows to {path}", 5000)
        return True

    # --- status, dialogs, close -----------------------------------------------------------------

    def _update_memory(self) -> None:
        # torch only if the engine already imported it: the status bar never pays for a torch import.
        torch = sys.modules.get("torch")
        try:
            if torch is not None and self.info is not None and self.info.device.startswith("cuda"):
                # Every GPU of a split target (or cuda:1 alone), not whichever device is current.
                devices = self.info.devices or (self.info.device,)
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
        if full != getattr(self, "_memory_full", False):
            self._memory_full = full
            self.tune.update_evidence(memory_used=used, memory_total_gib=total_gib)

    def _show_costs(self, info: ModelInfo | None, summary: Summary | None, proposer: str = "draft") -> None:
        short, full = cost_verdict(info, summary, proposer)
        self.cost_label.setText(short)
        self.cost_label.setToolTip(full)

    def _show_error(self, title: str, message: str) -> None:
        QMessageBox.critical(self, title, message)

    def _show_info(self, title: str, message: str) -> None:
        QMessageBox.information(self, title, message)

    def _about(self) -> None:
        QMessageBox.about(
            self, f"About {APP_NAME}",
            f"<b>{APP_NAME}</b><p>Speculative decoding you can watch: a small draft model proposes K tokens, "
            "the target verifies them in one forward, and the output is exactly the target's.</p>"
            "<p>Green: accepted draft tokens · red, struck: rejected drafts · amber: the target's correction · "
            "blue: the bonus token · violet: standard decoding.</p>",
        )

    def save_state(self) -> None:
        self.settings.set_generation(self.panel.values())
        self.settings.set_display(self.panel.display())
        self.settings.set_geometry(QByteArray(self.saveGeometry()))
        self.settings.set_splitter_sizes(self._splitter_sizes())
        self.settings.set_charts_visible(self.charts_action.isChecked())
        self.settings.set_sidebar_width(self.outer.sizes()[0])
        self.settings.sync()

    def closeEvent(self, event: QCloseEvent) -> None:
        if not self._closed:
            self._closed = True
            self.save_state()
            self._memory_timer.stop()
            self.host.shutdown()
            self.context.shutdown()
            self.conversations.shutdown()
            self.session.close()  # waits for the last save
        event.accept()
