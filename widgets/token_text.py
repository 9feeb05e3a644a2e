"""A streaming text view that colours every token by how it came to be (accepted, rejected, ...)."""
from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence

from PySide6.QtCore import QEvent, QPoint, QPointF, QRect, Qt, QTimer
from PySide6.QtGui import (
    QBrush,
    QFontDatabase,
    QHelpEvent,
    QPainter,
    QPaintEvent,
    QTextCharFormat,
    QTextCursor,
    QTextLine,
    QWheelEvent,
)
from PySide6.QtWidgets import QFrame, QTextEdit, QToolTip, QWidget

from engine.types import Step, TokenView
from widgets.palette import REJECTED_DISPLAYS, current_palette
from widgets.rejection_marks import RejectionMarks, format_rejected_tooltip, token_figures
from widgets.tree_marks import choice_text, is_branch, mark_format

FLASH_MS = 350  # "flash": how long the newest step's rejected drafts stay in the text at most


def format_token_tooltip(token: TokenView, k: int | None = None) -> str:
    """One line of the numbers behind a token, for its hover tooltip; values a token lacks are left out.

    e.g. "draft q=0.82 · target p=0.91 · accept prob=1.00 · draft position 2/5 · step 14 · status
    accepted · proposer draft"; a target token shows only p, step and status. A token of a tree round
    adds a line saying which of the drafter's choices it was (widgets.tree_marks.choice_text).
    """
    parts = token_figures(token, k)
    parts.append(f"step {token.step}")
    parts.append(f"status {token.status}")
    if token.source is not None:
        parts.append(f"proposer {token.source}")
    choice = choice_text(token)
    return " · ".join(parts) + (f"\n{choice}" if choice else "")


class TokenTextView(QTextEdit):
    """Appends Steps at the end of the document in one edit block per batch; never re-renders per token.

    The document holds only committed text: where a step's drafts were rejected, a small mark is
    painted between the characters (widgets.rejection_marks) and the rejected text is in its tooltip;
    with the "flash" display the newest step's rejects also show faded in the text until the next step
    (at most FLASH_MS). A token accepted through a branch of a draft tree keeps its colour and is underlined
    with dots (widgets.tree_marks). The TokenViews are kept as a model so the two display toggles (rejected
    drafts, colouring) can rebuild the document once. With `fit_content=True` the view has no scroll
    bars and grows to its text (for chat bubbles); otherwise it scrolls and follows the end while the
    reader is at the bottom.
    """

    def __init__(self, parent: QWidget | None = None, *, fit_content: bool = False) -> None:
        super().__init__(parent)
        self.setReadOnly(True)
        self.setUndoRedoEnabled(False)  # an undo stack of every token costs memory and time for nothing
        self.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse | Qt.TextInteractionFlag.TextSelectableByKeyboard)
        self.setLineWrapMode(QTextEdit.LineWrapMode.WidgetWidth)
        self.setTabStopDistance(4 * self.fontMetrics().horizontalAdvance(" "))
        self._fit_content = fit_content
        self._show_rejected = True
        self._display = current_palette().ghost.display  # "mark" or "flash"
        self._colouring = True
        self._flash_timer = QTimer(self)
        self._flash_timer.setSingleShot(True)
        self._flash_timer.setInterval(FLASH_MS)
        self._flash_timer.timeout.connect(self._end_flash)
        self._mono_families = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont).families()
        self._formats: dict[tuple[str, bool, bool], QTextCharFormat] = {}
        self._reset_model()
        if fit_content:
            self.setFrameShape(QFrame.Shape.NoFrame)
            self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
            self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
            self.document().documentLayout().documentSizeChanged.connect(self._on_document_size_changed)
            self._on_document_size_changed()

    # --- public API -------------------------------------------------------------------------

    def append_steps(self, steps: Sequence[Step]) -> None:
        """Appends a batch of Steps (call from a 10–30 Hz timer, not per token)."""
        if not steps:
            return
        follow = self._at_bottom()
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.beginEditBlock()  # one layout/repaint for the whole batch
        # A newer step has arrived, so the previous step's flashed drafts are settled history.
        self._drop_pending_ghosts(cursor)
        for i, step in enumerate(steps):
            self._step_k[step.index] = len(step.proposed)
            self._committed.append(step.text)
            self._last_step = step.index
            # Within a batch only the last step's rejects are still "live" enough to flash.
            flash = self._display == "flash" and i == len(steps) - 1
            for token in step.tokens:
                self._tokens.append(token)
                self._place(cursor, len(self._tokens) - 1, flash=flash)
        cursor.endEditBlock()
        if self._pending_ghosts:
            self._flash_timer.start()
        if follow and not self._fit_content:
            self.verticalScrollBar().setValue(self.verticalScrollBar().maximum())

    def finish(self) -> None:
        """The message is complete: a flashed draft of the last step goes too."""
        self._finished = True
        self._end_flash()

    def clear(self) -> None:  # Qt slot name; also forgets the token model so both stay in step
        self._reset_model()
        super().clear()

    def set_show_rejected(self, show: bool) -> None:
        """Mark where drafts were rejected (True) or show nothing of them (False)."""
        if show != self._show_rejected:
            self._show_rejected = show
            self._rerender()

    def show_rejected(self) -> bool:
        return self._show_rejected

    def set_rejected_display(self, display: str) -> None:
        """"mark" (a mark where drafts were rejected) or "flash" (the newest step's rejects shown briefly too)."""
        if display not in REJECTED_DISPLAYS:
            raise ValueError(f"unknown display {display!r}; choose one of {', '.join(REJECTED_DISPLAYS)}")
        self._display = display

    def rejected_display(self) -> str:
        return self._display

    def mark_positions(self) -> list[int]:
        """Document positions of the rejection marks shown (none while rejected drafts are hidden)."""
        return list(self._marks.positions) if self._show_rejected else []

    def mark_tooltip(self, mark: int) -> str:
        """The rejected drafts behind the mark-th mark, with their q and p."""
        tokens = [self._tokens[t] for t in self._marks.tokens[mark]]
        return format_rejected_tooltip(tokens, self._step_k.get(tokens[0].step))

    def mark_rects(self) -> list[QRect]:
        """Viewport rectangles (cursor-thin) of the marks shown, for painting and tests."""
        return [self._caret_rect(p) for p in self.mark_positions()]

    def set_colouring(self, on: bool) -> None:
        """Colour tokens by status (True) or plain reading mode (False)."""
        if on != self._colouring:
            self._colouring = on
            self._rerender()

    def colouring(self) -> bool:
        return self._colouring

    def refresh_palette(self) -> None:
        """Rebuilds the formats after the shared palette changed theme."""
        self._rerender()

    def token_spans(self) -> list[tuple[int, int, str]]:
        """(start, end, status) per shown token, in document positions (UTF-16 units)."""
        return [(s, e, self._tokens[t].status) for s, e, t in zip(self._starts, self._ends, self._span_token)]

    def plain_text(self) -> str:
        """What is shown: the committed text (and a flashed draft while it flashes)."""
        return self.toPlainText()

    def committed_text(self) -> str:
        """The answer itself: the committed text of every Step, without rejected drafts."""
        return "".join(self._committed)

    def tokens(self) -> list[TokenView]:
        """Every TokenView received, rejected ones included."""
        return list(self._tokens)

    def token_at(self, position: int) -> TokenView | None:
        """The token covering document position `position`, if any."""
        i = bisect_right(self._starts, position) - 1
        if i >= 0 and position < self._ends[i]:
            return self._tokens[self._span_token[i]]
        return None

    def tooltip_at(self, position: int) -> str | None:
        """Tooltip text for the token at document position `position` (and the drafts rejected just before it)."""
        token = self.token_at(position)
        if token is None:
            return None
        text = format_token_tooltip(token, self._step_k.get(token.step))
        i = bisect_right(self._starts, position) - 1
        mark = self._marks.at(self._starts[i]) if self._show_rejected else None
        if mark is not None and token.status != "rejected":
            text += "\n" + self.mark_tooltip(mark)
        return text

    def position_at(self, point: QPoint) -> int:
        """Document position of the character under a viewport point, or -1 off the text."""
        offset = QPointF(self.horizontalScrollBar().value(), self.verticalScrollBar().value())
        doc_point = QPointF(point) + offset
        hit = self.document().documentLayout().hitTest(doc_point, Qt.HitTestAccuracy.ExactHit)
        if hit < 0:
            return -1
        block = self.document().findBlock(hit)
        layout = block.layout()
        local = doc_point - layout.position()
        for i in range(layout.lineCount()):
            line = layout.lineAt(i)
            if line.y() <= local.y() < line.y() + line.height():
                # CursorOnCharacter gives the character under x, not the nearest gap between two.
                return block.position() + line.xToCursor(local.x(), QTextLine.CursorPosition.CursorOnCharacter)
        return -1

    # --- Qt overrides ---------------------------------------------------------------------------

    def viewportEvent(self, event: QEvent) -> bool:
        if event.type() == QEvent.Type.ToolTip:
            help_event: QHelpEvent = event  # type: ignore[assignment]
            mark = self._mark_under(help_event.pos())
            position = self.position_at(help_event.pos())
            text = self.mark_tooltip(mark) if mark is not None else self.tooltip_at(position) if position >= 0 else None
            if text:
                rect = self._span_rect(position) if mark is None else QRect()
                QToolTip.showText(help_event.globalPos(), text, self.viewport(), rect)
            else:
                QToolTip.hideText()
                event.ignore()
            return True
        return super().viewportEvent(event)

    def paintEvent(self, event: QPaintEvent) -> None:
        super().paintEvent(event)
        if not self._show_rejected or not len(self._marks):
            return
        area = event.rect()
        first = self.cursorForPosition(area.topLeft()).position()
        last = self.cursorForPosition(area.bottomRight()).position()
        rects = [self._caret_rect(self._marks.positions[i]) for i in self._marks.between(first, last)]
        if rects:
            painter = QPainter(self.viewport())
            self._marks.paint(painter, rects, current_palette().ghost.mark)
            painter.end()

    def wheelEvent(self, event: QWheelEvent) -> None:
        if self._fit_content:
            event.ignore()  # a bubble never scrolls itself; let the chat's scroll area have it
            return
        super().wheelEvent(event)

    # --- internals ------------------------------------------------------------------------------

    def _reset_model(self) -> None:
        self._tokens: list[TokenView] = []
        self._step_k: dict[int, int] = {}
        self._committed: list[str] = []
        self._last_step: int | None = None
        self._finished = False
        # Shown spans, sorted by start; parallel lists so bisect works without tuples.
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._span_token: list[int] = []
        self._pending_ghosts: list[int] = []  # span indices of flashed rejects to drop when settled
        self._marks = RejectionMarks()
        self._backtick_run = 0
        self._in_code = False

    def _format(self, status: str, mono: bool, branch: bool = False) -> QTextCharFormat:
        key = (status, mono, branch)
        fmt = self._formats.get(key)
        if fmt is not None:
            return fmt
        palette = current_palette()
        fmt = QTextCharFormat()
        rejected = status == "rejected"
        if self._colouring:
            colours = palette.ghost_colours(status) if rejected else palette.colours(status)
            fmt.setBackground(QBrush(colours.background))
            fmt.setForeground(QBrush(colours.foreground))
            if branch:  # accepted through a branch of a draft tree (widgets.tree_marks)
                mark_format(fmt, colours.foreground)
        elif rejected:
            fmt.setForeground(QBrush(palette.muted))
        else:
            fmt.setForeground(QBrush(palette.text))
        if rejected and palette.ghost.strikeout:
            fmt.setFontStrikeOut(True)
        if mono:
            fmt.setFontFamilies(self._mono_families)
        self._formats[key] = fmt
        return fmt

    def _advance_code_state(self, text: str) -> None:
        # Code between ``` fences is shown in a fixed-width font; a fence may span tokens.
        for ch in text:
            if ch == "`":
                self._backtick_run += 1
                if self._backtick_run == 3:
                    self._in_code = not self._in_code
                    self._backtick_run = 0
            else:
                self._backtick_run = 0

    def _place(self, cursor: QTextCursor, token_index: int, *, flash: bool) -> None:
        """A committed token goes into the text; a rejected one leaves a mark (and flashes when asked)."""
        token = self._tokens[token_index]
        if token.status != "rejected":
            self._insert(cursor, token_index)
            return
        if not self._show_rejected:
            return
        self._marks.add(cursor.position(), token.step, token_index)
        if flash and not self._finished:
            span = self._insert(cursor, token_index)
            if span is not None:
                self._pending_ghosts.append(span)

    def _end_flash(self) -> None:
        self._flash_timer.stop()
        if self._pending_ghosts:
            cursor = QTextCursor(self.document())
            cursor.beginEditBlock()
            self._drop_pending_ghosts(cursor)
            cursor.endEditBlock()

    def _caret_rect(self, position: int) -> QRect:
        cursor = QTextCursor(self.document())
        cursor.setPosition(position)
        return self.cursorRect(cursor)

    def _mark_under(self, point: QPoint) -> int | None:
        if not self._show_rejected or not len(self._marks):
            return None
        around = self.cursorForPosition(point).position()
        return self._marks.hit(self._marks.between(around - 2, around + 2), self._caret_rect, point.x(), point.y())

    def _insert(self, cursor: QTextCursor, token_index: int) -> int | None:
        token = self._tokens[token_index]
        mono = self._in_code
        if token.status != "rejected":
            self._advance_code_state(token.text)
        if not token.text:
            return None  # an incomplete multi-byte character; the next token carries it
        start = cursor.position()
        cursor.insertText(token.text, self._format(token.status, mono, is_branch(token)))
        self._starts.append(start)
        self._ends.append(cursor.position())
        self._span_token.append(token_index)
        return len(self._starts) - 1

    def _drop_pending_ghosts(self, cursor: QTextCursor) -> None:
        # Back to front, so earlier pending spans keep their positions while later ones go.
        for span in sorted(self._pending_ghosts, reverse=True):
            start, end = self._starts[span], self._ends[span]
            cursor.setPosition(start)
            cursor.setPosition(end, QTextCursor.MoveMode.KeepAnchor)
            cursor.removeSelectedText()
            del self._starts[span], self._ends[span], self._span_token[span]
            width = end - start
            for i in range(span, len(self._starts)):  # only the tail after the last step's rejects
                self._starts[i] -= width
                self._ends[i] -= width
        self._pending_ghosts.clear()
        cursor.movePosition(QTextCursor.MoveOperation.End)

    def _rerender(self) -> None:
        """Rebuilds the document from the model: only on a toggle, never while streaming."""
        self._formats.clear()
        self._flash_timer.stop()
        self._starts, self._ends, self._span_token, self._pending_ghosts = [], [], [], []
        self._marks = RejectionMarks()
        self._backtick_run, self._in_code = 0, False
        follow = self._at_bottom()
        super().clear()
        cursor = QTextCursor(self.document())
        cursor.beginEditBlock()
        for i in range(len(self._tokens)):
            self._place(cursor, i, flash=False)  # a re-render shows settled history: marks only
        cursor.endEditBlock()
        if follow and not self._fit_content:
            self.verticalScrollBar().setValue(self.verticalScrollBar().maximum())

    def _at_bottom(self) -> bool:
        bar = self.verticalScrollBar()
        return bar.value() >= bar.maximum() - 4

    def _span_rect(self, position: int) -> QRect:
        """Viewport rectangle of the token at `position`, so the tooltip hides once the mouse leaves it."""
        i = bisect_right(self._starts, position) - 1
        cursor = QTextCursor(self.document())
        cursor.setPosition(self._starts[i])
        first = self.cursorRect(cursor)
        cursor.setPosition(self._ends[i])
        last = self.cursorRect(cursor)
        if first.top() != last.top():  # token wraps onto the next line: use the character's own line
            return QRect()
        return first.united(last)

    def _on_document_size_changed(self, *_: object) -> None:
        height = self.document().size().height()
        margins = self.contentsMargins()
        self.setFixedHeight(math.ceil(height) + margins.top() + margins.bottom() + 2 * self.frameWidth())
