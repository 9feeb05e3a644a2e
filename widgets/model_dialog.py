"""The Load models dialog: target and draft from the packaged default, a folder, a .gguf file or a hub id."""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QButtonGroup,
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QFormLayout,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QRadioButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine.settings import (
    DEVICES,
    DTYPES,
    MAX_THREADS,
    RUNTIME_LABELS,
    RUNTIMES,
    SOURCE_KINDS,
    ModelChoice,
    ModelSelection,
)

DEFAULT_LABELS = {
    "target": "Default (Qwen2.5-Coder 1.5B, packaged)",
    "draft": "Default (Qwen2.5-Coder 0.5B, packaged)",
}


class _SourcePicker(QGroupBox):
    """Radio buttons for the four sources, each with its own field."""

    def __init__(self, role: str, parent: QWidget) -> None:
        super().__init__("Target model" if role == "target" else "Draft model", parent)
        self.role = role
        grid = QGridLayout(self)
        grid.setColumnStretch(1, 1)
        self._group = QButtonGroup(self)
        self.radios: dict[str, QRadioButton] = {}
        labels = {"default": DEFAULT_LABELS[role], "folder": "Local folder", "gguf": ".gguf file", "hub": "Hub id"}
        for row, kind in enumerate(SOURCE_KINDS):
            radio = QRadioButton(labels[kind], self)
            self._group.addButton(radio, row)
            self.radios[kind] = radio
            grid.addWidget(radio, row, 0)
        self.folder = QLineEdit(self)
        self.folder.setPlaceholderText("a folder with config.json and *.safetensors")
        self.gguf = QLineEdit(self)
        self.gguf.setPlaceholderText("path/to/model.gguf")
        self.hub = QLineEdit(self)
        self.hub.setPlaceholderText("e.g. Qwen/Qwen2.5-0.5B-Instruct (from the local Hugging Face cache)")
        self.fields = {"folder": self.folder, "gguf": self.gguf, "hub": self.hub}
        browse_folder = QPushButton("Browse…", self)
        browse_folder.clicked.connect(self._browse_folder)
        browse_gguf = QPushButton("Browse…", self)
        browse_gguf.clicked.connect(self._browse_gguf)
        grid.addWidget(self.folder, 1, 1)
        grid.addWidget(browse_folder, 1, 2)
        grid.addWidget(self.gguf, 2, 1)
        grid.addWidget(browse_gguf, 2, 2)
        grid.addWidget(self.hub, 3, 1, 1, 2)
        for kind, field in self.fields.items():
            # Typing into a field picks its source; nobody wants to click the radio as well.
            field.textEdited.connect(lambda _t, k=kind: self.radios[k].setChecked(True))
        self.radios["default"].setChecked(True)

    def choice(self) -> ModelChoice:
        kind = next(k for k, r in self.radios.items() if r.isChecked())
        return ModelChoice(kind, "" if kind == "default" else self.fields[kind].text().strip())

    def set_choice(self, choice: ModelChoice) -> None:
        kind = choice.kind if choice.kind in SOURCE_KINDS else "default"
        self.radios[kind].setChecked(True)
        if kind != "default":
            self.fields[kind].setText(choice.value)

    def _browse_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, f"Choose the {self.role} model folder", self.folder.text())
        if folder:
            self.folder.setText(folder)
            self.radios["folder"].setChecked(True)

    def _browse_gguf(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, f"Choose the {self.role} .gguf file", self.gguf.text(),
                                              "GGUF models (*.gguf);;All files (*)")
        if path:
            self.gguf.setText(path)
            self.radios["gguf"].setChecked(True)


class ModelDialog(QDialog):
    """Picks a pair; the app checks tokenizers and loads off the UI thread after OK."""

    def __init__(self, selection: ModelSelection | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Load models")
        self.setMinimumWidth(620)
        layout = QVBoxLayout(self)
        layout.setSpacing(10)
        intro = QLabel("Draft and target must share a tokenizer (same model family). "
                       "Tokenizers are checked before any weights load.", self)
        intro.setWordWrap(True)
        layout.addWidget(intro)
        self.target = _SourcePicker("target", self)
        layout.addWidget(self.target)
        self.draft = _SourcePicker("draft", self)
        layout.addWidget(self.draft)
        self.no_draft = QCheckBox("No draft (n-gram prompt lookup only)", self)
        self.no_draft.toggled.connect(lambda on: self.draft.setEnabled(not on))
        layout.addWidget(self.no_draft)
        form = QFormLayout()
        row = QHBoxLayout()
        self.device = QComboBox(self)
        self.device.addItems(DEVICES)
        self.device.setEditable(True)  # cuda:1 and friends
        self.dtype = QComboBox(self)
        self.dtype.addItems(DTYPES)
        self.dtype.setToolTip("auto: bfloat16 on CUDA and on CPUs with native bf16, else float32")
        self.runtime = QComboBox(self)
        for runtime in RUNTIMES:
            self.runtime.addItem(RUNTIME_LABELS[runtime], runtime)
        self.runtime.setToolTip("auto: llama.cpp on the CPU for .gguf files and the packaged pair (when it is "
                                "installed), torch otherwise. Precision applies to torch; llama.cpp runs the "
                                "GGUF's own quantization.")
        self.threads = QSpinBox(self)
        self.threads.setRange(0, MAX_THREADS)
        self.threads.setSpecialValueText("physical cores")
        self.threads.setToolTip("CPU threads per llama.cpp decode (0: one per physical core)")
        form.addRow("Device", self.device)
        form.addRow("Precision", self.dtype)
        form.addRow("Runtime", self.runtime)
        form.addRow("Threads", self.threads)
        row.addLayout(form)
        row.addStretch(1)
        layout.addLayout(row)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel,
                                   Qt.Orientation.Horizontal, self)
        buttons.button(QDialogButtonBox.StandardButton.Ok).setText("Load")
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)
        self.set_selection(selection or ModelSelection())

    def selection(self) -> ModelSelection:
        return ModelSelection(
            target=self.target.choice(),
            draft=self.draft.choice(),
            device=self.device.currentText().strip() or "auto",
            dtype=self.dtype.currentText(),
            no_draft=self.no_draft.isChecked(),
            runtime=self.runtime.currentData(),
            threads=self.threads.value(),
        )

    def set_selection(self, selection: ModelSelection) -> None:
        self.target.set_choice(selection.target)
        self.draft.set_choice(selection.draft)
        self.device.setCurrentText(selection.device)
        self.dtype.setCurrentIndex(max(0, self.dtype.findText(selection.dtype)))
        self.no_draft.setChecked(selection.no_draft)
        self.draft.setEnabled(not selection.no_draft)
        self.runtime.setCurrentIndex(max(0, self.runtime.findData(selection.runtime)))
        self.threads.setValue(selection.threads)
