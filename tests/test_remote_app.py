"""The app as a client: the Models dialog's "Remote server", and the chat streaming from this project's `serve`
(tiny models) and from llama-cpp-python's own server, on loopback only, with the real window and threads."""
from __future__ import annotations

import logging
import socket
from dataclasses import replace

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLineEdit

from app.core.remote import RemoteClient, RemoteConfig, RemoteFinish, RemotePiece
from app.core.remote_answer import NO_COLOURS
from app.ui.settings import AppSettings
from app.ui.window import MainWindow
from engine.settings import ModelSelection
from tests.engine_fixtures import tiny_engine
from tests.serve_fixtures import MODEL, Slow, llama_cpp_serving, serving, wait_until
from tests.test_app import FakeEngine
from widgets.model_dialog import ModelDialog
from widgets.remote_box import RemoteChoice

WAIT_MS = 30000


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return tiny_engine(*tiny_pair)


@pytest.fixture
def settings(tmp_path) -> AppSettings:
    return AppSettings(tmp_path / "settings.ini")


@pytest.fixture
def window(qtbot, settings, no_dangling_threads):
    """A window with a (fake) local pair loaded: going remote must let it go."""
    local = FakeEngine()
    w = MainWindow(engine_factory=lambda _req, _progress: local, settings=settings)
    qtbot.addWidget(w)
    w.show()
    with qtbot.waitSignal(w.models_loaded, timeout=5000):
        w.load_models(ModelSelection())
    w.panel.set_values(replace(w.panel.values(), system_prompt="", temperature=0.0, max_new_tokens=24))
    yield w
    w.close()


def go_remote(qtbot, window: MainWindow, choice: RemoteChoice) -> None:
    window.use_remote(choice)
    qtbot.waitUntil(lambda: window.worker.engine is None, timeout=WAIT_MS)  # no local models while remote
    assert window.info is not None and window.info.runtime == "remote"


def ask(qtbot, window: MainWindow, text: str):
    """Sends `text` as a person does (Enter); returns (request id, Summary)."""
    window.prompt.set_text(text)
    with qtbot.waitSignal(window.answer_finished, timeout=WAIT_MS) as blocker:
        qtbot.keyClick(window.prompt.edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: window.active_request is None, timeout=WAIT_MS)
    return blocker.args


def server_text(url: str, messages, max_tokens: int, api_key: str = "") -> str:
    events = list(RemoteClient(RemoteConfig(url, api_key=api_key)).stream_chat(messages, max_tokens=max_tokens,
                                                                               temperature=0))
    assert isinstance(events[-1], RemoteFinish)
    return "".join(e.text for e in events if isinstance(e, RemotePiece))


def test_the_dialogs_test_button_says_in_one_line_what_the_server_offers(window, engine, qtbot):
    dialog = ModelDialog(ModelSelection())
    qtbot.addWidget(dialog)
    window.remote.attach(dialog)
    assert not dialog.remote_choice().use and dialog.remote.api_key.echoMode() == QLineEdit.EchoMode.Password
    with serving(engine, api_key="sesame") as running:
        dialog.set_remote_choice(RemoteChoice(use=True, url=running.root, api_key="sesame"))
        assert not dialog.target.isEnabled()  # the local choices wait, greyed, while the remote box is checked
        qtbot.mouseClick(dialog.remote.test_button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda: dialog.remote.test_button.isEnabled(), timeout=WAIT_MS)
        assert dialog.remote.result.text() == f"connected: {MODEL}"
        dialog.remote.api_key.setText("wrong")
        qtbot.mouseClick(dialog.remote.test_button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda: dialog.remote.test_button.isEnabled(), timeout=WAIT_MS)
        assert "API key" in dialog.remote.result.text() and "\n" not in dialog.remote.result.text()
    dialog.set_remote_choice(RemoteChoice(use=False))
    assert dialog.target.isEnabled()


def test_the_chat_streams_from_our_server_with_colours_and_charts(window, engine, qtbot):
    with serving(engine) as running:
        go_remote(qtbot, window, RemoteChoice(use=True, url=running.base_url))
        qtbot.waitUntil(lambda: window.model_label.text() == f"Remote: {MODEL}", timeout=WAIT_MS)
        assert running.root in window.device_label.text()
        assert not window.race_view.race_button.isEnabled() and "needs local models" in \
            window.race_view.race_button.toolTip()
        assert not window.tune_view.start_button.isEnabled()
        rid, summary = ask(qtbot, window, "def add(a, b):")
        sent = window.records[-1].request.messages
        assert summary.text == server_text(running.base_url, sent, 24) and summary.text
        view = window.chat.token_view(rid)
        statuses = {t.status for t in view.tokens()}
        assert view.colouring() and statuses & {"accepted", "rejected", "corrected", "bonus"}
        assert summary.drafted > 0 and summary.per_position_acceptance  # the same Steps the local chat gets
        assert window.chat.stats_text(rid).startswith("remote · speculative · K=3")
        assert len(window.charts.position_acceptance()) >= 1
        assert window.history()[-1].content == summary.text  # the conversation holds the answer


def test_stop_ends_the_remote_answer_and_the_servers_generation(window, engine, qtbot):
    window.panel.set_values(replace(window.panel.values(), max_new_tokens=400))
    with Slow(engine, 0.05), serving(engine) as running:
        go_remote(qtbot, window, RemoteChoice(use=True, url=running.base_url))
        window.prompt.set_text("def add(a, b):")
        qtbot.keyClick(window.prompt.edit, Qt.Key.Key_Return)
        rid = window.active_request
        qtbot.waitUntil(lambda: bool(window.chat.token_view(rid).tokens()), timeout=WAIT_MS)
        with qtbot.waitSignal(window.answer_finished, timeout=WAIT_MS) as blocker:
            qtbot.keyClick(window.prompt.edit, Qt.Key.Key_Escape)
        summary = blocker.args[1]
        assert summary.stop_reason == "cancelled" and 0 < summary.new_tokens < 400
        assert "stopped" in window.chat.stats_text(rid)
        wait_until(lambda: running.scheduler.running == 0)  # the server let the generation go too


def test_llama_cpp_pythons_server_shows_counts_and_says_colours_are_off(window, qtbot, tmp_path):
    from tests.tiny_gguf import save_gguf_pair

    window.panel.set_values(replace(window.panel.values(), max_new_tokens=8))
    with llama_cpp_serving(save_gguf_pair(tmp_path)[0], "tiny") as url:
        go_remote(qtbot, window, RemoteChoice(use=True, url=url))
        qtbot.waitUntil(lambda: window.model_label.text() == "Remote: tiny", timeout=WAIT_MS)
        rid, summary = ask(qtbot, window, "hello")
        stats = window.chat.stats_text(rid)
        assert summary.new_tokens > 0 and f"{summary.new_tokens} tokens" in stats
        assert "no draft counts in its timings" in stats and "no /metrics" in stats
        assert stats.endswith(NO_COLOURS)
        assert not window.chat.token_view(rid).colouring()
        assert summary.text == server_text(url, window.records[-1].request.messages, 8)


def test_a_dead_url_is_one_line_and_the_question_stays(window, qtbot):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    go_remote(qtbot, window, RemoteChoice(use=True, url=f"http://127.0.0.1:{port}"))
    window.prompt.set_text("is anyone there?")
    with qtbot.waitSignal(window.answer_failed, timeout=WAIT_MS) as blocker:
        qtbot.keyClick(window.prompt.edit, Qt.Key.Key_Return)
    message = blocker.args[1]
    assert message == f"cannot reach http://127.0.0.1:{port}: is the server running?"
    # The status line comes from the remote controller's own slot, queued beside the chat's: wait for it.
    qtbot.waitUntil(lambda: message in window.statusBar().currentMessage(), timeout=WAIT_MS)
    assert [m.content for m in window.history()] == ["is anyone there?"]  # nothing typed is lost
    qtbot.waitUntil(lambda: window.active_request is None and window.prompt.edit.isEnabled(), timeout=WAIT_MS)


def test_loading_local_models_ends_the_remote_chat(window, engine, qtbot):
    with serving(engine) as running:
        go_remote(qtbot, window, RemoteChoice(use=True, url=running.base_url))
        with qtbot.waitSignal(window.models_loaded, timeout=WAIT_MS):
            window.load_models(ModelSelection())
    assert not window.remote.active and window.worker.engine is not None and window.info.target_name == "fake-target"
    assert not window.settings.remote().use  # the next start loads the local pair
    rid, summary = ask(qtbot, window, "local again")
    assert not window.chat.stats_text(rid).startswith("remote")
    assert window.race_view.race_button.isEnabled()


def test_the_remote_choice_round_trips_through_settings_and_its_key_is_never_logged(tmp_path, caplog):
    path = tmp_path / "settings.ini"
    choice = RemoteChoice(use=True, url="http://127.0.0.1:9/v1", api_key="s3cret-key", model="m")
    with caplog.at_level(logging.DEBUG):
        first = AppSettings(path)
        first.set_remote(choice)
        first.sync()
        assert AppSettings(path).remote() == choice
        assert "s3cret" not in repr(choice) and "s3cret" not in repr(RemoteConfig(choice.url, choice.api_key))
    assert "s3cret" not in caplog.text
    assert RemoteChoice.from_dict({"use": "yes", "url": 3, "model": "x" * 5000}) == RemoteChoice()


def test_remote_chat_says_train_head_needs_local_models(window, engine, qtbot, dialogs):
    with serving(engine) as running:
        go_remote(qtbot, window, RemoteChoice(use=True, url=running.base_url))
        assert window.open_train_dialog() is None
    assert dialogs and "needs the target loaded on this machine" in dialogs[-1][2]
