"""What every bench mode runs against (BenchContext) and how a mode is declared (ModeSpec); one engine run."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.errors import InputError
from engine.measure.experiment import BenchPrompt, RunRecord, record_run
from engine.types import GenerationRequest

if TYPE_CHECKING:  # heavy imports (torch, transformers) wait until a bench really runs
    from engine.decoding import Engine
    from engine.models.loader import LoadedPair


# (prompt text, mode, max_new_tokens) -> the request; the caller owns the settings → request conversion.
RequestFactory = Callable[[str, str, int], GenerationRequest]


@dataclass
class BenchContext:
    """What every mode runner may use: the loaded pair, the engine and how requests are made."""

    pair: LoadedPair | None  # torch models and tokenizer as the engine runs them (None on llama.cpp)
    engine: Engine  # our decoding loop
    make_request: RequestFactory  # the request for one prompt in one mode
    reload_pair: Callable[[], LoadedPair]  # loads the same pair again, as Hugging Face ships it
    # Loads the same pair on another runtime ("torch" / "llamacpp") for side-by-side modes.
    load_runtime: Callable[[str], Engine] | None = None
    _baseline: LoadedPair | None = None  # unmodified models for the hf-* modes, loaded on first use
    _engines: dict[str, Engine] = field(default_factory=dict)  # other runtimes, loaded on first use

    def baseline_pair(self) -> LoadedPair:
        """The models as Hugging Face ships them: the CPU fast path repacks the engine's in place."""
        if self.pair is not None and self.engine.info.fast_path != "cpu-onednn":
            return self.pair
        if self._baseline is None:
            self._baseline = self.reload_pair()
        return self._baseline

    def engine_on(self, runtime: str) -> Engine:
        """The engine on `runtime`: this one if it already runs there, else the same pair loaded beside it."""
        if self.engine.info.runtime == runtime:
            return self.engine
        if runtime not in self._engines:
            if self.load_runtime is None:
                raise InputError(f"this bench cannot load the {runtime} runtime beside the {self.engine.info.runtime} one")
            self._engines[runtime] = self.load_runtime(runtime)
        return self._engines[runtime]


ModeRunner = Callable[[BenchContext, BenchPrompt, int], RunRecord]


@dataclass(frozen=True)
class ModeSpec:
    run: ModeRunner  # (context, prompt, max_new_tokens) -> RunRecord
    needs_draft: bool  # load the draft model for this mode


def engine_run(ctx: BenchContext, prompt: BenchPrompt, max_new_tokens: int, mode: str, repeat: int = 0, *,
               engine: Engine | None = None, request: GenerationRequest | None = None) -> RunRecord:
    """One timed generation on `engine` (the bench's own by default) of `request` (made from the mode)."""
    engine = engine or ctx.engine
    generation = engine.generate(request or ctx.make_request(prompt.prompt, mode, max_new_tokens))
    steps = list(generation)
    return record_run(generation, steps, prompt, mode, repeat)
