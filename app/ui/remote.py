"""The chat through a remote OpenAI-compatible server: the Models dialog's "Remote server", the streams
(each on a thread of its own, with the worker's chat signals), and what the window shows while remote."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from PySide6.QtCore import QObject, Signal, Slot

from app.core.remote import RemoteClient, RemoteConfig, RemoteError, RemoteFinish, RemoteMetrics, RemotePiece
from app.core.remote_answer import RemoteAnswer, stats_line
from app.core.session import ChatSession
from app.ui.chat import ChatController
from app.ui.notices import Notices
from app.ui.settings import AppSettings
from app.ui.status_bar import StatusBarController
from app.ui.worker import FLUSH_INTERVAL_S, EngineWorker
from engine.types import GenerationRequest, ModelInfo
from widgets.charts import LiveCharts
from widgets.chat.view import ChatView
from widgets.remote_box import RemoteChoice

log = logging.getLogger(__name__)

JOIN_S = 2.0  # at close, how long each stream may take to notice its cancel (then it is left, a daemon)


def config_of(choice: RemoteChoice) -> RemoteConfig:
    return RemoteConfig(choice.url, api_key=choice.api_key, model=choice.model)


def remote_info(config: RemoteConfig, model: str) -> ModelInfo:
    """The "pair in use" while the chat is remote: the server's model; nothing measured here."""
    return ModelInfo(target_name=model or "remote model", draft_name=None, device=config.root, dtype="",
                     fast_path="remote server", vocab_size=0, runtime="remote")


class RemoteStreams(QObject):
    """Answers from a remote server with the worker's chat interface: `generate_requested(request)` and
    `stop(request_id)` in; `steps`, then exactly one of `generation_finished` / `generation_failed` out.
    Each answer streams on a thread of its own; signals reach the GUI thread queued."""

    generate_requested = Signal(object)  # GenerationRequest (request_id set)
    steps = Signal(int, object)  # request_id, tuple[Step, ...]
    generation_finished = Signal(int, object)  # request_id, Summary
    generation_failed = Signal(int, str)  # request_id, one line
    colours_known = Signal(int, bool)  # request_id, whether the stream carries token statuses (before its steps)
    stats_ready = Signal(int, str)  # request_id, the answer's stats line (just before generation_finished)
    tested = Signal(str)  # the Test button's one line
    probed = Signal(object, str)  # RemoteConfig, the model the server answers with ("" when it cannot be reached)
    probe_failed = Signal(str)  # one line

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.config: RemoteConfig | None = None  # where answers come from
        self._cancels: dict[int, threading.Event] = {}
        self._threads: list[threading.Thread] = []
        self.generate_requested.connect(self._on_generate_requested)

    def stop(self, request_id: int) -> None:
        """Cancels `request_id` (the stream ends at the server's next line)."""
        event = self._cancels.get(request_id)
        if event is not None:
            event.set()

    def stop_all(self) -> None:
        for event in self._cancels.values():
            event.set()

    def shutdown(self) -> None:
        """At close: every stream cancelled and given a moment to end."""
        self.stop_all()
        for thread in self._threads:
            thread.join(JOIN_S)

    def test(self, choice: RemoteChoice) -> None:
        """The Models dialog's Test: what the server offers, in one line on `tested` (off the GUI thread)."""
        self._spawn(self._test, config_of(choice), name="remote-test")

    def probe(self, config: RemoteConfig) -> None:
        """Which model answers (the first listed when none is named), for the status bar."""
        self._spawn(self._probe, config, name="remote-probe")

    @Slot(object)
    def _on_generate_requested(self, request: GenerationRequest) -> None:
        if self.config is None:
            self.generation_failed.emit(request.request_id, "No remote server is chosen: File ▸ Load models….")
            return
        cancel = self._cancels[request.request_id] = threading.Event()
        self._spawn(self._stream, request, self.config, cancel, name=f"remote-{request.request_id}")

    def _spawn(self, target: Callable[..., None], *args: object, name: str) -> None:
        self._threads = [t for t in self._threads if t.is_alive()]
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    # --- on the stream's own thread ---------------------------------------------------------------

    def _stream(self, request: GenerationRequest, config: RemoteConfig, cancel: threading.Event) -> None:
        rid = request.request_id
        client = RemoteClient(config)
        answer = RemoteAnswer(time.perf_counter())
        pending: list = []
        last_flush = answer.started

        def flush() -> None:
            nonlocal last_flush
            if pending:
                self.steps.emit(rid, tuple(pending))
                pending.clear()
            last_flush = time.perf_counter()

        s = request.sampling
        try:
            for event in client.stream_chat(request.messages, max_tokens=request.max_new_tokens,
                                            temperature=s.temperature, top_p=s.top_p, seed=s.seed, cancel=cancel):
                now = time.perf_counter()
                if isinstance(event, RemotePiece):
                    if answer.colours is None and (event.text or event.tokens):
                        self.colours_known.emit(rid, bool(event.tokens))
                    pending.append(answer.step(event, now))
                    if now - last_flush >= FLUSH_INTERVAL_S:
                        flush()
                elif isinstance(event, RemoteFinish):
                    flush()
                    self._finish(client, rid, answer, event, now)
                    return
            flush()
            self.generation_failed.emit(rid, "the server stopped in the middle of the answer")
        except RemoteError as e:
            flush()  # what arrived stays in the answer
            self.generation_failed.emit(rid, str(e))
        except Exception as e:  # a bug here must still end the answer with one line
            log.exception("remote stream failed")
            flush()
            self.generation_failed.emit(rid, f"the remote answer failed ({type(e).__name__}: {e})")
        finally:
            client.close()
            self._cancels.pop(rid, None)

    def _finish(self, client: RemoteClient, rid: int, answer: RemoteAnswer, end: RemoteFinish, now: float) -> None:
        summary = answer.finish(end, now)
        metrics: RemoteMetrics | None = None
        note = ""
        if not answer.colours and end.finish_reason != "cancelled":  # what the server says about speculation
            try:
                metrics = client.read_metrics()
            except RemoteError as e:
                note = "the server has none" if "(404)" in str(e) else str(e)
        self.stats_ready.emit(rid, stats_line(summary, end, bool(answer.colours), metrics, note))
        self.generation_finished.emit(rid, summary)

    def _test(self, config: RemoteConfig) -> None:
        client = RemoteClient(replace(config, timeout_s=10.0))
        try:
            line = client.test()
        except RemoteError as e:
            line = str(e)
        finally:
            client.close()
        self.tested.emit(line)

    def _probe(self, config: RemoteConfig) -> None:
        client = RemoteClient(replace(config, timeout_s=10.0))
        try:
            names = client.models()
            self.probed.emit(config, config.model or (names[0] if names else ""))
        except RemoteError as e:
            self.probe_failed.emit(str(e))
        finally:
            client.close()


class RemoteController(QObject):
    """While `active`, the chat streams from the server and no local models are loaded; loading local
    models (the worker's load_started) ends it. `ready_changed()` re-reads what the window allows."""

    def __init__(self, worker: EngineWorker, session: ChatSession, chat_controller: ChatController, chat: ChatView,
                 charts: LiveCharts, status: StatusBarController, notices: Notices, *, settings: AppSettings,
                 ready_changed: Callable[[], None], parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.worker = worker
        self.session = session
        self.chat_controller = chat_controller
        self.chat = chat
        self.charts = charts
        self.status = status
        self.notices = notices
        self.settings = settings
        self._ready_changed = ready_changed
        self.active = False
        self.config: RemoteConfig | None = None
        self.model = ""  # the model that answers ("" until the server says)
        self._lines: dict[int, str] = {}  # stats lines of answers about to finish
        self.streams = RemoteStreams(self)
        chat_controller.add_source(self.streams)
        self.streams.colours_known.connect(self._on_colours_known)
        self.streams.stats_ready.connect(self._on_stats_ready)
        self.streams.generation_failed.connect(self._on_failed)
        self.streams.probed.connect(self._on_probed)
        self.streams.probe_failed.connect(self._on_failed_probe)
        # After the loading controller's handlers: a release it reports must not end the remote chat.
        worker.engine_released.connect(self._on_engine_released)
        worker.load_started.connect(self._on_load_started)

    def attach(self, dialog) -> None:
        """dialog: a widgets.model_dialog.ModelDialog; its remote box shows the saved server and can Test."""
        dialog.set_remote_choice(replace(self.settings.remote(), use=self.active))
        box = dialog.remote
        box.test_requested.connect(self.streams.test)
        self.streams.tested.connect(box.set_test_result)
        dialog.finished.connect(lambda _code: self.streams.tested.disconnect(box.set_test_result))

    def use(self, choice: RemoteChoice) -> None:
        """The chat streams from this server from now on; the local pair is let go."""
        self.settings.set_remote(replace(choice, use=True))
        self.settings.sync()
        self.chat_controller.stop()  # an answer streaming from elsewhere ends here
        self.config = config_of(choice)
        self.model = choice.model
        self.streams.config = self.config
        self.active = True
        self.chat_controller.use_source(self.streams, header=self._header)
        self.worker.release_requested.emit(f"The local models were released: the chat uses {self.config.root}.")
        self._show()
        self.chat.add_system_note(
            f"Chatting through {self.config.root} ({self.model or 'the first model it lists'}). The panel's system "
            "prompt, temperature, top-p, seed and max new tokens are sent; mode, K and proposer are the server's. "
            "No local models are loaded meanwhile: File ▸ Load models… brings them back.")
        self.streams.probe(self.config)

    def annotate(self, request: GenerationRequest) -> str | None:
        """The stats line of a remote answer (None: the answer was not remote)."""
        return self._lines.pop(request.request_id, None)

    def shutdown(self) -> None:
        self.streams.shutdown()

    def _header(self, request: GenerationRequest, info: ModelInfo | None) -> str:
        return f"{info.target_name if info else 'remote model'} · remote · {self.config.root if self.config else ''}"

    def _show(self) -> None:
        assert self.config is not None, "shown only while remote"
        self.session.info = remote_info(self.config, self.model)
        self.status.show_remote(self.config.root, self.model or "first listed model")
        self._ready_changed()

    def _leave(self) -> None:
        self.active = False
        self.streams.stop_all()
        self.chat_controller.use_source(None)
        self.session.info = None  # the local pair's info comes with load_finished
        self.status.show_pair(None)
        self.charts.set_no_drafts_note("")
        self.settings.set_remote(replace(self.settings.remote(), use=False))

    # --- signals ---------------------------------------------------------------------------------

    def _on_load_started(self, _request: object) -> None:
        if self.active:
            self._leave()

    def _on_engine_released(self, _note: str) -> None:
        if self.active:
            self._show()

    def _on_colours_known(self, request_id: int, colours: bool) -> None:
        self.charts.set_no_drafts_note("" if colours else "not reported")
        view = self.chat.token_view(request_id)
        if view is not None and not colours:
            view.set_colouring(False)  # no statuses: one colour would claim a status nobody reported

    def _on_stats_ready(self, request_id: int, line: str) -> None:
        self._lines[request_id] = line

    def _on_failed(self, _request_id: int, message: str) -> None:
        self.notices.note(f"Remote server: {message}", 15000)

    def _on_probed(self, config: RemoteConfig, model: str) -> None:
        if self.active and config == self.config and model:
            self.model = model
            self._show()

    def _on_failed_probe(self, message: str) -> None:
        if self.active:
            self.notices.note(f"Remote server: {message}", 15000)
