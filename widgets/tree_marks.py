"""Tokens accepted through a branch of a draft tree: their dotted underline, their hover line, their legend chip.

A dynamic tree round (the draft head grows its likeliest continuations, the target walks them) can accept
a token that was not the drafter's first choice after its parent. Such a token keeps the accepted colour
(one palette entry per status) and gets a dotted underline in its own text colour, so the mark has the
text's contrast against the token background (WCAG AA in both themes) and reads as "hover me" rather than
as a link (solid) or a spelling mistake (wavy).
"""
from __future__ import annotations

from PySide6.QtCore import QPointF, Qt
from PySide6.QtGui import QColor, QPainter, QPaintEvent, QPen, QTextCharFormat
from PySide6.QtWidgets import QLabel, QWidget

from engine.types import TokenView

UNDERLINE = QTextCharFormat.UnderlineStyle.DotLine  # the mark in the text
CHIP_TEXT = "tree branch"
CHIP_TOOLTIP = ("tree branch: an accepted token that was not the draft head's first choice after the previous "
                "token — the target accepted a branch of the head's draft tree. Shown in the accepted colour with "
                "a dotted underline; hover the token for which choice it was.")
_DRAFTERS = {"head": "head", "draft": "draft model", "ngram": "n-gram lookup"}


def is_branch(token: TokenView) -> bool:
    """The token came through a branch of a draft tree (not the drafter's first choice)."""
    return bool(token.branch)


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ... 11th, 12th, 13th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def choice_text(token: TokenView) -> str | None:
    """What a token of a tree round was among its drafter's choices, for its hover; None outside trees.

    e.g. "drafted as the head's 2nd choice after the previous token (a branch of the tree)".
    """
    if token.branch is None:
        return None
    drafter = _DRAFTERS.get(token.source or "", "drafter")
    if token.branch == 0:
        return f"drafted as the {drafter}'s first choice after the previous token"
    choice = ordinal(token.branch + 1)
    return f"drafted as the {drafter}'s {choice} choice after the previous token (a branch of the tree)"


def mark_format(fmt: QTextCharFormat, colour: QColor) -> None:
    """Adds the branch mark to a token's format: a dotted underline in `colour` (the token's text colour)."""
    fmt.setUnderlineStyle(UNDERLINE)
    fmt.setUnderlineColor(colour)


def paint_dotted_underline(painter: QPainter, x0: float, x1: float, y: float, colour: QColor) -> None:
    """The mark drawn by hand (the legend chip is no text document): 1 px dots, 1 px apart, like the text's."""
    pen = QPen(colour, 1.0, Qt.PenStyle.DotLine)
    pen.setCapStyle(Qt.PenCapStyle.FlatCap)
    painter.setPen(pen)
    painter.drawLine(QPointF(x0, y), QPointF(x1, y))


class BranchChip(QLabel):
    """The legend's chip for the mark: the accepted chip's colours (its stylesheet) with the dotted underline."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(CHIP_TEXT, parent)
        self.setObjectName("legendChip")
        self.setToolTip(CHIP_TOOLTIP)
        self._underline = QColor()

    def set_underline_colour(self, colour: QColor) -> None:
        self._underline = QColor(colour)
        self.update()

    def paintEvent(self, event: QPaintEvent) -> None:  # noqa: N802 (Qt override)
        super().paintEvent(event)
        metrics = self.fontMetrics()
        rect = self.contentsRect()
        width = metrics.horizontalAdvance(self.text())
        left = rect.left() + max(0, (rect.width() - width) // 2) if self.alignment() & Qt.AlignmentFlag.AlignHCenter \
            else rect.left()
        baseline = rect.top() + (rect.height() - metrics.height()) / 2 + metrics.ascent()
        painter = QPainter(self)
        paint_dotted_underline(painter, left, left + width, baseline + metrics.underlinePos() + 0.5, self._underline)
        painter.end()
