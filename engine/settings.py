"""What a person chooses — decoding settings and the model pair — as plain, validated values (no Qt, no torch).

The settings panel and the Models dialog edit these, the app persists them, and one function in
app/core/session.py turns them into the engine's requests; the CLI builds the same values from its flags.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields

from engine.limits import K_AUTO, K_MAX, MAX_NEW_TOKENS
from engine.types import MODES, PROPOSERS

K_RANGE = (K_AUTO, K_MAX)  # K_AUTO (0): chosen per step
MAX_NEW_TOKENS_RANGE = (1, MAX_NEW_TOKENS)
TEMPERATURE_RANGE = (0.0, 2.0)
SEED_RANGE = (0, 2**31 - 1)  # what a Qt spin box holds, and every torch generator accepts
TOP_K_RANGE = (0, 1_000_000)
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
MAX_SYSTEM_PROMPT_CHARS = 100_000  # longer than any context we load; a stored megabyte is damage
MAX_PATH_CHARS = 4096  # PATH_MAX on Linux; longer stored "paths" are damage
SOURCE_KINDS = ("default", "folder", "gguf", "hub")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "bfloat16", "float16", "float32")
# One model's precision: a float dtype, 8-bit / 4-bit weights through bitsandbytes, or fast 8-bit weights
# (int8-wo, fp8: engine/models/fastquant.py) ("auto": DTYPES' choice).
PRECISIONS = ("auto", "bfloat16", "float16", "float32", "int8", "nf4", "int8-wo", "fp8")
GPU_PRECISIONS = ("fp8",)  # need a GPU of compute capability 8.9+ (engine/models/fastquant.py says so in one line)
CONTEXT_RANGE = (0, 1 << 20)  # 0: the default (engine.limits.DEFAULT_MAX_LENGTH, or the model's limit)
MEMORY_RANGE = (0.0, 4096.0)  # GiB per device; 0: what the device has free
# Who runs the forwards: auto = llama.cpp on the CPU for GGUF models (when installed), torch otherwise.
RUNTIMES = ("auto", "torch", "llamacpp")
RUNTIME_LABELS = {"auto": "auto", "torch": "torch", "llamacpp": "llama.cpp"}
MAX_THREADS = 256  # upper bound of the threads setting (0 = chosen for the cores)


def _clamp(value, low, high):
    return min(max(value, low), high)


@dataclass(frozen=True)
class GenerationSettings:
    """How answers are decoded, as the settings panel edits them."""

    mode: str = "auto"  # "auto" (K and proposer chosen per step), "speculative" or "standard"
    proposer: str = "draft+ngram"  # draft, ngram, draft+ngram or head (auto routes per step, a loaded head too)
    k: int = K_AUTO  # draft tokens per step, K_RANGE; K_AUTO: chosen per step
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables
    seed: int = 0  # seed of every random draw in one generation
    max_new_tokens: int = 512  # MAX_NEW_TOKENS_RANGE
    system_prompt: str = DEFAULT_SYSTEM_PROMPT  # sent as the first message when not empty

    @classmethod
    def from_dict(cls, raw: dict[str, object]) -> GenerationSettings:
        """Tolerant of missing, extra or mistyped entries (settings files written by older versions)."""
        return cls(**_coerce(cls, raw)).clamped()

    def clamped(self) -> GenerationSettings:
        """Every value inside the range the panel offers; non-finite numbers fall back to the defaults."""
        default = GenerationSettings()
        temperature = self.temperature if math.isfinite(self.temperature) else default.temperature
        top_p = self.top_p if math.isfinite(self.top_p) else default.top_p
        return GenerationSettings(
            mode=self.mode if self.mode in MODES else default.mode,
            proposer=self.proposer if self.proposer in PROPOSERS else default.proposer,
            k=_clamp(self.k, *K_RANGE),
            temperature=_clamp(temperature, *TEMPERATURE_RANGE),
            top_k=_clamp(self.top_k, *TOP_K_RANGE),
            top_p=_clamp(top_p, 0.01, 1.0),
            seed=_clamp(self.seed, *SEED_RANGE),
            max_new_tokens=_clamp(self.max_new_tokens, *MAX_NEW_TOKENS_RANGE),
            system_prompt=self.system_prompt[:MAX_SYSTEM_PROMPT_CHARS],
        )


@dataclass(frozen=True)
class ModelChoice:
    """One side of the pair: where its weights come from."""

    kind: str = "default"  # "default", "folder", "gguf" or "hub"
    value: str = ""  # folder path, .gguf path or hub id; "" for the default

    def spec(self) -> str | None:
        """What engine.models.store.resolve_source takes: None for the packaged default."""
        return None if self.kind == "default" or not self.value.strip() else self.value.strip()

    @classmethod
    def from_spec(cls, spec: str | None) -> ModelChoice:
        """What a person typed on a command line (a folder, a .gguf file, a hub id, or nothing)."""
        if spec is None or spec.strip() in ("", "default"):
            return cls()
        spec = spec.strip()
        if spec.lower().endswith(".gguf"):
            return cls("gguf", spec)
        if os.path.isdir(os.path.expanduser(spec)) or spec.startswith((".", "/", "~")):
            return cls("folder", spec)
        return cls("hub", spec)


@dataclass(frozen=True)
class ModelSelection:
    """Which pair to load and how, as the Models dialog decides it."""

    target: ModelChoice = ModelChoice()  # the model whose output is produced
    draft: ModelChoice = ModelChoice()  # the proposer model
    device: str = "auto"  # auto / cpu / cuda / cuda:N
    dtype: str = "auto"  # auto / bfloat16 / float16 / float32: both models' float dtype
    no_draft: bool = False  # target only: n-gram lookup or standard decoding
    target_precision: str = "auto"  # PRECISIONS: the target's own precision ("auto": dtype)
    draft_precision: str = "auto"  # PRECISIONS: the draft's own precision
    context: int = 0  # positions each KV cache holds; 0: the default
    memory_gib: float = 0.0  # memory budget per device in GiB; 0: the device's free memory
    runtime: str = "auto"  # auto / torch / llamacpp
    threads: int = 0  # CPU threads per decode (llama.cpp, torch on a CPU); 0 = engine.cpu_threads chooses

    @classmethod
    def from_dict(cls, raw: dict[str, object]) -> ModelSelection:
        """Tolerant of missing, extra or mistyped entries; unknown values fall back to the defaults."""

        def choice(value: object) -> ModelChoice:
            if not isinstance(value, dict):
                return ModelChoice()
            c = ModelChoice(**_coerce(ModelChoice, value))
            usable = len(c.value) <= MAX_PATH_CHARS and "\x00" not in c.value
            return c if c.kind in SOURCE_KINDS and usable else ModelChoice()

        values = _coerce(cls, {k: v for k, v in raw.items() if k not in ("target", "draft")})
        selection = cls(**{**values, "target": choice(raw.get("target")), "draft": choice(raw.get("draft"))})
        device = selection.device.strip()
        if not (device in DEVICES or (device.startswith("cuda:") and device[5:].isdigit())):
            device = "auto"
        dtype = selection.dtype if selection.dtype in DTYPES else "auto"
        precisions = [p if p in PRECISIONS else "auto" for p in (selection.target_precision, selection.draft_precision)]
        memory = selection.memory_gib if math.isfinite(selection.memory_gib) else 0.0
        runtime = selection.runtime if selection.runtime in RUNTIMES else "auto"
        return ModelSelection(selection.target, selection.draft, device, dtype, selection.no_draft,
                              *precisions, _clamp(selection.context, *CONTEXT_RANGE), _clamp(memory, *MEMORY_RANGE),
                              runtime, _clamp(selection.threads, 0, MAX_THREADS))


@dataclass(frozen=True)
class PairPreset:
    """A named target/draft pair as the Models dialog offers it (engine.models.presets makes them)."""

    name: str  # what --preset takes, e.g. "qwen3-32b"
    title: str  # what a menu shows
    target: ModelChoice  # the target's source
    draft: ModelChoice  # the draft's source
    offline: bool  # True when it needs no download (the packaged pair)


def _coerce(cls, raw: dict[str, object]) -> dict[str, object]:
    """The fields of dataclass `cls` from `raw`, each converted to its default's type or left at the default."""
    default = cls()
    values: dict[str, object] = {}
    for f in fields(cls):
        fallback = getattr(default, f.name)
        kind = type(fallback)
        if kind not in (bool, int, float, str):
            continue  # nested values are the caller's business
        value = raw.get(f.name, fallback)
        try:
            if kind is bool:
                value = value.strip().lower() in ("1", "true", "yes", "on") if isinstance(value, str) else bool(value)
            elif kind is int and isinstance(value, float) and not value.is_integer():
                value = fallback  # 2.5 is not a K or a seed
            elif kind is int and isinstance(value, str):
                value = int(value.strip())
            elif kind is str and not isinstance(value, str):
                value = fallback
            values[f.name] = kind(value)
        except (TypeError, ValueError, OverflowError):
            values[f.name] = fallback
    return values
