"""What to load and how (LoadSpec), and how a load reports its progress (LoadProgress)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from engine.errors import ModelLoadError

log = logging.getLogger(__name__)

Precision = Literal["auto", "bfloat16", "float16", "float32", "int8", "nf4", "int8-wo", "fp8"]
PRECISIONS: tuple[Precision, ...] = ("auto", "bfloat16", "float16", "float32", "int8", "nf4", "int8-wo", "fp8")
_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
            "8bit": "int8", "4bit": "nf4", "int4": "nf4", "none": "auto",
            "int8wo": "int8-wo", "int8_wo": "int8-wo", "w8": "int8-wo", "float8": "fp8", "fp8-e4m3": "fp8",
            "float8_e4m3fn": "fp8"}


def normalize_precision(text: str | None) -> Precision:
    """'bf16', 'BFloat16', '4bit' ... -> one of PRECISIONS; a ModelLoadError names the choices."""
    value = (text or "auto").strip().lower()
    value = _ALIASES.get(value, value)
    if value not in PRECISIONS:
        raise ModelLoadError(
            f"Unknown precision {text!r}: use auto, bfloat16, float16, float32, int8, nf4, int8-wo or fp8."
        )
    return value  # type: ignore[return-value]


@dataclass(frozen=True)
class LoadSpec:
    """Which pair to load and how: one value from the Models dialog or the CLI to engine.assemble.

    `None` model specs mean the packaged default. The precisions are normalized once, here.
    """

    target: str | None = None  # folder, .gguf file, hub id, or None for the default target
    draft: str | None = None  # same for the draft; ignored when with_draft is False
    with_draft: bool = True  # False: target only (n-gram proposer, a head, or standard decoding)
    runtime: str = "auto"  # auto / torch / llamacpp (engine.assemble.choose_runtime)
    device: str = "auto"  # auto / cpu / cuda / cuda:N
    dtype: str = "auto"  # auto / bfloat16 / float16 / float32: both models' float dtype (torch)
    target_precision: Precision = "auto"  # the target's own precision: auto (dtype's) / a float / int8 / nf4
    draft_precision: Precision = "auto"  # the draft's own precision
    fast_path: str = "auto"  # torch: auto (graphs on CUDA, oneDNN packing on a CPU) / eager / static / compiled
    compile_k: int = 5  # the K whose verify the "compiled" fast path compiles
    head: str | None = "auto"  # the draft head: "auto" (the shipped one for this target), a folder, or None
    needs_head: bool = False  # the head proposer will be asked for: auto picks torch (llama.cpp keeps no hidden states)
    threads: int | None = None  # CPU threads per decode (llama.cpp, torch on a CPU); None = chosen for the cores
    context: int | None = None  # positions each KV cache holds (None: the default)
    gpus: int | None = None  # GPUs to split the target over (None: one, or as many as the plan needs)
    memory: int | None = None  # memory budget per device in bytes (None: what the device has free)
    force: bool = False  # load even when the memory plan says it will not fit (a person said so)
    sequences: int = 1  # decoded together (serve --max-seqs): the memory plan counts each one's cache rows
    keep_costs: bool = False  # forward costs kept for this machine and pair are used, measured ones kept (the app)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_precision", normalize_precision(self.target_precision))
        object.__setattr__(self, "draft_precision", normalize_precision(self.draft_precision))

    def target_only(self) -> LoadSpec:
        """The same load without the draft (a second runtime beside a bench, a head's training)."""
        return replace(self, draft=None, with_draft=False)


@dataclass(frozen=True)
class LoadProgress:
    stage: str  # "check" | "wait" | "assemble" | "verify" | "repair" | "convert" | "load" | "warmup"
    fraction: float  # 0..1 within the stage
    message: str  # human-readable, e.g. "Assembling Qwen2.5-Coder-1.5B-Instruct GGUF (12/22 parts)"


ProgressFn = Callable[[LoadProgress], None]


def emit(progress: ProgressFn | None, stage: str, fraction: float, message: str) -> None:
    """Logs one stage of a load and tells `progress` (fraction clamped to 0..1)."""
    log.info("%s %.0f%%: %s", stage, 100 * fraction, message)
    if progress is not None:
        progress(LoadProgress(stage, min(1.0, max(0.0, fraction)), message))
