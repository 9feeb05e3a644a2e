"""The Models dialog's "Remote server" box: an OpenAI-compatible server's URL, API key and model, and a Test."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from PySide6.QtCore import Qt, Signal, Slot
from PySide6.QtWidgets import QFormLayout, QGroupBox, QHBoxLayout, QLabel, QLineEdit, QPushButton, QWidget

DEFAULT_URL = "http://127.0.0.1:8000/v1"
MAX_FIELD_CHARS = 2048  # a URL, key or model name longer than this is not one


@dataclass(frozen=True)
class RemoteChoice:
    """Chat through a remote server instead of local models (saved with the app's settings)."""

    use: bool = False  # the chat streams from the server; no local models are loaded meanwhile
    url: str = DEFAULT_URL  # the server's base URL (…/v1 is added when missing)
    api_key: str = field(default="", repr=False)  # bearer token ("" sends none); never logged
    model: str = ""  # the model to ask for; "" takes the first the server lists

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RemoteChoice:
        """From stored settings; anything damaged falls back to the default."""
        def text(key: str, default: str) -> str:
            value = raw.get(key, default)
            return value.strip() if isinstance(value, str) and len(value) <= MAX_FIELD_CHARS else default

        return cls(use=raw.get("use") is True, url=text("url", DEFAULT_URL) or DEFAULT_URL,
                   api_key=text("api_key", ""), model=text("model", ""))


class RemoteBox(QGroupBox):
    """Checkable: checked, the dialog connects to the server instead of loading models. Test asks the app
    (test_requested) and shows its one-line answer (set_test_result)."""

    test_requested = Signal(object)  # RemoteChoice to try (the app asks the server off the GUI thread)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Remote server (OpenAI-compatible: specdec-studio serve, vLLM, llama-server, …)", parent)
        self.setCheckable(True)
        self.setChecked(False)
        form = QFormLayout(self)
        self.url = QLineEdit(self)
        self.url.setPlaceholderText(DEFAULT_URL)
        self.api_key = QLineEdit(self)
        self.api_key.setEchoMode(QLineEdit.EchoMode.Password)
        self.api_key.setPlaceholderText("none")
        self.model = QLineEdit(self)
        self.model.setPlaceholderText("empty: the first model the server lists")
        for edit in (self.url, self.api_key, self.model):
            edit.setMaxLength(MAX_FIELD_CHARS)
        form.addRow("URL", self.url)
        form.addRow("API key", self.api_key)
        form.addRow("Model", self.model)
        row = QHBoxLayout()
        self.test_button = QPushButton("Test", self)
        self.test_button.setToolTip("Ask the server which models it offers (nothing is loaded)")
        self.test_button.clicked.connect(self._on_test)
        self.result = QLabel("", self)
        self.result.setTextFormat(Qt.TextFormat.PlainText)
        self.result.setWordWrap(True)
        row.addWidget(self.test_button)
        row.addWidget(self.result, 1)
        form.addRow(row)

    def choice(self) -> RemoteChoice:
        return RemoteChoice(use=self.isChecked(), url=self.url.text().strip() or DEFAULT_URL,
                            api_key=self.api_key.text().strip(), model=self.model.text().strip())

    def set_choice(self, choice: RemoteChoice) -> None:
        self.setChecked(choice.use)
        self.url.setText(choice.url)
        self.api_key.setText(choice.api_key)
        self.model.setText(choice.model)

    @Slot(str)
    def set_test_result(self, line: str) -> None:
        """What the server said, in one line."""
        self.test_button.setEnabled(True)
        self.result.setText(line)

    def _on_test(self) -> None:
        self.test_button.setEnabled(False)
        self.result.setText("Asking the server…")
        self.test_requested.emit(self.choice())
