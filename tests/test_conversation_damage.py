"""Crafted and damaged conversation files and index entries: the app starts, nothing outside the folder is touched,
no cycle hangs, no wrong type kills a thread."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from app.core.chat_tree import Conversation, ConversationFormatError
from app.core.conversations import INDEX_NAME, ConversationStore
from app.core.demo import demo_conversations
from tests.test_chat_history import ask, data, open_window  # noqa: F401  (fixtures)


def _saved(folder: Path, n: int = 2) -> tuple[ConversationStore, list[str]]:
    store = ConversationStore(folder)
    return store, demo_conversations(store, n)


def _file(folder: Path, conversation_id: str) -> dict:
    return json.loads((folder / f"{conversation_id}.json").read_text(encoding="utf-8"))


def _rewrite(folder: Path, conversation_id: str, **changes) -> None:
    raw = {**_file(folder, conversation_id), **changes}
    (folder / f"{conversation_id}.json").write_text(json.dumps(raw), encoding="utf-8")


def _edit_index(folder: Path, edit) -> None:
    index = json.loads((folder / INDEX_NAME).read_text(encoding="utf-8"))
    edit(index)
    (folder / INDEX_NAME).write_text(json.dumps(index), encoding="utf-8")


# --------------------------------------------------------------------------- 4: unknown index fields

def test_an_index_from_a_newer_version_with_extra_header_fields_is_read(tmp_path):
    store, ids = _saved(tmp_path)
    store.list()

    def newer(index):
        for entry in index["entries"].values():
            entry["header"]["pinned"] = True  # a field this version does not know
        index["written_by"] = "SpecDec Studio 9"

    _edit_index(tmp_path, newer)
    assert sorted(h.id for h in ConversationStore(tmp_path).list()) == sorted(ids)


@pytest.mark.parametrize("bad", [{"turns": "many"}, {"title": 5}, {"id": None}, "not a dict", {"size": "1"}])
def test_a_wrong_type_in_an_index_entry_reads_the_file_again(tmp_path, bad):
    store, ids = _saved(tmp_path)
    store.list()

    def damage(index):
        entry = index["entries"][ids[0]]
        if isinstance(bad, str):
            index["entries"][ids[0]] = bad
        elif "size" in bad:
            entry.update(bad)
        else:
            entry["header"].update(bad)

    _edit_index(tmp_path, damage)
    headers = {h.id: h for h in ConversationStore(tmp_path).list()}
    assert sorted(headers) == sorted(ids) and isinstance(headers[ids[0]].turns, int)


def test_the_window_starts_with_an_index_of_unknown_fields(open_window, data):  # noqa: F811
    store, ids = _saved(data)
    store.list()
    _edit_index(data, lambda index: [e["header"].update(pinned=True) for e in index["entries"].values()])
    w = open_window()
    assert sorted(w.sidebar.ids()) == sorted(ids)


# --------------------------------------------------------------------------- 5: ids are file stems

def test_an_index_id_that_is_a_path_never_leaves_the_folder(tmp_path):
    folder = tmp_path / "conversations"
    victim = tmp_path / "victim" / "secret.json"
    victim.parent.mkdir(parents=True)
    victim.write_text("mine", encoding="utf-8")
    store, ids = _saved(folder)
    store.list()
    _edit_index(folder, lambda index: index["entries"][ids[0]]["header"].update(id="../victim/secret"))
    fresh = ConversationStore(folder)
    listed = [h.id for h in fresh.list()]
    assert "../victim/secret" not in listed and sorted(listed) == sorted(ids)
    with pytest.raises(ConversationFormatError):
        fresh.delete("../victim/secret")
    ConversationStore(folder)  # the next start empties the trash
    assert victim.read_text(encoding="utf-8") == "mine"


def test_a_file_whose_id_is_a_path_is_reported_not_opened(tmp_path):
    store, ids = _saved(tmp_path)
    _rewrite(tmp_path, ids[0], id="../x")
    fresh = ConversationStore(tmp_path)
    assert [h.id for h in fresh.list()] == [ids[1]] and fresh.problems
    with pytest.raises(ConversationFormatError):
        fresh.load(ids[0])


# --------------------------------------------------------------------------- 6: cycles

def _cycle(folder: Path, conversation_id: str) -> None:
    raw = _file(folder, conversation_id)
    first, last = raw["turns"][0], raw["turns"][-1]
    first["parent"] = last["id"]  # the first question now answers the last answer: a loop
    (folder / f"{conversation_id}.json").write_text(json.dumps(raw), encoding="utf-8")


def test_a_cycle_of_turns_is_cut_where_it_repeats(tmp_path):
    store, ids = _saved(tmp_path)
    _cycle(tmp_path, ids[0])
    result: list = []
    worker = threading.Thread(target=lambda: result.append(_walk(store.load(ids[0]))), daemon=True)
    worker.start()
    worker.join(60)
    assert result, "walking a conversation with a cycle never ended"
    assert 0 < result[0] <= len(_file(tmp_path, ids[0])["turns"])


def _walk(conversation: Conversation) -> int:
    for turn in conversation.turns.values():
        conversation.path(turn.id)
        conversation.switch_to(turn.id)
    return len(conversation.path())


def test_a_turn_that_is_its_own_parent_starts_a_branch():
    raw = Conversation().to_json()
    raw["turns"] = [{"id": "a", "parent": "a", "role": "user", "content": "hi", "created": ""}]
    assert [t.id for t in Conversation.from_json(raw).path()] == ["a"]


def test_clicking_a_conversation_with_a_cycle_opens_it(open_window, qtbot, data):  # noqa: F811
    _, ids = _saved(data)
    _cycle(data, ids[0])
    w = open_window()
    assert w.open_conversation(ids[0])


# --------------------------------------------------------------------------- 7: wrong types

@pytest.mark.parametrize("field,value", [("current", ["a"]), ("current", {"x": 1}), ("title", {"t": 1}),
                                         ("settings", [1]), ("turns", {"a": 1}), ("trim_oldest", "yes")])
def test_a_wrong_type_in_a_conversation_is_ignored_or_one_reason(tmp_path, field, value):
    store, ids = _saved(tmp_path)
    _rewrite(tmp_path, ids[0], **{field: value})
    try:
        c = store.load(ids[0])
    except ConversationFormatError:
        return
    assert isinstance(c.title, str) and (c.current is None or c.current in c.turns)
    assert c.trim_oldest in (True, False) and isinstance(c.settings, dict)


def test_wrong_types_inside_an_answer_lose_its_figures_not_the_answer(tmp_path):
    store, ids = _saved(tmp_path)
    raw = _file(tmp_path, ids[0])
    answer = next(t for t in raw["turns"] if t["role"] == "assistant")
    answer["summary"]["new_tokens"] = "lots"
    answer["request"]["k"] = [5]
    answer["tokens"]["text"] = [1] * len(answer["tokens"]["status"])
    answer["model"] = 7
    (tmp_path / f"{ids[0]}.json").write_text(json.dumps(raw), encoding="utf-8")
    turn = store.load(ids[0]).turns[answer["id"]]
    assert turn.content == answer["content"] and turn.summary is None and turn.request is None
    assert turn.tokens is None and turn.model == ""


def test_search_keeps_working_past_a_damaged_file(open_window, qtbot, data):  # noqa: F811
    _, ids = _saved(data, 3)
    _rewrite(data, ids[0], current=["not", "a", "string"])
    w = open_window()
    w.sidebar.search.setText("Note 2.0: done")  # only in the damaged file's answers: the search parses it
    qtbot.waitUntil(lambda: w.sidebar.ids() == [ids[0]], timeout=5000)
    assert w.open_conversation(ids[0])
    w.sidebar.search.setText("zzz-nothing")
    qtbot.waitUntil(lambda: w.sidebar.ids() == [], timeout=5000)  # the search thread still answers
    w.sidebar.search.clear()
    qtbot.waitUntil(lambda: len(w.sidebar.ids()) == 3, timeout=5000)


# --------------------------------------------------------------------------- weak point: a huge damaged file

def test_a_damaged_file_is_parsed_once_not_at_every_list(tmp_path, monkeypatch):
    store, ids = _saved(tmp_path)
    (tmp_path / "junk.json").write_text("[" + "1," * 1000 + "oops", encoding="utf-8")
    store.list()
    opened: list[str] = []
    real = Path.read_bytes

    def spy(self: Path) -> bytes:
        opened.append(self.name)
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", spy)
    fresh = ConversationStore(tmp_path)  # the next start
    fresh.list()
    fresh.search("zzz")
    fresh.list()
    assert "junk.json" not in opened and [p.path.name for p in fresh.problems] == ["junk.json"]
    os.utime(tmp_path / "junk.json", ns=(1, 1))  # changed: read again
    fresh.list()
    assert "junk.json" in opened


def test_a_huge_file_is_not_read_at_all(tmp_path, monkeypatch):
    store, ids = _saved(tmp_path)
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.truncate(200 << 20)  # sparse: 200 MB on paper, nothing on disk
    opened: list[str] = []
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: opened.append(self.name) or real(self))
    headers = store.list()
    assert sorted(h.id for h in headers) == sorted(ids) and "huge.json" not in opened
    assert "too large" in store.problems[0].reason
