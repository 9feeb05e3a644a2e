"""The menu bar as data: which menus hold which actions, with their shortcuts. What an action does is
connected by whoever owns it (the window, the view options), so this module knows no controller."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from PySide6.QtCore import QObject
from PySide6.QtGui import QAction, QActionGroup, QKeySequence
from PySide6.QtWidgets import QMenu, QMenuBar


@dataclass(frozen=True)
class Item:
    name: str  # the key the action is kept under in Menus.actions
    text: str  # the menu text, & before the mnemonic
    shortcut: str | None = None  # a QKeySequence string
    checkable: bool = False  # a toggle (connected to `toggled`) rather than a command (`triggered`)


SEPARATOR = None
MENUS: tuple[tuple[str, tuple[Item | None, ...]], ...] = (
    ("&File", (
        Item("load", "&Load models…", "Ctrl+L"),
        Item("train_head", "&Train a draft head…"),
        SEPARATOR,
        Item("export", "&Export session CSV…", "Ctrl+E"),
        Item("export_trace", "Export step &trace CSV…"),
        Item("export_md", "Export conversation as &Markdown…"),
        Item("export_json", "Export conversation as &JSON…"),
        SEPARATOR,
        Item("quit", "&Quit", "Ctrl+Q"),
    )),
    ("&Chat", (
        Item("new_chat", "&New chat", "Ctrl+N"),
        Item("regenerate", "&Regenerate", "Ctrl+R"),
        Item("stop", "&Stop", "Esc"),
    )),
    ("&View", (
        Item("colouring", "&Colour tokens", checkable=True),
        Item("ghosts", "Mark &rejected drafts", checkable=True),
        Item("markdown", "&Format finished answers (markdown)", "Ctrl+M", checkable=True),
        SEPARATOR,
        Item("sidebar", "C&onversations panel", "Ctrl+B", checkable=True),
        Item("settings_panel", "&Settings panel", "Ctrl+Shift+S", checkable=True),
        Item("charts", "C&harts panel", "Ctrl+Shift+C", checkable=True),
    )),
)
THEMES = (("system", "Follow the &system"), ("light", "&Light"), ("dark", "&Dark"))  # View ▸ Theme, one checked
HELP = (
    Item("docs", "&Documentation", "F1"),
    Item("shortcuts", "&Keyboard shortcuts", "Ctrl+/"),
    SEPARATOR,
    Item("about", "&About SpecDec Studio"),
)


def _plain(text: str) -> str:
    """A menu text without its mnemonic marks ("&Load models…" -> "Load models…", "&&" -> "&")."""
    return text.replace("&&", "\0").replace("&", "").replace("\0", "&")


class Menus:
    """The actions of the menu bar, by name (`actions["load"]`), and the theme choices (`theme_actions`)."""

    def __init__(self, bar: QMenuBar, owner: QObject) -> None:
        self._owner = owner
        self.actions: dict[str, QAction] = {}
        menus = {title: self._fill(bar.addMenu(title), items) for title, items in MENUS}
        theme_menu = menus["&View"].addMenu("&Theme")
        group = QActionGroup(owner)
        self.theme_actions: dict[str, QAction] = {}
        for name, label in THEMES:
            act = self._add(theme_menu, Item(f"theme_{name}", label, checkable=True))
            group.addAction(act)
            self.theme_actions[name] = act
        self._fill(bar.addMenu("&Help"), HELP)
        self.bar = bar

    def shortcuts(self) -> list[tuple[str, str, str]]:
        """(menu path, action, shortcut) for every action of the menu bar that has a shortcut, in menu order:
        read from the actions themselves, so the list cannot drift from what the keys do."""
        rows: list[tuple[str, str, str]] = []

        def walk(menu: QMenu, path: str) -> None:
            for act in menu.actions():
                if act.menu() is not None:
                    walk(act.menu(), f"{path} ▸ {_plain(act.menu().title())}")
                elif not act.isSeparator() and not act.shortcut().isEmpty():
                    keys = ", ".join(k.toString(QKeySequence.SequenceFormat.NativeText) for k in act.shortcuts())
                    rows.append((path, _plain(act.text()), keys))

        for top in self.bar.actions():
            if top.menu() is not None:
                walk(top.menu(), _plain(top.menu().title()))
        return rows

    def connect(self, name: str, slot: Callable) -> None:
        """A toggle's slot hears `toggled(bool)`; a command's hears `triggered`."""
        act = self.actions[name]
        (act.toggled if act.isCheckable() else act.triggered).connect(slot)

    def _fill(self, menu: QMenu, items: tuple[Item | None, ...]) -> QMenu:
        for item in items:
            if item is SEPARATOR:
                menu.addSeparator()
            else:
                self._add(menu, item)
        return menu

    def _add(self, menu: QMenu, item: Item) -> QAction:
        act = QAction(item.text, self._owner)
        if item.shortcut is not None:
            act.setShortcut(QKeySequence(item.shortcut))
        act.setCheckable(item.checkable)
        menu.addAction(act)
        self.actions[item.name] = act
        return act
