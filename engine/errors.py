"""The engine's errors: each message says what went wrong and what a person can do about it."""
from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InputError(EngineError):
    """Bad input found before any model loads: a prompts file, an option, a value out of range."""


class ModelLoadError(EngineError):
    """A model could not be found, verified, converted or loaded."""


class ModelWontFitError(ModelLoadError):
    """The memory plan says the pair will not fit; `plan` (an engine.types.MemoryPlan) says by how much."""

    def __init__(self, message: str, plan: object) -> None:
        super().__init__(message)
        self.plan = plan


class IncompatibleModelsError(EngineError):
    """Draft and target do not share a tokenizer."""


class DistillError(EngineError):
    """Distillation cannot start or continue (bad work folder, refused prompts, no data)."""


class GenerationError(EngineError):
    """A request cannot be decoded (bad settings, prompt too long, out of memory)."""


class CostsInterrupted(Exception):
    """A measurement of the forward costs was dropped between two rounds: other work asked for the engine.
    Not an EngineError: nothing went wrong, and the costs in use stay (engine/decoding/cost_check.py)."""
