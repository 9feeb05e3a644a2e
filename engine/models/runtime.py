"""Which runtime runs a pair — torch or llama.cpp — and loading an Engine on it.

auto: llama.cpp on the CPU for GGUF sources (the packaged pair included) when llama-cpp-python
imports; torch otherwise (GPUs, model folders, hub ids). On llama.cpp a GGUF loads as it is: the
packaged pair is assembled and SHA-checked once, never converted, and the tokenizer is llama.cpp's
own (engine/runners/llamacpp_tokenizer.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

from engine.errors import ModelLoadError
from engine.models.cache import cache_lock
from engine.models.cache_space import sweep
from engine.models.store import (
    DEFAULT_MODELS,
    LoadProgress,
    ModelSource,
    ProgressFn,
    _assemble_default,
    _emit,
    _read_gguf_tokenizer,
    check_compatible,
    resolve_source,
)
from engine.settings import RUNTIMES
from engine.types import ModelInfo

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class RuntimeChoice:
    """The runtime a load will use, and why when it is not the obvious one."""

    runtime: str  # "torch" or "llamacpp"
    note: str = ""  # one line for the status bar when auto could not use llama.cpp; "" otherwise


def _on_cpu(device: str) -> bool:
    if device == "cpu":
        return True
    if device != "auto":
        return False
    import torch

    return not torch.cuda.is_available()


def choose_runtime(requested: str, device: str, sources: list[ModelSource], *, dtype: str = "auto",
                   fast_path: str = "auto", needs_head: bool = False, torch_options: bool = False) -> RuntimeChoice:
    """auto → llama.cpp for GGUF sources on the CPU when it imports, else torch (saying why).

    An explicit torch dtype or fast path (--dtype float32, --fast-path eager) asks for torch under
    auto, as do torch's own options (torch_options: 8/4-bit precisions, a GPU split); so does a draft head (needs_head: a head folder given, or the head proposer asked for),
    which reads the target's hidden states. An explicit "llamacpp" that cannot run is a
    ModelLoadError naming the reason.
    """
    if requested not in RUNTIMES:
        raise ModelLoadError(f"Unknown runtime {requested!r}: use auto, torch or llamacpp.")
    if requested == "torch":
        return RuntimeChoice("torch")
    not_gguf = next((s for s in sources if s.kind not in ("default", "gguf")), None)
    cpu = _on_cpu(device)
    if requested == "auto" and (not cpu or not_gguf is not None or dtype != "auto" or fast_path != "auto"
                                or torch_options):
        return RuntimeChoice("torch")  # decided without importing llama.cpp at all
    from engine.runners.llamacpp import HEAD_REFUSED, INSTALL_HINT, RuntimeUnavailable, unavailable_reason

    missing = unavailable_reason()
    if requested == "llamacpp":
        if not_gguf is not None:
            raise ModelLoadError(
                f"The llama.cpp runtime loads .gguf files and the packaged pair; {not_gguf.name} is a "
                f"{'model folder' if not_gguf.kind == 'folder' else 'hub id'}: use the torch runtime or a .gguf file.")
        if not cpu:
            raise ModelLoadError(f"The llama.cpp runtime runs on the CPU here, not on {device}: "
                                 f"use --device cpu, or the torch runtime for the GPU.")
        if missing is not None:
            raise RuntimeUnavailable(f"llama.cpp is not available ({missing}); install it with: {INSTALL_HINT}")
        if needs_head:
            raise ModelLoadError(HEAD_REFUSED)
        return RuntimeChoice("llamacpp")
    if missing is not None:
        return RuntimeChoice("torch", f"llama.cpp unavailable ({missing})")
    if needs_head:
        return RuntimeChoice("torch", "a draft head needs hidden states, which llama.cpp does not give")
    return RuntimeChoice("llamacpp")


def load_engine(
    target: str | None,
    draft: str | None,
    *,
    runtime: str = "auto",
    device: str = "auto",
    dtype: str = "auto",
    with_draft: bool = True,
    fast_path: str = "auto",
    threads: int | None = None,
    progress: ProgressFn | None = None,
    compile_k: int = 5,
    head: str | None = "auto",
    needs_head: bool = False,
    target_dtype: str | None = None,
    draft_dtype: str | None = None,
    context: int | None = None,
    gpus: int | None = None,
    memory: int | None = None,
    force: bool = False,
):
    """The Engine for a pair on the chosen runtime (the CLI and the app both load through here).

    dtype, fast_path and head (Engine.from_pair: "auto", a head folder or None) apply to torch;
    threads to llama.cpp (None: the physical cores). needs_head: the head proposer will be asked
    for, so auto picks torch; a head folder given counts as that too. On llama.cpp, head "auto"
    finds nothing to attach (no hidden states there) and the head proposer is refused in one line.
    target_dtype, draft_dtype, context, gpus, memory, force: engine.models.loader.load_pair's (torch).
    """
    from engine.decoding import Engine

    sources = [resolve_source(target, "target")] + ([resolve_source(draft, "draft")] if with_draft else [])
    wants_head = needs_head or (head is not None and str(head) not in ("auto", "none"))
    torch_options = any(p not in (None, "auto") for p in (target_dtype, draft_dtype)) or gpus is not None
    choice = choose_runtime(runtime, device, sources, dtype=dtype, fast_path=fast_path, needs_head=wants_head,
                            torch_options=torch_options)
    if choice.runtime == "llamacpp":
        return load_llamacpp(sources, threads=threads, progress=progress)
    from engine.models.loader import load_pair

    pair = load_pair(target, draft, device=device, dtype=dtype, target_dtype=target_dtype, draft_dtype=draft_dtype,
                     progress=progress, with_draft=with_draft, context=context, gpus=gpus, memory=memory, force=force,
                     pack_cpu=fast_path in ("auto", "static"), head=head)
    engine = Engine.from_pair(pair, fast_path=fast_path, progress=progress, compile_k=compile_k, head=head)
    if choice.note:
        log.warning("%s", choice.note)
        engine.info = replace(engine.info, runtime_note=choice.note)
    return engine


# --------------------------------------------------------------------------- llama.cpp

def gguf_file(source: ModelSource, progress: ProgressFn | None = None) -> Path:
    """The GGUF llama.cpp loads: the packaged model assembled and SHA-checked (once), or the file given."""
    if source.kind == "default":
        # Under the cache's lock, as torch's loads: a second first start waits for the assembly in progress.
        with cache_lock(lambda stage, fraction, message: _emit(progress, stage, fraction, message)):
            sweep()
            return _assemble_default(DEFAULT_MODELS[source.ref], progress)
    if source.kind == "gguf":
        return Path(source.ref)
    raise ModelLoadError(f"{source.name} is not a GGUF model; the llama.cpp runtime needs a .gguf file.")


def load_llamacpp(sources: list[ModelSource], *, threads: int | None = None, progress: ProgressFn | None = None):
    """Target (and draft) GGUFs on llama.cpp runners: tokenizers checked first, no weight conversion."""
    from engine.decoding import Engine
    from engine.runners.llamacpp import NAME, LlamaCppRunner, physical_cores
    from engine.runners.llamacpp_probe import amx_note, amx_runs
    from engine.runners.llamacpp_tokenizer import LlamaCppTokenizer

    started = time.perf_counter()
    _emit(progress, "check", 0.0, "Finding the models")
    files = [gguf_file(s, progress) for s in sources]
    _emit(progress, "check", 0.5, "Checking that draft and target share a tokenizer")
    infos = [_read_gguf_tokenizer(f, s.name) for f, s in zip(files, sources)]
    shared = check_compatible(infos[0], infos[1]) if len(infos) > 1 else infos[0].head_rows
    _emit(progress, "check", 1.0, f"Tokenizers match (shared vocabulary {shared:,})")
    threads = threads or physical_cores()
    runners, without_amx = [], []
    for i, (f, s) in enumerate(zip(files, sources)):
        fraction = (i + 1) / (len(files) + 1)
        # Where AMX is advertised, its kernels are tried once per model in a child process (they died here).
        repack = amx_runs(f, lambda message, fraction=fraction: _emit(progress, "load", fraction, message))
        if not repack:
            without_amx.append(s.name)
        _emit(progress, "load", fraction, f"Loading {s.name} ({s.role}) with llama.cpp, {threads} threads")
        runners.append(LlamaCppRunner(f, threads=threads, label=s.name, repack=repack))
    shared = min(shared, *(r.vocab_size for r in runners))
    _emit(progress, "warmup", 0.4, f"Models loaded in {time.perf_counter() - started:.1f} s")
    target = runners[0]
    tokenizer = LlamaCppTokenizer(target)  # the vocabulary llama.cpp loaded: nothing to build or convert
    info = ModelInfo(
        target_name=sources[0].name,
        draft_name=sources[1].name if len(sources) > 1 else None,
        device="cpu",
        dtype=target.file_type,
        fast_path=NAME,
        vocab_size=shared,
        runtime="llamacpp",
        threads=threads,
        fast_path_note=amx_note(without_amx),
    )
    engine = Engine(None, tokenizer, info, vocab=shared, target_runner=target,
                    draft_runner=runners[1] if len(runners) > 1 else None, eos_ids=target.eog_ids)
    engine.measure_costs(progress)
    if progress is not None:
        progress(LoadProgress("warmup", 1.0, f"Ready ({NAME}, {threads} threads)"))
    return engine
