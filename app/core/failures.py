"""What a failed load, answer or training says: one line a person can act on (out of memory, the engine's own
message, or the exception's first line for a bug); no Qt."""
from __future__ import annotations

import logging

from engine.errors import EngineError

log = logging.getLogger("app.ui.worker")  # the worker's log, where these failures always appeared


def _is_out_of_memory(exc: BaseException) -> bool:
    # torch.OutOfMemoryError without importing torch here (the fake engines never need it).
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def training_error_message(exc: BaseException) -> str:
    if _is_out_of_memory(exc):
        return "Out of memory while training the draft head: close other programs or use a GPU."
    if isinstance(exc, EngineError):
        return first_line(exc)
    log.exception("unexpected error while training a draft head")
    return f"Training failed ({type(exc).__name__}: {first_line(exc)})."


def load_error_message(exc: BaseException) -> str:
    if isinstance(exc, EngineError):
        log.warning("load failed: %s", exc)
        return first_line(exc)
    if _is_out_of_memory(exc):
        return "Out of memory while loading: choose smaller models, bfloat16, or free memory."
    # Anything else is a bug or an environment problem: say it, keep going.
    log.exception("unexpected error while loading models")
    return f"Could not load the models ({type(exc).__name__}: {first_line(exc)})."


def generation_error_message(exc: BaseException) -> str:
    if _is_out_of_memory(exc):
        log.warning("out of memory while generating: %s", exc)
        return ("Out of memory while generating: try a shorter max new tokens, a smaller K, "
                "or smaller models.")
    if isinstance(exc, EngineError):
        log.warning("generation failed: %s", exc)
        return first_line(exc)
    log.exception("unexpected error while generating")
    return f"Generation failed ({type(exc).__name__}: {first_line(exc)})."
