"""Help ▸ Keyboard shortcuts: a table of what each key does, given as plain rows (menu, action, keys)."""
from __future__ import annotations

from collections.abc import Sequence

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QDialogButtonBox,
    QHeaderView,
    QLabel,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

COLUMNS = ("Keys", "Action", "Menu")


class ShortcutsDialog(QDialog):
    """One row per shortcut; `notes` are lines shown under the table (keys that belong to a box, not a menu)."""

    def __init__(self, rows: Sequence[tuple[str, str, str]], notes: Sequence[str] = (),
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Keyboard shortcuts")
        self.resize(520, 540)  # every row of the menus without scrolling
        layout = QVBoxLayout(self)
        self.table = QTableWidget(len(rows), len(COLUMNS), self)
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().hide()
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setWordWrap(True)
        for r, (menu, action, keys) in enumerate(rows):
            for c, text in enumerate((keys, action, menu)):
                item = QTableWidgetItem(text)
                item.setToolTip(text)
                self.table.setItem(r, c, item)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)
        header.setSectionResizeMode(2, QHeaderView.ResizeMode.ResizeToContents)
        layout.addWidget(self.table, 1)
        for line in notes:
            note = QLabel(line, self)
            note.setWordWrap(True)
            note.setObjectName("systemNote")
            layout.addWidget(note)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close, Qt.Orientation.Horizontal, self)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)

    def rows(self) -> list[tuple[str, str, str]]:
        """(menu, action, keys) as shown, for tests."""
        t = self.table
        return [(t.item(r, 2).text(), t.item(r, 1).text(), t.item(r, 0).text()) for r in range(t.rowCount())]
