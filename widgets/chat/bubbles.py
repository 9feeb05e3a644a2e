"""The chat's message bubbles: a question (editable, with its branches), a note, an answer (tokens or markdown)."""
from __future__ import annotations

from collections.abc import Callable, Sequence

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from engine.types import Step
from widgets.chat.markdown import MarkdownView
from widgets.chat.markdown_render import Segment
from widgets.token_text import TokenTextView


COLLAPSE_LINES = 30  # a question longer than this many lines (a paste) is shown collapsed
COLLAPSE_CHARS = 6000  # ... or longer than this many characters
PREVIEW_LINES = 8  # lines of a collapsed question that show
PREVIEW_CHARS = 1200  # at most this many characters of it


def collapsed(text: str) -> tuple[str, int] | None:
    """(the preview, how many lines are left out) for a question too long to show whole; None when it fits."""
    lines = text.split("\n")
    if len(lines) <= COLLAPSE_LINES and len(text) <= COLLAPSE_CHARS:
        return None
    preview = "\n".join(lines[:PREVIEW_LINES])
    if len(preview) > PREVIEW_CHARS:
        preview = preview[:PREVIEW_CHARS].rstrip() + "…"
    return preview, len(lines) - preview.count("\n") - 1


class WrapLabel(QLabel):
    """A word-wrapped label that takes the height its text needs at its width, without telling the
    layout it depends on the width (heightForWidth). A chat of 100 bubbles whose labels did would
    have every relayout ask all of them again: hundreds of ms per change."""

    def __init__(self, text: str, parent: QWidget) -> None:
        super().__init__(text, parent)
        self.setWordWrap(True)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Fixed)
        self._fitted_width = -1

    def hasHeightForWidth(self) -> bool:
        return False

    def setText(self, text: str) -> None:
        super().setText(text)
        self._fitted_width = -1
        self._fit()

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._fit()

    def _fit(self) -> None:
        width = self.width()
        if width != self._fitted_width:
            self._fitted_width = width
            self.setMinimumHeight(0)  # QLabel's heightForWidth never goes below the minimum height
            self.setFixedHeight(max(QLabel.heightForWidth(self, width), self.fontMetrics().height()))


def plain_label(text: str, object_name: str, parent: QWidget) -> QLabel:
    label = WrapLabel(text, parent)
    label.setObjectName(object_name)
    label.setTextFormat(Qt.TextFormat.PlainText)  # people's text is never HTML
    label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    return label


def small_button(text: str, tip: str, parent: QWidget) -> QToolButton:
    button = QToolButton(parent)
    button.setObjectName("bubbleButton")
    button.setText(text)
    button.setToolTip(tip)
    button.setCursor(Qt.CursorShape.PointingHandCursor)
    return button


class BranchSwitch(QWidget):
    """‹ 2/3 ›: which of the alternatives at this place is shown (after an edit or a regenerate)."""

    moved = Signal(int)  # -1 (older) or +1 (newer)

    def __init__(self, parent: QWidget) -> None:
        super().__init__(parent)
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        row.setSpacing(0)
        self.back = small_button("‹", "Show the previous version", self)
        self.label = QLabel("", self)
        self.label.setObjectName("branchLabel")
        self.forward = small_button("›", "Show the next version", self)
        for widget in (self.back, self.label, self.forward):
            row.addWidget(widget)
        self.back.clicked.connect(lambda: self.moved.emit(-1))
        self.forward.clicked.connect(lambda: self.moved.emit(1))
        self.set_branch(0, 1)

    def set_branch(self, index: int, count: int) -> None:
        self.label.setText(f"{index + 1}/{count}")
        self.back.setEnabled(index > 0)
        self.forward.setEnabled(index < count - 1)
        self.setVisible(count > 1)


class UserBubble(QWidget):
    """A right-aligned question with Edit (then Send/Cancel in place), Copy and its branch switch."""

    edit_submitted = Signal(str)  # the edited text (stripped, not empty)
    copy_requested = Signal()

    def __init__(self, text: str, key: str, parent: QWidget) -> None:
        super().__init__(parent)
        self._text = text
        self.key = key  # the turn id ("" when the chat is not backed by a conversation)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.setSpacing(2)
        row = QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        row.addStretch(1)
        self.frame = QFrame(self)
        self.frame.setObjectName("userBubble")
        inner = QVBoxLayout(self.frame)
        inner.setContentsMargins(12, 8, 12, 8)
        self._collapsed = collapsed(text)
        self.label = plain_label(self._collapsed[0] if self._collapsed else text, "userText", self.frame)
        inner.addWidget(self.label)
        self.expand_button: QToolButton | None = None
        if self._collapsed:
            # A long paste reads as its first lines; the whole text is still what was sent and saved.
            self.expand_button = small_button("", "Show the whole message", self.frame)
            self.expand_button.setObjectName("userCollapsed")
            self.expand_button.setCheckable(True)
            self.expand_button.toggled.connect(self.set_expanded)
            inner.addWidget(self.expand_button, 0, Qt.AlignmentFlag.AlignLeft)
            self.set_expanded(False)
        self._inner = inner
        self.editor: QPlainTextEdit | None = None  # built on the first Edit: most questions are never edited
        self.edit_buttons: QWidget | None = None
        row.addWidget(self.frame)
        outer.addLayout(row)
        footer = QHBoxLayout()
        footer.setContentsMargins(0, 0, 0, 0)
        footer.addStretch(1)
        self.branches = BranchSwitch(self)
        footer.addWidget(self.branches)
        self.edit_button = small_button("Edit", "Edit this message and send it again (the chat forks here)", self)
        self.copy_button = small_button("Copy", "Copy this message", self)
        footer.addWidget(self.edit_button)
        footer.addWidget(self.copy_button)
        outer.addLayout(footer)
        self.edit_button.setVisible(bool(key))
        self.edit_button.clicked.connect(self.start_edit)
        self.copy_button.clicked.connect(self.copy_requested)

    def plain_text(self) -> str:
        return self._text

    def is_collapsed(self) -> bool:
        return self._collapsed is not None and not (self.expand_button and self.expand_button.isChecked())

    def set_expanded(self, on: bool) -> None:
        if self._collapsed is None or self.expand_button is None:
            return
        preview, hidden = self._collapsed
        self.label.setText(self._text if on else preview)
        more = f"{hidden:,} more line{'s' if hidden != 1 else ''}" if hidden else "the rest"
        self.expand_button.setText("Show less" if on else f"… {more} · show all")
        if self.expand_button.isChecked() != on:
            self.expand_button.setChecked(on)

    def is_editing(self) -> bool:
        return self.editor is not None and not self.editor.isHidden()

    def start_edit(self) -> None:
        if self.editor is None:
            self._build_editor()
        self.editor.setPlainText(self._text)
        self.frame.setMaximumWidth(16777215)  # room to edit
        if self.expand_button is not None:
            self.expand_button.hide()
        for widget, show in ((self.label, False), (self.editor, True), (self.edit_buttons, True),
                             (self.edit_button, False)):
            widget.setVisible(show)
        self.editor.setFocus()

    def cancel_edit(self) -> None:
        if self.editor is None:
            return
        for widget, show in ((self.label, True), (self.editor, False), (self.edit_buttons, False),
                             (self.edit_button, bool(self.key))):
            widget.setVisible(show)
        if self.expand_button is not None:
            self.expand_button.show()

    def _build_editor(self) -> None:
        self.editor = QPlainTextEdit(self.frame)
        self.editor.setObjectName("editEdit")
        self._inner.addWidget(self.editor)
        self.edit_buttons = QWidget(self.frame)
        buttons = QHBoxLayout(self.edit_buttons)
        buttons.setContentsMargins(0, 0, 0, 0)
        buttons.addStretch(1)
        self.cancel_button = QPushButton("Cancel", self.edit_buttons)
        self.send_button = QPushButton("Send", self.edit_buttons)
        self.send_button.setObjectName("primaryButton")
        buttons.addWidget(self.cancel_button)
        buttons.addWidget(self.send_button)
        self._inner.addWidget(self.edit_buttons)
        self.cancel_button.clicked.connect(self.cancel_edit)
        self.send_button.clicked.connect(self._submit)

    def _submit(self) -> None:
        text = self.editor.toPlainText().strip()
        if text:
            self.cancel_edit()
            self.edit_submitted.emit(text)


class NoteBubble(WrapLabel):
    """A centred grey line: model loaded, generation stopped, ..."""

    def __init__(self, text: str, parent: QWidget) -> None:
        super().__init__(text, parent)
        self.setObjectName("systemNote")
        self.setTextFormat(Qt.TextFormat.PlainText)
        self.setAlignment(Qt.AlignmentFlag.AlignHCenter)

    def plain_text(self) -> str:
        return self.text()


class HintBubble(QFrame):
    """A hint in the chat's flow with a choice of buttons (never modal): e.g. Regenerate at T = 0."""

    chosen = Signal(int)  # the index of the button clicked; -1 when dismissed

    def __init__(self, text: str, choices: Sequence[str], parent: QWidget) -> None:
        super().__init__(parent)
        self.setObjectName("hintBubble")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 8, 12, 8)
        self.label = plain_label(text, "hintText", self)
        layout.addWidget(self.label)
        row = QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        row.addStretch(1)
        self.buttons: list[QPushButton] = []
        for i, choice in enumerate(choices):
            button = QPushButton(choice, self)
            if i == 0:
                button.setObjectName("primaryButton")
            button.clicked.connect(lambda _=False, i=i: self.chosen.emit(i))
            row.addWidget(button)
            self.buttons.append(button)
        self.dismiss_button = QPushButton("Cancel", self)
        self.dismiss_button.clicked.connect(lambda: self.chosen.emit(-1))
        row.addWidget(self.dismiss_button)
        layout.addLayout(row)

    def plain_text(self) -> str:
        return self.label.text()


class AssistantBubble(QFrame):
    """Header, the answer (coloured tokens while it streams, markdown once done), an error line,
    then stats and Copy / Tokens / Regenerate and the branch switch."""

    def __init__(self, request_id: int, header: str, key: str, parent: QWidget) -> None:
        super().__init__(parent)
        self.setObjectName("assistantBubble")
        self.request_id = request_id
        self.key = key  # the turn id ("" when not backed by a conversation)
        self.done = False
        self._final_text: str | None = None
        # A reloaded answer's tokens (or the function that makes them), replayed only when first shown.
        self._pending_steps: Sequence[Step] | Callable[[], Sequence[Step]] | None = None
        self.segments: tuple[Segment, ...] | None = None  # the rendered markdown, once it arrived
        self.wants_markdown = False  # the view this answer should show when finished
        self.has_tokens = True  # False for a reloaded answer saved without its tokens: markdown only
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 8, 12, 8)
        layout.setSpacing(4)
        # Wrapped: on one line, a long header (model, mode, proposer) set the bubble's minimum width,
        # and a narrower chat column cut every answer off at its right edge.
        self.header = plain_label(header, "bubbleHeader", self)
        self.header.setVisible(bool(header))
        layout.addWidget(self.header)
        # While the prompt is read, before the first token: "Reading the prompt: 2,100 / 4,449 tokens".
        self.progress = plain_label("", "bubbleProgress", self)
        self.progress.hide()
        layout.addWidget(self.progress)
        self.view = TokenTextView(self, fit_content=True)
        self.view.setObjectName("assistantText")
        self.view.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        layout.addWidget(self.view)
        self.markdown: MarkdownView | None = None  # built when first shown
        self._layout = layout
        self.error = plain_label("", "bubbleError", self)
        self.error.hide()
        layout.addWidget(self.error)
        self.stats = plain_label("", "statsLine", self)
        self.stats.hide()
        layout.addWidget(self.stats)
        footer = QHBoxLayout()
        footer.setContentsMargins(0, 0, 0, 0)
        self.branches = BranchSwitch(self)
        footer.addWidget(self.branches)
        footer.addStretch(1)
        self.copy_button = small_button("Copy", "Copy this answer as plain text", self)
        self.tokens_button = small_button("Tokens", "Show the coloured tokens instead of the formatted answer", self)
        self.tokens_button.setCheckable(True)
        self.regenerate_button = small_button("Regenerate", "Generate this answer again (the old one stays "
                                              "as another version)", self)
        for button in (self.copy_button, self.tokens_button, self.regenerate_button):
            button.hide()
            footer.addWidget(button, 0, Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        layout.addLayout(footer)

    def plain_text(self) -> str:
        return self._final_text if self._final_text is not None else self.view.committed_text()

    def show_progress(self, text: str) -> None:
        """The line above the answer while there is none yet ("" hides it)."""
        self.progress.setText(text)
        self.progress.setVisible(bool(text))

    def finish(self, final_text: str | None) -> None:
        self.done = True
        self.show_progress("")
        self._final_text = final_text
        self.view.finish()
        self.copy_button.show()

    def set_pending_steps(self, steps: Sequence[Step] | Callable[[], Sequence[Step]]) -> None:
        """Tokens to replay into the token view only when someone looks at it (reloaded answers)."""
        self._pending_steps = steps

    def ensure_tokens(self) -> None:
        if self._pending_steps is not None:
            steps, self._pending_steps = self._pending_steps, None
            self.view.append_steps(steps() if callable(steps) else steps)
            self.view.finish()

    def showing_markdown(self) -> bool:
        return self.markdown is not None and not self.markdown.isHidden()

    def show_markdown(self, on: bool) -> None:
        """Switches between the formatted answer and its coloured tokens (when it has been rendered)."""
        on = on or not self.has_tokens
        self.wants_markdown = on
        if on and self.segments is not None:
            if self.markdown is None:
                self.markdown = MarkdownView(self)
                self.markdown.set_segments(self.segments)
                self._layout.insertWidget(self._layout.indexOf(self.view) + 1, self.markdown)
            self.markdown.show()
            self.view.hide()
        elif on:
            # Waiting for the rendering: a streamed answer keeps its tokens meanwhile; a reloaded one
            # (tokens not built yet) shows nothing rather than building them only to hide them.
            self.view.setVisible(self._pending_steps is None and self.has_tokens)
        else:
            self.ensure_tokens()
            if self.markdown is not None:
                self.markdown.hide()
            self.view.show()
        self.tokens_button.blockSignals(True)
        self.tokens_button.setChecked(not self.showing_markdown())
        self.tokens_button.blockSignals(False)

    def set_segments(self, segments: tuple[Segment, ...]) -> None:
        self.segments = segments
        if self.markdown is not None:
            self.markdown.set_segments(segments)
        self.show_markdown(self.wants_markdown)
