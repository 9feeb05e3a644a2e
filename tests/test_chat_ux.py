"""The chat at first sight and in daily use: the welcome pane, empty charts, the message box's placeholder,
draft text per conversation, collapsed pastes, and the hint before Regenerate repeats an answer."""
from __future__ import annotations

from dataclasses import replace

import pytest
from PySide6.QtCore import Qt

from app.ui.window import MainWindow
from tests.test_app import SCRIPT_TEXT, FakeEngine
from tests.test_chat_history import ask, data, open_window  # noqa: F401  (fixtures)
from widgets.chat.bubbles import COLLAPSE_LINES, PREVIEW_LINES


def test_a_new_chat_shows_the_welcome_pane_and_an_example_fills_the_box(open_window, qtbot):
    w: MainWindow = open_window()
    assert w.chat.showing_welcome()
    pane = w.chat.welcome
    assert pane.categories() == ["Code", "Explain", "Translate", "Summarise"]
    translate = next(b for b in pane.buttons if b.property("category") == "Translate")
    qtbot.mouseClick(translate, Qt.MouseButton.LeftButton)
    assert w.prompt.text() == translate.toolTip() and w.prompt.text().startswith("Translate into")
    assert w.prompt.edit.hasFocus()
    assert w.active_request is None  # filled, not sent
    with qtbot.waitSignal(w.answer_finished, timeout=10000):
        qtbot.keyClick(w.prompt.edit, Qt.Key.Key_Return)
    assert not w.chat.showing_welcome()
    w.new_chat()
    assert w.chat.showing_welcome()


def test_charts_say_no_data_yet_until_the_first_step(open_window, qtbot):
    w = open_window()
    assert w.charts.is_empty()
    ask(qtbot, w, "hello")
    w.charts.refresh()
    assert not w.charts.is_empty()
    for plot in w.charts.plots().values():  # pyqtgraph's SI prefix would turn 2,000 tok/s into "(×0.001)"
        assert not plot.getAxis("left").autoSIPrefix and not plot.getAxis("bottom").autoSIPrefix
    w.new_chat()
    w.charts.refresh()
    assert w.charts.is_empty()


def test_the_placeholder_is_never_cut_at_the_edge(qtbot):
    from widgets.chat.prompt_box import PLACEHOLDERS, PromptBox

    box = PromptBox()
    qtbot.addWidget(box)
    box.show()
    for width in (900, 420, 260, 160):
        box.resize(width, 80)
        qtbot.wait(1)
        edit = box.edit
        shown = edit.placeholderText()
        assert shown in PLACEHOLDERS
        fits = edit.fontMetrics().horizontalAdvance(shown) <= edit.viewport().width()
        assert fits or shown == PLACEHOLDERS[-1], (width, shown)
    box.resize(900, 80)
    qtbot.wait(1)
    assert box.edit.placeholderText() == PLACEHOLDERS[0]


def test_draft_text_stays_with_its_conversation(open_window, qtbot):
    w = open_window()
    ask(qtbot, w, "first conversation")
    first = w.session.conversation.id
    w.prompt.set_text("half-typed for the first")
    w.new_chat()
    assert w.prompt.text() == ""  # the new conversation starts with an empty box
    ask(qtbot, w, "second conversation")
    second = w.session.conversation.id
    w.prompt.set_text("half-typed for the second")
    assert w.open_conversation(first)
    assert w.prompt.text() == "half-typed for the first"
    assert w.open_conversation(second)
    assert w.prompt.text() == "half-typed for the second"
    w.prompt.set_text("")
    assert w.open_conversation(first) and w.open_conversation(second)
    assert w.prompt.text() == ""  # emptied there: nothing comes back


def test_a_huge_paste_is_collapsed_in_the_chat_but_sent_and_saved_whole(open_window, qtbot):
    engine = FakeEngine()
    w = open_window(engine)
    paste = "\n".join(f"{i}" for i in range(600))  # fits the fake pair's context
    ask(qtbot, w, paste)
    bubble = w.chat.user_bubble(0)
    assert bubble.is_collapsed()
    shown = bubble.label.text()
    assert shown.count("\n") == PREVIEW_LINES - 1 and "599" not in shown
    assert bubble.expand_button.text() == f"… {600 - PREVIEW_LINES:,} more lines · show all"
    # What was sent and saved is the whole paste; Copy copies all of it.
    assert engine.requests[-1].messages[-1].content == paste
    assert w.history()[0].content == paste
    assert w.chat.message_text(w.chat.message_count() - 2) == paste
    bubble.expand_button.click()
    assert not bubble.is_collapsed() and bubble.label.text() == paste
    bubble.expand_button.click()
    assert bubble.is_collapsed()
    # A short question is shown as it is.
    ask(qtbot, w, "\n".join(["short"] * COLLAPSE_LINES))
    assert not w.chat.user_bubble(1).is_collapsed() and w.chat.user_bubble(1).expand_button is None


def test_regenerate_at_t0_offers_to_raise_the_temperature(open_window, qtbot):
    engine = FakeEngine()
    w = open_window(engine)
    first = ask(qtbot, w, "question")
    assert w.panel.values().temperature == 0
    w.chat._assistants[first].regenerate_button.click()
    hint = w.chat.hint()
    assert hint is not None and "same answer" in hint.plain_text() and w.active_request is None
    assert len(engine.requests) == 1
    with qtbot.waitSignal(w.answer_finished, timeout=10000):
        hint.buttons[0].click()  # "Raise to T = 0.7 and regenerate"
    assert engine.requests[-1].sampling.temperature == pytest.approx(0.7)
    assert w.panel.values().temperature == pytest.approx(0.7)  # it stays raised, as the hint said
    assert w.chat.hint() is None
    # At T > 0 Regenerate asks nothing.
    with qtbot.waitSignal(w.answer_finished, timeout=10000):
        assert w.regenerate() is not None
    assert w.chat.hint() is None
    # Cancel asks for nothing and leaves the settings alone.
    w.panel.set_values(replace(w.panel.values(), temperature=0.0))
    w.regenerate()
    w.chat.hint().dismiss_button.click()
    assert w.chat.hint() is None and w.active_request is None and w.panel.values().temperature == 0
    assert w.history()[-1].content == SCRIPT_TEXT
