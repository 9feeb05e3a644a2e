"""The sidebar of saved conversations: New, search, rename, delete with Undo, export; damaged files named."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from PySide6.QtCore import QModelIndex, QPoint, QRect, QSize, Qt, QTimer, Signal
from PySide6.QtGui import QFont, QFontMetrics, QPainter
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QPushButton,
    QStyle,
    QStyledItemDelegate,
    QStyleOptionViewItem,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

SEARCH_DEBOUNCE_MS = 250  # a search starts once typing pauses
UNDO_MS = 10_000  # how long Undo stays offered after a delete
_ID = Qt.ItemDataRole.UserRole
_SUBTITLE = Qt.ItemDataRole.UserRole + 1
_PAD = 6  # pixels around the two lines of an item


class _EntryDelegate(QStyledItemDelegate):
    """Two lines per conversation, each elided on its own: the title, then date · model in muted text."""

    def sizeHint(self, option: QStyleOptionViewItem, index: QModelIndex) -> QSize:
        # CJK glyphs come from a fallback font with a taller line; leave room for it.
        line = max(QFontMetrics(option.font).height(), round(QFontMetrics(option.font).height() * 1.25))
        return QSize(option.rect.width(), 2 * line + 2 * _PAD)

    def paint(self, painter: QPainter, option: QStyleOptionViewItem, index: QModelIndex) -> None:
        opt = QStyleOptionViewItem(option)
        self.initStyleOption(opt, index)
        title, opt.text = opt.text, ""
        style = opt.widget.style() if opt.widget is not None else None
        if style is not None:
            style.drawControl(QStyle.ControlElement.CE_ItemViewItem, opt, painter, opt.widget)
        rect = opt.rect.adjusted(_PAD + 2, _PAD, -_PAD, -_PAD)
        half = rect.height() // 2
        painter.save()
        painter.setPen(opt.palette.text().color())
        painter.setFont(opt.font)
        metrics = QFontMetrics(opt.font)
        painter.drawText(QRect(rect.left(), rect.top(), rect.width(), half), Qt.AlignmentFlag.AlignVCenter,
                         metrics.elidedText(title, Qt.TextElideMode.ElideRight, rect.width()))
        small = QFont(opt.font)
        small.setPointSizeF(max(7.0, opt.font.pointSizeF() * 0.85))
        painter.setFont(small)
        painter.setPen(opt.palette.placeholderText().color())
        subtitle = str(index.data(_SUBTITLE) or "")
        painter.drawText(QRect(rect.left(), rect.top() + half, rect.width(), half), Qt.AlignmentFlag.AlignVCenter,
                         QFontMetrics(small).elidedText(subtitle, Qt.TextElideMode.ElideRight, rect.width()))
        painter.restore()


@dataclass(frozen=True)
class SidebarEntry:
    """One conversation in the list (plain data from the app)."""

    id: str  # the conversation id
    title: str  # first line of the item
    subtitle: str  # second line: date · model · messages


class ConversationList(QWidget):
    """Lists conversations newest first; every action is a signal the app acts on."""

    new_requested = Signal()
    selected = Signal(str)  # conversation id clicked
    rename_requested = Signal(str, str)  # id, new title
    delete_requested = Signal(str)  # id
    undo_requested = Signal(str)  # id of the conversation deleted last
    export_requested = Signal(str, str)  # id, "markdown" or "json"
    search_changed = Signal(str)  # the query, once typing pauses ("" clears the filter)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("conversationSidebar")
        self.setAttribute(Qt.WidgetAttribute.WA_StyledBackground, True)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 8, 8)
        layout.setSpacing(6)
        self.new_button = QPushButton("+  New chat", self)
        self.new_button.setToolTip("Start a new conversation (Ctrl+N)")
        self.new_button.clicked.connect(self.new_requested)
        layout.addWidget(self.new_button)
        self.search = QLineEdit(self)
        self.search.setObjectName("conversationSearch")
        self.search.setPlaceholderText("Search conversations…")
        self.search.setClearButtonEnabled(True)
        layout.addWidget(self.search)
        self.list = QListWidget(self)
        self.list.setObjectName("conversationList")
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.setItemDelegate(_EntryDelegate(self.list))
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setUniformItemSizes(True)  # 100+ items lay out in one pass (every item is two lines)
        layout.addWidget(self.list, 1)
        self.undo_bar = QFrame(self)
        self.undo_bar.setObjectName("undoBar")
        undo_row = QHBoxLayout(self.undo_bar)
        undo_row.setContentsMargins(8, 4, 4, 4)
        self.undo_label = QLabel("", self.undo_bar)
        self.undo_label.setTextFormat(Qt.TextFormat.PlainText)
        self.undo_label.setWordWrap(True)
        self.undo_button = QToolButton(self.undo_bar)
        self.undo_button.setObjectName("bubbleButton")
        self.undo_button.setText("Undo")
        undo_row.addWidget(self.undo_label, 1)
        undo_row.addWidget(self.undo_button)
        self.undo_bar.hide()
        layout.addWidget(self.undo_bar)
        self.problems = QLabel("", self)
        self.problems.setObjectName("sidebarProblems")
        self.problems.setTextFormat(Qt.TextFormat.PlainText)
        self.problems.setWordWrap(True)
        self.problems.hide()
        layout.addWidget(self.problems)

        self._undo_id = ""
        self._undo_timer = QTimer(self)
        self._undo_timer.setSingleShot(True)
        self._undo_timer.timeout.connect(self.undo_bar.hide)
        self._search_timer = QTimer(self)
        self._search_timer.setSingleShot(True)
        self._search_timer.setInterval(SEARCH_DEBOUNCE_MS)
        self._search_timer.timeout.connect(lambda: self.search_changed.emit(self.search.text().strip()))
        self.search.textChanged.connect(lambda _text: self._search_timer.start())
        self.list.itemClicked.connect(lambda item: self.selected.emit(item.data(_ID)))
        self.list.itemActivated.connect(lambda item: self.selected.emit(item.data(_ID)))
        self.list.customContextMenuRequested.connect(self._menu)
        self.undo_button.clicked.connect(self._undo)

    # --- public API -------------------------------------------------------------------------

    def set_entries(self, entries: Sequence[SidebarEntry], current: str | None = None) -> None:
        self.list.blockSignals(True)
        self.list.clear()
        for entry in entries:
            item = QListWidgetItem(entry.title)
            item.setData(_ID, entry.id)
            item.setData(_SUBTITLE, entry.subtitle)
            item.setToolTip(f"{entry.title}\n{entry.subtitle}")
            self.list.addItem(item)
        self.list.blockSignals(False)
        self.set_current(current)

    def set_current(self, conversation_id: str | None) -> None:
        for i in range(self.list.count()):
            item = self.list.item(i)
            if item.data(_ID) == conversation_id:
                self.list.setCurrentItem(item)
                return
        self.list.clearSelection()

    def ids(self) -> list[str]:
        """Ids shown, top to bottom (hidden ones left out)."""
        return [self.list.item(i).data(_ID) for i in range(self.list.count()) if not self.list.item(i).isHidden()]

    def titles(self) -> list[str]:
        return [self.list.item(i).text() for i in range(self.list.count())
                if not self.list.item(i).isHidden()]

    def set_filter(self, ids: Sequence[str] | None) -> None:
        """Shows only these conversations (None: all), e.g. the hits of a search."""
        keep = None if ids is None else set(ids)
        for i in range(self.list.count()):
            item = self.list.item(i)
            item.setHidden(keep is not None and item.data(_ID) not in keep)

    def offer_undo(self, conversation_id: str, title: str) -> None:
        self._undo_id = conversation_id
        self.undo_label.setText(f"Deleted “{title}”.")
        self.undo_bar.show()
        self._undo_timer.start(UNDO_MS)

    def set_problems(self, lines: Sequence[str]) -> None:
        """Files that could not be read: a short warning, each file in the tooltip."""
        if not lines:
            self.problems.hide()
            return
        n = len(lines)
        self.problems.setText(f"⚠ {n} file{'s' if n > 1 else ''} in the conversations folder could not be "
                              f"read and {'were' if n > 1 else 'was'} skipped (hover for details).")
        self.problems.setToolTip("\n".join(lines))
        self.problems.show()

    def rename(self, conversation_id: str) -> None:
        """Asks for a new title."""
        item = self._item(conversation_id)
        if item is None:
            return
        title, ok = QInputDialog.getText(self, "Rename conversation", "Title:", text=item.text())
        if ok and title.strip():
            self.rename_requested.emit(conversation_id, title.strip())

    # --- internals ------------------------------------------------------------------------------

    def _item(self, conversation_id: str) -> QListWidgetItem | None:
        return next((self.list.item(i) for i in range(self.list.count())
                     if self.list.item(i).data(_ID) == conversation_id), None)

    def _menu(self, point: QPoint) -> None:
        item = self.list.itemAt(point)
        if item is None:
            return
        cid = item.data(_ID)
        menu = QMenu(self)
        menu.addAction("Rename…", lambda: self.rename(cid))
        menu.addAction("Export as Markdown…", lambda: self.export_requested.emit(cid, "markdown"))
        menu.addAction("Export as JSON…", lambda: self.export_requested.emit(cid, "json"))
        menu.addSeparator()
        menu.addAction("Delete", lambda: self.delete_requested.emit(cid))
        menu.popup(self.list.viewport().mapToGlobal(point))

    def _undo(self) -> None:
        self.undo_bar.hide()
        self._undo_timer.stop()
        if self._undo_id:
            self.undo_requested.emit(self._undo_id)
            self._undo_id = ""
