"""Rendered answers, the Tokens toggle, themes (WCAG AA contrast, charts follow) and the context meter widget."""
from __future__ import annotations

import pytest
from PySide6.QtGui import QColor, QGuiApplication, QTextCursor
from PySide6.QtWidgets import QApplication

from app.core.demo import DEMO_ANSWER, scripted_steps
from engine.measure.stats import summarize
from widgets.chat.markdown_render import CodeSegment, TextSegment, highlight, render_markdown
from widgets.palette import STATUSES, current_palette, current_theme, load_palette, load_stylesheet
from widgets.stats_line import format_stats_line

ANSWER = (
    "# Sorting\n\nSome **bold** text, `inline code` and a table:\n\n"
    "| algorithm | average |\n|---|---|\n| quicksort | O(n log n) |\n\n"
    "- one\n- two\n\n"
    "```python\ndef f(x):\n    return x + 1  # add one\n```\n\n"
    "Then a shell block:\n\n```bash\necho \"hi\" | wc -c\n```\n\n<script>alert(1)</script>\n"
)


def luminance(colour: QColor) -> float:
    def channel(c: float) -> float:
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    return 0.2126 * channel(colour.redF()) + 0.7152 * channel(colour.greenF()) + 0.0722 * channel(colour.blueF())


def over(top: QColor, bottom: QColor) -> QColor:
    """`top` (with its alpha) painted on an opaque `bottom`."""
    a = top.alphaF()
    return QColor.fromRgbF(top.redF() * a + bottom.redF() * (1 - a), top.greenF() * a + bottom.greenF() * (1 - a),
                           top.blueF() * a + bottom.blueF() * (1 - a))


def contrast(a: QColor, b: QColor) -> float:
    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


@pytest.fixture
def light_theme():
    from widgets.theme import apply_theme

    yield
    apply_theme("light")  # every other test expects the default theme


# --------------------------------------------------------------------------- rendering

def test_markdown_splits_prose_and_highlighted_code():
    colours = load_palette("light").code
    segments = render_markdown(ANSWER, colours)
    kinds = [type(s) for s in segments]
    assert kinds == [TextSegment, CodeSegment, TextSegment, CodeSegment, TextSegment]
    prose = segments[0].html
    assert "<h1>Sorting</h1>" in prose and "<strong>bold</strong>" in prose and "<table border=" in prose
    assert "<li>one</li>" in prose and "<code style=" in prose
    code = segments[1]
    assert code.language == "python" and code.code == "def f(x):\n    return x + 1  # add one"
    assert f'color:{colours["keyword"]}">def</span>' in code.html
    assert f'color:{colours["comment"]}"># add one</span>' in code.html
    assert segments[3].language == "bash" and segments[3].code == 'echo "hi" | wc -c'
    assert "<script>" not in segments[4].html and "&lt;script&gt;" in segments[4].html  # shown, never run


def test_unknown_languages_and_huge_blocks_stay_plain():
    colours = load_palette("light").code
    assert "<span" not in highlight("x = 1", "no-such-language", colours)
    big = "\n".join(f"x = {i}" for i in range(5000))
    html = highlight(big, "python", colours)
    assert html.count("<span") < 5 * 4100  # lines past the limit are not highlighted


def finished_answer(chat, qtbot, rid: int = 1, text: str = DEMO_ANSWER):
    steps = scripted_steps(text, k=4, acceptance=0.7, seed=3)
    summary = summarize(steps, mode="speculative", k=4, prompt_tokens=5, seconds=0.5, stop_reason="eos")
    chat.add_user_message("question")
    chat.begin_assistant_message(rid, "model · speculative")
    chat.append_steps(rid, steps)
    assert chat.markdown_view(rid) is None  # while streaming: coloured tokens
    chat.finish_assistant_message(rid, summary, format_stats_line(summary))
    return steps


@pytest.fixture
def chat(qtbot):
    from widgets.chat.view import ChatView

    view = ChatView()
    qtbot.addWidget(view)
    view.resize(700, 500)
    view.show()
    qtbot.waitExposed(view)
    return view


def test_a_finished_answer_is_rendered_and_toggles_back_to_its_tokens(chat, qtbot):
    steps = finished_answer(chat, qtbot)
    qtbot.waitUntil(lambda: chat.markdown_view(1) is not None and chat.markdown_view(1).is_complete(), timeout=5000)
    view = chat.markdown_view(1)
    assert not chat.token_view(1).isVisible()
    blocks = view.code_blocks()
    assert [b.segment.language for b in blocks] == ["python"]
    blocks[0].copy_button.click()
    assert QGuiApplication.clipboard().text().startswith("def quicksort(items: list[int])")
    assert blocks[0].copy_button.text() == "Copied"
    # The per-answer toggle shows the coloured tokens again, unchanged.
    bubble = chat._assistants[1]
    bubble.tokens_button.click()
    assert chat.markdown_view(1) is None and chat.token_view(1).isVisible()
    statuses = [s for _, _, s in chat.token_view(1).token_spans()]
    assert statuses == [t.status for s in steps for t in s.tokens if t.text and t.status != "rejected"]
    bubble.tokens_button.click()
    assert chat.markdown_view(1) is not None
    assert chat.message_text(1) == DEMO_ANSWER  # Copy gives the answer's own text


def test_the_global_preference_keeps_tokens_and_applies_to_every_answer(chat, qtbot):
    chat.set_render_markdown(False)
    finished_answer(chat, qtbot)
    qtbot.wait(100)
    assert chat.markdown_view(1) is None and chat.token_view(1).isVisible()
    chat.set_render_markdown(True)
    qtbot.waitUntil(lambda: chat.markdown_view(1) is not None, timeout=5000)
    chat.set_render_markdown(False)
    assert chat.markdown_view(1) is None


def test_a_failed_answer_stays_as_tokens(chat, qtbot):
    steps = scripted_steps("partial `code", k=3, acceptance=0.9, seed=1)
    chat.begin_assistant_message(5, "")
    chat.append_steps(5, steps)
    chat.fail_assistant_message(5, "out of memory")
    qtbot.wait(100)
    assert chat.markdown_view(5) is None and chat.token_view(5).isVisible()


# --------------------------------------------------------------------------- themes

@pytest.mark.parametrize("theme", ["light", "dark"])
def test_every_text_colour_meets_wcag_aa(theme):
    p = load_palette(theme)
    surface = QColor(p.ui["surface"])
    for status in STATUSES:
        c = p.colours(status)
        assert contrast(c.foreground, c.background) >= 4.5, f"{theme} {status}"
        ghost = p.ghost_colours(status)  # rejected drafts: faded, on a faded background, on the bubble
        background = over(ghost.background, surface)
        assert contrast(over(ghost.foreground, background), background) >= 4.5, f"{theme} {status} ghost"
        assert contrast(c.chart, QColor(p.chart["background"])) >= 3.0, f"{theme} {status} chart line"
    code_bg = QColor(p.code["background"])
    for role in ("text", "keyword", "string", "number", "comment", "function", "class", "builtin", "decorator"):
        assert contrast(QColor(p.code[role]), code_bg) >= 4.5, f"{theme} code {role}"
    ui = {k: QColor(v) for k, v in p.ui.items()}
    for fg, bg in (("text", "surface"), ("text", "window_bg"), ("muted", "surface"), ("muted", "window_bg"),
                   ("secondary", "surface"), ("accent_text", "accent"), ("error_text", "error_bg"),
                   ("text", "user_bubble"), ("text", "sidebar_bg"), ("text", "sidebar_selected"),
                   ("selection_text", "selection"), ("muted", "sidebar_bg"), ("warning", "sidebar_bg")):
        assert contrast(ui[fg], ui[bg]) >= 4.5, f"{theme} {fg} on {bg}"


def test_both_themes_fill_every_stylesheet_name():
    light, dark = load_stylesheet("light"), load_stylesheet("dark")
    assert "@" not in light.replace("@ word", "") and "@" not in dark.replace("@ word", "")
    assert load_palette("dark").ui["window_bg"] in dark and load_palette("light").ui["window_bg"] in light


def test_theme_switch_recolours_tokens_charts_and_code(chat, qtbot, light_theme):
    from widgets.charts import LiveCharts
    from widgets.theme import ThemeManager

    finished_answer(chat, qtbot)
    qtbot.waitUntil(lambda: chat.markdown_view(1) is not None, timeout=5000)
    charts = LiveCharts()
    qtbot.addWidget(charts)
    manager = ThemeManager("light")
    manager.apply(force=True)
    with qtbot.waitSignal(manager.changed, timeout=1000) as blocker:
        manager.set_preference("dark")
    assert blocker.args == ["dark"] and current_theme() == "dark"
    app = QApplication.instance()
    assert load_palette("dark").ui["window_bg"] in app.styleSheet()
    chat.refresh_theme()
    charts.refresh_theme()
    # Tokens keep their meaning: each status now has the dark palette's colours.
    view = chat.token_view(1)
    start, _end, status = next(span for span in view.token_spans() if span[2] == "accepted")
    cursor = QTextCursor(view.document())
    cursor.setPosition(start + 1)
    assert cursor.charFormat().background().color() == current_palette().colours(status).background
    # The charts' background follows, and the code block is highlighted with the dark colours again.
    assert charts._graphics.backgroundBrush().color() == QColor(load_palette("dark").chart["background"])
    dark_keyword = load_palette("dark").code["keyword"]
    qtbot.waitUntil(lambda: bool(chat.markdown_view(1) is not None and chat.markdown_view(1).code_blocks()
                                 and dark_keyword in chat.markdown_view(1).code_blocks()[0].segment.html), timeout=5000)
    manager.set_preference("light")
    assert current_theme() == "light"


def test_system_preference_follows_the_desktop(monkeypatch, light_theme):
    from PySide6.QtCore import Qt

    from widgets import theme

    monkeypatch.setattr(theme, "system_theme", lambda: "dark")
    manager = theme.ThemeManager("system")
    manager.apply()
    assert current_theme() == "dark"
    monkeypatch.setattr(theme, "system_theme", lambda: "light")
    manager._on_system_changed(Qt.ColorScheme.Light)
    assert current_theme() == "light"
    manager.set_preference("dark")
    manager._on_system_changed(Qt.ColorScheme.Light)  # a fixed choice ignores the desktop
    assert current_theme() == "dark"


# --------------------------------------------------------------------------- the meter

def test_context_meter_levels(qtbot):
    from widgets.context_meter import ContextMeter

    meter = ContextMeter()
    qtbot.addWidget(meter)
    meter.set_usage(0, 0)
    assert "load a model" in meter.label.text()
    meter.set_usage(1000, 32768)
    assert meter.level() == "ok" and "1,000 / 32,768" in meter.label.text()
    meter.set_usage(30000, 32768)
    assert meter.level() == "warn"
    meter.set_usage(40000, 32768)
    assert meter.level() == "full" and "too long" in meter.label.text()
    meter.set_usage(30000, 32768, dropped=4)
    assert "4 oldest messages left out" in meter.label.text()


def test_a_long_answer_header_wraps_inside_a_narrow_chat(chat, qtbot):
    # On one line, the header (model · mode · proposer) set the bubble's minimum width, and a chat
    # column narrower than it cut every answer off at its right edge (the real window at 1,480 px).
    chat.resize(380, 500)
    chat.begin_assistant_message(1, "Qwen2.5-Coder-1.5B-Instruct · auto: K and proposer chosen per step · "
                                    "draft + n-gram · K auto")
    qtbot.waitUntil(lambda: chat.viewport().width() <= 380, timeout=2000)
    qtbot.wait(50)
    assert chat.widget().minimumSizeHint().width() <= chat.viewport().width()
    assert chat.widget().width() <= chat.viewport().width()
