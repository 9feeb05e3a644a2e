"""The memory plan as a bar per device: what the pair needs, against what the device has, and what to change."""
from __future__ import annotations

from PySide6.QtCore import QRectF, QSize, Qt, Signal
from PySide6.QtGui import QColor, QPainter, QPaintEvent, QPen
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QSizePolicy, QVBoxLayout, QWidget

from engine.types import DevicePlan, MemoryPlan, PlanChange

GiB = 2**30
# (kind, model) -> colour: the target's share dark, the draft's light, overheads grey.
SEGMENT_COLOURS = {
    ("weights", "target"): "#2f6fed",
    ("kv", "target"): "#7fa6f5",
    ("graphs", "target"): "#b7ccf9",
    ("weights", "draft"): "#1f9d55",
    ("kv", "draft"): "#7ccf9f",
    ("graphs", "draft"): "#b5e4c8",
    ("activations", ""): "#a8a29e",
    ("runtime", ""): "#d6d3d1",
}
LEGEND = (("target", "#2f6fed"), ("draft", "#1f9d55"), ("caches, graphs", "#7fa6f5"), ("runtime", "#d6d3d1"))
OVER = QColor("#d92d20")  # the capacity line when the plan does not fit


def gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def summary(plan: MemoryPlan) -> str:
    """"On llama.cpp: Qwen2.5-Coder-1.5B-Instruct as Q4_K_M GGUF, draft … as Q4_K_M GGUF; context 32,768 tokens"."""
    draft = f"; draft {plan.draft_name} as {plan.draft_precision}" if plan.draft_name else "; no draft model"
    return f"On {plan.runner}: {plan.target_name} as {plan.target_precision}{draft}; context {plan.context:,} tokens."


class _DeviceBar(QWidget):
    """One device: stacked segments per plan line, a tick where its capacity ends."""

    def __init__(self, parent: QWidget) -> None:
        super().__init__(parent)
        self.device: DevicePlan | None = None
        self.setMinimumHeight(18)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def sizeHint(self) -> QSize:
        return QSize(360, 18)

    def set_device(self, device: DevicePlan | None) -> None:
        self.device = device
        if device is not None:
            self.setToolTip("\n".join(f"{i.label}: {gib(i.bytes)}" for i in device.items))
        self.update()

    def paintEvent(self, event: QPaintEvent) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        rect = QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5)
        painter.setPen(QPen(self.palette().mid().color()))
        painter.setBrush(self.palette().base())
        painter.drawRoundedRect(rect, 3, 3)
        d = self.device
        if d is None or d.total <= 0:
            return
        scale = max(d.total, d.capacity or 0)
        x = rect.left()
        painter.setPen(Qt.PenStyle.NoPen)
        for item in d.items:
            width = rect.width() * item.bytes / scale
            painter.setBrush(QColor(SEGMENT_COLOURS.get((item.kind, item.model), "#a8a29e")))
            painter.drawRect(QRectF(x, rect.top() + 1, width, rect.height() - 2))
            x += width
        if d.capacity is not None and not d.fits:
            cap_x = rect.left() + rect.width() * d.capacity / scale
            painter.setPen(QPen(OVER, 2))
            painter.drawLine(int(cap_x), int(rect.top()), int(cap_x), int(rect.bottom()))


class PlanBar(QWidget):
    """The plan: a bar per device, the verdict, and the cheapest change that fits with an Apply button."""

    change_applied = Signal(object)  # PlanChange the person chose to apply

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.plan: MemoryPlan | None = None
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(4)
        self.summary = QLabel(self)  # what will run: the runtime, each model's format, the context
        self.summary.setWordWrap(True)
        layout.addWidget(self.summary)
        self._rows = QVBoxLayout()
        self._rows.setSpacing(3)
        layout.addLayout(self._rows)
        legend = QHBoxLayout()
        for name, colour in LEGEND:
            chip = QLabel(f'<span style="color:{colour}">■</span> {name}', self)
            legend.addWidget(chip)
        legend.addStretch(1)
        layout.addLayout(legend)
        self.verdict = QLabel(self)
        self.verdict.setWordWrap(True)
        self.verdict.setTextFormat(Qt.TextFormat.RichText)
        layout.addWidget(self.verdict)
        change_row = QHBoxLayout()
        self.suggestion = QLabel(self)
        self.suggestion.setWordWrap(True)
        self.apply = QPushButton("Apply", self)
        self.apply.setToolTip("Change the choices above as suggested")
        self.apply.clicked.connect(self._on_apply)
        change_row.addWidget(self.suggestion, 1)
        change_row.addWidget(self.apply, 0, Qt.AlignmentFlag.AlignTop)
        layout.addLayout(change_row)
        self._bars: list[tuple[QLabel, _DeviceBar]] = []
        self.set_plan(None)

    def set_message(self, text: str) -> None:
        """No plan (e.g. a hub model that is neither cached nor a preset): say why instead."""
        self.set_plan(None)
        self.verdict.setText(text)

    def set_plan(self, plan: MemoryPlan | None) -> None:
        self.plan = plan
        devices = plan.devices if plan is not None else ()
        while len(self._bars) < len(devices):
            label, bar = QLabel(self), _DeviceBar(self)
            row = QHBoxLayout()
            row.addWidget(label)
            row.addWidget(bar, 1)
            self._rows.addLayout(row)
            self._bars.append((label, bar))
        for i, (label, bar) in enumerate(self._bars):
            shown = i < len(devices)
            label.setVisible(shown)
            bar.setVisible(shown)
            if shown:
                d = devices[i]
                cap = f" / {gib(d.capacity)}" if d.capacity is not None else ""
                label.setText(f"{d.device}: {gib(d.total)}{cap}")
                bar.set_device(d)
        self.summary.setText(summary(plan) if plan is not None else "")
        self.summary.setVisible(plan is not None)
        self.verdict.setText(self._verdict(plan))
        change = plan.suggestion if plan is not None and not plan.fits else None
        self.suggestion.setText(f"Cheapest change that fits: <b>{change.description}</b> (needs {gib(change.needed)})"
                                if change else "")
        self.suggestion.setVisible(change is not None)
        self.apply.setVisible(change is not None)

    @staticmethod
    def _verdict(plan: MemoryPlan | None) -> str:
        if plan is None:
            return ""
        notes = "".join(f"<br><small>{n}</small>" for n in plan.notes)
        if any(d.capacity is None for d in plan.devices):
            return f"Needs {gib(plan.total)}; this device's free memory is unknown.{notes}"
        if plan.fits:
            spare = min(d.capacity - d.total for d in plan.devices)
            return f'<span style="color:#1f9d55"><b>Fits</b></span>: {gib(spare)} to spare ({plan.runner}).{notes}'
        worst = max(plan.devices, key=lambda d: d.total - d.capacity)
        return (f'<span style="color:#d92d20"><b>Does not fit</b></span>: {worst.device} needs {gib(worst.total)} '
                f"and has {gib(worst.capacity)}.{notes}")

    def _on_apply(self) -> None:
        if self.plan is not None and self.plan.suggestion is not None:
            change: PlanChange = self.plan.suggestion
            self.change_applied.emit(change)
