"""Widget tests with pytest-qt, fed by hand-made Steps (no engine, no torch)."""
from __future__ import annotations

import time

import numpy as np
import pytest
from PySide6.QtCore import QPoint
from PySide6.QtGui import QColor, QGuiApplication, QTextCursor
from PySide6.QtWidgets import QApplication

from engine.measure.stats import summarize
from engine.types import GenerationRequest, Sampling, Step, Summary, TokenView
from widgets.palette import STATUSES, current_palette, load_stylesheet
from widgets.stats_line import format_stats_line

_next_id = iter(range(10**9))


def spec_step(
    index: int,
    accepted: list[str],
    rejected: list[str],
    added: str | None,
    *,
    total_before: int = 0,
    draft_ms: float = 2.0,
    verify_ms: float = 8.0,
    elapsed_s: float | None = None,
) -> Step:
    """A speculative Step: K = accepted + rejected drafts, then a correction (or a bonus after K hits)."""
    k = len(accepted) + len(rejected)
    tokens: list[TokenView] = []
    for i, text in enumerate(accepted):
        tokens.append(TokenView(next(_next_id), text, "accepted", index, i, 0.8, 0.9, 1.0, "draft"))
    for j, text in enumerate(rejected):
        tokens.append(TokenView(next(_next_id), text, "rejected", index, len(accepted) + j, 0.6, 0.15, 0.25, "draft"))
    added_status = None
    if added is not None:
        added_status = "corrected" if rejected else "bonus"
        tokens.append(TokenView(next(_next_id), added, added_status, index, None, None, 0.7, None, None))
    new_tokens = len(accepted) + (added is not None)
    return Step(
        index=index,
        mode="speculative",
        proposed=tuple(range(k)),
        proposed_q=(0.8,) * k,
        proposed_p=(0.9,) * k,
        sources=("draft",) * k,
        accepted=len(accepted),
        added=1 if added is not None else None,
        added_status=added_status,
        tokens=tuple(tokens),
        text="".join(accepted) + (added or ""),
        new_tokens=new_tokens,
        total_tokens=total_before + new_tokens,
        draft_ms=draft_ms,
        verify_ms=verify_ms,
        elapsed_s=elapsed_s if elapsed_s is not None else (index + 1) * (draft_ms + verify_ms) / 1000,
    )


def standard_step(index: int, text: str, *, total_before: int = 0, ms: float = 10.0) -> Step:
    token = TokenView(next(_next_id), text, "target", index, None, None, 0.95, None, None)
    return Step(
        index=index, mode="standard", proposed=(), proposed_q=(), proposed_p=(), sources=(), accepted=0,
        added=1, added_status="target", tokens=(token,), text=text, new_tokens=1,
        total_tokens=total_before + 1, draft_ms=0.0, verify_ms=ms, elapsed_s=(index + 1) * ms / 1000,
    )


def script_steps() -> list[Step]:
    """Three steps: partial accept + correction, all accepted + bonus, and a Chinese step."""
    return [
        spec_step(0, ["Hello", " world"], [" foo", " bar"], ","),  # "Hello world,"
        spec_step(1, [" this", " is", " fine"], [], ".", total_before=3),  # bonus
        spec_step(2, ["\n", "快速", ""], ["错误"], "排序", total_before=7),  # "" = incomplete char
    ]


def background_at(view, position: int) -> QColor:
    cursor = QTextCursor(view.document())
    cursor.setPosition(position + 1)  # the format of the character before the cursor
    return cursor.charFormat().background().color()


def char_format_at(view, position: int):
    cursor = QTextCursor(view.document())
    cursor.setPosition(position + 1)
    return cursor.charFormat()


@pytest.fixture
def token_view(qtbot):
    from widgets.token_text import TokenTextView

    view = TokenTextView()
    qtbot.addWidget(view)
    view.resize(500, 300)
    return view


# --- TokenTextView ---------------------------------------------------------------------------


def test_colours_per_status_at_character_ranges(token_view):
    token_view.append_steps(script_steps()[:2])
    palette = current_palette()
    text = token_view.plain_text()
    assert text == "Hello world, this is fine."
    spans = token_view.token_spans()
    assert [s[2] for s in spans] == ["accepted", "accepted", "corrected", "accepted", "accepted", "accepted", "bonus"]
    for start, end, status in spans:
        for pos in range(start, end):
            fmt = char_format_at(token_view, pos)
            assert fmt.background().color() == palette.colours(status).background, (pos, status)
            assert fmt.foreground().color() == palette.colours(status).foreground
            assert not fmt.fontStrikeOut()
    assert text[spans[2][0]:spans[2][1]] == ","


def test_rejected_drafts_never_enter_the_words_being_read(token_view, qtbot):
    # "list" then a rejected " 1 2" then the correction "):" — the text reads "list):", never "list 1 2):".
    token_view.show()
    qtbot.waitExposed(token_view)
    steps = [spec_step(0, ["def", " f", "(list"], [" 1", " 2"], "):"),
             spec_step(1, ["\n", "   "], ["\t "], " return", total_before=4)]
    token_view.append_steps(steps)
    assert token_view.plain_text() == "def f(list):\n    return"
    assert all(status != "rejected" for *_, status in token_view.token_spans())
    # One mark per step with rejects, exactly where the drafts were rejected.
    assert token_view.mark_positions() == [len("def f(list"), len("def f(list):\n   ")]
    tip = token_view.mark_tooltip(0)
    assert "Rejected here: “ 1 2”" in tip and "draft q=0.60 · target p=0.15" in tip
    assert "“⇥ ”" in token_view.mark_tooltip(1)  # whitespace made visible, not a blank tooltip
    # The corrected token after the mark names the drafts it replaced.
    assert "Rejected here: “ 1 2”" in token_view.tooltip_at(len("def f(list"))
    # The marks are painted: the pixel under the first one has the mark's colour.
    rect = token_view.mark_rects()[0]
    image = token_view.viewport().grab().toImage()
    mark = current_palette().ghost.mark
    found = any(QColor(image.pixel(x, y)).red() > 150 and QColor(image.pixel(x, y)).green() < 120
                for x in range(rect.left() - 2, rect.left() + 3) for y in range(rect.bottom() - 3, rect.bottom() + 1))
    assert found, f"no {mark.name()} mark under {rect}"
    token_view.set_show_rejected(False)
    assert token_view.mark_positions() == [] and token_view.plain_text() == "def f(list):\n    return"
    token_view.set_show_rejected(True)
    assert len(token_view.mark_positions()) == 2


def test_flash_shows_the_newest_rejects_briefly_then_only_the_mark(token_view, qtbot):
    token_view.set_rejected_display("flash")
    steps = script_steps()
    token_view.append_steps(steps[:1])
    assert token_view.plain_text() == "Hello world foo bar,"  # the newest step's rejects, faded, no strike
    assert not char_format_at(token_view, len("Hello world ")).fontStrikeOut()
    qtbot.waitUntil(lambda: token_view.plain_text() == "Hello world,", timeout=2000)
    assert token_view.mark_positions() == [len("Hello world")]
    token_view.append_steps(steps[1:])  # a batch: only its last step flashes
    assert token_view.plain_text() == "Hello world, this is fine.\n快速错误排序"
    token_view.finish()
    assert token_view.plain_text() == "Hello world, this is fine.\n快速排序"
    text = token_view.plain_text()
    assert "".join(text[s:e] for s, e, _ in token_view.token_spans()) == text
    with pytest.raises(ValueError):
        token_view.set_rejected_display("strike")


def test_colouring_toggle(token_view):
    token_view.append_steps(script_steps())
    palette = current_palette()
    token_view.set_colouring(False)
    for start, end, status in token_view.token_spans():
        fmt = char_format_at(token_view, start)
        assert fmt.background().style().name == "NoBrush"
    token_view.set_colouring(True)
    start = token_view.token_spans()[0][0]
    assert background_at(token_view, start) == palette.colours("accepted").background
    assert len(token_view.mark_positions()) == 2  # re-rendered with its marks


def test_chinese_and_empty_token_text(token_view):
    token_view.append_steps(script_steps())
    text = token_view.plain_text()
    assert text.endswith("\n快速排序")
    # The "" token has no span; every shown span has text.
    assert all(e > s for s, e, _ in token_view.token_spans())
    start = text.index("快速")
    assert token_view.token_at(start).text == "快速"
    assert token_view.mark_positions()[-1] == text.index("排序")


def test_tooltip_text(token_view):
    token_view.append_steps(script_steps())
    text = token_view.plain_text()
    assert token_view.tooltip_at(text.index("world")) == (
        "draft q=0.80 · target p=0.90 · accept prob=1.00 · draft position 2/4 · step 0 · status accepted"
        " · proposer draft"
    )
    assert token_view.tooltip_at(text.index(",")) == (
        "target p=0.70 · step 0 · status corrected\nRejected here: “ foo bar” (step 0)\n"
        "  “ foo”: draft q=0.60 · target p=0.15 · accept prob=0.25 · draft position 3/4 · proposer draft\n"
        "  “ bar”: draft q=0.60 · target p=0.15 · accept prob=0.25 · draft position 4/4 · proposer draft"
    )
    assert token_view.tooltip_at(text.index("this")) .endswith("status accepted · proposer draft")
    assert token_view.tooltip_at(len(text) + 5) is None


def test_tooltip_for_target_token_and_mouse_mapping(token_view, qtbot):
    token_view.append_steps([standard_step(0, "alpha"), standard_step(1, " beta", total_before=1)])
    token_view.show()
    qtbot.waitExposed(token_view)
    assert token_view.tooltip_at(0) == "target p=0.95 · step 0 · status target"
    cursor = QTextCursor(token_view.document())
    cursor.setPosition(7)  # inside " beta"
    rect = token_view.cursorRect(cursor)
    position = token_view.position_at(rect.center() + QPoint(2, 0))
    assert token_view.tooltip_at(position) == "target p=0.95 · step 1 · status target"
    assert token_view.position_at(QPoint(480, 280)) == -1


def test_many_tokens_in_batches(token_view, qtbot):
    token_view.show()
    qtbot.waitExposed(token_view)
    steps = []
    total = 0
    for i in range(1000):
        step = spec_step(i, [" tok", "en", "s"], [" no"], " ok", total_before=total)
        total = step.total_tokens
        steps.append(step)
    started = time.perf_counter()
    for i in range(0, len(steps), 25):  # ~25 steps per 15 Hz tick
        token_view.append_steps(steps[i : i + 25])
        QApplication.processEvents()  # layout and paint each batch, as the app's timer would
    appended = time.perf_counter() - started
    token_view.set_show_rejected(False)
    QApplication.processEvents()
    toggled = time.perf_counter() - started - appended
    token_view.finish()
    print(f"\n5,000 tokens appended in {appended:.3f} s; ghost toggle re-render {toggled:.3f} s")
    assert len(token_view.tokens()) == 5000
    assert token_view.plain_text() == token_view.committed_text()
    assert len(token_view.mark_positions()) == 0  # hidden
    token_view.set_show_rejected(True)
    assert len(token_view.mark_positions()) == 1000 and token_view.plain_text() == token_view.committed_text()


# --- ChatView --------------------------------------------------------------------------------


def make_summary(steps: list[Step]) -> Summary:
    return summarize(steps, mode="speculative", k=4, prompt_tokens=10, seconds=0.5, stop_reason="eos")


@pytest.fixture
def chat(qtbot):
    from widgets.chat.view import ChatView

    view = ChatView()
    qtbot.addWidget(view)
    view.resize(600, 400)
    view.show()
    qtbot.waitExposed(view)
    return view


def test_chat_flow(chat, qtbot):
    steps = script_steps()
    assert chat.add_user_message("Sort this 快速") == 0
    chat.begin_assistant_message(7, "target 1.5B · speculative K=4")
    chat.append_steps(7, steps[:2])
    chat.append_steps(7, steps[2:])
    assert not chat.regenerate_visible(7)  # not while streaming
    summary = make_summary(steps)
    chat.finish_assistant_message(7, summary, format_stats_line(summary))
    assert chat.message_text(0) == "Sort this 快速"
    assert chat.message_text(1) == "Hello world, this is fine.\n快速排序"
    assert chat.regenerate_visible(7)
    chat.copy_message(1)
    assert QGuiApplication.clipboard().text() == "Hello world, this is fine.\n快速排序"
    with qtbot.waitSignal(chat.regenerate_requested, timeout=1000):
        chat._assistants[7].regenerate_button.click()
    # Every finished answer can be regenerated, not only the last one.
    chat.add_user_message("again")
    chat.begin_assistant_message(8, "")
    chat.append_steps(8, steps[:1])
    chat.fail_assistant_message(8, "CUDA out of memory")
    assert chat.message_text(3) == "Hello world,"
    assert chat._assistants[8].error.text() == "⚠ CUDA out of memory"
    assert chat.regenerate_visible(8) and chat.regenerate_visible(7)
    chat.set_busy(True)  # an answer is streaming: no regenerate meanwhile
    assert not chat.regenerate_visible(8) and not chat.regenerate_visible(7)
    chat.set_busy(False)
    assert chat.add_system_note("model loaded") == 4
    chat.remove_assistant_message(8)  # Regenerate replaces the last answer
    assert chat.message_count() == 4 and chat.token_view(8) is None
    assert chat.regenerate_visible(7)
    chat.set_show_rejected(False)
    assert "foo" not in chat.token_view(7).plain_text()
    chat.set_colouring(False)
    assert not chat.token_view(7).colouring()
    chat.clear()
    assert chat.message_count() == 0


def test_chat_follows_bottom_unless_scrolled_up(chat, qtbot):
    chat.add_user_message("long please")
    chat.begin_assistant_message(1, "")
    total = 0
    for i in range(60):
        step = spec_step(i, ["line", "\n"], [], "x\n", total_before=total)
        total = step.total_tokens
        chat.append_steps(1, [step])
        qtbot.wait(1)
    bar = chat.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0 and bar.value() == bar.maximum(), timeout=2000)
    bar.setValue(0)  # the reader scrolls up
    assert not chat.is_following()
    chat.append_steps(1, [spec_step(60, ["more", "\n"], [], "y\n", total_before=total)])
    qtbot.wait(20)
    assert bar.value() == 0


# --- stats line ------------------------------------------------------------------------------


def test_stats_line():
    steps = script_steps()
    summary = make_summary(steps)
    line = format_stats_line(summary, GenerationRequest(k=4))
    split = (f"draft {summary.draft_s / summary.seconds:.0%} / verify {summary.verify_s / summary.seconds:.0%} / "
             f"other {1 - (summary.draft_s + summary.verify_s) / summary.seconds:.0%} of the time")
    assert line == ("speculative · K=4 · 73% accepted · 3.7 tokens/step · 22 tok/s · 11 tokens · 0.5 s · "
                    f"first token {steps[0].elapsed_s:.1f} s · " + split)
    sampled = GenerationRequest(k=4, sampling=Sampling(temperature=0.7))
    assert format_stats_line(summary, sampled).endswith("· T=0.7")
    std = summarize([standard_step(i, "a") for i in range(128)], mode="standard", k=0, prompt_tokens=3,
                    seconds=10.1, stop_reason="max_new_tokens")
    assert format_stats_line(std).startswith("standard · 1.0 tokens/step · 13 tok/s · 128 tokens · 10.1 s · "
                                             f"first token {std.first_token_s:.1f} s · draft 0% / ")


# --- legend, palette --------------------------------------------------------------------------


def test_legend_and_palette(qtbot):
    from widgets.legend import Legend

    legend = Legend()
    qtbot.addWidget(legend)
    for status in STATUSES:
        assert status in legend.chip(status).text()
        assert status in legend.chip(status).toolTip()
    # The legend says what the text shows of rejected drafts: the mark, and that hovering it gives q/p.
    assert "▲" in legend.chip("rejected").text() and "hover" in legend.chip("rejected").toolTip()
    assert "QFrame#assistantBubble" in load_stylesheet()


# --- LiveCharts ------------------------------------------------------------------------------


@pytest.fixture
def charts(qtbot):
    from widgets.charts import LiveCharts

    view = LiveCharts()
    qtbot.addWidget(view)
    return view


def test_chart_series(charts):
    steps = script_steps()
    charts.push_steps(steps)
    charts.refresh()
    s = charts.series()
    assert list(s["step"]) == [0, 1, 2]
    assert list(s["k"]) == [4, 3, 4]
    assert list(s["accepted"]) == [2, 3, 3]
    # Rolling acceptance: (2)/4, (2+3)/7, (2+3+3)/11.
    np.testing.assert_allclose(s["acceptance_rate"], [50.0, 500 / 7, 800 / 11])
    # Per step: new tokens / (draft + verify) = 3/0.01, 4/0.01, 4/0.01.
    np.testing.assert_allclose(s["tokens_per_s"], [300.0, 400.0, 400.0])
    # Positions 1..4 reached 3,3,3,1 times, accepted 3,3,2,0 times — same as engine.measure.stats.
    np.testing.assert_allclose(s["position_acceptance"], [100.0, 100.0, 200 / 3, 0.0])
    expected = np.array(make_summary(steps).per_position_acceptance) * 100
    np.testing.assert_allclose(s["position_acceptance"], expected)
    # Rolling rate over wall clock: 11 tokens in 30 ms since the first step started.
    assert s["tokens_per_s_rolling"][-1] == pytest.approx(11 / 0.03)
    charts.reset()
    assert len(charts.series()["step"]) == 0


def test_chart_standard_steps_and_ring_buffer(qtbot):
    from widgets.charts import LiveCharts

    charts = LiveCharts(capacity=64)
    qtbot.addWidget(charts)
    charts.push_steps([standard_step(i, "a", total_before=i) for i in range(100)])
    charts.refresh()
    s = charts.series()
    assert 32 <= len(s["step"]) <= 64
    assert s["step"][-1] == 99 and np.all(np.diff(s["step"]) == 1)
    assert np.isnan(s["acceptance_rate"]).all() and np.isnan(s["k"]).all()
    np.testing.assert_allclose(s["tokens_per_s"], 100.0)
    np.testing.assert_allclose(s["tokens_per_s_rolling"][-1], 100.0)
    assert len(s["position_acceptance"]) == 0


def test_chart_plots_the_k_chosen_and_the_time_split(charts):
    """Auto mode: a standard step the controller chose is K = 0 (not a gap); a short n-gram match
    under a larger K shows the K chosen; every step's drafting, verifying and overhead times."""
    from dataclasses import replace

    from engine.types import Decision

    chosen_standard = replace(standard_step(0, "a"), decision=Decision(0, None, "no_gain", 0.4, 1.0, 2, 0.9),
                              overhead_ms=1.5)
    drafted = replace(spec_step(1, ["b"], [], "c", total_before=1), decision=Decision(4, "ngram", "best", 0.8, 1.4, 4, 1.4),
                      overhead_ms=0.5)
    plain = standard_step(2, "d", total_before=3)  # standard mode: no K at all
    charts.push_steps([chosen_standard, drafted, plain])
    charts.refresh()
    s = charts.series()
    assert s["k"][0] == 0 and s["k"][1] == 4 and np.isnan(s["k"][2])
    assert list(s["accepted"][:2]) == [0, 1]
    np.testing.assert_allclose(s["draft_ms"], [0.0, 2.0, 0.0])
    np.testing.assert_allclose(s["verify_ms"], [10.0, 8.0, 10.0])
    np.testing.assert_allclose(s["overhead_ms"], [1.5, 0.5, 0.0])
    assert "time_split" in charts.plots()


def test_stats_line_says_what_auto_decided():
    from dataclasses import replace

    from engine.types import Decision

    no_gain = Decision(0, None, "no_gain", 0.41, 1.0, 2, 0.91)
    steps = [replace(standard_step(i, "a", total_before=i), decision=no_gain) for i in range(3)]
    summary = summarize(steps, mode="auto", k=0, prompt_tokens=3, seconds=0.05, stop_reason="eos")
    line = format_stats_line(summary, GenerationRequest(mode="auto", k=0, proposer="draft"))
    assert line.startswith("auto · K auto, mean 0.0 · 100% standard steps")
    assert line.endswith("standard here: at 41% acceptance the draft costs more than it saves (best K=2: 0.91x)")


def test_chart_zero_time_step_is_guarded(charts):
    charts.push_steps([spec_step(0, ["a"], [], "b", draft_ms=0.0, verify_ms=0.0, elapsed_s=0.0)])
    charts.refresh()
    assert np.isnan(charts.series()["tokens_per_s"][0])


def test_widgets_never_import_torch():
    import ast
    from pathlib import Path

    for path in Path(__file__).resolve().parents[1].joinpath("widgets").glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert name.split(".")[0] not in {"torch", "transformers"}, f"{path.name} imports {name}"


def test_tooltip_event_shows_token_numbers(token_view, qtbot):
    from PySide6.QtCore import QEvent
    from PySide6.QtGui import QHelpEvent
    from PySide6.QtWidgets import QToolTip

    token_view.append_steps(script_steps())
    token_view.show()
    qtbot.waitExposed(token_view)
    cursor = QTextCursor(token_view.document())
    cursor.setPosition(token_view.plain_text().index("world") + 2)
    point = token_view.cursorRect(cursor).center()
    event = QHelpEvent(QEvent.Type.ToolTip, point, token_view.viewport().mapToGlobal(point))
    QApplication.sendEvent(token_view.viewport(), event)
    assert QToolTip.text().startswith("draft q=0.80 · target p=0.90")


def test_chat_streams_a_long_answer(chat, qtbot):
    chat.begin_assistant_message(3, "long")
    total = 0
    started = time.perf_counter()
    for batch in range(40):  # 5,000 tokens, with a line break now and then
        steps = []
        for i in range(25):
            index = batch * 25 + i
            step = spec_step(index, [" word", "s", "\n" if i == 24 else " x"], [" no"], " ok", total_before=total)
            total = step.total_tokens
            steps.append(step)
        chat.append_steps(3, steps)
        QApplication.processEvents()
    print(f"\nchat: 5,000 tokens streamed in {time.perf_counter() - started:.3f} s")
    assert len(chat.token_view(3).tokens()) == 5000




def test_a_closed_chart_takes_its_plot_menus_with_it(qtbot):
    """pyqtgraph's context menus belong to the widget showing them: none outlives a closed chart (they
    piled up as hidden top-level widgets, and every theme change restyled them all), and they still open."""
    import gc

    from PySide6.QtCore import QCoreApplication, QEvent

    from widgets.charts import LiveCharts
    from widgets.check_view import CheckView
    from widgets.race.chart import RaceChart
    from widgets.tune.plots import SweepPlots

    def flush() -> None:  # what the event loop and the suite's collector do between tests
        gc.collect()
        QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
        gc.collect()

    flush()
    before = len(QApplication.topLevelWidgets())
    for make in (LiveCharts, RaceChart, SweepPlots, CheckView):
        widget = make()
        widget.show()
        assert len(QApplication.topLevelWidgets()) > before  # the widget and its menus
        widget.close()
        widget.deleteLater()
        del widget
        flush()
        assert len(QApplication.topLevelWidgets()) == before, make.__name__
    charts = LiveCharts()
    qtbot.addWidget(charts)
    charts.show()
    box = next(iter(charts.plots().values())).getViewBox()
    assert box.menu.parent() is not None
    box.menu.popup(charts.mapToGlobal(QPoint(10, 10)))
    qtbot.waitUntil(box.menu.isVisible)
    box.menu.close()
