"""A row of colour chips naming the token statuses, each drawn exactly like a token in the text."""
from __future__ import annotations

from PySide6.QtGui import QColor
from PySide6.QtWidgets import QLabel, QSizePolicy, QWidget

from widgets.flow_layout import FlowLayout
from widgets.palette import STATUSES, current_palette
from widgets.tree_marks import BranchChip

# Wording from DESIGN.md, "Token colours".
DESCRIPTIONS: dict[str, str] = {
    "accepted": "Proposed by the draft, accepted by the target.",
    "rejected": "Proposed by the draft, rejected by the target: never part of the answer.",
    "corrected": "The target's own token at the first rejection.",
    "bonus": "The target's extra token after all K draft tokens were accepted.",
    "target": "Standard decoding: a token from the target alone.",
}


# What the text shows of rejected drafts, per palette ghost display (the chip reads like the text).
SHOWN = {
    "mark": "A small ▲ under the text marks where drafts were rejected; hover it for the rejected text and "
            "its draft q / target p.",
    "flash": "The newest step's rejected drafts show faded for a moment, then a small ▲ marks where they "
             "were; hover it for the rejected text and its draft q / target p.",
}


def _css(colour: QColor) -> str:
    return f"rgba({colour.red()}, {colour.green()}, {colour.blue()}, {colour.alphaF():.2f})"


class Legend(QWidget):
    """accepted · tree branch · rejected · corrected · bonus · target, with a tooltip explaining each.

    "tree branch" is no status: it is the mark an accepted token gets when a draft tree's branch brought it
    (widgets.tree_marks), drawn like it and shown with the accepted chip.

    The chips wrap onto a second row in a narrow window rather than being cut mid-word.
    """

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("legend")
        layout = FlowLayout(self, spacing=6, line_spacing=4)
        policy = QSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Preferred)
        policy.setHeightForWidth(True)
        self.setSizePolicy(policy)
        self._chips: dict[str, QLabel] = {}
        for status in STATUSES:
            chip = QLabel(status, self)
            chip.setObjectName("legendChip")
            layout.addWidget(chip)
            self._chips[status] = chip
            if status == "accepted":
                self._branch = BranchChip(self)
                layout.addWidget(self._branch)
        self.refresh_palette()

    def chip(self, status: str) -> QLabel:
        return self._chips[status]

    def branch_chip(self) -> BranchChip:
        return self._branch

    def set_visible_statuses(self, statuses: tuple[str, ...] | list[str]) -> None:
        """Shows only these chips (e.g. just "target" while comparing against standard decoding)."""
        for status, chip in self._chips.items():
            chip.setVisible(status in statuses)
        self._branch.setVisible("accepted" in statuses)

    def refresh_palette(self) -> None:
        palette = current_palette()
        for status, chip in self._chips.items():
            chip.setToolTip(f"{status}: {DESCRIPTIONS[status]}"
                            + (f" {SHOWN[palette.ghost.display]}" if status == "rejected" else ""))
            if status == "rejected":  # drawn like the mark in the text: no token colour, the mark before the word
                chip.setText("▲ rejected")
                chip.setStyleSheet(f"QLabel {{ background: transparent; color: {_css(palette.ghost.mark)};"
                                   f" border-radius: 4px; padding: 1px 7px; }}")
                continue
            colours = palette.colours(status)
            style = (f"QLabel {{ background: {_css(colours.background)}; color: {_css(colours.foreground)};"
                     f" border-radius: 4px; padding: 1px 7px; }}")
            chip.setStyleSheet(style)
            if status == "accepted":  # the branch mark: an accepted token with a dotted underline
                self._branch.setStyleSheet(style)
                self._branch.set_underline_colour(colours.foreground)
