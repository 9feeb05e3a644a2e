"""A layout that places its items in rows and starts a new row when the width runs out (Qt's flow layout example)."""
from __future__ import annotations

from PySide6.QtCore import QMargins, QPoint, QRect, QSize, Qt
from PySide6.QtWidgets import QLayout, QLayoutItem, QWidget


class FlowLayout(QLayout):
    """Items left to right, wrapping to the next row: a row of chips that never cuts a word in a narrow window."""

    def __init__(self, parent: QWidget | None = None, *, spacing: int = 6, line_spacing: int = 4) -> None:
        super().__init__(parent)
        self._items: list[QLayoutItem] = []
        self._spacing = spacing
        self._line_spacing = line_spacing
        self.setContentsMargins(QMargins(0, 0, 0, 0))

    # --- QLayout ------------------------------------------------------------------------------

    def addItem(self, item: QLayoutItem) -> None:
        self._items.append(item)

    def count(self) -> int:
        return len(self._items)

    def itemAt(self, index: int) -> QLayoutItem | None:
        return self._items[index] if 0 <= index < len(self._items) else None

    def takeAt(self, index: int) -> QLayoutItem | None:
        return self._items.pop(index) if 0 <= index < len(self._items) else None

    def expandingDirections(self) -> Qt.Orientation:
        return Qt.Orientation(0)

    def hasHeightForWidth(self) -> bool:
        return True

    def heightForWidth(self, width: int) -> int:
        return self._place(QRect(0, 0, width, 0), move=False)

    def setGeometry(self, rect: QRect) -> None:
        super().setGeometry(rect)
        self._place(rect, move=True)

    def sizeHint(self) -> QSize:
        # One row: what the items want side by side.
        shown = [i for i in self._items if not i.isEmpty()]
        width = sum(i.sizeHint().width() for i in shown) + self._spacing * max(0, len(shown) - 1)
        height = max((i.sizeHint().height() for i in shown), default=0)
        m = self.contentsMargins()
        return QSize(width + m.left() + m.right(), height + m.top() + m.bottom())

    def minimumSize(self) -> QSize:
        # The widest single item: narrower than that, an item would have to be cut.
        size = QSize()
        for item in self._items:
            if not item.isEmpty():
                size = size.expandedTo(item.minimumSize().expandedTo(item.sizeHint()))
        m = self.contentsMargins()
        return size + QSize(m.left() + m.right(), m.top() + m.bottom())

    # --- placing ------------------------------------------------------------------------------

    def _place(self, rect: QRect, *, move: bool) -> int:
        """Lays the items out in `rect` (when `move`) and returns the height that takes.

        Items whose widget expands horizontally share what is left of their row; an item wider than the row
        gets the row's width. A label that wraps is as tall as its text at the width it gets; each item sits
        centred in its row's height.
        """
        m = self.contentsMargins()
        area = rect.adjusted(m.left(), m.top(), -m.right(), -m.bottom())
        rows: list[list[tuple[QLayoutItem, int]]] = [[]]  # (item, width) per row
        used = 0
        for item in self._items:
            if item.isEmpty():  # a hidden widget takes no room
                continue
            width = item.sizeHint().width()
            if area.width() > 0:
                width = min(width, area.width())
            if rows[-1] and used + self._spacing + width > area.width():
                rows.append([])
                used = 0
            used += width + (self._spacing if rows[-1] else 0)
            rows[-1].append((item, width))
        y = area.y()
        for row in filter(None, rows):
            extra = area.width() - sum(w for _, w in row) - self._spacing * (len(row) - 1)
            growing = [i for i, (item, _) in enumerate(row) if item.expandingDirections() & Qt.Orientation.Horizontal]
            sized = []
            for i, (item, width) in enumerate(row):
                if i in growing and extra > 0:
                    width += extra // len(growing)
                height = item.heightForWidth(width) if item.hasHeightForWidth() else item.sizeHint().height()
                sized.append((item, width, height))
            row_height = max(h for _, _, h in sized)
            if move:
                x = area.x()
                for item, width, height in sized:
                    item.setGeometry(QRect(QPoint(x, y + (row_height - height) // 2), QSize(width, height)))
                    x += width + self._spacing
            y += row_height + self._line_spacing
        return max(0, y - self._line_spacing - rect.y()) + m.bottom()
