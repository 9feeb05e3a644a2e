"""A finished answer rendered as markdown: prose, tables, highlighted code blocks with a Copy button."""
from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from PySide6.QtCore import QObject, Qt, QTimer, Signal
from PySide6.QtGui import QFontDatabase, QGuiApplication, QTextOption, QWheelEvent
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QSizePolicy, QTextBrowser, QToolButton, QVBoxLayout, QWidget

from widgets.chat.markdown_render import CodeSegment, Segment, TextSegment, render_markdown
from widgets.palette import current_palette, current_theme, load_palette

log = logging.getLogger(__name__)

BUILD_BUDGET_S = 0.008  # segment widgets built per event-loop turn
CACHE_SIZE = 256  # rendered answers kept; switching conversations back and forth re-renders nothing
COPIED_MS = 1200  # how long a Copy button says "Copied"


class FitTextBrowser(QTextBrowser):
    """Read-only rich text that grows to its content and never scrolls itself (the chat scrolls)."""

    def __init__(self, parent: QWidget | None = None, *, mono: bool = False) -> None:
        super().__init__(parent)
        self.setOpenExternalLinks(True)
        self.setUndoRedoEnabled(False)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        if mono:
            self.document().setDefaultFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
            self.setWordWrapMode(QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere)
        self.document().documentLayout().documentSizeChanged.connect(self._fit)
        self._fit()

    def wheelEvent(self, event: QWheelEvent) -> None:
        event.ignore()  # let the chat's scroll area have it

    def _fit(self, *_: object) -> None:
        height = self.document().size().height()
        margins = self.contentsMargins()
        self.setFixedHeight(math.ceil(height) + margins.top() + margins.bottom() + 2 * self.frameWidth())


class CodeBlock(QFrame):
    """A fenced code block: a header with its language and Copy, then the highlighted code."""

    def __init__(self, segment: CodeSegment, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("codeBlock")
        self.segment = segment
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        header = QFrame(self)
        header.setObjectName("codeHeader")
        row = QHBoxLayout(header)
        row.setContentsMargins(10, 2, 4, 2)
        self.language = QLabel(segment.language or "code", header)
        self.language.setObjectName("codeLanguage")
        self.language.setTextFormat(Qt.TextFormat.PlainText)
        row.addWidget(self.language, 1)
        self.copy_button = QToolButton(header)
        self.copy_button.setObjectName("bubbleButton")
        self.copy_button.setText("Copy")
        self.copy_button.setToolTip("Copy this code block")
        self.copy_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.copy_button.clicked.connect(self.copy)
        row.addWidget(self.copy_button)
        layout.addWidget(header)
        self.text = FitTextBrowser(self, mono=True)
        self.text.setObjectName("codeText")
        self.text.document().setDocumentMargin(8)
        self.text.setHtml(segment.html)
        layout.addWidget(self.text)

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.segment.code)
        self.copy_button.setText("Copied")
        QTimer.singleShot(COPIED_MS, self._reset_copy)

    def _reset_copy(self) -> None:
        # The block may be gone by now (conversation switched); shiboken raises then.
        try:
            self.copy_button.setText("Copy")
        except RuntimeError:
            pass


class MarkdownView(QWidget):
    """The segments of one rendered answer, stacked: FitTextBrowser for prose, CodeBlock for code.

    Widgets are built a few at a time (BUILD_BUDGET_S per event-loop turn), so a long answer, or many
    answers of a conversation being opened, never holds the UI thread for long.
    """

    completed = Signal()  # every segment has its widget

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("markdownView")
        self._layout = QVBoxLayout(self)
        self._layout.setContentsMargins(0, 0, 0, 0)
        self._layout.setSpacing(6)
        self._segments: tuple[Segment, ...] = ()
        self._next = 0  # index of the next segment to build
        self._timer = QTimer(self)
        self._timer.setInterval(0)
        self._timer.timeout.connect(self._build_some)

    def set_segments(self, segments: Sequence[Segment]) -> None:
        while self._layout.count():
            item = self._layout.takeAt(0)
            if item.widget() is not None:
                item.widget().deleteLater()
        self._segments = tuple(segments)
        self._next = 0
        self._build_some()
        if not self.is_complete():
            self._timer.start()

    def is_complete(self) -> bool:
        return self._next >= len(self._segments)

    def segments(self) -> tuple[Segment, ...]:
        return self._segments

    def code_blocks(self) -> list[CodeBlock]:
        return [self._layout.itemAt(i).widget() for i in range(self._layout.count())
                if isinstance(self._layout.itemAt(i).widget(), CodeBlock)]

    def plain_text(self) -> str:
        """What is shown, as text (for tests and accessibility; Copy uses the answer's own text)."""
        parts = []
        for i in range(self._layout.count()):
            widget = self._layout.itemAt(i).widget()
            if isinstance(widget, CodeBlock):
                parts.append(widget.segment.code)
            elif isinstance(widget, FitTextBrowser):
                parts.append(widget.toPlainText())
        return "\n".join(parts)

    def _build_some(self) -> None:
        deadline = time.perf_counter() + BUILD_BUDGET_S
        while not self.is_complete() and (time.perf_counter() < deadline or self._layout.count() == 0):
            segment = self._segments[self._next]
            self._next += 1
            if isinstance(segment, CodeSegment):
                widget: QWidget = CodeBlock(segment, self)
            else:
                widget = FitTextBrowser(self)
                widget.setObjectName("markdownText")
                widget.setHtml(segment.html)
            self._layout.addWidget(widget)
            widget.show()  # now, within the budget, not as a queued show later
        if self.is_complete():
            self._timer.stop()
            self.completed.emit()


class MarkdownRenderer(QObject):
    """Renders markdown on one background thread and hands the segments back on the UI thread.

    Parsing and highlighting are plain Python (tens of ms for a long answer); only building the
    widgets runs on the UI thread. Results are cached by (theme, text).
    """

    rendered = Signal(object, object)  # key given to request(), tuple[Segment, ...]

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="markdown")
        self._cache: OrderedDict[tuple[str, str], tuple[Segment, ...]] = OrderedDict()
        self._done.connect(self._on_done, Qt.ConnectionType.QueuedConnection)

    _done = Signal(object, object, object)  # key, (theme, text), segments: from the pool thread

    def cached(self, text: str, theme: str | None = None) -> tuple[Segment, ...] | None:
        return self._cache.get((theme or current_theme(), text))

    def request(self, key: object, text: str) -> None:
        """Renders `text` for the current theme; `rendered(key, segments)` follows (queued, even when cached)."""
        theme = current_theme()
        cache_key = (theme, text)
        hit = self._cache.get(cache_key)
        if hit is not None:
            self._done.emit(key, cache_key, hit)
            return
        colours = dict(load_palette(theme).code)
        future = self._pool.submit(render_markdown, text, colours)

        def finished(f) -> None:
            try:
                segments = f.result()
            except Exception as e:  # a renderer bug must not lose the answer: show it as plain prose
                log.exception("markdown rendering failed")
                segments = (TextSegment(f"<pre>{e!r}</pre>"),)
            self._done.emit(key, cache_key, segments)

        future.add_done_callback(finished)

    def render_now(self, text: str) -> tuple[Segment, ...]:
        """Synchronous rendering (tests, exports)."""
        return render_markdown(text, dict(current_palette().code))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _on_done(self, key: object, cache_key: tuple[str, str], segments: tuple[Segment, ...]) -> None:
        self._cache[cache_key] = segments
        self._cache.move_to_end(cache_key)
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        self.rendered.emit(key, segments)


_shared: MarkdownRenderer | None = None


def shared_renderer() -> MarkdownRenderer:
    """One renderer (one thread, one cache) for every view of the process."""
    global _shared
    if _shared is None:
        _shared = MarkdownRenderer()
    return _shared
