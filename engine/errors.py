"""The engine's errors: each message says what went wrong and what a person can do about it."""
from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InputError(EngineError):
    """Bad input found before any model loads: a prompts file, an option, a value out of range."""


class ModelLoadError(EngineError):
    """A model could not be found, verified, converted or loaded."""


class IncompatibleModelsError(EngineError):
    """Draft and target do not share a tokenizer."""


class GenerationError(EngineError):
    """A request cannot be decoded (bad settings, prompt too long, out of memory)."""
