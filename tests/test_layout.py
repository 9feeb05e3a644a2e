"""The window at every size: side panels that collapse (by hand and by width) and are remembered, a chat that keeps
its share, a legend that wraps instead of cutting words, spin boxes with arrows, and the Help menu."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from PySide6.QtCore import QUrl
from PySide6.QtGui import QKeySequence
from PySide6.QtWidgets import QApplication

from app.core.demo import ScriptedEngine
from app.ui.help import Help
from app.ui.settings import AppSettings
from app.ui.window import MainWindow
from engine.settings import ModelSelection
from widgets.palette import load_stylesheet


@pytest.fixture
def make_window(qtbot, tmp_path, no_dangling_threads):
    windows: list[MainWindow] = []

    def make(size: tuple[int, int], settings: AppSettings | None = None) -> MainWindow:
        w = MainWindow(engine_factory=lambda _spec, _progress: ScriptedEngine(delay_s=0.0),
                       settings=settings or AppSettings(tmp_path / "settings.ini"))
        qtbot.addWidget(w)
        w.resize(*size)
        w.show()
        qtbot.waitExposed(w)
        windows.append(w)
        with qtbot.waitSignal(w.models_loaded, timeout=10000):
            w.load_models(ModelSelection())
        settle(qtbot)
        return w

    yield make
    for w in windows:
        w.close()


def settle(qtbot) -> None:
    qtbot.wait(120)  # the panels lay out on the event loop after a resize


def test_at_900x600_the_chat_column_has_at_least_half_the_width(make_window, qtbot):
    w = make_window((900, 600))
    assert w.width() == 900
    assert w.chat_column.isVisible() and w.chat_column.width() >= w.width() / 2
    assert not w.panels.shown("charts") and not w.charts_action.isChecked()  # collapsed by the width rule
    assert w.panels.wanted["charts"]  # ... but still wanted: a wider window shows it again
    w.resize(1600, 1000)
    settle(qtbot)
    assert all(w.panels.shown(n) for n in ("sidebar", "settings", "charts"))
    panels = (w.sidebar.width(), w.settings_scroll.width(), w.charts.width())
    assert w.chat_column.width() >= 0.48 * w.width() and w.chat_column.width() > max(panels)  # the widest column


def test_at_640x480_the_chat_is_visible_and_the_message_box_usable(make_window, qtbot):
    w = make_window((640, 480))
    assert (w.width(), w.height()) == (640, 480)
    assert w.chat.isVisible() and w.chat.height() >= 150 and w.chat_column.width() >= 0.9 * w.width()
    edit = w.prompt.edit
    assert edit.isVisible() and edit.width() >= 300 and w.prompt.button.isVisible()
    right = w.prompt.button.mapTo(w, w.prompt.button.rect().bottomRight())
    assert right.x() <= w.width() and right.y() <= w.height()  # the Send button is on screen
    with qtbot.waitSignal(w.answer_finished, timeout=10000):
        edit.setFocus()
        qtbot.keyClicks(edit, "hello")
        w.prompt.edit.submitted.emit()
    assert w.chat.answer_ids()


def test_the_window_can_be_made_small_whatever_tab_shows(make_window, qtbot):
    w = make_window((1480, 900))
    for index in range(w.tabs.count()):
        w.tabs.setCurrentIndex(index)
        hint = w.minimumSizeHint()
        assert hint.width() <= 640 and hint.height() <= 480, (w.tabs.tabText(index), hint)


def test_panels_toggle_from_the_view_menu_and_their_state_persists(make_window, qtbot, tmp_path):
    path = tmp_path / "panels.ini"
    first = make_window((1600, 1000), AppSettings(path))
    assert first.sidebar_action.shortcut() == QKeySequence("Ctrl+B")
    first.sidebar_action.trigger()
    first.settings_panel_action.trigger()
    settle(qtbot)
    assert not first.sidebar.isVisible() and not first.settings_scroll.isVisible()
    assert first.charts.isVisible()
    first.close()
    assert AppSettings(path).panels() == {"sidebar": False, "settings": False, "charts": True}

    second = make_window((1600, 1000), AppSettings(path))
    assert not second.sidebar.isVisible() and not second.sidebar_action.isChecked()
    assert not second.settings_scroll.isVisible() and second.charts.isVisible()
    second.sidebar_action.trigger()
    settle(qtbot)
    assert second.sidebar.isVisible() and second.sidebar.width() >= second.sidebar.minimumWidth()


def test_a_panel_asked_for_in_a_narrow_window_shows_until_the_width_crosses_again(make_window, qtbot):
    w = make_window((900, 600))
    assert not w.charts.isVisible()
    w.charts_action.trigger()
    settle(qtbot)
    assert w.charts.isVisible() and w.charts_action.isChecked()
    w.resize(1400, 900)  # wide enough for the charts: the width rule decides again
    settle(qtbot)
    w.resize(900, 600)
    settle(qtbot)
    assert not w.charts.isVisible() and w.panels.wanted["charts"]


@pytest.mark.parametrize("size", [(640, 480), (900, 600), (1600, 1000)])
def test_the_legend_wraps_instead_of_cutting_a_word(make_window, qtbot, size):
    w = make_window(size)
    legend = w.legend.geometry()
    for status in ("accepted", "rejected", "corrected", "bonus", "target"):
        chip = w.legend.chip(status)
        assert chip.isVisible()
        assert chip.width() >= chip.sizeHint().width(), status  # the whole word fits
        assert chip.geometry().right() < legend.width(), status  # inside the legend, not clipped at its edge
        assert chip.text().endswith(status) and status in chip.toolTip()  # "▲ rejected": the mark, then the word


@pytest.mark.parametrize("width", [150, 260, 600])
def test_a_narrow_legend_puts_its_chips_on_more_rows(qtbot, width):
    from PySide6.QtWidgets import QVBoxLayout, QWidget

    from widgets.legend import Legend

    column = QWidget()
    qtbot.addWidget(column)
    layout = QVBoxLayout(column)
    legend = Legend(column)
    layout.addWidget(legend)
    layout.addStretch(1)
    column.resize(width, 200)
    column.show()
    qtbot.waitExposed(column)
    chips = [legend.chip(s) for s in ("accepted", "rejected", "corrected", "bonus", "target")]
    for chip in chips:
        assert chip.width() >= chip.sizeHint().width() and chip.geometry().right() < legend.width(), chip.text()
        assert chip.geometry().bottom() < legend.height(), chip.text()  # the legend grew to hold every row
    rows = {chip.geometry().top() for chip in chips}
    assert (len(rows) > 1) == (sum(c.sizeHint().width() + 6 for c in chips) > legend.width())


def test_spin_box_arrows_are_pictures_that_exist():
    sheet = load_stylesheet()
    for rule in ("QSpinBox::up-arrow", "QSpinBox::down-arrow"):
        assert rule in sheet
    paths = re.findall(r"image:\s*url\(([^)]+)\)", sheet)
    assert paths and all(Path(p).is_file() for p in paths), paths


def test_shortcuts_dialog_lists_every_action_shortcut(make_window, qtbot):
    w = make_window((1480, 900))
    dialog = w.help.show_shortcuts()
    rows = dialog.rows()
    listed = {(action, keys) for _menu, action, keys in rows}
    with_keys = [a for a in w.menus.actions.values() if not a.shortcut().isEmpty()]
    assert len(with_keys) >= 10 and len(rows) == len(with_keys)
    for act in with_keys:
        text = act.text().replace("&", "")
        assert (text, act.shortcut().toString(QKeySequence.SequenceFormat.NativeText)) in listed, text
    assert any(menu == "View" and action == "Conversations panel" for menu, action, _ in rows)
    # A changed shortcut shows as changed: the dialog reads the actions, not a list of its own.
    w.help.dialog = None
    w.stop_action.setShortcut(QKeySequence("Ctrl+."))
    assert ("Chat", "Stop", QKeySequence("Ctrl+.").toString(QKeySequence.SequenceFormat.NativeText)) in \
        w.help.show_shortcuts().rows()


def test_help_opens_the_readme_or_says_where_it_is(qtbot, tmp_path):
    from PySide6.QtWidgets import QMainWindow

    window = QMainWindow()
    qtbot.addWidget(window)
    opened: list[QUrl] = []
    from app.ui.notices import Notices

    notices = Notices(window, window.statusBar())
    root = Path(__file__).resolve().parents[1]
    help_ = Help(window, notices, lambda: [], open_url=lambda url: opened.append(url) or True, root=root)
    assert help_.open_docs() and opened[0].toLocalFile() == str(root / "README.md")
    nothing = Help(window, notices, lambda: [], open_url=lambda url: False, root=root)
    assert not nothing.open_docs() and "README.md" in window.statusBar().currentMessage()
    empty = Help(window, notices, lambda: [], open_url=lambda url: True, root=tmp_path)
    assert not empty.open_docs() and "not installed" in window.statusBar().currentMessage()
    QApplication.processEvents()
