"""One side of a race: its token view (with the first divergence outlined) and its live figures."""
from __future__ import annotations

import math
from collections.abc import Sequence

from PySide6.QtCore import QRect, QRectF, Qt
from PySide6.QtGui import (
    QColor,
    QPainter,
    QPaintEvent,
    QPen,
    QTextCharFormat,
    QTextCursor,
)
from PySide6.QtWidgets import (
    QFrame,
    QLabel,
    QSizePolicy,
    QTextEdit,
    QVBoxLayout,
    QWidget,
)

import widgets.charts  # noqa: F401  (sets pyqtgraph options once, before any plot exists)
from engine.types import Step, Summary
from widgets.flow_layout import FlowLayout
from widgets.palette import current_palette
from widgets.race.chart import MODE_STATUS
from widgets.token_text import TokenTextView

MODE_TITLES = {"standard": "Standard — target only", "speculative": "Speculative — draft + target"}
DIVERGENCE_COLOUR = "#d92d20"


def rate_text(tokens_per_s: float) -> str:
    if math.isnan(tokens_per_s):
        return "–"
    return f"{tokens_per_s:.1f}" if tokens_per_s < 100 else f"{tokens_per_s:.0f}"


def times_text(x: float) -> str:
    return "–" if math.isnan(x) else f"{x:.2f}×"


def identical_text(identical: bool | None) -> str:
    return {True: "yes", False: "no", None: "n/a (sampled)"}[identical]


# --------------------------------------------------------------------------- token view with a highlight

class RaceTokenView(TokenTextView):
    """A TokenTextView that can mark one committed token (the first divergence): a red outline box
    drawn over the text plus a red underline (an ExtraSelection), so the token keeps its status
    colours. The mark survives the display toggles (it is re-applied after every re-render).
    """

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._highlight: tuple[int, str] | None = None  # (committed token index, reason)

    def highlight_token(self, index: int, reason: str) -> None:
        """Marks committed token `index` (0-based, rejected drafts not counted); its tooltip gets `reason`."""
        self._highlight = (index, reason)
        self._apply_highlight()

    def clear_highlight(self) -> None:
        self._highlight = None
        self.setExtraSelections([])
        self.viewport().update()

    def highlighted_span(self) -> tuple[int, int] | None:
        """(start, end) document positions of the marked token, or None."""
        if self._highlight is None:
            return None
        return self.committed_span(self._highlight[0])

    def highlight_reason(self) -> str | None:
        return self._highlight[1] if self._highlight else None

    def committed_span(self, index: int) -> tuple[int, int] | None:
        """Document range of committed token `index`. A token that only starts a multi-byte character
        shows no text of its own; it is marked through the token that completes the character."""
        committed = [i for i, t in enumerate(self._tokens) if t.status != "rejected"]
        for token_index in committed[index:]:
            if self._tokens[token_index].text:
                try:
                    span = self._span_token.index(token_index)
                except ValueError:
                    return None
                return self._starts[span], self._ends[span]
        return None

    def clear(self) -> None:
        self._highlight = None
        self.setExtraSelections([])
        super().clear()

    def tooltip_at(self, position: int) -> str | None:
        text = super().tooltip_at(position)
        span = self.highlighted_span()
        if text and span and span[0] <= position < span[1]:
            text += f"\nfirst divergence: {self.highlight_reason()}"
        return text

    def _rerender(self) -> None:
        super()._rerender()
        self._apply_highlight()

    def _apply_highlight(self) -> None:
        span = self.highlighted_span()
        if span is None:
            self.setExtraSelections([])
            return
        selection = QTextEdit.ExtraSelection()
        cursor = QTextCursor(self.document())
        cursor.setPosition(span[0])
        cursor.setPosition(span[1], QTextCursor.MoveMode.KeepAnchor)
        fmt = QTextCharFormat()
        fmt.setUnderlineStyle(QTextCharFormat.UnderlineStyle.SingleUnderline)
        fmt.setUnderlineColor(QColor(DIVERGENCE_COLOUR))
        selection.cursor = cursor
        selection.format = fmt
        self.setExtraSelections([selection])
        self.viewport().update()

    def highlight_rects(self) -> list[QRect]:
        """Viewport rectangles of the marked token, one per line it covers."""
        span = self.highlighted_span()
        if span is None:
            return []
        rects: list[QRect] = []
        cursor = QTextCursor(self.document())
        for pos in range(span[0], span[1]):
            cursor.setPosition(pos)
            left = self.cursorRect(cursor)
            cursor.setPosition(pos + 1)
            right = self.cursorRect(cursor)
            if right.top() != left.top():  # the character ends its line: up to the viewport edge
                right = QRect(self.viewport().width() - 4, left.top(), 1, left.height())
            char = QRect(left.topLeft(), right.bottomLeft()).adjusted(0, 0, 0, 0)
            if rects and rects[-1].top() == char.top():
                rects[-1] = rects[-1].united(char)
            else:
                rects.append(char)
        return rects

    def paintEvent(self, event: QPaintEvent) -> None:
        super().paintEvent(event)
        rects = self.highlight_rects()
        if not rects:
            return
        painter = QPainter(self.viewport())
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setPen(QPen(QColor(DIVERGENCE_COLOUR), 2))
        painter.setBrush(Qt.BrushStyle.NoBrush)
        for r in rects:
            painter.drawRoundedRect(QRectF(r).adjusted(-2, -1, 2, 1), 3, 3)
        painter.end()


# --------------------------------------------------------------------------- one pane

class RacePane(QFrame):
    """A mode's title, its live tok/s and elapsed time, and its coloured tokens."""

    def __init__(self, mode: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.mode = mode
        self.setObjectName("racePane")
        self.setFrameShape(QFrame.Shape.StyledPanel)
        chart = current_palette().colours(MODE_STATUS[mode]).chart
        self.title = QLabel(f'<span style="color:{chart.name()}">■</span>&nbsp;<b>{MODE_TITLES[mode]}</b>')
        self.stats = QLabel("waiting")
        self.stats.setObjectName("statsLine")
        self.view = RaceTokenView(self)
        self.view.setObjectName("raceText")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 6, 8, 8)
        layout.setSpacing(4)
        self.stats.setWordWrap(True)  # a narrow pane puts its figures under the title, on as many lines as they need
        self.stats.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        header = QWidget(self)
        row = FlowLayout(header, spacing=12, line_spacing=2)
        row.addWidget(self.title)
        row.addWidget(self.stats)
        layout.addWidget(header)
        layout.addWidget(self.view, 1)
        self.reset("waiting")

    def reset(self, note: str) -> None:
        self.view.clear()
        self._tokens = 0
        self._seconds = 0.0
        self.stats.setText(note)

    def append(self, steps: Sequence[Step]) -> None:
        if not steps:
            return
        self.view.append_steps(steps)
        last = steps[-1]
        self.show_progress(last.total_tokens, last.elapsed_s)

    def show_progress(self, tokens: int, seconds: float) -> None:
        rate = tokens / seconds if seconds > 0 else math.nan
        self.stats.setText(f"{rate_text(rate)} tok/s · {seconds:.2f} s · {tokens} tokens")

    def finish(self, summary: Summary) -> None:
        self.view.finish()
        parts = [f"<b>{rate_text(summary.tokens_per_s)} tok/s</b>", f"{summary.seconds:.2f} s", f"{summary.new_tokens} tokens"]
        if summary.mode == "speculative":
            parts.append(f"{summary.acceptance_rate * 100:.0f}% accepted")
            parts.append(f"{summary.tokens_per_target_forward:.1f} tok/fwd")
        if summary.stop_reason == "cancelled":
            parts.append("stopped")
        self.stats.setText(" · ".join(parts))
