"""The Load models dialog: target and draft (a preset, the packaged default, a folder, a .gguf file or a hub id),
each model's precision, the context, and the memory plan of that choice before anything loads."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QButtonGroup,
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
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

from engine.cpu_threads import choose_threads, physical_cores
from engine.errors import EngineError
from engine.settings import (
    CONTEXT_RANGE,
    DEVICES,
    DTYPES,
    GPU_PRECISIONS,
    MAX_THREADS,
    MEMORY_RANGE,
    PRECISIONS,
    RUNTIME_LABELS,
    RUNTIMES,
    SOURCE_KINDS,
    ModelChoice,
    ModelSelection,
    PairPreset,
)
from engine.types import MemoryPlan, PlanChange
from widgets.check_view import CheckView
from widgets.plan_bar import PlanBar
from widgets.remote_box import RemoteBox, RemoteChoice

Planner = Callable[[ModelSelection], MemoryPlan]  # raises EngineError when a model cannot be sized
# precision -> device choice ("auto", "cpu", "cuda", "cuda:N") -> why that precision cannot run there, one line;
# made by the app (engine.models.fastquant.precision_refusals): this module never asks torch.
Refusals = Mapping[str, Mapping[str, str]]
PLAN_DELAY_MS = 250  # typing a path re-plans once it pauses, not per keystroke
PRECISION_TIP = ("auto: the float dtype below. int8 / nf4: 8-bit / 4-bit weights through bitsandbytes "
                 "(about a half / a quarter of bf16; nf4 runs in CUDA graphs, int8 eagerly). int8-wo / fp8: "
                 "8-bit weights read at memory speed in CUDA graphs (fp8 needs a GPU of compute capability 8.9+).")
CHECK_TIP = ("Rank the draft, the draft head and n-gram lookup by the speedup they should give on this machine, "
             "from a look at the loaded target's own answers")
STOP_TIP = "Stop the draft check after the probe in progress (on a CPU a check takes minutes)"

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
        self.precision = QComboBox(self)
        self.precision.addItems(PRECISIONS)
        self.precision.setToolTip(PRECISION_TIP)
        grid.addWidget(QLabel("Precision", self), 4, 0)
        grid.addWidget(self.precision, 4, 1, 1, 2, Qt.AlignmentFlag.AlignLeft)
        self.radios["default"].setChecked(True)

    def connect_changed(self, slot: Callable[[], None]) -> None:
        """Calls `slot` whenever this side's choice changes."""
        for radio in self.radios.values():
            radio.toggled.connect(slot)
        for field in self.fields.values():
            field.textChanged.connect(slot)
        self.precision.currentIndexChanged.connect(slot)

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
    """Picks a pair; shows its memory plan as it changes; the app loads off the UI thread after Load."""

    check_requested = Signal(object)  # ModelSelection: "Check drafts" (the app runs it on the worker)
    check_stop_requested = Signal()  # "Stop check": the check in flight ends after its probe in progress

    def __init__(self, selection: ModelSelection | None = None, parent: QWidget | None = None, *,
                 planner: Planner | None = None, presets: Sequence[PairPreset] = (),
                 refusals: Refusals | None = None) -> None:
        """refusals: what each device cannot run (None: only that the CPU runs no GPU_PRECISIONS)."""
        super().__init__(parent)
        self.setWindowTitle("Load models")
        self.setMinimumWidth(660)
        self._planner = planner
        self._presets = tuple(presets)
        self._refusals = refusals
        self._checking = False  # a check runs: its button is Stop until check_ended
        self.plan: MemoryPlan | None = None  # the plan of the current choice (None: not planned)
        layout = QVBoxLayout(self)
        layout.setSpacing(10)
        intro = QLabel("Draft and target must share a tokenizer (same model family). "
                       "Tokenizers are checked and memory is planned before any weights load.", self)
        intro.setWordWrap(True)
        layout.addWidget(intro)
        self.preset = QComboBox(self)
        self.preset.addItem("Choose a preset pair…")
        for p in self._presets:
            self.preset.addItem(p.title + ("" if p.offline else "  (download)"), p.name)
        self.preset.setToolTip("Hub presets need the network once, unless they are in the local Hugging Face cache.")
        self.preset.activated.connect(self._on_preset)
        if self._presets:
            layout.addWidget(self.preset)
        else:
            self.preset.hide()  # a child outside every layout would sit over the intro at the top left
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
        self.dtype.setToolTip("Float dtype of both models (auto: bfloat16 on CUDA and on CPUs with native bf16, "
                              "else float32); a model's own precision above overrides it")
        self.context = QSpinBox(self)
        self.context.setRange(*CONTEXT_RANGE)
        self.context.setSingleStep(1024)
        self.context.setSpecialValueText("auto")  # the plan names the runtime's own default once it is made
        self.context.setToolTip("Positions each KV cache holds; a shorter context needs less memory")
        self.memory = QDoubleSpinBox(self)
        self.memory.setRange(*MEMORY_RANGE)
        self.memory.setDecimals(1)
        self.memory.setSuffix(" GiB")
        self.memory.setSpecialValueText("free memory")
        self.memory.setToolTip("Memory each device may use; 'free memory' asks the device. "
                               "Set it to plan for another GPU, or to leave room for other programs.")
        form.addRow("Device", self.device)
        form.addRow("Float dtype", self.dtype)
        form.addRow("Context", self.context)
        form.addRow("Memory budget", self.memory)
        self.runtime = QComboBox(self)
        for runtime in RUNTIMES:
            self.runtime.addItem(RUNTIME_LABELS[runtime], runtime)
        self.runtime.setToolTip("auto: llama.cpp on the CPU for .gguf files and the packaged pair (when it is "
                                "installed), torch otherwise. Precision applies to torch; llama.cpp runs the "
                                "GGUF's own quantization.")
        self.threads = QSpinBox(self)
        self.threads.setRange(0, MAX_THREADS)
        auto = choose_threads(physical_cores())
        self.threads.setSpecialValueText(f"auto ({auto.label()})")
        self.threads.setToolTip(f"CPU threads per decode, llama.cpp and torch on a CPU. auto: {auto.describe()}")
        form.addRow("Runtime", self.runtime)
        form.addRow("Threads", self.threads)
        row.addLayout(form)
        row.addStretch(1)
        layout.addLayout(row)
        plan_box = QGroupBox("Memory plan", self)
        plan_layout = QVBoxLayout(plan_box)
        self.plan_bar = PlanBar(plan_box)
        self.plan_bar.change_applied.connect(self.apply_change)
        plan_layout.addWidget(self.plan_bar)
        plan_box.setVisible(planner is not None)
        layout.addWidget(plan_box)
        self.check_view = CheckView(self)  # the draft check's result, shown once one is asked for
        self.check_view.hide()
        layout.addWidget(self.check_view)
        self.remote = RemoteBox(self)  # checked: Connect to a server instead of loading (see remote_toggled)
        layout.addWidget(self.remote)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel,
                                   Qt.Orientation.Horizontal, self)
        buttons.button(QDialogButtonBox.StandardButton.Ok).setText("Load")
        self.check_button = buttons.addButton("Check drafts", QDialogButtonBox.ButtonRole.ActionRole)
        self.check_button.setToolTip(CHECK_TIP)
        self.check_button.clicked.connect(self._on_check)
        self._load_button = buttons.button(QDialogButtonBox.StandardButton.Ok)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(PLAN_DELAY_MS)
        self._timer.timeout.connect(self.update_plan)
        self.set_selection(selection or ModelSelection())
        for picker in (self.target, self.draft):
            picker.connect_changed(self._timer.start)
        self.no_draft.toggled.connect(self._timer.start)
        self.device.currentTextChanged.connect(self._timer.start)
        self.device.currentTextChanged.connect(self._offer_precisions)
        self._offer_precisions(self.device.currentText())
        self.dtype.currentIndexChanged.connect(self._timer.start)
        self.context.valueChanged.connect(self._timer.start)
        self.memory.valueChanged.connect(self._timer.start)
        self.runtime.currentIndexChanged.connect(self._timer.start)  # the plan is of the runtime that will run
        self.remote.toggled.connect(self._on_remote_toggled)
        self.update_plan()

    def set_refusals(self, refusals: Refusals) -> None:
        """What each device cannot run, from the app; the precisions are offered again for the device shown."""
        self._refusals = refusals
        self._offer_precisions(self.device.currentText())

    def refusal(self, precision: str, device: str) -> str | None:
        """Why `precision` cannot run on `device` (a device choice as typed), or None."""
        device = device.strip()
        if self._refusals is None:
            return f"{precision} needs a GPU" if device == "cpu" and precision in GPU_PRECISIONS else None
        # A typed cuda:N the app did not list is no GPU it saw: loading it says so in one line.
        return self._refusals.get(precision, {}).get(device)

    def _offer_precisions(self, device: str) -> None:
        """Precisions the device cannot run are greyed out, each item's tooltip saying why."""
        for picker in (self.target, self.draft):
            model = picker.precision.model()
            for row in range(picker.precision.count()):
                why = self.refusal(picker.precision.itemText(row), device)
                item = model.item(row)
                item.setEnabled(why is None)
                item.setToolTip(why or "")

    def selection(self) -> ModelSelection:
        return ModelSelection(
            target=self.target.choice(),
            draft=self.draft.choice(),
            device=self.device.currentText().strip() or "auto",
            dtype=self.dtype.currentText(),
            no_draft=self.no_draft.isChecked(),
            target_precision=self.target.precision.currentText(),
            draft_precision=self.draft.precision.currentText(),
            context=self.context.value(),
            memory_gib=self.memory.value(),
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
        self.target.precision.setCurrentIndex(max(0, self.target.precision.findText(selection.target_precision)))
        self.draft.precision.setCurrentIndex(max(0, self.draft.precision.findText(selection.draft_precision)))
        self.context.setValue(selection.context)
        self.memory.setValue(selection.memory_gib)
        self.runtime.setCurrentIndex(max(0, self.runtime.findData(selection.runtime)))
        self.threads.setValue(selection.threads)

    def update_plan(self) -> None:
        """Plans the current choice now (configs and headers only, well under a second)."""
        self._timer.stop()
        if self._planner is None:
            return
        try:
            self.plan = self._planner(self.selection())
        except EngineError as e:
            self.plan = None
            self.plan_bar.set_message(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            return
        self.plan_bar.set_plan(self.plan)
        if self.plan is None:  # a planner with nothing to say (no plan for this choice)
            return
        self.context.setSpecialValueText(f"auto ({self.plan.context:,})" if not self.context.value() else "auto")
        gguf = self.plan.runner == "llama.cpp"
        for picker in (self.target, self.draft):
            picker.precision.setToolTip(f"llama.cpp runs the GGUF's own quantization ({self.plan.target_precision}); "
                                        "another precision loads on torch." if gguf else PRECISION_TIP)

    def apply_change(self, change: PlanChange) -> None:
        """Applies the plan's suggestion to the choices (precisions, context, draft)."""
        self.target.precision.setCurrentIndex(max(0, self.target.precision.findText(change.target_precision)))
        if not change.with_draft:
            self.no_draft.setChecked(True)
        else:
            if change.draft_name is not None:
                self.draft.set_choice(ModelChoice.from_spec(change.draft))
            self.draft.precision.setCurrentIndex(max(0, self.draft.precision.findText(change.draft_precision)))
        if self.plan is None or change.context != self.plan.context:
            self.context.setValue(change.context)
        self.update_plan()

    def _on_preset(self, index: int) -> None:
        if index <= 0:
            return
        preset = self._presets[index - 1]
        self.target.set_choice(preset.target)
        self.draft.set_choice(preset.draft)
        self.no_draft.setChecked(False)
        self.update_plan()

    def _on_check(self) -> None:
        """One button: Check drafts, then Stop check while it runs (Orange3's Start/Stop)."""
        if self._checking:
            self.check_button.setEnabled(False)  # until the worker says it ended
            self.check_view.status.setText("Stopping the draft check after the probe in progress…")
            self.check_stop_requested.emit()
            return
        self._set_checking(True)
        self.check_view.show()
        self.check_view.set_progress(0.0, "Starting the draft check on the loaded target…")
        self.check_requested.emit(self.selection())

    def check_ended(self) -> None:
        """The check finished, failed or was stopped (the app shows its result in check_view first)."""
        self._set_checking(False)

    def _set_checking(self, on: bool) -> None:
        self._checking = on
        self.check_button.setText("Stop check" if on else "Check drafts")
        self.check_button.setToolTip(STOP_TIP if on else CHECK_TIP)
        self.check_button.setEnabled(on or not self.remote_choice().use)

    def use_draft(self, spec: str) -> None:
        """The check's Apply for a draft other than the loaded one: it becomes this dialog's draft."""
        self.no_draft.setChecked(False)
        self.draft.set_choice(ModelChoice.from_spec(spec))

    # --- a remote server instead of local models -------------------------------------------------

    def remote_choice(self) -> RemoteChoice:
        """The "Remote server" box: with `use`, Connect streams the chat from it and loads nothing."""
        return self.remote.choice()

    def set_remote_choice(self, choice: RemoteChoice) -> None:
        self.remote.set_choice(choice)
        self._on_remote_toggled(choice.use)

    def _on_remote_toggled(self, on: bool) -> None:
        # The local choices stay as they were (greyed), for the next time local models are loaded.
        for part in (self.preset, self.target, self.draft, self.no_draft, self.device, self.dtype, self.context,
                     self.memory, self.runtime, self.threads, self.plan_bar, self.check_button):
            part.setEnabled(not on)
        self.check_button.setEnabled(not on or self._checking)  # a check in flight can always be stopped
        if not on:
            self.draft.setEnabled(not self.no_draft.isChecked())
        self._load_button.setText("Connect" if on else "Load")
