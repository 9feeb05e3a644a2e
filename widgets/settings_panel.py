"""The side panel of generation settings: mode, proposer, K, sampling, limits, system prompt, display."""
from __future__ import annotations

from dataclasses import dataclass, fields

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QLabel,
    QPlainTextEdit,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine.settings import K_RANGE, MAX_NEW_TOKENS_RANGE, SEED_RANGE, TEMPERATURE_RANGE, GenerationSettings
from engine.types import MODES, PROPOSERS


@dataclass(frozen=True)
class DisplaySettings:
    """How answers are shown; persisted beside the decoding settings."""

    colouring: bool = True  # colour tokens by status
    show_rejected: bool = True  # mark where drafts were rejected (details on hover)

    @classmethod
    def from_dict(cls, raw: dict[str, object]) -> DisplaySettings:
        default = cls()
        values = {}
        for f in fields(cls):
            value = raw.get(f.name, getattr(default, f.name))
            values[f.name] = value if isinstance(value, bool) else getattr(default, f.name)
        return cls(**values)


_PROPOSER_LABELS = {"draft": "Draft model", "ngram": "N-gram (prompt lookup)", "draft+ngram": "Draft + n-gram",
                    "head": "Draft head (trained on the target)"}


class SettingsPanel(QWidget):
    """Emits `settings_changed(GenerationSettings)` or `display_changed(DisplaySettings)` whenever a
    control changes (not on set_values / set_display)."""

    settings_changed = Signal(object)  # GenerationSettings
    display_changed = Signal(object)  # DisplaySettings

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("settingsPanel")
        self._updating = False
        outer = QVBoxLayout(self)
        outer.setContentsMargins(10, 6, 6, 10)
        outer.setSpacing(10)

        decoding = QGroupBox("Decoding", self)
        form = QFormLayout(decoding)
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        self.mode = QComboBox(decoding)
        for mode in MODES:
            self.mode.addItem(mode.capitalize(), mode)
        self.mode.setToolTip("Auto: speculative decoding that chooses K and the proposer per step from measured costs\n"
                             "and acceptance, and decodes standard steps where drafting would lose.\n"
                             "Speculative: a draft proposes K tokens, the target verifies them in one forward.\n"
                             "Standard: the target alone, one token per forward.")
        form.addRow("Mode", self.mode)
        self.proposer = QComboBox(decoding)
        for proposer in PROPOSERS:
            self.proposer.addItem(_PROPOSER_LABELS[proposer], proposer)
        self.proposer.setToolTip("Where draft tokens come from; n-gram lookup copies from the prompt and costs nothing.")
        form.addRow("Proposer", self.proposer)
        self.k = QSpinBox(decoding)
        self.k.setRange(*K_RANGE)
        self.k.setSpecialValueText("auto")  # K_AUTO (0): chosen per step
        self.k.setToolTip("Draft tokens proposed per step (K); auto chooses K per step (0 = a standard step).")
        form.addRow("Draft length K", self.k)
        outer.addWidget(decoding)

        sampling = QGroupBox("Sampling", self)
        form = QFormLayout(sampling)
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        self.temperature = QDoubleSpinBox(sampling)
        self.temperature.setRange(*TEMPERATURE_RANGE)
        self.temperature.setSingleStep(0.1)
        self.temperature.setDecimals(2)
        self.temperature.setToolTip("0 = greedy (deterministic).")
        form.addRow("Temperature", self.temperature)
        self.top_k = QSpinBox(sampling)
        self.top_k.setRange(0, 100_000)
        self.top_k.setSpecialValueText("off")
        form.addRow("Top-k", self.top_k)
        self.top_p = QDoubleSpinBox(sampling)
        self.top_p.setRange(0.01, 1.0)
        self.top_p.setSingleStep(0.05)
        self.top_p.setDecimals(2)
        form.addRow("Top-p", self.top_p)
        self.seed = QSpinBox(sampling)
        self.seed.setRange(*SEED_RANGE)
        form.addRow("Seed", self.seed)
        self.max_new_tokens = QSpinBox(sampling)
        self.max_new_tokens.setRange(*MAX_NEW_TOKENS_RANGE)
        self.max_new_tokens.setSingleStep(64)
        form.addRow("Max new tokens", self.max_new_tokens)
        outer.addWidget(sampling)

        system = QGroupBox("System prompt", self)
        box = QVBoxLayout(system)
        self.system_prompt = QPlainTextEdit(system)
        self.system_prompt.setPlaceholderText("Optional instructions sent before the conversation")
        self.system_prompt.setTabChangesFocus(True)
        self.system_prompt.setMinimumHeight(60)
        self.system_prompt.setMaximumHeight(120)
        box.addWidget(self.system_prompt)
        outer.addWidget(system)

        display = QGroupBox("Display", self)
        box = QVBoxLayout(display)
        self.colouring = QCheckBox("Colour tokens by status", display)
        self.show_rejected = QCheckBox("Mark where drafts were rejected", display)
        box.addWidget(self.colouring)
        box.addWidget(self.show_rejected)
        outer.addWidget(display)

        self.hint = QLabel("", self)
        self.hint.setObjectName("settingsHint")
        self.hint.setWordWrap(True)
        self.hint.setTextFormat(Qt.TextFormat.PlainText)
        outer.addWidget(self.hint)
        outer.addStretch(1)

        for field in (self.mode, self.proposer, self.k, self.temperature, self.top_k, self.top_p, self.seed,
                      self.max_new_tokens):
            # An explicit minimum beats the size hint (wide for 2**31 seeds), so the panel can be narrow.
            field.setMinimumWidth(70)
            if isinstance(field, QComboBox):
                field.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
                field.setMinimumContentsLength(6)
        self.set_values(GenerationSettings())
        for combo in (self.mode, self.proposer):
            combo.currentIndexChanged.connect(self._on_changed)
        for spin in (self.k, self.top_k, self.seed, self.max_new_tokens):
            spin.valueChanged.connect(self._on_changed)
        for dspin in (self.temperature, self.top_p):
            dspin.valueChanged.connect(self._on_changed)
        self.system_prompt.textChanged.connect(self._on_changed)
        for check in (self.colouring, self.show_rejected):
            check.toggled.connect(self._on_display_changed)

    # --- public API -------------------------------------------------------------------------

    def values(self) -> GenerationSettings:
        return GenerationSettings(
            mode=self.mode.currentData(),
            proposer=self.proposer.currentData(),
            k=self.k.value(),
            temperature=round(self.temperature.value(), 4),
            top_k=self.top_k.value(),
            top_p=round(self.top_p.value(), 4),
            seed=self.seed.value(),
            max_new_tokens=self.max_new_tokens.value(),
            system_prompt=self.system_prompt.toPlainText(),
        )

    def display(self) -> DisplaySettings:
        return DisplaySettings(colouring=self.colouring.isChecked(), show_rejected=self.show_rejected.isChecked())

    def set_display(self, display: DisplaySettings) -> None:
        """Shows `display` without emitting display_changed."""
        self._updating = True
        try:
            self.colouring.setChecked(display.colouring)
            self.show_rejected.setChecked(display.show_rejected)
        finally:
            self._updating = False

    def set_values(self, settings: GenerationSettings) -> None:
        """Shows `settings` without emitting settings_changed once per control."""
        s = settings.clamped()
        self._updating = True
        try:
            self.mode.setCurrentIndex(max(0, self.mode.findData(s.mode)))
            self.proposer.setCurrentIndex(max(0, self.proposer.findData(s.proposer)))
            self.k.setValue(s.k)
            self.temperature.setValue(s.temperature)
            self.top_k.setValue(s.top_k)
            self.top_p.setValue(s.top_p)
            self.seed.setValue(s.seed)
            self.max_new_tokens.setValue(s.max_new_tokens)
            if self.system_prompt.toPlainText() != s.system_prompt:
                self.system_prompt.setPlainText(s.system_prompt)
        finally:
            self._updating = False
        self._update_enabled()

    def set_draft_available(self, available: bool, head: bool = False) -> None:
        """Without a draft model only n-gram lookup and a draft head (when one is loaded) can propose."""
        needs = {"draft": available, "draft+ngram": available, "head": head, "ngram": True}
        model = self.proposer.model()
        for row in range(self.proposer.count()):
            item = model.item(row)  # type: ignore[attr-defined]
            item.setEnabled(needs.get(self.proposer.itemData(row), True))
        if not needs.get(self.proposer.currentData(), True):
            fallback = "head" if head else "ngram"
            self.proposer.setCurrentIndex(self.proposer.findData(fallback))
        if available:
            self.hint.setText("")
        elif head:
            self.hint.setText("No draft model loaded: speculative decoding uses the draft head or n-gram lookup.")
        else:
            self.hint.setText("No draft model loaded: speculative decoding uses n-gram lookup.")

    # --- internals ------------------------------------------------------------------------------

    def _update_enabled(self) -> None:
        mode = self.mode.currentData()
        self.proposer.setEnabled(mode != "standard")
        self.k.setEnabled(mode == "speculative")  # auto mode always chooses K per step
        sampled = self.temperature.value() > 0
        for w in (self.top_k, self.top_p, self.seed):
            w.setEnabled(sampled)

    def _on_changed(self, *_: object) -> None:
        if self._updating:
            return
        self._update_enabled()
        self.settings_changed.emit(self.values())

    def _on_display_changed(self, *_: object) -> None:
        if not self._updating:
            self.display_changed.emit(self.display())
