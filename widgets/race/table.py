"""The Race tab's results table: one row per finished race, grouped by category, and the plain data it reads."""
from __future__ import annotations

from typing import Protocol

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QTableWidget, QTableWidgetItem, QWidget

from widgets.race.pane import DIVERGENCE_COLOUR, identical_text, rate_text, times_text

# Categories of assets/bench_prompts.jsonl, in the order the picker and the table group them.
CATEGORY_LABELS: dict[str, str] = {
    "code": "Code",
    "longform_zh": "Long-form Chinese",
    "longform_en": "Long-form English",
    "chat": "Chat",
    "math": "Math",
    "short": "Short answers",
    "summarize": "Summarise",
    "custom": "Custom",
}

TABLE_COLUMNS = ("Category", "Prompt", "Reps", "Std tok/s", "Spec tok/s", "Speedup", "Spread", "Accepted",
                 "Tokens/step", "Identical")
TABLE_TIPS = ("Prompt category", "Bench prompt id (custom: typed by hand)", "Repeats of the race",
              "Standard decoding tokens/s (median over repeats)", "Speculative decoding tokens/s (median)",
              "Median speedup = speculative tok/s ÷ standard tok/s", "Speedup min–max and interquartile range",
              "Draft tokens accepted (median)", "Tokens per target forward (median)",
              "Greedy outputs identical token for token in every repeat")


class PromptLike(Protocol):
    id: str
    category: str
    prompt: str


class SpreadLike(Protocol):
    n: int
    median: float
    minimum: float
    maximum: float
    iqr: float


class RaceSummaryLike(Protocol):
    """What show_race_summary reads (app.core.race_logic.RaceSummary has it)."""

    race_id: int
    prompt_id: str
    category: str
    speedup: SpreadLike
    standard_tokens_per_s: float
    speculative_tokens_per_s: float
    acceptance_rate: float
    tokens_per_target_forward: float
    identical: bool | None
    verdict: str  # who won, in plain words (only beyond the measured spread)


class RaceTable(QTableWidget):
    """Median speedup, spread, acceptance and identity per race; rows stay grouped by category."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(0, len(TABLE_COLUMNS), parent)
        self.setObjectName("raceTable")
        self.setHorizontalHeaderLabels(TABLE_COLUMNS)
        for col, tip in enumerate(TABLE_TIPS):
            self.horizontalHeaderItem(col).setToolTip(tip)
        self.verticalHeader().setVisible(False)
        self.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.setAlternatingRowColors(True)
        header = self.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setStretchLastSection(True)

    def add_summary(self, s: RaceSummaryLike) -> None:
        """One row per finished race, grouped by category in the picker's order."""
        order = list(CATEGORY_LABELS)
        rank = order.index(s.category) if s.category in order else len(order)
        row = self.rowCount()
        # Grouped by category: after the last row of this category (or of any category before it).
        for r in range(self.rowCount()):
            other = self.item(r, 0).data(Qt.ItemDataRole.UserRole)
            if other > rank:
                row = r
                break
        self.insertRow(row)
        spread = s.speedup
        cells = [
            CATEGORY_LABELS.get(s.category, s.category),
            s.prompt_id,
            str(spread.n),
            rate_text(s.standard_tokens_per_s),
            rate_text(s.speculative_tokens_per_s),
            times_text(spread.median),
            f"{spread.minimum:.2f}–{spread.maximum:.2f}× · IQR {spread.iqr:.2f}" if spread.n > 1 else "–",
            f"{s.acceptance_rate * 100:.0f}%",
            f"{s.tokens_per_target_forward:.2f}",
            identical_text(s.identical),
        ]
        for col, text in enumerate(cells):
            item = QTableWidgetItem(text)
            if col >= 2:
                item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            if col == 5:
                font = item.font()
                font.setBold(True)
                item.setFont(font)
            if col == 9 and s.identical is False:
                item.setForeground(QColor(DIVERGENCE_COLOUR))
            self.setItem(row, col, item)
        self.item(row, 0).setData(Qt.ItemDataRole.UserRole, rank)
        self.item(row, 0).setToolTip(f"race {s.race_id}")
        self.scrollToItem(self.item(row, 0))

    def rows(self) -> list[list[str]]:
        """The table's text, row by row (for tests and copy)."""
        return [[self.item(r, c).text() for c in range(self.columnCount())] for r in range(self.rowCount())]
