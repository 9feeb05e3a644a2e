"""How the window's controllers tell the person something: an error or a note in a box, a question, a
short line in the status bar, a file to save to."""
from __future__ import annotations

from PySide6.QtWidgets import QFileDialog, QMessageBox, QStatusBar, QWidget


class Notices:
    """One place for message boxes and status lines, so a controller needs this instead of the window.

    `parent` is the window the boxes and dialogs belong to (they centre on it and close with it).
    """

    def __init__(self, parent: QWidget, status: QStatusBar) -> None:
        self.parent = parent
        self._status = status

    def error(self, title: str, message: str) -> None:
        QMessageBox.critical(self.parent, title, message)

    def info(self, title: str, message: str) -> None:
        QMessageBox.information(self.parent, title, message)

    def confirm(self, title: str, message: str) -> bool:
        """Yes or No, No by default: for a step that will probably fail."""
        answer = QMessageBox.question(
            self.parent, title, message,
            QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No, QMessageBox.StandardButton.No,
        )
        return answer == QMessageBox.StandardButton.Yes

    def choose(self, title: str, message: str, accept: str) -> bool:
        """A question whose Yes is a named action (`accept`, e.g. "Switch to torch"); Cancel by default."""
        box = QMessageBox(QMessageBox.Icon.Question, title, message, QMessageBox.StandardButton.Cancel, self.parent)
        yes = box.addButton(accept, QMessageBox.ButtonRole.AcceptRole)
        box.setDefaultButton(QMessageBox.StandardButton.Cancel)
        box.exec()
        return box.clickedButton() is yes

    def note(self, message: str, ms: int = 5000) -> None:
        """A line in the status bar that goes after `ms` milliseconds."""
        self._status.showMessage(message, ms)

    def save_path(self, title: str, suggested: str, filters: str) -> str:
        """The file the person chose to write, or "" when they cancelled."""
        path, _ = QFileDialog.getSaveFileName(self.parent, title, suggested, filters)
        return path
