"""Plans a pair before loading: each model's figures and the devices' free memory; plan.py does the sums."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from engine.errors import ModelLoadError
from engine.models.census import ModelCensus, census_from_config, census_from_folder, census_from_gguf
from engine.models.plan import (
    DEFAULT_CONTEXT,
    RUNTIME_CPU,
    RUNTIME_CUDA,
    DraftOption,
    HeadSpec,
    ModelSpec,
    PlanInputs,
    build_plan,
    suggest,
)
from engine.models.presets import PACKAGED, cached_snapshot, offline_message, other_drafts, packaged, preset_model
from engine.loadspec import normalize_precision
from engine.models.quant import FLOATS
from engine.types import MemoryPlan
from engine.models.store import _cached_folder, resolve_source
from engine.models.device import pick_dtype
from engine.models.plan import GiB
from engine.models.presets import presets

log = logging.getLogger(__name__)


def model_census(spec: str | None, role: str) -> tuple[ModelCensus, str | None, tuple[str, ...]]:
    """(figures, preset id or None, hub ids sized from a shipped config because they are not cached)."""
    source = resolve_source(spec, role)  # type: ignore[arg-type]
    if source.kind == "default":
        folder = _cached_folder(source)[0]  # (folder, why not) when damaged or missing
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
        return census_from_config(known.config, source.name, "preset config"), known.id, (source.ref,)
    raise ModelLoadError(offline_message(source.ref) + " (The plan needs at least its config.json.)")


def resolve_precision(precision: str, dtype: str, device_type: str) -> tuple[str, str]:
    """(precision, compute dtype) for one model: 'auto' follows --dtype, which follows the device."""
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


HEAD_MANIFEST = "manifest.json"  # engine/heads/shards.py's name for it (read here as JSON: no torch, no heads)


def _head_manifest(folder: Path) -> dict | None:
    try:
        data = json.loads((folder / HEAD_MANIFEST).read_text())
        return data if isinstance(data, dict) and isinstance(data.get("config"), dict) else None
    except (OSError, ValueError, RecursionError):
        return None


def head_spec(head: str | Path | None, target: ModelCensus, precision: str) -> HeadSpec | None:
    """The draft head a load will attach, from its manifest: a folder given, or for "auto" the shipped
    head whose target has this model's shape (the load checks the exact fingerprint); None for none."""
    if head is None or str(head) == "none":
        return None
    if str(head) == "auto":
        root = Path(str(resources.files("assets").joinpath("heads")))
        folders = sorted(root.iterdir()) if root.is_dir() else []
    else:
        folders = [Path(head)]
    for folder in folders:
        m = _head_manifest(folder)
        if m is None:
            continue
        shape = m.get("target") if isinstance(m.get("target"), dict) else {}
        if str(head) == "auto" and (shape.get("model_type"), shape.get("hidden"), shape.get("layers"),
                                    shape.get("vocab")) != (target.model_type, target.hidden,
                                                            len(target.layers), target.vocab):
            continue
        c = m["config"]
        try:
            return HeadSpec(str(m.get("name", folder.name)), int(m.get("parameters", 0)), int(c["hidden"]),
                            int(c["n_kv_heads"]), int(c["head_dim"]), len(c["feature_layers"]),
                            int(c["draft_vocab"]), precision, int(c.get("layers", 1)))
        except (KeyError, TypeError, ValueError):
            return None  # a damaged manifest: the load says so in its own line
    return None


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
    head: str | Path | None = None,
    sequences: int = 1,
) -> MemoryPlan:
    """The memory plan for a pair of model specs on a device (see plan_models), read without weights."""
    t_census, t_id, missing = model_census(target, "target")
    d_census = d_id = None
    if with_draft:
        d_census, d_id, d_missing = model_census(draft, "draft")
        missing += d_missing
    notes = (f"{' and '.join(missing)} not in the local Hugging Face cache: sized from the shipped "
             f"config{'s' if len(missing) > 1 else ''}; loading needs the network.",) if missing else ()
    plan = plan_models(
        ModelFigures(t_census, target, t_id), ModelFigures(d_census, draft, d_id) if d_census else None,
        device=device, dtype=dtype, target_precision=target_precision, draft_precision=draft_precision,
        context=context, memory=memory, gpus=gpus, fast_path=fast_path, head=head, sequences=sequences,
    )
    return replace(plan, notes=plan.notes + notes)


@dataclass(frozen=True)
class ModelFigures:
    """One model's figures and where they came from."""

    census: ModelCensus  # its shape facts
    spec: str | None  # what the store loads
    preset_id: str | None  # its id among the presets' models (for "another draft"), if any


def plan_models(
    target: ModelFigures,
    draft: ModelFigures | None,
    *,
    device: str = "auto",
    dtype: str = "auto",
    target_precision: str = "auto",
    draft_precision: str = "auto",
    context: int | None = None,
    memory: int | None = None,
    gpus: int | None = None,
    fast_path: str = "auto",
    head: str | Path | None = None,
    sequences: int = 1,
) -> MemoryPlan:
    """The memory plan, with the cheapest change that fits when it does not.

    head: the draft head the load attaches ("auto", a folder, None): counted where the logits come out.
    sequences: how many are decoded together (serve --max-seqs); more than one counts the batch's cache rows.

    gpus: how many GPUs the target may be split over; None tries one, then as many as are needed
    (up to the visible ones, or the --memory plan's count).
    """
    notes: tuple[str, ...] = ()
    device_type, names, capacities, source = device_capacity(device, memory, gpus)
    t_prec, t_compute = resolve_precision(target_precision, dtype, device_type)
    t_spec = ModelSpec(target.census, t_prec, t_compute, target.spec)
    d_spec = None
    if draft is not None:
        d_prec, d_compute = resolve_precision(draft_precision, dtype, device_type)
        d_spec = ModelSpec(draft.census, d_prec, d_compute, draft.spec)
    for figures, asked in ((target, target_precision), (draft, draft_precision)):
        if figures is not None and figures.census.prequantized and normalize_precision(asked) != "auto":
            notes += (f"{figures.census.name} is already quantized ({figures.census.prequantized}); "
                      f"it loads as it is.",)
    ctx = min(context or DEFAULT_CONTEXT, target.census.max_positions)
    head_precision = d_spec.precision if d_spec is not None else t_compute
    inputs = PlanInputs(t_spec, d_spec, device_type, ctx, gpus=1, fast_path=fast_path,
                        head=head_spec(head, target.census, head_precision), sequences=max(1, sequences))
    counts = [gpus] if gpus else list(range(1, len(names) + 1))
    plan = None
    for count in counts:  # the fewest GPUs that hold it
        inputs = replace(inputs, gpus=count)
        plan = build_plan(inputs, capacities[:count], source, names[:count])
        if plan.fits:
            break
    assert plan is not None
    if not plan.fits:
        options: tuple[DraftOption, ...] = ()
        if draft is not None:
            options = tuple(
                DraftOption(ModelSpec(census_from_config(m.config, m.name, "preset config"),
                                      *resolve_precision("auto", dtype, device_type), m.spec), m.name)
                for m in other_drafts(target.preset_id or "", draft.preset_id)
            ) + (DraftOption(None, "no draft"),)
        plan = replace(plan, suggestion=suggest(inputs, capacities[: inputs.gpus], source, options))
    return replace(plan, notes=plan.notes + notes)


def device_maps(plan: MemoryPlan, device: str) -> tuple[dict[str, str] | None, str]:
    """(the target's device_map when the plan splits it over GPUs, else None; the draft's device).

    Contiguous layers per GPU as the plan placed them; the embedding beside the first layer, the
    final norm and output head beside the last, so the fast path can run each GPU's part as a stage.
    """
    names = [d.device for d in plan.devices]
    out = names[plan.output_device]
    if len(names) <= 1:
        return None, device if device != "auto" else names[0]
    first = names[plan.target_layers[0]]
    last = names[plan.target_layers[-1]]
    mapping = {"model.embed_tokens": first, "model.rotary_emb": first}
    mapping.update({f"model.layers.{i}": names[g] for i, g in enumerate(plan.target_layers)})
    mapping.update({"model.norm": last, "lm_head": out})
    return mapping, out


TABLE_SIZES = (24, 48, 80)  # GiB: the usual single-GPU sizes (RTX 4090 / A6000 / A100-H100)


def preset_table(device: str = "cuda", memory: int | None = None, context: int | None = None,
                 gpus: int | None = None) -> str:
    """Every preset's plan at 24, 48 and 80 GiB (or at `memory`): fits as is, or the cheapest change."""
    sizes = [memory] if memory else [n * GiB for n in TABLE_SIZES]
    head = f"{'preset':<16}{'target + draft':<56}" + "".join(f"{gib_label(m):>30}" for m in sizes)
    rows = [f"Memory plans, one GPU{'' if not gpus else f' x {gpus}'}, context {context or DEFAULT_CONTEXT:,}, "
            "bfloat16 unless a change is named (GiB needed on the busiest GPU):", head]
    for p in presets():
        cells = []
        for size in sizes:
            plan = plan_pair(p.target.spec, p.draft.spec, device=device, memory=size, context=context, gpus=gpus)
            busiest = max(d.total for d in plan.devices)
            if plan.fits:
                cells.append(f"fits ({busiest / GiB:.1f})")
            elif plan.suggestion is None:
                cells.append("does not fit")
            else:
                cells.append(f"{_short_change(plan, plan.suggestion)} ({plan.suggestion.needed / GiB:.1f})")
        rows.append(f"{p.name:<16}{p.title[:55]:<56}" + "".join(f"{c:>30}" for c in cells))
    rows.append("Changes: 'target int8-wo' = quantize the target to 8 bits (this project's kernel, faster than bf16); "
                "'target nf4' = to nf4 (bitsandbytes); 'ctx N' = a shorter context.")
    return "\n".join(rows)


def gib_label(n: int) -> str:
    return f"{n / 2**30:g} GiB"


def _short_change(plan: MemoryPlan, change) -> str:
    parts = []
    if change.target_precision != plan.target_precision:
        parts.append(f"target {change.target_precision}")
    if not change.with_draft:
        parts.append("no draft")
    elif plan.draft_precision is not None and change.draft_precision != plan.draft_precision:
        parts.append(f"draft {change.draft_precision}")
    if change.draft_name:
        parts.append(f"draft {change.draft_name}")
    if change.context != plan.context:
        parts.append(f"ctx {change.context:,}")
    return ", ".join(parts)
