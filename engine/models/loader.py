"""Loading a pair: tokenizer check, memory plan, then each model at its precision on its device(s)."""
from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.errors import ModelLoadError, ModelWontFitError
from engine.loadspec import LoadSpec, ProgressFn, emit
from engine.models import fastquant
from engine.models import memory as pages
from engine.models.cache_space import sweep
from engine.models.census import ModelCensus, census_from_folder, census_from_gguf
from engine.models.device import DTYPES, dtype_name, output_device, pick_device, pick_dtype
from engine.models.plan import format_plan, gib
from engine.models.planner import ModelFigures, device_maps, plan_models, resolve_precision
from engine.models.presets import PACKAGED, preset_model
from engine.models.quant import (
    FLOATS,
    checkpoint_quantization,
    quantization_config,
    quiet_int8_casts,
    require_bitsandbytes,
)
from engine.models.store import (
    ModelSource,
    Role,
    _ensure_folder,
    _first_line,
    _prepare,
    _Prepared,
    _read_json,
    resolve_source,
)
from engine.models.tokenizers import _tokenizer_info, check_compatible
from engine.types import MemoryPlan, ModelInfo

if TYPE_CHECKING:  # transformers costs ~150 MB to import; the llama.cpp runtime never needs it
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)


@dataclass
class LoadedPair:  # not frozen: holds models
    target: PreTrainedModel  # the model whose distribution is produced
    draft: PreTrainedModel | None  # the proposer model (None: target only)
    tokenizer: PreTrainedTokenizerBase  # the target's tokenizer
    info: ModelInfo  # names, device, dtype; fast_path="eager" here
    shared_vocab: int  # vocabulary size both models share (compare/slice logits to this)
    plan: MemoryPlan | None = None  # the memory plan it was loaded by


# Called on each float model on the CPU right after it loads (index 0: the target), with the dtype its
# linear weights still need casting to: engine.assemble packs them for oneDNN there (load_pair, pack).
Packer = Callable[[int, torch.nn.Module, torch.dtype], None]

@dataclass(frozen=True)
class _Placement:
    """How one model loads: its precision and where its weights go."""

    precision: str  # "bfloat16" / "float16" / "float32" / "int8" / "nf4"
    dtype: torch.dtype  # float dtype of everything not quantized
    device: torch.device  # where its first layer goes
    device_map: dict[str, str] | None  # module -> device when split over GPUs (None: all on `device`)


def _load_model(folder: Path, name: str, place: _Placement, *, keep_linear_weights: bool = False) -> PreTrainedModel:
    """from_pretrained straight onto the device (no .to(): transformers refuses it for 8/4-bit models).

    keep_linear_weights: a float model on the CPU keeps its linear weights in the file's dtype, for
    the packer to cast one at a time (load_pair, pack).
    """
    prequantized = checkpoint_quantization(_read_json(folder / "config.json"))
    if (problem := fastquant.checkpoint_problem(_read_json(folder / "config.json"))) is not None:
        raise ModelLoadError(f"{name} is {problem}.")
    kwargs: dict = {"dtype": place.dtype}
    if prequantized is None:
        config = quantization_config(place.precision, place.dtype)
        if config is not None:
            kwargs["quantization_config"] = config
    quantized = "quantization_config" in kwargs or prequantized is not None
    move_after = False  # float weights may also load on the CPU and move: the way without accelerate
    if place.device_map is not None or quantized or place.device.type != "cpu":
        if importlib.util.find_spec("accelerate") is not None:
            kwargs["device_map"] = place.device_map or {"": str(place.device)}
        elif place.device_map is not None or quantized:
            what = "splitting a model over GPUs" if place.device_map else "8-bit and 4-bit weights"
            raise ModelLoadError(f"Loading {name}: {what} needs the accelerate package: pip install accelerate")
        else:
            move_after = True
    if place.precision == "int8" or prequantized == "int8":
        quiet_int8_casts()
    # On the CPU, a float32 model from a file in a narrower float type loads memory-mapped without a
    # copy and is then cast one tensor at a time, each mapped source given back as it goes: casting in
    # from_pretrained would keep every mapped page resident beside the copies (a 4.8 GB higher peak).
    plain_cpu = place.device.type == "cpu" and not quantized and place.device_map is None
    stored = pages.stored_dtypes(folder) & {"BF16", "F16", "F32"} if plain_cpu else set()
    narrow = {"BF16": torch.bfloat16, "F16": torch.float16}.get(next(iter(stored))) if len(stored) == 1 else None
    if narrow is not None and place.dtype == torch.float32:
        kwargs["dtype"] = narrow

    from transformers import AutoModelForCausalLM

    def attempt(attn: str) -> PreTrainedModel:
        return AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation=attn, **kwargs)

    label = f"{name} on {place.device} in {place.precision}"
    try:
        try:
            model = attempt("sdpa")
        except (ValueError, ImportError) as e:
            if "sdpa" not in str(e).lower() and "attention" not in str(e).lower():
                raise
            log.info("%s does not support SDPA attention; using eager attention", name)
            model = attempt("eager")
        if kwargs["dtype"] != place.dtype:
            embedding = model.get_input_embeddings()
            source = embedding.weight.detach() if keep_linear_weights and kwargs["dtype"] == torch.bfloat16 else None
            pages.cast_releasing_pages(model, place.dtype, keep_linear_weights=keep_linear_weights)
            if source is not None and isinstance(embedding, torch.nn.Embedding):
                # The packer keeps the input embedding in bfloat16 (CompactEmbedding): the file's own
                # tensor serves, memory-mapped, so only the rows looked up are ever resident.
                embedding.file_weight = source
            del embedding, source
        if move_after:
            model = model.to(place.device)
    except (torch.OutOfMemoryError, MemoryError):
        raise _out_of_memory(label) from None
    except RuntimeError as e:
        # The CPU allocator reports exhaustion as a plain RuntimeError.
        if "allocate memory" in str(e) or "out of memory" in str(e).lower():
            raise _out_of_memory(label) from None
        raise ModelLoadError(f"Could not load {name} from {folder}: {_first_line(e)}") from None
    except ModelLoadError:
        raise
    except Exception as e:  # a damaged folder fails inside transformers or safetensors with any type
        raise ModelLoadError(f"Could not load {name} from {folder}: {_first_line(e)}") from None
    model.eval()
    model.requires_grad_(False)
    return model


def _out_of_memory(label: str) -> ModelLoadError:
    return ModelLoadError(
        f"Out of memory loading {label}: run `specdec-studio plan` to see what fits, quantize the target "
        f"(--target-quant nf4), shorten --context, or free memory (other programs, other models)."
    )


def _head_rows(model: PreTrainedModel) -> int:
    return int(model.get_output_embeddings().out_features)


def load_pair(spec: LoadSpec, progress: ProgressFn | None = None, *, pack: Packer | None = None) -> LoadedPair:
    """Resolves, checks (before any weights load), plans memory, converts if needed, loads target + draft.

    spec.dtype: the float dtype of both models (auto: bf16 on CUDA and on CPUs with native bf16);
    spec.target_precision / draft_precision: one model's precision, including "int8" and "nf4" (bitsandbytes).
    A pair the memory plan says will not fit raises ModelWontFitError (with the plan) unless spec.force.
    pack: on the CPU, called on each float model right after it loads, its linear weights still in the
    file's dtype (engine.assemble packs them for oneDNN there), so the draft never loads beside an
    unpacked target: the float32 peak stays near the final size. None for models that must stay as
    Hugging Face ships them (the bench's hf baselines).
    """
    started = time.perf_counter()
    emit(progress, "check", 0.0, "Finding the models")
    with_draft, dtype = spec.with_draft, spec.dtype
    torch_device = pick_device(spec.device)
    torch_dtype = pick_dtype(torch_device, dtype)
    sources = [resolve_source(spec.target, "target")]
    if with_draft:
        sources.append(resolve_source(spec.draft, "draft"))
    asked = [spec.target_precision, spec.draft_precision][: len(sources)]
    precisions = [resolve_precision(a, dtype, torch_device.type) for a in asked]  # (precision, compute)
    for source, (precision, _) in zip(sources, precisions):
        require_bitsandbytes(precision, source.name)
        fastquant.require_runnable(precision, torch_device, source.name)  # fp8 on a CPU: one line, nothing loaded
    sweep()  # temp files of processes that died (kill -9 mid-conversion): hundreds of MB to GBs each
    with ExitStack() as stack:  # holds the cache lock from assembling to the last conversion, if either runs
        prepared = [_prepare(s, progress, stack) for s in sources]

        emit(progress, "check", 0.4, "Checking that draft and target share a tokenizer")
        infos = [_tokenizer_info(p) for p in prepared]
        shared = check_compatible(infos[0], infos[1]) if with_draft else infos[0].head_rows
        emit(progress, "check", 0.7, f"Tokenizers match (shared vocabulary {shared:,})")

        # Planned before anything is downloaded, converted or loaded: configs and headers only.
        figures = [ModelFigures(_census(p), given, _preset_id(p.source))
                   for p, given in zip(prepared, (spec.target, spec.draft))]
        plan = plan_models(figures[0], figures[1] if with_draft else None, device=str(torch_device), dtype=dtype,
                           target_precision=asked[0], draft_precision=asked[-1] if with_draft else "auto",
                           context=spec.context, gpus=spec.gpus, memory=spec.memory, head=spec.head,
                           sequences=spec.sequences)
        busiest = max(plan.devices, key=lambda d: d.total - (d.capacity or 0))
        if not plan.fits:
            change = f" Cheapest change: {plan.suggestion.description[0].lower()}{plan.suggestion.description[1:]}." \
                if plan.suggestion else ""
            message = (f"{plan.target_name} + {plan.draft_name or 'no draft'} needs {gib(busiest.total)} on "
                       f"{busiest.device}, which has {gib(busiest.capacity or 0)}: it will not fit.{change}")
            if spec.sequences > 1:
                message += f" Serving fewer than {spec.sequences} sequences at once (--max-seqs) also needs less."
            if not spec.force:
                raise ModelWontFitError(message, plan)
            log.warning("loading although the plan says it will not fit:\n%s", format_plan(plan))
        emit(progress, "check", 1.0, f"Memory plan: {gib(busiest.total)} of {gib(busiest.capacity or 0)} on "
                                     f"{busiest.device}" if busiest.capacity else "Memory plan made")
        folders = [_ensure_folder(p, progress) for p in prepared]
    target_map, draft_device = device_maps(plan, str(torch_device))
    places = [_Placement(precisions[0][0], _dtype(precisions[0][1]),
                         torch.device(plan.devices[0].device) if target_map else torch_device, target_map)]
    if with_draft:
        places.append(_Placement(precisions[1][0], _dtype(precisions[1][1]), torch.device(draft_device), None))

    models: list[PreTrainedModel] = []
    for i, (p, folder, place) in enumerate(zip(prepared, folders, places)):
        where = ", ".join(dict.fromkeys(place.device_map.values())) if place.device_map else str(place.device)
        emit(progress, "load", i / len(folders), f"Loading {p.source.name} ({p.source.role}) on {where} "
                                                 f"in {place.precision}")
        packing = (pack is not None and place.device.type == "cpu" and place.device_map is None
                   and place.precision in FLOATS)
        # int8-wo / fp8 on one GPU: the float weights load in host memory and each layer is quantized
        # onto the GPU in turn, so the GPU holds what the plan counts, never the float model
        staged = (place.precision in fastquant.FAST_PRECISIONS and place.device_map is None
                  and place.device.type != "cpu" and checkpoint_quantization(_read_json(folder / "config.json")) is None)
        model = _load_model(folder, p.source.name, replace(place, device=torch.device("cpu")) if staged else place,
                            keep_linear_weights=packing)
        if place.precision in fastquant.FAST_PRECISIONS and fastquant.model_kind(model) is None:
            emit(progress, "load", (i + 0.5) / len(folders), f"Quantizing {p.source.name} to {place.precision}")
            try:
                fastquant.quantize_model(model, place.precision, device=place.device if staged else None)
            except torch.OutOfMemoryError:
                raise _out_of_memory(f"{p.source.name} on {place.device} in {place.precision}") from None
        if packing:
            emit(progress, "load", (i + 0.5) / len(folders), f"Packing {p.source.name} for the CPU fast path")
            pack(i, model, place.dtype)
        models.append(model)
        del model
    emit(progress, "load", 1.0, "Models loaded")
    if with_draft:
        # Real heads can differ from config.json (e.g. resized embeddings): trust the loaded weights.
        shared = min(shared, *(_head_rows(m) for m in models))
    else:
        shared = _head_rows(models[0])

    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folders[0]))
    except Exception as e:
        raise ModelLoadError(f"Could not load the tokenizer of {sources[0].name}: {_first_line(e)}") from None

    emit(progress, "warmup", 0.0, "Warming up")
    with torch.inference_mode():
        for m, source, place in zip(models, sources, places):
            ids = torch.tensor([[tokenizer.eos_token_id or 0]], device=m.get_input_embeddings().weight.device)
            label = f"{source.name} on {place.device} in {place.precision}"
            try:
                logits = m(input_ids=ids).logits  # first call pays one-time allocator / kernel selection costs
                if not bool(torch.isfinite(logits).all()):
                    raise ModelLoadError(
                        f"{source.name} computes scores that are not finite numbers (NaN or infinity): its "
                        f"weights are damaged, or they overflow in {place.precision}; try float32."
                    )
            except ModelLoadError:
                raise
            except (torch.OutOfMemoryError, MemoryError):
                raise _out_of_memory(label) from None
            except Exception as e:  # weights that load but cannot run (a damaged or odd config)
                raise ModelLoadError(f"{source.name} loaded but cannot run: {_first_line(e)}") from None
    # The engine continues this stage (fast-path set-up, cost measurement) before the pair is ready.
    emit(progress, "warmup", 0.4, f"Models warmed up in {time.perf_counter() - started:.1f} s")

    info = ModelInfo(
        target_name=sources[0].name,
        draft_name=sources[1].name if with_draft else None,
        device=str(output_device(models[0])),
        dtype=dtype_name(torch_dtype),
        fast_path="eager",
        vocab_size=shared,
        target_precision=places[0].precision,
        draft_precision=places[1].precision if with_draft else "",
        devices=tuple(dict.fromkeys(target_map.values())) if target_map else (),
    )
    return LoadedPair(target=models[0], draft=models[1] if with_draft else None,
                      tokenizer=tokenizer, info=info, shared_vocab=shared, plan=plan)


def _census(prepared: _Prepared) -> ModelCensus:
    if prepared.folder is not None:
        return census_from_folder(prepared.folder, prepared.source.name)  # a hub snapshot: its config so far
    assert prepared.gguf is not None, "a prepared source has a folder or a GGUF"
    return census_from_gguf(prepared.gguf, prepared.source.name)


def _preset_id(source: ModelSource) -> str | None:
    if source.kind == "default":
        return PACKAGED + source.role
    return source.ref if source.kind == "hub" and preset_model(source.ref) else None


def _dtype(name: str) -> torch.dtype:
    return DTYPES[name]


def load_tokenizer(spec: str | None, role: Role) -> PreTrainedTokenizerBase:
    """The tokenizer of one model spec (from its converted folder when there is one)."""
    from transformers import AutoTokenizer

    with ExitStack() as stack:
        prepared = _prepare(resolve_source(spec, role), None, stack)
        try:
            if prepared.folder is not None:
                return AutoTokenizer.from_pretrained(str(prepared.folder))
            assert prepared.gguf is not None
            return AutoTokenizer.from_pretrained(str(prepared.gguf.parent), gguf_file=prepared.gguf.name)
        except Exception as e:
            raise ModelLoadError(f"Could not load the tokenizer of {prepared.source.name}: {_first_line(e)}") from None
