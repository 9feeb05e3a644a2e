"""Saved conversations: the tree, the files (atomic under kill -9), damaged and foreign files, search."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app.core.chat_tree import Conversation, ConversationFormatError, StoredTokens, messages_fitting
from app.core.conversations import BackgroundWriter, ConversationStore, default_folder
from app.core.demo import scripted_steps
from engine.measure.stats import summarize
from engine.types import GenerationRequest, Message, Sampling

ROOT = Path(__file__).resolve().parents[1]


def answered(conversation: Conversation, question: str, answer: str, parent: str | None = None) -> str:
    """Adds a question and a finished answer (with tokens and figures); returns the answer's id."""
    q = conversation.add(parent if parent is not None else conversation.current, "user", question)
    steps = scripted_steps(answer, k=4, acceptance=0.7, seed=len(conversation.turns))
    summary = summarize(steps, mode="speculative", k=4, prompt_tokens=9, seconds=0.5, stop_reason="eos")
    a = conversation.add(q.id, "assistant", answer, model="t + d",
                         request=GenerationRequest(k=4, sampling=Sampling(temperature=0.7, seed=3)),
                         summary=summary, tokens=StoredTokens.from_steps(steps))
    return a.id


def test_tokens_round_trip_to_steps_with_the_same_text_and_statuses():
    steps = scripted_steps("def f(x):\n    return x  # 你好\n", k=5, acceptance=0.6, seed=2)
    stored = StoredTokens.from_steps(steps)
    replay = stored.to_steps()
    assert "".join(s.text for s in replay) == "".join(s.text for s in steps)
    assert [t.status for s in replay for t in s.tokens] == [t.status for s in steps for t in s.tokens]
    assert len(replay) == len(steps)  # a step ends at the target's own token


def test_conversation_tree_forks_on_edit_and_regenerate():
    c = Conversation()
    a1 = answered(c, "first question", "first answer")
    a2 = answered(c, "second question", "second answer")
    q2 = c.turns[a2].parent
    # Edit the second question: a sibling under the same parent, shown instead of the old one.
    edited = c.add(c.turns[q2].parent, "user", "second question, edited")
    assert [t.content for t in c.path()] == ["first question", "first answer", "second question, edited"]
    assert [t.id for t in c.siblings(edited.id)] == [q2, edited.id]
    # The old branch is still there and can be shown again, down to its answer.
    c.switch_to(q2)
    assert c.current == a2
    # Regenerate the first answer: a sibling answer; the path ends there.
    again = c.add(c.turns[a1].parent, "assistant", "first answer, again")
    assert [t.content for t in c.path()] == ["first question", "first answer, again"]
    assert len(c.siblings(again.id)) == 2
    assert c.title == "first question"
    assert c.messages() == (Message("user", "first question"), Message("assistant", "first answer, again"))


def test_messages_fitting_drops_whole_oldest_turns():
    msgs = [Message("user", "q1"), Message("assistant", "a1"), Message("user", "q2"), Message("assistant", "a2"),
            Message("user", "q3")]
    counts = [10, 50, 10, 50, 10]
    assert messages_fitting(msgs, counts, 1000) == 0
    assert messages_fitting(msgs, counts, 70) == 2  # q1 + a1 go; q2 starts the kept context
    assert messages_fitting(msgs, counts, 5) == 4  # the newest question always stays


def test_save_and_reload_keeps_everything(tmp_path):
    store = ConversationStore(tmp_path)
    c = Conversation(settings={"k": 4})
    a1 = answered(c, "解释快速排序", "```python\nprint('hi')\n```")
    c.rename("Quicksort, renamed")
    store.save(c)
    back = store.load(c.id)
    assert back.to_json() == c.to_json()
    turn = back.turns[a1]
    assert turn.summary is not None and turn.summary.text == turn.content
    assert turn.request is not None and turn.request.sampling.temperature == 0.7
    assert turn.tokens is not None and "".join(s.text for s in turn.tokens.to_steps()) == turn.content
    # The file is JSON a person can read, Chinese included.
    assert "解释快速排序" in (tmp_path / f"{c.id}.json").read_text(encoding="utf-8")
    headers = store.list()
    assert [(h.id, h.title, h.turns) for h in headers] == [(c.id, "Quicksort, renamed", 2)]


def test_a_summary_keeps_its_decision_and_older_files_without_new_figures_still_load():
    from dataclasses import replace

    from app.core.chat_tree import _summary_from, _summary_json
    from engine.types import Decision

    steps = scripted_steps("a b c d e", k=4, acceptance=0.7, seed=1, adaptive=True)
    summary = summarize(steps, mode="auto", k=0, prompt_tokens=9, seconds=0.5, stop_reason="eos", prefill_s=0.1)
    assert isinstance(summary.decision, Decision)
    assert _summary_from(json.loads(json.dumps(_summary_json(summary))), summary.text) == summary
    old = _summary_json(replace(summary, decision=None))
    for name in ("k_mean", "standard_steps", "prefill_s", "draft_s", "verify_s", "overhead_s", "decision"):
        old.pop(name)
    back = _summary_from(old, summary.text)
    assert back is not None and back.new_tokens == summary.new_tokens and back.decision is None


def test_list_uses_the_index_and_notices_changed_files(tmp_path):
    store = ConversationStore(tmp_path)
    ids = []
    for i in range(5):
        c = Conversation()
        answered(c, f"question {i}", f"answer {i}")
        store.save(c)
        ids.append(c.id)
    assert len(store.list()) == 5
    # A fresh store (a new start) lists from the index without opening the files...
    fresh = ConversationStore(tmp_path)
    opened: list[Path] = []
    original = Path.read_bytes

    def spy(self):
        opened.append(self)
        return original(self)

    try:
        Path.read_bytes = spy  # type: ignore[method-assign]
        assert len(fresh.list()) == 5
        assert [p.name for p in opened] == ["index.json"]
        # ...and reads again a file changed behind its back.
        c = fresh.load(ids[0])
        c.rename("changed elsewhere")
        other = ConversationStore(tmp_path)
        other.save(c)
        opened.clear()
        fresh._index = {}  # as after a restart: read the index file again
        titles = {h.id: h.title for h in fresh.list()}
    finally:
        Path.read_bytes = original  # type: ignore[method-assign]
    assert titles[ids[0]] == "changed elsewhere"


def test_damaged_and_foreign_files_are_reported_and_skipped(tmp_path):
    store = ConversationStore(tmp_path)
    good = Conversation()
    answered(good, "keep me", "kept")
    store.save(good)
    (tmp_path / "broken.json").write_text('{"format": "specdec-studio.conversation", "vers', encoding="utf-8")
    (tmp_path / "other.json").write_text('{"name": "somebody else\'s file"}', encoding="utf-8")
    (tmp_path / "future.json").write_text(json.dumps(
        {"format": "specdec-studio.conversation", "version": 99, "id": "future", "turns": []}), encoding="utf-8")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00garbage")
    (tmp_path / "notes.txt").write_text("hello", encoding="utf-8")
    headers = store.list()
    assert [h.id for h in headers] == [good.id]
    reasons = {p.path.name: p.reason for p in store.problems}
    assert set(reasons) == {"broken.json", "other.json", "future.json", "binary.json", "notes.txt"}
    assert "not valid JSON" in reasons["broken.json"]
    assert "not a SpecDec Studio conversation" in reasons["other.json"]
    assert "newer" in reasons["future.json"]
    # Nothing was deleted or rewritten.
    assert (tmp_path / "broken.json").read_text(encoding="utf-8").endswith('"vers')
    with pytest.raises(ConversationFormatError):
        store.load("other")


def test_a_file_nested_too_deeply_is_damage_not_a_crash(tmp_path):
    """A conversation (or index) file of "[[[[…" would raise RecursionError from json: the app must still start."""
    store = ConversationStore(tmp_path)
    good = Conversation()
    answered(good, "keep me", "kept")
    store.save(good)
    (tmp_path / "deep.json").write_text("[" * 100_000, encoding="utf-8")
    (tmp_path / "index.json").write_text("{" * 100_000, encoding="utf-8")
    again = ConversationStore(tmp_path)
    assert [h.id for h in again.list()] == [good.id]
    assert {p.path.name: p.reason for p in again.problems}["deep.json"] == "damaged: nested too deeply"
    with pytest.raises(ConversationFormatError):
        again.load("deep")
    assert again.search("keep") == [good.id]


def test_a_failed_write_leaves_the_previous_file(tmp_path, monkeypatch):
    store = ConversationStore(tmp_path)
    c = Conversation()
    answered(c, "before", "the old answer")
    store.save(c)
    before = store.path_of(c.id).read_bytes()
    answered(c, "after", "x" * 100_000)

    def disk_full(fd, data):
        os.write(fd, bytes(data[:1000]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("app.core.conversations._write_all", disk_full)
    with pytest.raises(OSError):
        store.save(c)
    assert store.path_of(c.id).read_bytes() == before
    assert not list(tmp_path.glob(".*.tmp")), "the partial temp file is removed"


def test_kill_9_mid_write_leaves_the_previous_file(tmp_path):
    """A real crash: a child process is killed with SIGKILL halfway through writing a big conversation."""
    store = ConversationStore(tmp_path)
    c = Conversation()
    answered(c, "before the crash", "the answer that must survive")
    store.save(c)
    before = store.path_of(c.id).read_bytes()
    child = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        import app.core.conversations as conv
        store = conv.ConversationStore({str(tmp_path)!r})
        c = store.load({c.id!r})
        c.add(c.current, "user", "y" * 2_000_000)
        def slow(fd, data):
            os.write(fd, bytes(data[: len(data) // 2]))
            print("half", flush=True)
            time.sleep(60)
        conv._write_all = slow
        store.save(c)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "half"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert list(tmp_path.glob(".*.tmp")), "the interrupted write left its temp file"
    assert store.path_of(c.id).read_bytes() == before
    again = ConversationStore(tmp_path)  # the next start: the old conversation is intact, the temp file gone
    assert [h.title for h in again.list()] == ["before the crash"] and not again.problems
    assert again.load(c.id).path()[-1].content == "the answer that must survive"
    assert not list(tmp_path.glob(".*.tmp"))


def test_delete_and_undo(tmp_path):
    store = ConversationStore(tmp_path)
    c = Conversation()
    answered(c, "delete me", "soon gone")
    store.save(c)
    store.delete(c.id)
    assert store.list() == []
    assert store.restore(c.id)
    assert [h.id for h in store.list()] == [c.id]
    store.delete(c.id)
    ConversationStore(tmp_path)  # the next start empties the trash: no undo across restarts
    assert not store.restore(c.id)


def test_search_finds_text_in_any_message_and_branch(tmp_path):
    store = ConversationStore(tmp_path)
    first = Conversation()
    answered(first, "How do I sort?", "Use quicksort: 快速排序 is fast.\nSecond line")
    second = Conversation()
    a = answered(second, "Tell me about heaps", "A heap is a tree.")
    second.add(second.turns[a].parent, "assistant", "Binary HEAP, regenerated")
    second.switch_to(second.turns[a].id)
    for c in (first, second):
        store.save(c)
    assert store.search("QUICKSORT") == [first.id]
    assert store.search("快速排序") == [first.id]
    assert store.search("regenerated") == [second.id]  # a branch not shown still counts
    assert store.search("fast.\nsecond") == [first.id]  # across an escaped newline
    assert sorted(store.search("")) == sorted([first.id, second.id])
    assert store.search("nowhere to be found") == []


def test_background_writer_saves_the_newest_snapshot(tmp_path):
    store = ConversationStore(tmp_path)
    errors: list[tuple[str, str]] = []
    writer = BackgroundWriter(store, on_error=lambda cid, msg: errors.append((cid, msg)))
    c = Conversation()
    for i in range(20):
        answered(c, f"q{i}", f"a{i}")
        writer.save(c)
    writer.close()
    assert len(store.load(c.id).turns) == 40 and not errors


def test_default_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_DATA_DIR", str(tmp_path))
    assert default_folder() == tmp_path / "conversations"
    monkeypatch.delenv("SPECDEC_DATA_DIR")
    assert "SpecDec Studio" in str(default_folder())


def test_a_conversation_opened_while_its_save_is_still_on_the_disk_opens_whole(tmp_path, monkeypatch):
    """The writer saves on its own thread; opening the conversation before the slow disk has the file waits for
    that save instead of failing with "No such file" (a first save) or showing an older version."""
    import threading

    from app.core.session import ChatSession

    store = ConversationStore(tmp_path)
    release = threading.Event()
    write = store.write

    def slow_write(snapshot):
        release.wait(5)
        write(snapshot)

    monkeypatch.setattr(store, "write", slow_write)
    session = ChatSession(store=store)
    first = session.conversation
    answered(first, "q0", "a0")
    session.save()
    session.new_chat()
    threading.Timer(0.2, release.set).start()  # the disk answers only after open() has started waiting
    session.open(first.id)
    assert session.conversation.id == first.id and len(session.conversation.turns) == 2
    answered(session.conversation, "q1", "a1")  # a second save of the same conversation, queued behind the first
    release.clear()
    session.save()
    session.new_chat()
    threading.Timer(0.2, release.set).start()
    session.open(first.id)
    assert len(session.conversation.turns) == 4  # the newest version, not the one already on disk
    session.close()
