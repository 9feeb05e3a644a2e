"""Bench modes that compare runtimes side by side in one process: llama.cpp as people use it, and torch.

- "llamacpp-plain": a plain llama-cpp-python greedy loop (Llama.generate, temperature 0) on the
  same GGUF as the engine's llama.cpp target, same threads and context: what the engine's
  standard decoding on llama.cpp must match.
- "torch-standard" / "llamacpp-standard": the engine's standard decoding on the other runtime,
  loaded beside the first on first use (the same models, converted for torch).
- "speculative-ngram": speculative decoding with n-gram prompt lookup whatever --proposer says,
  so draft-model and n-gram figures come from one run.
"""
from __future__ import annotations

import atexit
import time
import weakref
from dataclasses import replace
from typing import Any

from engine.errors import InputError
from engine.measure.context import BenchContext, ModeSpec, engine_run
from engine.measure.experiment import BenchPrompt, RunRecord

# engine -> its llama_cpp.Llama, loaded once and dropped with the engine.
_plain: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


@atexit.register
def _close_plain() -> None:
    # Closed before the interpreter tears llama_cpp down: its __del__ fails on a half-gone module.
    for llm in list(_plain.values()):
        llm.close()
    _plain.clear()


def plain_llama(engine) -> Any:
    """A high-level llama_cpp.Llama on the engine's target GGUF, configured like the engine's runner."""
    from engine.runners.llamacpp import LlamaCppRunner, llama_cpp

    runner = engine.target_runner
    if not isinstance(runner, LlamaCppRunner):
        raise InputError("llamacpp-plain compares against the llama.cpp runtime: run the bench with --runtime llamacpp.")
    if engine not in _plain:
        lib = llama_cpp()
        _plain[engine] = lib.Llama(
            model_path=str(runner.path), n_ctx=runner.max_length, n_batch=runner.n_batch, n_ubatch=runner.n_ubatch,
            type_k=runner.kv_type_id, type_v=runner.kv_type_id, n_threads=runner.threads,
            n_threads_batch=runner.batch_threads, flash_attn=runner.flash_attn, use_mmap=runner.use_mmap,
            n_gpu_layers=0, verbose=False,
        )
    return _plain[engine]


def run_plain(llm: Any, prompt_ids: list[int], max_new_tokens: int, eog) -> tuple[list[int], float]:
    """(generated ids, seconds): prompt evaluated from an empty cache, then one token per decode, greedy.

    Stops after an end-of-generation token (kept, as the engine keeps its EOS) or max_new_tokens.
    """
    out: list[int] = []
    t0 = time.perf_counter()
    llm.reset()  # no prefix reuse from the previous prompt: the engine prefills every prompt too
    for token in llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        out.append(int(token))
        if token in eog or len(out) >= max_new_tokens:
            break
    return out, time.perf_counter() - t0


def run_llamacpp_plain(ctx: BenchContext, prompt: BenchPrompt, max_new_tokens: int) -> RunRecord:
    engine = ctx.engine
    llm = plain_llama(engine)
    ids = engine.encode(ctx.make_request(prompt.prompt, "standard", max_new_tokens))
    out, seconds = run_plain(llm, ids, max_new_tokens, engine.target_runner.eog_ids)
    return RunRecord(
        prompt_id=prompt.id, category=prompt.category, mode="llamacpp-plain", new_tokens=len(out),
        seconds=seconds, tokens_per_s=len(out) / seconds if seconds > 0 else 0.0, target_forwards=len(out),
        draft_forwards=0, drafted=0, accepted=0, text=engine.tokenizer.decode(out, skip_special_tokens=True),
        token_ids=tuple(out),
    )


def _other_runtime(ctx: BenchContext, prompt: BenchPrompt, max_new_tokens: int, runtime: str) -> RunRecord:
    engine = ctx.engine_on(runtime)
    record = engine_run(ctx, prompt, max_new_tokens, "standard", engine=engine)
    return replace(record, mode=f"{runtime}-standard")


def run_torch_standard(ctx: BenchContext, prompt: BenchPrompt, max_new_tokens: int) -> RunRecord:
    return _other_runtime(ctx, prompt, max_new_tokens, "torch")


def run_llamacpp_standard(ctx: BenchContext, prompt: BenchPrompt, max_new_tokens: int) -> RunRecord:
    return _other_runtime(ctx, prompt, max_new_tokens, "llamacpp")


def run_speculative_ngram(ctx: BenchContext, prompt: BenchPrompt, max_new_tokens: int) -> RunRecord:
    request = replace(ctx.make_request(prompt.prompt, "speculative", max_new_tokens), proposer="ngram")
    record = engine_run(ctx, prompt, max_new_tokens, "speculative", request=request)
    return replace(record, mode="speculative-ngram")


# The modes engine/measure/bench.py adds to its own (bench.MODE_RUNNERS).
RUNTIME_MODES: dict[str, ModeSpec] = {
    "llamacpp-plain": ModeSpec(run_llamacpp_plain, needs_draft=False),
    "torch-standard": ModeSpec(run_torch_standard, needs_draft=False),
    "llamacpp-standard": ModeSpec(run_llamacpp_standard, needs_draft=False),
    "speculative-ngram": ModeSpec(run_speculative_ngram, needs_draft=False),
}
