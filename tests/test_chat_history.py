"""The chat people keep using, through the real window and real files in a temporary data folder:
saved and reopened conversations (with colours), the sidebar, edit-and-resend forks, regenerate any
answer, exports, and the context meter with its overflow choice."""
from __future__ import annotations

import json

import pytest
from PySide6.QtGui import QGuiApplication

from app.core.chat_tree import Conversation
from app.ui.context import ApproxCounter, ContextCounter, TokenizerCounter, counter_for
from app.core.conversations import ConversationStore
from app.core.demo import DEMO_ANSWER, ScriptedEngine, demo_conversations
from app.ui.window import MainWindow
from engine.settings import ModelSelection
from engine.types import Message
from tests.test_app import SCRIPT_STATUSES, SCRIPT_TEXT, FakeEngine, long_script


@pytest.fixture
def data(tmp_path):
    return tmp_path / "conversations"


@pytest.fixture
def open_window(qtbot, tmp_path, data, no_dangling_threads):
    from app.ui.settings import AppSettings

    windows: list[MainWindow] = []

    def make(engine=None) -> MainWindow:
        engine = engine if engine is not None else FakeEngine()
        w = MainWindow(engine_factory=lambda _r, _p: engine, settings=AppSettings(tmp_path / "settings.ini"),
                       store=ConversationStore(data))
        qtbot.addWidget(w)
        w.show()
        windows.append(w)
        with qtbot.waitSignal(w.models_loaded, timeout=5000):
            w.load_models(ModelSelection())
        return w

    yield make
    for w in windows:
        w.close()


def ask(qtbot, w: MainWindow, text: str) -> int:
    with qtbot.waitSignal(w.answer_finished, timeout=10000) as blocker:
        rid = w.send(text)
    assert rid == blocker.args[0]
    qtbot.waitUntil(lambda: w.active_request is None)
    return rid


def statuses_shown(w: MainWindow, rid: int) -> list[str]:
    """The statuses in the text, and "rejected" where a mark stands for a step's rejected drafts."""
    view = w.chat.token_view(rid)
    marks = view.mark_positions()
    shown = []
    for start, _end, status in view.token_spans():
        if start in marks and status == "corrected":
            shown += ["rejected"] * sum(t.status == "rejected" and t.step == view.token_at(start).step
                                        for t in view.tokens())
        shown.append(status)
    return shown


def test_a_conversation_is_saved_and_reopens_with_its_colours(open_window, qtbot, data):
    w = open_window()
    rid = ask(qtbot, w, "Say hello")
    assert statuses_shown(w, rid) == SCRIPT_STATUSES
    conversation_id = w.session.conversation.id
    w.close()  # waits for the last save
    saved = json.loads((data / f"{conversation_id}.json").read_text(encoding="utf-8"))
    assert saved["format"] == "specdec-studio.conversation" and saved["title"] == "Say hello"
    assert [t["role"] for t in saved["turns"]] == ["user", "assistant"]
    assert saved["turns"][1]["summary"]["new_tokens"] > 0 and len(saved["turns"][1]["tokens"]["status"]) == 11

    again = open_window()
    assert again.sidebar.ids() == [conversation_id] and again.sidebar.titles() == ["Say hello"]
    again.sidebar.selected.emit(conversation_id)
    qtbot.waitUntil(lambda: again.chat.message_count() == 2, timeout=5000)  # question + answer
    answer = again.chat.answer_ids()[-1]
    assert again.chat.message_text(1) == SCRIPT_TEXT
    assert statuses_shown(again, answer) == SCRIPT_STATUSES  # the colours came back
    assert "auto" in again.chat.stats_detail(answer)  # the app's default mode
    assert again.chat.stats_text(answer) and "K auto" not in again.chat.stats_text(answer)  # plain words
    # The reopened conversation goes on where it was.
    ask(qtbot, again, "And again")
    assert again.history()[:2] == [Message("user", "Say hello"), Message("assistant", SCRIPT_TEXT)]
    assert len(again.session.conversation.turns) == 4


def test_edit_and_resend_forks_and_both_branches_stay(open_window, qtbot):
    engine = FakeEngine()
    w = open_window(engine)
    ask(qtbot, w, "first question")
    ask(qtbot, w, "second question")
    first_q = w.chat.user_bubble(0)
    first_q.edit_button.click()
    assert first_q.is_editing()
    first_q.editor.setPlainText("first question, better")
    with qtbot.waitSignal(w.answer_finished, timeout=10000):
        first_q.send_button.click()
    qtbot.waitUntil(lambda: w.active_request is None)
    assert engine.requests[-1].messages[-1] == Message("user", "first question, better")
    assert [m.role for m in engine.requests[-1].messages] == ["system", "user"]  # the later turns are not sent
    assert w.history() == [Message("user", "first question, better"), Message("assistant", SCRIPT_TEXT)]
    edited = w.chat.user_bubble(0)
    assert edited.branches.label.text() == "2/2" and edited.branches.isVisibleTo(w)
    # Back to the first version: the whole old branch, second question included.
    edited.branches.back.click()
    qtbot.waitUntil(lambda: w.chat.user_bubble(1) is not None, timeout=5000)
    assert [m.content for m in w.history() if m.role == "user"] == ["first question", "second question"]
    assert w.chat.user_bubble(0).branches.label.text() == "1/2"
    w.chat.user_bubble(0).branches.forward.click()
    assert [m.content for m in w.history() if m.role == "user"] == ["first question, better"]


def test_regenerate_any_answer_keeps_the_old_one_as_a_version(open_window, qtbot):
    w = open_window()
    first = ask(qtbot, w, "one")
    ask(qtbot, w, "two")
    w.chat._assistants[first].regenerate_button.click()  # at T = 0: the hint first
    with qtbot.waitSignal(w.answer_finished, timeout=10000) as blocker:
        w.chat.hint().buttons[1].click()
    qtbot.waitUntil(lambda: w.active_request is None)
    new = blocker.args[0]
    assert [m.content for m in w.history() if m.role == "user"] == ["one"]  # "two" is on the other branch
    bubble = w.chat._assistants[new]
    assert bubble.branches.label.text() == "2/2"
    bubble.branches.back.click()
    qtbot.waitUntil(lambda: len(w.history()) == 4, timeout=5000)
    assert [m.content for m in w.history() if m.role == "user"] == ["one", "two"]


def test_copy_any_message(open_window, qtbot):
    w = open_window()
    ask(qtbot, w, "copy me 你好")
    w.chat.user_bubble(0).copy_button.click()
    assert QGuiApplication.clipboard().text() == "copy me 你好"
    answer = w.chat.answer_ids()[-1]
    w.chat._assistants[answer].copy_button.click()
    assert QGuiApplication.clipboard().text() == SCRIPT_TEXT


def test_sidebar_new_rename_delete_undo_and_search(open_window, qtbot, data):
    w = open_window()
    ask(qtbot, w, "about heaps")
    heaps = w.session.conversation.id
    w.new_chat()
    ask(qtbot, w, "about tries")
    tries = w.session.conversation.id
    assert w.sidebar.ids() == [tries, heaps]  # newest first
    w.conversations.rename(heaps, "Heaps, renamed")
    assert "Heaps, renamed" in w.sidebar.titles()
    w.session.writer.flush()
    assert ConversationStore(data).load(heaps).title == "Heaps, renamed"
    # Search by text in any message (answers included), after typing pauses.
    w.sidebar.search.setText("ABOUT TRIES")
    qtbot.waitUntil(lambda: w.sidebar.ids() == [tries], timeout=5000)
    w.sidebar.search.setText("hello world")  # in both answers
    qtbot.waitUntil(lambda: sorted(w.sidebar.ids()) == sorted([tries, heaps]), timeout=5000)
    w.sidebar.search.clear()
    qtbot.waitUntil(lambda: len(w.sidebar.ids()) == 2, timeout=5000)
    # Delete the conversation shown: a new chat takes its place; Undo brings it back.
    w.sidebar.delete_requested.emit(tries)
    assert w.sidebar.ids() == [heaps] and w.session.conversation.is_empty() and w.chat.message_count() == 0
    assert not (data / f"{tries}.json").exists()
    assert w.sidebar.undo_bar.isVisibleTo(w)
    w.sidebar.undo_button.click()
    assert set(w.sidebar.ids()) == {tries, heaps} and (data / f"{tries}.json").exists()
    assert w.open_conversation(tries)
    qtbot.waitUntil(lambda: w.history() and w.history()[0].content == "about tries", timeout=5000)


def test_damaged_files_are_named_and_the_rest_still_open(open_window, qtbot, data):
    store = ConversationStore(data)
    ids = demo_conversations(store, 3)
    (data / "broken.json").write_text("{ not json", encoding="utf-8")
    (data / "someone-else.json").write_text('{"hello": "world"}', encoding="utf-8")
    w = open_window()
    assert w.sidebar.ids() == ids
    assert w.sidebar.problems.isVisibleTo(w) and "2 files" in w.sidebar.problems.text()
    assert "broken.json" in w.sidebar.problems.toolTip() and "someone-else.json" in w.sidebar.problems.toolTip()
    assert w.open_conversation(ids[0])
    qtbot.waitUntil(lambda: len(w.chat.answer_ids()) == 3, timeout=5000)
    assert (data / "broken.json").read_text(encoding="utf-8") == "{ not json"  # left alone


def test_export_markdown_and_json(open_window, qtbot, tmp_path, dialogs):
    w = open_window()
    ask(qtbot, w, "Export me")
    md, js = tmp_path / "chat.md", tmp_path / "chat.json"
    assert w.conversations.export(None, "markdown", str(md))
    assert w.conversations.export(None, "json", str(js))
    text = md.read_text(encoding="utf-8")
    assert text.startswith("# Export me") and "## You\n\nExport me" in text and SCRIPT_TEXT in text
    assert "tokens/step" in text  # the figures under the answer
    back = Conversation.from_json(json.loads(js.read_text(encoding="utf-8")))
    assert back.messages() == (Message("user", "Export me"), Message("assistant", SCRIPT_TEXT))
    assert not w.conversations.export(None, "json", str(tmp_path))  # a folder: one clear error, nothing lost
    assert dialogs and dialogs[-1][1] == "Export failed"


# --------------------------------------------------------------------------- context

def test_context_meter_follows_typing(open_window, qtbot):
    w = open_window(ScriptedEngine(text="short answer", delay_s=0.0, context_length=400))
    qtbot.waitUntil(lambda: w.context_meter.usage()[1] == 400, timeout=5000)
    before = w.context_meter.usage()[0]
    w.prompt.set_text("word " * 50)
    qtbot.waitUntil(lambda: w.context_meter.usage()[0] > before + 40, timeout=5000)
    w.prompt.set_text("word " * 500)
    qtbot.waitUntil(lambda: w.context_meter.level() == "full", timeout=5000)
    assert "too long" in w.context_meter.label.text()


@pytest.mark.parametrize("choice", ["drop", "new", "cancel"])
def test_overflow_asks_what_to_do(open_window, qtbot, choice):
    engine = ScriptedEngine(text="answer " * 30, delay_s=0.0, context_length=400)
    w = open_window(engine)
    for i in range(3):
        ask(qtbot, w, f"question {i} " + "pad " * 20)
    asked = []
    w.ask_overflow = lambda count: asked.append(count) or choice
    long_question = "last question " + "pad " * 250
    if choice == "cancel":
        assert w.send(long_question) is None
        assert asked and w.prompt.text() == long_question.strip()  # nothing lost
        return
    sent = []
    w.worker.generate_requested.connect(lambda request: sent.append(request))
    rid = ask(qtbot, w, long_question)
    assert len(asked) == 1 and asked[0].used >= asked[0].limit
    request = sent[-1]
    assert request.request_id == rid and request.messages[-1].content == long_question.strip()
    if choice == "drop":
        assert w.session.conversation.trim_oldest
        assert "question 0" not in " ".join(m.content for m in request.messages)  # the oldest turns left out
        assert len(w.history()) == 8  # but kept in the conversation
        ask(qtbot, w, "one more")  # remembered: no second question
        assert len(asked) == 1
    else:
        assert [m.role for m in request.messages] == ["system", "user"]  # a new chat with just this question
        assert len(w.sidebar.ids()) == 2


def test_counter_cache_matches_a_full_count(tiny_pair):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    counter = TokenizerCounter(tokenizer, 2048)
    system = (Message("system", "Be brief."),)
    messages = (Message("user", "def add(a, b):"), Message("assistant", "return a + b 快速排序"),
                Message("user", "emoji 🙂🚀"), Message("assistant", "Hello world!"))
    draft = "The quick brown fox"
    counted = ContextCounter()._count(counter, system, messages, draft, 0, False)
    exact = counter.count_prompt(system + messages + (Message("user", draft),))
    assert abs(counted.used - exact) <= 2, (counted.used, exact)  # BPE merges across a boundary at most
    small = TokenizerCounter(tokenizer, exact - 5)  # a context a few tokens too small: the oldest turn goes
    trimmed = ContextCounter()._count(small, system, messages, draft, 0, True)
    assert trimmed.dropped == 2 and trimmed.used < trimmed.limit


def test_counter_for_engines_with_and_without_a_tokenizer():
    assert isinstance(counter_for(FakeEngine()), ApproxCounter)
    assert counter_for(ScriptedEngine(context_length=123)).context_length == 123


def test_opening_a_conversation_while_an_answer_streams_saves_it_to_its_own(open_window, qtbot, data):
    w = open_window(FakeEngine(long_script(), delay_s=0.005))
    ids = demo_conversations(ConversationStore(data), 1)
    w.conversations._headers.update({h.id: h for h in w.session.list()})
    rid = w.send("streaming question")
    first = w.session.conversation.id
    qtbot.waitUntil(lambda: bool(w.chat.token_view(rid).token_spans()), timeout=5000)
    with qtbot.waitSignal(w.answer_finished, timeout=5000):
        assert w.open_conversation(ids[0])
    w.session.writer.flush()
    stopped = ConversationStore(data).load(first)
    assert stopped.path()[-1].summary is not None and stopped.path()[-1].summary.stop_reason == "cancelled"
    assert w.session.conversation.id == ids[0] and w.history()[1].content.startswith(DEMO_ANSWER)


def test_search_finds_a_conversation_whose_save_is_still_on_its_way_to_the_disk(open_window, qtbot, data,
                                                                                  monkeypatch):
    """An answer that ends in a conversation not shown is saved in the background; a search typed meanwhile
    waits for that save instead of searching the older file."""
    import threading

    from tests.test_conversations import answered

    other, lions = Conversation(), Conversation()
    answered(other, "about zebras", "Zebras live in Africa.")
    answered(lions, "about lions", "Lions live in Africa too.")
    ConversationStore(data).save(other)
    ConversationStore(data).save(lions)
    w = open_window()
    assert sorted(w.sidebar.ids()) == sorted([other.id, lions.id])
    store = w.session.writer.store
    release = threading.Event()
    write = store.write
    monkeypatch.setattr(store, "write", lambda snapshot: release.wait(5) and write(snapshot))
    answered(other, "and their colours?", "They are striped.")
    w.session.save(other)  # queued behind the slow disk: the file still holds the first answer only
    threading.Timer(1.5, release.set).start()  # well after the search starts (it waits for typing to pause)
    w.sidebar.search.setText("striped")
    qtbot.waitUntil(lambda: w.sidebar.ids() == [other.id], timeout=5000)
