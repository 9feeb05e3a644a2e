"""Plans a pair before loading it: finds each model's figures and the devices' free memory, then plan.py does the sums."""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from engine.errors import ModelLoadError
from engine.models.census import ModelCensus, census_from_config, census_from_folder, census_from_gguf
from engine.models.plan import (
    DEFAULT_CONTEXT,
    RUNTIME_CPU,
    RUNTIME_CUDA,
    DraftOption,
    ModelSpec,
    PlanInputs,
    build_plan,
    suggest,
)
from engine.models.presets import PACKAGED, cached_snapshot, offline_message, other_drafts, packaged, preset_model
from engine.models.quant import FLOATS, normalize_precision
from engine.types import MemoryPlan

log = logging.getLogger(__name__)


def model_census(spec: str | None, role: str) -> tuple[ModelCensus, str | None, tuple[str, ...]]:
    """(figures, preset id or None, notes) for a model spec, read without loading any weights."""
    from engine.models.store import _cached_folder, resolve_source  # the store owns what a spec means

    source = resolve_source(spec, role)  # type: ignore[arg-type]
    if source.kind == "default":
        folder = _cached_folder(source)
        if folder is not None:
            return census_from_folder(folder, source.name), PACKAGED + role, ()
        model = packaged(role)
        return census_from_config(model.config, source.name, "packaged config"), model.id, ()
    if source.kind == "folder":
        return census_from_folder(Path(source.ref), source.name), None, ()
    if source.kind == "gguf":
        return census_from_gguf(Path(source.ref), source.name), None, ()
    folder = cached_snapshot(source.ref)
    known = preset_model(source.ref)
    if folder is not None:
        return census_from_folder(folder, source.name), source.ref if known else None, ()
    if known is not None:
        note = f"{source.ref} is not in the local Hugging Face cache: sized from its shipped config; loading it needs the network."
        return census_from_config(known.config, source.name, "preset config"), known.id, (note,)
    raise ModelLoadError(offline_message(source.ref) + " (The plan needs at least its config.json.)")


def resolve_precision(precision: str, dtype: str, device_type: str) -> tuple[str, str]:
    """(precision, compute dtype) for one model: 'auto' follows --dtype, which follows the device."""
    from engine.models.device import pick_dtype
    import torch

    p = normalize_precision(precision)
    base = normalize_precision(dtype)
    if base not in FLOATS + ("auto",):
        base = "auto"  # --dtype is a float dtype; quantization is asked per model
    compute = str(pick_dtype(torch.device(device_type), base)).removeprefix("torch.")
    if p == "auto":
        p = normalize_precision(dtype) if normalize_precision(dtype) != "auto" else compute
    if p in FLOATS:
        compute = p
    return p, compute


def device_capacity(device: str, memory: int | None, gpus: int | None) -> tuple[str, list[str], list[int | None], str]:
    """(device type, device names, capacity per device, where capacities come from)."""
    import torch

    kind = "cuda" if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()) else "cpu"
    if device == "auto" and memory is not None and gpus:
        kind = "cuda"  # an offline plan for a GPU machine
    if kind == "cpu":
        if memory is not None:
            return "cpu", ["cpu"], [memory], "given"
        return "cpu", ["cpu"], [_ram_available() + RUNTIME_CPU], "RAM available"
    first = int(device.split(":")[1]) if ":" in device else 0
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    count = gpus or max(1, visible - first)
    names = [f"cuda:{first + i}" for i in range(count)]
    if memory is not None:
        return "cuda", names, [memory] * count, "given"
    if visible == 0:
        return "cuda", names, [None] * count, "unknown"
    capacities: list[int | None] = []
    for name in names:
        index = int(name.split(":")[1])
        if index >= visible:
            capacities.append(None)
            continue
        free, _total = torch.cuda.mem_get_info(index)
        # This process's CUDA context already exists (mem_get_info made it): the plan counts it.
        capacities.append(free + RUNTIME_CUDA)
    return "cuda", names, capacities, "free memory"


def _ram_available() -> int:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil  # not on Linux: psutil knows (installed with torch's usual companions)

    return int(psutil.virtual_memory().available)


def plan_pair(
    target: str | None,
    draft: str | None,
    *,
    with_draft: bool = True,
    device: str = "auto",
    dtype: str = "auto",
    target_precision: str = "auto",
    draft_precision: str = "auto",
    context: int | None = None,
    memory: int | None = None,
    gpus: int | None = None,
    fast_path: str = "auto",
) -> MemoryPlan:
    """The memory plan for a pair on a device, with the cheapest change that fits when it does not.

    gpus: how many GPUs the target may be split over; None tries one, then as many as are needed
    (up to the visible ones, or the --memory plan's count).
    """
    t_census, t_id, notes = model_census(target, "target")
    d_census = d_id = None
    if with_draft:
        d_census, d_id, d_notes = model_census(draft, "draft")
        notes += d_notes
    device_type, names, capacities, source = device_capacity(device, memory, gpus)
    t_prec, t_compute = resolve_precision(target_precision, dtype, device_type)
    t_spec = ModelSpec(t_census, t_prec, t_compute, target)
    d_spec = None
    if d_census is not None:
        d_prec, d_compute = resolve_precision(draft_precision, dtype, device_type)
        d_spec = ModelSpec(d_census, d_prec, d_compute, draft)
    for census, asked in ((t_census, target_precision), (d_census, draft_precision)):
        if census is not None and census.prequantized and normalize_precision(asked) != "auto":
            notes += (f"{census.name} is already quantized ({census.prequantized}); it loads as it is.",)
    ctx = min(context or DEFAULT_CONTEXT, t_census.max_positions)
    inputs = PlanInputs(t_spec, d_spec, device_type, ctx, gpus=1, fast_path=fast_path)
    counts = [gpus] if gpus else list(range(1, len(names) + 1))
    plan = None
    for count in counts:  # the fewest GPUs that hold it
        inputs = replace(inputs, gpus=count)
        plan = build_plan(inputs, capacities[:count], source, names[:count])
        if plan.fits:
            break
    assert plan is not None
    if not plan.fits:
        options = tuple(
            DraftOption(ModelSpec(census_from_config(m.config, m.name, "preset config"), *resolve_precision(
                "auto", dtype, device_type), m.spec), m.name)
            for m in other_drafts(t_id or "", d_id)
        ) if with_draft and t_id else ()
        if with_draft:
            options += (DraftOption(None, "no draft"),)
        plan = replace(plan, suggestion=suggest(inputs, capacities[: inputs.gpus], source, options))
    return replace(plan, notes=plan.notes + notes)
