"""One LoadSpec -> a ready Engine: runtime choice, plan check, weights, packing once, the head, runners, costs.

The app's worker, the CLI and the benchmarks all load through build_engine. auto: llama.cpp on the
CPU for GGUF sources (the packaged pair included) when llama-cpp-python imports; torch otherwise
(GPUs, model folders, hub ids). On llama.cpp a GGUF loads as it is: the packaged pair is assembled
and SHA-checked once, never converted, and the tokenizer is llama.cpp's own.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from engine.cpu_threads import ThreadPolicy, choose_threads
from engine.decoding import Engine
from engine.errors import IncompatibleModelsError, ModelLoadError
from engine.heads.shards import resolve_head
from engine.limits import TREE_ALTERNATIVES, TREE_K_MAX
from engine.loadspec import LoadProgress, LoadSpec, ProgressFn, emit
from engine.models import fastquant
from engine.models.loader import LoadedPair, load_pair
from engine.models.memory import cast_releasing_pages
from engine.models.planner import plan_pair
from engine.models.quant import quantized_kind
from engine.models.store import ModelSource, gguf_file, resolve_source
from engine.models.tokenizers import check_compatible, read_gguf_tokenizer
from engine.runners.cpu import try_pack, use_torch_threads
from engine.runners.graphs import build_runners
from engine.runners.lean import UnsupportedModelError
from engine.runners.llamacpp import (
    DEFAULT_N_CTX,
    HEAD_REFUSED,
    INSTALL_HINT,
    NAME,
    LlamaCppRunner,
    RuntimeUnavailable,
    physical_cores,
    unavailable_reason,
)
from engine.runners.llamacpp_plan import plan_llamacpp
from engine.runners.llamacpp_probe import amx_note, amx_runs
from engine.runners.llamacpp_tokenizer import LlamaCppTokenizer
from engine.runners.tree import sibling_rows
from engine.settings import RUNTIMES
from engine.types import MemoryPlan, ModelInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeChoice:
    """The runtime a load will use, and why when it is not the obvious one."""

    runtime: str  # "torch" or "llamacpp"
    note: str = ""  # one line for the status bar when auto could not use llama.cpp; "" otherwise


def build_engine(spec: LoadSpec, progress: ProgressFn | None = None) -> Engine:
    """The Engine for `spec` on the runtime it chooses (the CLI and the app both load through here).

    dtype, precisions, fast_path and head apply to torch; threads to llama.cpp and to torch on a CPU (None:
    cpu_threads.choose_threads for the physical cores). needs_head: the head proposer will be asked for,
    so auto picks torch; a head folder given counts as that too. On llama.cpp, head "auto" finds nothing
    to attach (no hidden states there) and the head proposer is refused in one line.
    """
    sources = [resolve_source(spec.target, "target")] + ([resolve_source(spec.draft, "draft")] if spec.with_draft
                                                         else [])
    choice = choose_runtime(spec, sources)
    policy = choose_threads(physical_cores(), spec.threads)
    if choice.runtime == "llamacpp":
        return _llamacpp_engine(sources, policy, progress, spec.context, spec.keep_costs)
    on_cpu = spec.device == "cpu" or (spec.device == "auto" and not torch.cuda.is_available())
    threads = use_torch_threads(policy) if on_cpu else 0
    engine = engine_for_pair(load_pair_packed(spec, progress), spec, progress)
    if on_cpu:
        engine.info = replace(engine.info, threads=threads, threads_batch=threads,
                              threads_note=replace(policy, decode=threads, batch=threads).describe())
    if choice.note:
        log.warning("%s", choice.note)
        engine.info = replace(engine.info, runtime_note=choice.note)
    return engine


@dataclass
class PackedPair:  # not frozen: holds models
    """A pair as the engine loads it: on the CPU fast path each model packed as it loaded."""

    pair: LoadedPair  # the models, tokenizer and plan
    head: tuple | None = None  # the draft head found before packing the target (DraftHead, HeadFiles), or None
    head_resolved: bool = False  # the head was looked for (a packed target has no plain output head to bind to)


def load_pair_packed(spec: LoadSpec, progress: ProgressFn | None = None) -> PackedPair:
    """load_pair, packing each float model for oneDNN right after it loads on the CPU fast path (spec.fast_path
    auto or static), so the draft never loads beside an unpacked target: the float32 peak stays near the final
    size. The head (spec.head) is resolved first, as binding reads the target's unpacked output head."""
    found: dict[str, tuple | None] = {}

    def pack(index: int, model: torch.nn.Module, dtype: torch.dtype) -> None:
        if index == 0:
            found["head"] = resolve_head(model, spec.head)
        if try_pack(model, dtype) is None:  # no oneDNN here: the linear weights still need casting
            cast_releasing_pages(model, dtype)
        model.get_input_embeddings().__dict__.pop("file_weight", None)  # not packed (no oneDNN): unused
        head = found.get("head")
        if head is not None:
            # Packing replaced a float32 input embedding by exact bfloat16 (CompactEmbedding); the
            # head, bound before, still held the float32 one (0.9 GB for the default target) beside
            # the draft's loading and packing: the float32 load peak. It reads the bfloat16 one now.
            head[0].bind_inputs(model)

    packs = spec.fast_path in ("auto", "static")
    pair = load_pair(spec, progress, pack=pack if packs else None)
    return PackedPair(pair, found.get("head"), head_resolved=packs and pair.target.device.type == "cpu")


def choose_runtime(spec: LoadSpec, sources: list[ModelSource]) -> RuntimeChoice:
    """auto → llama.cpp for GGUF sources on the CPU when it imports, else torch (saying why).

    An explicit torch dtype or fast path (--dtype float32, --fast-path eager) asks for torch under
    auto, as do torch's own options (8/4-bit precisions, a GPU split); so does a draft head (a head
    folder given, or the head proposer asked for), which reads the target's hidden states. An
    explicit "llamacpp" that cannot run is a ModelLoadError naming the reason.
    """
    requested, device = spec.runtime, spec.device
    if requested not in RUNTIMES:
        raise ModelLoadError(f"Unknown runtime {requested!r}: use auto, torch or llamacpp.")
    if requested == "torch":
        return RuntimeChoice("torch")
    needs_head = spec.needs_head or (spec.head is not None and str(spec.head) not in ("auto", "none"))
    torch_options = spec.target_precision != "auto" or spec.draft_precision != "auto" or spec.gpus is not None
    not_gguf = next((s for s in sources if s.kind not in ("default", "gguf")), None)
    cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if requested == "auto" and (not cpu or not_gguf is not None or spec.dtype != "auto" or spec.fast_path != "auto"
                                or torch_options):
        return RuntimeChoice("torch")  # decided without importing llama.cpp at all
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


# --------------------------------------------------------------------------- torch

def engine_for_pair(loaded: LoadedPair | PackedPair, spec: LoadSpec, progress: ProgressFn | None = None) -> Engine:
    """Builds runners for a loaded pair; the fast path when CUDA allows it (spec.fast_path, compile_k, head).

    fast_path: "auto" (CUDA graphs where possible, else eager), "eager", "static" (graphs or
    an error), "compiled" (graphs of inductor-compiled forwards for K = compile_k: minutes of
    warm-up, fewer kernels per forward).
    head: "auto" (the shipped draft head trained for this target, if there is one), a head
    folder (refused when it was trained for another target), or None; a PackedPair's own when it
    was resolved before packing. spec's model specs and the target's precision are not read: the pair
    is loaded; an int8-wo / fp8 draft precision quantizes the head's layer.
    """
    packed = loaded if isinstance(loaded, PackedPair) else PackedPair(loaded)
    pair = packed.pair
    fast_path, compile_k, head = spec.fast_path, spec.compile_k, spec.head
    target_runner = draft_runner = None
    name = "eager"
    notes: list[str] = []
    context = pair.plan.context if pair.plan is not None else None
    on_cpu = pair.target.device.type == "cpu"
    quantized = [m for m in (pair.target, pair.draft) if m is not None and quantized_kind(m)]
    if len(pair.info.devices) > 1 and head is not None and str(head) not in ("auto", "none"):
        # The head reads the target's input embeddings (first GPU) and output rows (last GPU) at once.
        raise IncompatibleModelsError("A draft head needs the target on one GPU; this target is split over "
                                      f"{', '.join(pair.info.devices)}. Load it without a head, or on one GPU.")
    if len(pair.info.devices) > 1:
        head = None  # "auto" too: a shipped head is skipped rather than failing the load
    # Before packing: the head gathers its output rows from the target's own output head.
    found = packed.head if packed.head_resolved else resolve_head(pair.target, head)
    if found is not None and spec.draft_precision in fastquant.FAST_PRECISIONS and found[0].kind is None:
        notes.append(_quantize_head(found[0], spec.draft_precision, pair.target.device))
    layers = found[0].config.feature_layers if found else ()
    if fast_path in ("auto", "static") and on_cpu and not quantized:
        if progress is not None:
            progress(LoadProgress("warmup", 0.5, "Packing weights for the CPU fast path (oneDNN)"))
        # In place: the pair's models are the engine's from now on (baselines load their own).
        packed_name = try_pack(pair.target)
        if packed_name and pair.draft is not None:
            try_pack(pair.draft)
        name = packed_name or name
        if found is not None and packed_name:
            # The head's dynamic trees need a target runner that verifies trees: the lean decoder's static
            # cache, calling the packed linears as they are (its forwards cost what the packed model's do).
            target_runner = _cpu_tree_runner(pair.target, context, layers, notes)
    if fast_path != "eager" and not on_cpu:
        try:
            target_runner, draft_runner, name = build_runners(
                pair.target, pair.draft, progress=progress, max_length=context,
                compile_k=compile_k if fast_path == "compiled" else None, hidden_layers=layers,
                compile_tree=sibling_rows(compile_k, TREE_ALTERNATIVES) if found and compile_k <= TREE_K_MAX
                else None,
            )
            notes += [f"{role}: {r.fallback_reason}" for role, r in (("target", target_runner),
                                                                      ("draft", draft_runner))
                      if r is not None and r.fallback_reason]
        except Exception as exc:  # any model the fast path cannot take falls back, loudly
            if fast_path in ("static", "compiled"):
                raise
            log.warning("fast path unavailable, using eager decoding: %s", exc)
            target_runner = draft_runner = None
            name = "eager"
            notes.append(_first_line(exc))
    info = replace(pair.info, fast_path=name, fast_path_note="; ".join(notes))
    engine = Engine(pair.target, pair.tokenizer, info, draft=pair.draft, vocab=pair.shared_vocab,
                    target_runner=target_runner, draft_runner=draft_runner, max_length=context)
    if found is not None:
        engine.attach_head(found[0], found[1].name, progress, compile_step=fast_path == "compiled")
    engine.settle_costs(progress, spec.keep_costs)
    if progress is not None:
        progress(LoadProgress("warmup", 1.0, f"Ready ({name})"))
    return engine


def _cpu_tree_runner(target, context: int | None, layers: tuple[int, ...], notes: list[str]):
    """The target's lean runner on a CPU (no graphs), or None (the eager runner, chains only) where the lean
    forward cannot take the model, said in `notes`."""
    try:
        runner, _, _ = build_runners(target, None, max_length=context, hidden_layers=layers)
        return runner
    except UnsupportedModelError as exc:
        notes.append(f"target: chains only ({_first_line(exc)})")
        return None


def _quantize_head(head, precision: str, device: torch.device) -> str:
    """The draft precision applies to the head's layers too (the head is the drafter): one line on what happened."""
    problem = fastquant.precision_problem(precision, device)
    if problem is not None:
        dtype = str(head.embed.dtype).removeprefix("torch.") if head.embed is not None else "its float dtype"
        return f"draft head: kept in {dtype} ({problem})"
    count = head.quantize(precision)
    log.info("draft head: %d layer matrices in %s", count, precision)
    return f"draft head: {'layers' if head.config.layers > 1 else 'layer'} in {precision}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


# --------------------------------------------------------------------------- llama.cpp

def _llamacpp_engine(sources: list[ModelSource], policy: ThreadPolicy, progress: ProgressFn | None,
                     context: int | None = None, keep_costs: bool = False) -> Engine:
    """Target (and draft) GGUFs on llama.cpp runners: tokenizers checked first, no weight conversion; each KV
    cache grows up to `context` cells (None: DEFAULT_N_CTX), as the memory plan counts it."""
    started = time.perf_counter()
    emit(progress, "check", 0.0, "Finding the models")
    files = [gguf_file(s, progress) for s in sources]
    emit(progress, "check", 0.5, "Checking that draft and target share a tokenizer")
    infos = [read_gguf_tokenizer(f, s.name) for f, s in zip(files, sources)]
    shared = check_compatible(infos[0], infos[1]) if len(infos) > 1 else infos[0].head_rows
    emit(progress, "check", 1.0, f"Tokenizers match (shared vocabulary {shared:,})")
    threads = policy.label()
    runners, without_amx = [], []
    for i, (f, s) in enumerate(zip(files, sources)):
        fraction = (i + 1) / (len(files) + 1)
        # Where AMX is advertised, its kernels are tried once per model in a child process (they died here).
        repack = amx_runs(f, lambda message, fraction=fraction: emit(progress, "load", fraction, message))
        if not repack:
            without_amx.append(s.name)
        emit(progress, "load", fraction, f"Loading {s.name} ({s.role}) with llama.cpp, {threads}")
        runners.append(LlamaCppRunner(f, n_ctx=context or DEFAULT_N_CTX, threads=policy.decode,
                                      batch_threads=policy.batch, label=s.name,
                                      repack=repack))
    shared = min(shared, *(r.vocab_size for r in runners))
    emit(progress, "warmup", 0.4, f"Models loaded in {time.perf_counter() - started:.1f} s")
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
        threads=policy.decode,
        threads_batch=policy.batch,
        threads_note=policy.describe(),
        fast_path_note=amx_note(without_amx),
    )
    engine = Engine(None, tokenizer, info, vocab=shared, target_runner=target,
                    draft_runner=runners[1] if len(runners) > 1 else None, eos_ids=target.eog_ids)
    engine.settle_costs(progress, keep_costs)
    if progress is not None:
        progress(LoadProgress("warmup", 1.0, f"Ready ({NAME}, {threads})"))
    return engine


# --------------------------------------------------------------------------- the plan

def plan_load(spec: LoadSpec) -> MemoryPlan:
    """The memory plan of what build_engine would load for `spec`, on the runtime it would choose: the GGUFs as
    they are on llama.cpp, the converted weights at their precision on torch (headers and configs only)."""
    sources = [resolve_source(spec.target, "target")] + ([resolve_source(spec.draft, "draft")] if spec.with_draft
                                                         else [])
    choice = choose_runtime(spec, sources)
    if choice.runtime == "llamacpp":
        return plan_llamacpp(spec.target, spec.draft, with_draft=spec.with_draft, context=spec.context,
                             memory=spec.memory, sequences=spec.sequences)
    plan = plan_pair(spec.target, spec.draft if spec.with_draft else None, with_draft=spec.with_draft,
                     device=spec.device, dtype=spec.dtype, target_precision=spec.target_precision,
                     draft_precision=spec.draft_precision, context=spec.context, memory=spec.memory, gpus=spec.gpus,
                     fast_path=spec.fast_path, head=spec.head, sequences=spec.sequences)
    return replace(plan, notes=plan.notes + ((f"Runs on torch: {choice.note}.",) if choice.note else ()))
