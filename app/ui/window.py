"""The main window: builds the layout and wires the worker, the session and the controllers, each given the
widgets and callables it needs, never the window; its public names (send, load_models, …) delegate to them."""
from __future__ import annotations

import logging
from collections.abc import Callable

from PySide6.QtCore import QByteArray, Qt, QTimer, Signal
from PySide6.QtGui import QCloseEvent
from PySide6.QtWidgets import QFrame, QMainWindow, QScrollArea, QSplitter, QTabWidget, QVBoxLayout, QWidget

from app.core.conversations import ConversationStore
from app.core.session import ChatSession
from app.ui.chat import ChatController
from app.ui.check import CheckLink
from app.ui.context import ContextCounter, ContextGuard, ask_overflow
from app.ui.conversations import ConversationsController, open_store
from app.ui.exports import SessionExporter
from app.ui.help import Help
from app.ui.loading import LoadingController
from app.ui.menus import Menus
from app.ui.notices import Notices
from app.ui.panels import COLLAPSE_BELOW, DEFAULT_WIDTHS, Panel, SidePanels, scrolling
from app.ui.race import RaceController
from app.ui.remote import RemoteController
from app.ui.settings import AppSettings
from app.ui.status_bar import StatusBarController
from app.ui.training import HeadTrainingController
from app.ui.tune import TuneController
from app.ui.view_options import ViewActions, ViewOptions
from app.ui.worker import EngineFactory, HeadTrainer, WorkerHost, default_engine_factory, default_head_trainer
from engine.measure.diagnostics import AnswerFacts, category_speedups
from engine.settings import PRECISIONS, GenerationSettings, ModelSelection
from engine.types import Message, ModelInfo
from widgets.charts import LiveCharts
from widgets.chat.conversation_list import ConversationList
from widgets.chat.prompt_box import PromptBox
from widgets.chat.view import ChatView
from widgets.context_meter import ContextMeter
from widgets.legend import Legend
from widgets.race.view import RaceView
from widgets.remote_box import RemoteChoice
from widgets.settings_panel import SettingsPanel
from widgets.theme import ThemeManager
from widgets.tune.view import TuneView

log = logging.getLogger(__name__)

APP_NAME = "SpecDec Studio"
DEFAULT_SIZE = (1480, 900)
MIN_CHAT_WIDTH = 300  # the chat column never gets narrower: a message box and a readable line
_NOT_READY = "Models are loading."
_NO_MODEL = "No model loaded: File ▸ Load models… (Ctrl+L)."
_REMOTE = "{} needs local models; the chat uses a remote server now (File ▸ Load models… to load them)"


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
        self.session = ChatSession(store or open_store(), on_save_error=self._on_save_error_thread)
        self._closed = False
        self._remote_said = False  # the Race and Tune tabs say they need local models (while remote)

        self.themes = ThemeManager(self.settings.theme(), self)
        self.themes.apply(force=True)  # cheap when the app already has this theme's palette and stylesheet
        self.context = ContextCounter(self)  # counts off the UI thread; ContextGuard decides what to do
        self._build_ui()
        self._build_menus_and_status()
        self._build_controllers()
        self._restore_saved()
        self._apply_stored("window layout", self._restore_layout)
        self._set_ready_state()
        self.guard.update()
        self.status.update_memory()

    # --- construction ---------------------------------------------------------------------------

    def _build_ui(self) -> None:
        """The layout: conversations | settings | chat | charts in the Chat tab, then the Race and Tune tabs."""
        self.panel = SettingsPanel()
        panel_scroll = QScrollArea()
        panel_scroll.setObjectName("settingsScroll")
        panel_scroll.setWidgetResizable(True)
        panel_scroll.setFrameShape(QFrame.Shape.NoFrame)
        panel_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        panel_scroll.setWidget(self.panel)
        # As wide as the panel's fields need beside the scroll bar: narrower, its right edge would be cut off.
        panel_scroll.setMinimumWidth(self.panel.minimumSizeHint().width() + panel_scroll.verticalScrollBar()
                                     .sizeHint().width() + 4)
        self.settings_scroll = panel_scroll

        self.chat_column = centre = QWidget()
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

        centre.setMinimumWidth(MIN_CHAT_WIDTH)
        self.charts = LiveCharts()
        self.charts.setMinimumWidth(320)  # narrower, the plots' titles and axes no longer fit and are cut off

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
        self.sidebar.setMinimumWidth(160)
        self.outer = QSplitter(Qt.Orientation.Horizontal, self)
        self.outer.setObjectName("outerSplitter")
        self.outer.addWidget(self.sidebar)
        self.outer.addWidget(self.splitter)
        self.outer.setChildrenCollapsible(False)
        self.outer.setStretchFactor(0, 0)
        self.outer.setStretchFactor(1, 1)
        # The splitters may be narrower than their panels' minimums for a moment: a window being narrowed
        # is not held wide by panels that collapse at that width (app/ui/panels.py).
        for splitter in (self.outer, self.splitter):
            splitter.setMinimumWidth(MIN_CHAT_WIDTH)
        self.tabs.addTab(self.outer, "Chat")
        # In a window smaller than they need, the Race and Tune tabs scroll instead of holding the window large.
        self.tabs.addTab(scrolling(self.race_view), "Race: standard vs speculative")
        self.tabs.addTab(scrolling(self.tune_view), "Tune")
        self.setCentralWidget(self.tabs)

    def _build_menus_and_status(self) -> None:
        self.menus = m = Menus(self.menuBar(), self)
        a = m.actions
        self.load_action, self.train_head_action, self.quit_action = a["load"], a["train_head"], a["quit"]
        self.export_action, self.export_trace_action = a["export"], a["export_trace"]
        self.export_md_action, self.export_json_action = a["export_md"], a["export_json"]
        self.new_chat_action, self.regenerate_action, self.stop_action = a["new_chat"], a["regenerate"], a["stop"]
        self.colouring_action, self.ghosts_action = a["colouring"], a["ghosts"]
        self.charts_action, self.markdown_action, self.theme_actions = a["charts"], a["markdown"], m.theme_actions
        self.sidebar_action, self.settings_panel_action = a["sidebar"], a["settings_panel"]
        self.notices = Notices(self, self.statusBar())
        self.help = Help(self, self.notices, m.shortcuts)
        for name, slot in (("load", self.open_model_dialog), ("train_head", self.open_train_dialog),
                           ("export", lambda: self.export_session()), ("export_trace", lambda: self.export_trace()),
                           ("export_md", lambda: self.conversations.export(None, "markdown")),
                           ("export_json", lambda: self.conversations.export(None, "json")),
                           ("quit", self.close), ("new_chat", self.new_chat), ("regenerate", self.regenerate),
                           ("stop", self.stop), ("about", self.help.about), ("docs", self.help.open_docs),
                           ("shortcuts", self.help.show_shortcuts)):
            m.connect(name, slot)
        self.view_options = ViewOptions(
            self.settings, self.themes, self.panel,
            ViewActions(self.colouring_action, self.ghosts_action, self.markdown_action, self.theme_actions),
            chat=self.chat, race_view=self.race_view, tune_view=self.tune_view, charts=self.charts,
            legend=self.legend, parent=self,
        )
        self.panels = SidePanels(self, tuple(
            Panel(name, widget, splitter, index, COLLAPSE_BELOW[name], DEFAULT_WIDTHS[name])
            for name, widget, splitter, index in (("sidebar", self.sidebar, self.outer, 0),
                                                  ("settings", self.settings_scroll, self.splitter, 0),
                                                  ("charts", self.charts, self.splitter, 2))),
            {"sidebar": self.sidebar_action, "settings": self.settings_panel_action, "charts": self.charts_action},
            self.settings, parent=self)
        self.status = s = StatusBarController(self.statusBar(), info=lambda: self.info, on_memory=self._on_memory,
                                              parent=self)
        self.model_label, self.device_label, self.memory_label = s.model_label, s.device_label, s.memory_label
        self.cost_label, self.decision_label = s.cost_label, s.decision_label
        self.load_label, self.load_bar = s.load_label, s.load_bar

    def _build_controllers(self) -> None:
        """Each controller gets what it needs; the order keeps the worker's signals reaching the chat first."""
        self.check_link = CheckLink(self.worker, loaded=lambda: self.selection, info=lambda: self.info,
                                    current_settings=self.panel.values, apply_settings=self._apply_settings,
                                    parent=self)
        self.conversations = ConversationsController(self.session, self.sidebar, self.chat, self.notices,
                                                     new_chat=self.new_chat, open_conversation=self.open_conversation,
                                                     parent=self)
        self.guard = ContextGuard(self.context, self.prompt, self.context_meter, self.session,
                                  settings=self.panel.values, ask_overflow=lambda count: self.ask_overflow(count),
                                  new_chat=self.new_chat, parent=self)
        self.chat_controller = c = ChatController(
            self.worker, self.session, self.chat, self.prompt, self.charts, conversations=self.conversations,
            guard=self.guard, status=self.status, notices=self.notices, settings=self.panel.values,
            can_chat=self._can_chat, annotate=self._annotate, ready_changed=self._set_ready_state,
            evidence_changed=self._update_evidence, apply_settings=self._apply_settings,
            loading=self.is_loading, parent=self,
        )
        c.finished.connect(self.answer_finished)
        c.failed.connect(self.answer_failed)
        self.prompt.send_requested.connect(self.send)
        self.prompt.stop_requested.connect(self.stop)
        self.prompt.queue_cancelled.connect(c.cancel_queued)
        self.chat.regenerate_requested.connect(self.regenerate)
        self.chat.edit_submitted.connect(self.edit_and_resend)
        self.chat.branch_requested.connect(self.show_branch)
        self.panel.settings_changed.connect(self._on_settings_changed)
        # The race shares the worker and the request-id counter, and takes the panel's settings.
        self.race = RaceController(self.worker, self.race_view, next_request_id=self.session.allocate_request_id,
                                   current_settings=self.panel.values, info=lambda: self.info, parent=self)
        self.race.running_changed.connect(lambda _running: self._set_ready_state())
        self.race.race_finished.connect(lambda _summary: self._update_evidence())
        # The Tune tab sweeps through the same worker; Apply puts a configuration into the panel.
        self.tune = TuneController(self.worker, self.tune_view, current_settings=self.panel.values,
                                   apply_settings=self._apply_settings, info=lambda: self.info, parent=self)
        self.tune.running_changed.connect(lambda _running: self._set_ready_state())
        self.training = HeadTrainingController(self.worker, next_request_id=self.session.allocate_request_id,
                                               target_spec=lambda: self.selection.target.spec(), parent=self)
        self.training.running_changed.connect(lambda _running: self._set_ready_state())
        self.loading = LoadingController(
            self.worker, self.session, self.status, self.notices, settings=self.settings, chat=self.chat,
            panel=self.panel, context=self.context, training=self.training,
            recount=lambda: self.guard.update(now=True), ready_changed=self._set_ready_state,
            closed=lambda: self._closed, parent=self,
        )
        self.loading.loaded.connect(self.models_loaded)
        self.loading.loaded.connect(lambda _info: c.send_queued())  # a message sent while loading goes now
        self.loading.load_failed.connect(self.models_load_failed)
        self.loading.load_failed.connect(lambda _message: c.cancel_queued())  # back in the box, editable
        self.remote = RemoteController(self.worker, self.session, c, self.chat, self.charts, self.status,
                                       self.notices, settings=self.settings, ready_changed=self._set_ready_state,
                                       parent=self)
        self.exports = SessionExporter(lambda: self.records, self.notices, races=lambda: self.race.results,
                                       sweeps=lambda: self.tune.session_runs)

    def _restore_saved(self) -> None:
        """Applies the stored generation, display and markdown settings (the layout comes once the view is built)."""
        self._apply_stored("generation settings", lambda: self.panel.set_values(self.settings.generation()))
        self._apply_stored("display settings", lambda: self.panel.set_display(self.settings.display()))
        self.view_options.apply_display(self.panel.display())
        self._apply_stored("markdown setting", self.view_options.restore_markdown)

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
        widths = {"sidebar": self.settings.sidebar_width() or 0}
        sizes = self.settings.splitter_sizes()
        if sizes is not None and len(sizes) == 3:  # settings | chat | charts
            widths.update(settings=sizes[0], charts=sizes[2])
        self.panels.restore(self.settings.panels(), widths)

    def show_tab(self, view: QWidget) -> None:
        """Brings the tab showing `view` (the Chat column, the race view, the tune view) to the front."""
        while view is not None and self.tabs.indexOf(view) < 0:
            view = view.parentWidget()
        if view is not None:
            self.tabs.setCurrentWidget(view)

    # --- state read by the controllers and tests -------------------------------------------------

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

    @property
    def selection(self) -> ModelSelection:
        """What was last loaded successfully (or asked for at start)."""
        return self.loading.selection

    def is_loading(self) -> bool:
        return self.loading.is_loading()

    def history(self) -> list[Message]:
        return self.session.history

    def allocate_request_id(self) -> int:
        """One counter for chat and race: the worker cancels by id, so ids must never repeat."""
        return self.session.allocate_request_id()

    def _can_chat(self) -> bool:
        return (self.active_request is None and self.info is not None and not self.is_loading()
                and not self.race.running and not self.tune.running)

    # --- models (app/ui/loading.py) ---------------------------------------------------------------

    def load_models(self, selection: ModelSelection, *, force: bool = False) -> None:
        """Loads in the background; the pair in use stays until the new one is ready (see LoadingController)."""
        self.loading.load_models(selection, force=force)

    def open_model_dialog(self) -> None:
        from engine.models.fastquant import precision_refusals  # torch: imported with the dialog, not the window

        def attach(dialog) -> None:
            self.check_link.attach(dialog)
            self.remote.attach(dialog)
            dialog.set_refusals(precision_refusals(PRECISIONS))  # fp8 greyed where the device cannot run it

        self.loading.open_model_dialog(attach, self.use_remote)

    def use_remote(self, choice: RemoteChoice) -> None:
        """The chat streams from an OpenAI-compatible server; the local models are released (app/ui/remote.py)."""
        self.remote.use(choice)

    def open_train_dialog(self):
        """The "Train a draft head" dialog for the loaded target (None when no target is loaded yet)."""
        return self.loading.open_train_dialog()

    # --- chat (app/ui/chat.py) --------------------------------------------------------------------

    def send(self, text: str) -> int | None:
        """Adds a question and asks for the answer; returns the request id (None if not sent)."""
        return self.chat_controller.send(text)

    def regenerate(self, request_id: int | None = None) -> int | None:
        """A new version of an answer (the last one by default); the old one stays as another version."""
        return self.chat_controller.regenerate(request_id)

    def edit_and_resend(self, turn_id: str, text: str) -> int | None:
        return self.chat_controller.edit_and_resend(turn_id, text)

    def show_branch(self, turn_id: str, delta: int) -> None:
        self.chat_controller.show_branch(turn_id, delta)

    def new_chat(self) -> None:
        self.chat_controller.new_chat()

    def open_conversation(self, conversation_id: str) -> bool:
        """Shows a saved conversation; False (and one line saying why) if it cannot be read."""
        return self.chat_controller.open_conversation(conversation_id)

    def stop(self) -> None:
        self.chat_controller.stop()

    def messages_for_request(self) -> tuple[Message, ...]:
        return self.chat_controller.messages_for_request()

    def ask_overflow(self, count) -> str:
        """"new", "drop" or "cancel" when the conversation no longer fits (a dialog; tests replace it)."""
        return ask_overflow(self, count)

    def _set_ready_state(self) -> None:
        generating = self.active_request is not None
        racing = self.race.running or self.tune.running
        self.prompt.set_generating(generating)
        if self.is_loading():
            self.prompt.set_ready(False, _NOT_READY, queue=True)
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
        remote = self.remote.active
        can_chat = not generating and self.info is not None and not self.is_loading() and not self.training.running
        reason = (_NOT_READY if self.is_loading() else _NO_MODEL if self.info is None
                  else "A draft head is training" if self.training.running else "An answer is streaming in the chat")
        self.race_view.set_race_enabled(can_chat and not self.tune.running and not remote,
                                        _REMOTE.format("Racing") if remote else
                                        "A sweep is running in the Tune tab" if self.tune.running else reason)
        self.tune_view.set_enabled(can_chat and not self.race.running and not remote,
                                   _REMOTE.format("Tuning") if remote else
                                   "A race is running in the Race tab" if self.race.running else reason)
        if remote != self._remote_said:  # said where their buttons are, once per change
            self._remote_said = remote
            self.race_view.show_status(_REMOTE.format("Racing") if remote else "")
            self.tune_view.show_status(_REMOTE.format("Tuning") if remote else "")
        self.stop_action.setEnabled(generating)
        self.chat.set_busy(generating)
        self.regenerate_action.setEnabled(can_chat and not racing and self.session.can_regenerate())
        self.load_action.setEnabled(not self.is_loading() and not self.training.running)
        self.train_head_action.setEnabled(self.info is not None and not self.is_loading())

    # --- settings, evidence, view -----------------------------------------------------------------

    def _annotate(self, stats: str, summary, request) -> str:
        """An answer's stats line: the remote server's, or the local one with the draft check's note."""
        line = self.remote.annotate(request)
        return line if line is not None else self.check_link.annotate(stats, summary, request)

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

    def _on_memory(self, used: float, total_gib: float) -> None:
        # The status bar heard of a change of diagnosis (memory full or not): the Tune tab's rules re-run.
        self.tune.update_evidence(memory_used=used, memory_total_gib=total_gib)

    def _update_memory(self) -> None:
        self.status.update_memory()

    @property
    def _memory_full(self) -> bool:
        return self.status.memory_full

    def set_theme(self, preference: str) -> None:
        """"system", "light" or "dark"; remembered."""
        self.view_options.set_theme(preference)

    def _on_save_error_thread(self, _conversation_id: str, message: str) -> None:
        # Called on the writer thread: a queued single-shot brings it to the UI thread.
        QTimer.singleShot(0, self, lambda: self.statusBar().showMessage(
            f"Could not save the conversation: {message}. It stays open; the next change tries again.", 10000))

    # --- export, about, close ---------------------------------------------------------------------

    def export_session(self, path: str | None = None) -> bool:
        """Writes one row per answer; asks for a file when `path` is None. False if nothing was written."""
        return self.exports.export_session(path)

    def export_trace(self, path: str | None = None) -> bool:
        """Writes one row per decoding step of every answer."""
        return self.exports.export_trace(path)

    def save_state(self) -> None:
        self.settings.set_generation(self.panel.values())
        self.settings.set_display(self.panel.display())
        self.settings.set_geometry(QByteArray(self.saveGeometry()))
        widths = self.panels.saved_widths()  # a collapsed panel keeps the width it had
        self.settings.set_splitter_sizes([widths["settings"], self.splitter.sizes()[1], widths["charts"]])
        self.settings.set_panels(self.panels.wanted)
        self.settings.set_sidebar_width(widths["sidebar"])
        self.settings.sync()

    def closeEvent(self, event: QCloseEvent) -> None:
        if not self._closed:
            self._closed = True
            self.save_state()
            self.status.stop()
            self.remote.shutdown()
            self.host.shutdown()
            self.context.shutdown()
            self.conversations.shutdown()
            self.session.close()  # waits for the last save
        event.accept()
