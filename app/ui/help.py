"""The Help menu: the documentation opened in the desktop's own viewer, and the keyboard shortcuts of the menus."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from PySide6.QtCore import QUrl
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import QMessageBox, QWidget

from app.ui.notices import Notices
from widgets.shortcuts_dialog import ShortcutsDialog

ROOT = Path(__file__).resolve().parents[2]
# Keys that act inside the message box rather than through a menu (widgets/chat/prompt_box.py).
BOX_KEYS = "In the message box: Enter sends, Shift+Enter starts a new line, Esc stops the answer."


def documentation(root: Path = ROOT) -> Path | None:
    """The README beside the code, else the docs folder; None when neither is there (an installed wheel)."""
    for candidate in (root / "README.md", root / "docs"):
        if candidate.exists():
            return candidate
    return None


class Help:
    """`shortcuts` gives the menus' (menu, action, keys) rows when the dialog opens."""

    def __init__(self, parent: QWidget, notices: Notices, shortcuts: Callable[[], Sequence[tuple[str, str, str]]], *,
                 open_url: Callable[[QUrl], bool] = QDesktopServices.openUrl, root: Path = ROOT) -> None:
        self._parent = parent
        self._notices = notices
        self._shortcuts = shortcuts
        self._open_url = open_url
        self._root = root
        self.dialog: ShortcutsDialog | None = None

    def open_docs(self) -> bool:
        """Opens the README (or the docs folder) with the desktop's viewer; says where it is when nothing opens it."""
        path = documentation(self._root)
        if path is None:
            self._notices.note("The documentation is not installed here: see the project's README online.", 10000)
            return False
        if not self._open_url(QUrl.fromLocalFile(str(path))):
            self._notices.note(f"No program here opens {path.name}; it is at {path}", 15000)
            return False
        return True

    def show_shortcuts(self) -> ShortcutsDialog:
        if self.dialog is None:
            self.dialog = ShortcutsDialog(self._shortcuts(), (BOX_KEYS,), self._parent)
        self.dialog.show()
        self.dialog.raise_()
        return self.dialog

    def about(self) -> None:
        QMessageBox.about(
            self._parent, "About SpecDec Studio",
            "<b>SpecDec Studio</b><p>Speculative decoding you can watch: a small draft proposes K tokens, "
            "the target verifies them in one forward, and the output is exactly the target's.</p>"
            "<p>Green: accepted draft tokens (a dotted underline: accepted through a branch of the draft head's "
            "tree, not its first choice) · a red mark: where drafts were rejected (hover it for them) · "
            "amber: the target's correction · blue: the bonus token · violet: standard decoding.</p>",
        )
