"""Where drafts were rejected in a streaming answer: small marks painted between characters, never text.

Rejected drafts inserted into the words being read (struck or not) break them: `list1 2):` for
`list):`. So the text view keeps only what was committed, and each step whose drafts the target
rejected leaves a mark at the document position where they would have gone; hovering it (or the
corrected token after it) shows the rejected text with its draft q and target p.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence

from PySide6.QtCore import QPointF, QRect
from PySide6.QtGui import QColor, QPainter, QPolygonF

from engine.types import TokenView
from widgets.tree_marks import choice_text

MARK_WIDTH = 7  # px: the mark's base
MARK_HEIGHT = 5  # px: how far it reaches up from the line's bottom
HIT_SLACK = 5  # px either side of a mark that still counts as hovering it


def visible(text: str) -> str:
    """A draft's text with its whitespace made visible, for a tooltip."""
    return text.replace("\n", "↵").replace("\t", "⇥") or "∅"


def token_figures(token: TokenView, k: int | None = None) -> list[str]:
    """The numbers behind a token that it has: draft q, target p, accept prob, draft position (of k)."""
    parts: list[str] = []
    if token.q is not None:
        parts.append(f"draft q={token.q:.2f}")
    if token.p is not None:
        parts.append(f"target p={token.p:.2f}")
    if token.accept_prob is not None:
        parts.append(f"accept prob={token.accept_prob:.2f}")
    if token.draft_pos is not None:
        parts.append(f"draft position {token.draft_pos + 1}/{k}" if k else f"draft position {token.draft_pos + 1}")
    return parts


def format_rejected_tooltip(tokens: Sequence[TokenView], k: int | None = None) -> str:
    """e.g. 'Rejected here: “ foo bar” (step 0)' and one line of q/p per rejected token."""
    head = f"Rejected here: “{visible(''.join(t.text for t in tokens))}” (step {tokens[0].step})" if tokens else ""
    lines = [head]
    for t in tokens:
        parts = token_figures(t, k)
        if t.source is not None:
            parts.append(f"proposer {t.source}")
        if t.branch is not None:  # a tree round: which of the drafter's choices it was
            parts.append(choice_text(t) or "")
        lines.append(f"  “{visible(t.text)}”: " + " · ".join(parts))
    return "\n".join(lines)


class RejectionMarks:
    """Marks in document order: (position, step, token indices of the rejected drafts)."""

    def __init__(self) -> None:
        self.positions: list[int] = []  # document positions, ascending
        self.steps: list[int] = []  # the step each mark belongs to
        self.tokens: list[list[int]] = []  # indices into the view's token list

    def __len__(self) -> int:
        return len(self.positions)

    def add(self, position: int, step: int, token_index: int) -> None:
        """A rejected token of `step` at `position`; the rejects of one step share one mark."""
        if self.steps and self.steps[-1] == step:
            self.tokens[-1].append(token_index)
            return
        self.positions.append(position)
        self.steps.append(step)
        self.tokens.append([token_index])

    def at(self, position: int) -> int | None:
        """The mark at exactly this document position, if any."""
        i = bisect_left(self.positions, position)
        return i if i < len(self.positions) and self.positions[i] == position else None

    def between(self, first: int, last: int) -> range:
        """Indices of the marks with first <= position <= last."""
        return range(bisect_left(self.positions, first), bisect_right(self.positions, last))

    def paint(self, painter: QPainter, rects: Sequence[QRect], colour: QColor) -> None:
        """A small filled wedge at the bottom of the line, pointing up at the gap between two characters."""
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setPen(colour)
        painter.setBrush(colour)
        half = MARK_WIDTH / 2
        for r in rects:
            x, bottom = r.left() + 0.5, r.bottom() + 1.0
            painter.drawPolygon(QPolygonF([QPointF(x - half, bottom), QPointF(x + half, bottom),
                                           QPointF(x, bottom - MARK_HEIGHT)]))

    def hit(self, indices: range, rect_of: Callable[[int], QRect], x: float, y: float) -> int | None:
        """The mark among `indices` whose line holds y and whose x is within HIT_SLACK of x."""
        for i in indices:
            r = rect_of(self.positions[i])
            if r.top() <= y <= r.bottom() + 2 and abs(r.left() - x) <= HIT_SLACK:
                return i
        return None
