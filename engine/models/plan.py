"""The memory plan: what a pair needs on each device before any weight loads, and the cheapest change that fits.

Pure arithmetic over ModelCensus figures (engine/models/census.py); engine/models/planner.py
gathers the figures and the free memory. Every constant below is either exact (weights, KV cache,
graph outputs) or calibrated against measured peaks (activations, runtime), and says which.
"""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, replace

from engine.limits import BATCH_WIDTHS, PREFILL_WIDTHS, tree_widths
from engine.models.census import ModelCensus
from engine.models.quant import (CAPTURABLE, FLOAT_BYTES, NF4_BLOCK, NF4_CODE_BYTES, is_fast, is_quantized,
                                 nf4_absmax_bytes_on_cpu)
from engine.types import DevicePlan, MemoryPlan, PlanChange, PlanItem

MiB, GiB = 2**20, 2**30
DEFAULT_CONTEXT = 8192  # positions when nobody says (the fast path's default cache)
CACHE_ALIGN = 64  # the fast path rounds its static cache up to this many slots
PREFILL_CHUNK = 256  # prompts are fed in chunks this long
MIN_BUCKET = 512  # smallest attention span the fast path captures
K_MAX = 12  # verify widths 2..K_MAX+1 get graphs (engine.fast.DEFAULT_K_MAX)
LEAN_TYPES = ("qwen2", "qwen3", "llama", "mistral")  # what the fast path runs
# Calibrated (bench/gpu_memory_plan.py on an H200; bench/cpu_memory_plan.py on a CPU): memory the process needs
# besides its tensors. CUDA: context, kernels and library handles per device. CPU: the Python
# process with torch and transformers imported.
# On a quiet H200 (torch 2.11, CUDA 13; bench/results/h200_quant.json) the process held 0.92 GiB
# outside PyTorch's allocator with the default pair in bf16, 0.98-1.02 GiB once bitsandbytes' kernels
# were loaded: 600 MiB put the plan 4.6% (bf16) to 12.4% (nf4 target, int8 draft) under the peak.
RUNTIME_CUDA = 900 * MiB
RUNTIME_BNB = 100 * MiB  # bitsandbytes' kernels and handles, on a device holding a quantized model
QUANTIZED = ("int8", "nf4")
RUNTIME_CPU = 500 * MiB
SLACK = 0.02  # allocator rounding and fragmentation, as a share of the tensors' bytes
LOOP_BUFFERS = 6  # [K+1, V] float32 tensors alive at once in the acceptance maths
FAST_ROWS = 64  # int8-wo / fp8 forwards up to this wide read 8-bit weights in the kernel (fastquant_kernel.MAX_ROWS)


@dataclass(frozen=True)
class ModelSpec:
    """One model as the plan sees it."""

    census: ModelCensus  # its shape facts
    precision: str  # "bfloat16" / "float16" / "float32" / "int8" / "nf4" / "int8-wo" / "fp8"
    compute: str  # float dtype of what is not quantized, and of the KV cache
    spec: str | None = None  # what the store loads (for suggestions: "another draft")


@dataclass(frozen=True)
class HeadSpec:
    """A draft head as the plan sees it (its manifest's figures); it reads the target's layers."""

    name: str
    parameters: int  # its own weights (the layer, the fusing fc, the norms)
    hidden: int  # the target's width, which the head's layer keeps
    n_kv_heads: int
    head_dim: int
    n_features: int  # target layers it reads
    draft_vocab: int  # output rows gathered from the target's head
    precision: str = "bfloat16"  # its layer's: the draft precision (int8-wo / fp8) or the float dtype
    layers: int = 1  # its decoder layers, each with its own K/V cache


@dataclass(frozen=True)
class PlanInputs:
    """Everything one plan depends on."""

    target: ModelSpec  # the model whose output is produced
    draft: ModelSpec | None  # the proposer (None: target only)
    device_type: str  # "cuda" or "cpu"
    context: int  # positions each cache must hold
    gpus: int = 1  # GPUs the target is split over (the draft lives on the one with the output head)
    fast_path: str = "auto"  # "auto", "eager", "static", "compiled"
    k_max: int = K_MAX  # largest K that gets a captured verify graph
    head: HeadSpec | None = None  # the draft head that will be attached (on torch), if any
    sequences: int = 1  # sequences decoded together (serve --max-seqs): more than one adds the batched step's rows


# --------------------------------------------------------------------------- sizes

def parse_size(text: str) -> int:
    """'24GiB', '24 GB', '80G', '512MiB', '1.5T' -> bytes. GiB/MiB are binary, GB/MB decimal; a bare G is GiB."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(b?)\s*", text.lower())
    if not m:
        raise ValueError(f"not a memory size: {text!r} (e.g. 24GiB)")
    value, unit, binary, b = m.groups()
    power = " kmgt".index(unit or " ")
    base = 1000 if (b and not binary) else 1024
    return int(float(value) * base**power)


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


# --------------------------------------------------------------------------- per-model arithmetic

def _float_bytes(spec: ModelSpec) -> int:
    return FLOAT_BYTES[spec.compute]


def layer_weight_bytes(spec: ModelSpec, device_type: str = "cuda") -> list[int]:
    """Bytes of each decoder layer at the chosen precision (exact, bitsandbytes' layouts).

    On a CPU with AVX512-BF16, bitsandbytes (0.48+) repacks 4-bit weights at their first use with bf16 absmax.
    """
    b = _float_bytes(spec)
    absmax = nf4_absmax_bytes_on_cpu() if device_type == "cpu" and spec.precision == "nf4" else 4
    out = []
    for layer in spec.census.layers:
        if is_fast(spec.precision) and not spec.census.prequantized:
            # int8-wo / fp8: one byte per weight and one float32 scale per output row.
            n = layer.linear_params + 4 * layer.linear_rows + layer.other_params * b
        elif spec.census.prequantized or not is_quantized(spec.precision):
            n = layer.stored_bytes + (layer.linear_params + layer.other_params) * b
        elif spec.precision == "int8":
            # LLM.int8(): one int8 per weight and one float32 scale per output row.
            n = layer.linear_params + 4 * layer.linear_rows + layer.other_params * b
        else:
            # NF4: two weights per byte, a float32 absmax per block, a 16-entry code book per module.
            n = (layer.linear_params // 2 + absmax * math.ceil(layer.linear_params / NF4_BLOCK)
                 + NF4_CODE_BYTES * layer.linears + layer.other_params * b)
        out.append(n)
    return out


def outside_weight_bytes(spec: ModelSpec, device_type: str = "cuda") -> tuple[int, int]:
    """(embedding + what precedes the layers, output head + final norm) bytes.

    The embedding stays float. An untied head is 8-bit on a GPU in int8-wo / fp8 (one byte per weight and
    a float32 scale per row: fastquant.quantize_model), float otherwise.
    """
    b = _float_bytes(spec)
    c = spec.census
    if c.head_params and is_fast(spec.precision) and not c.prequantized and device_type == "cuda":
        return c.embed_params * b, c.head_params + 4 * c.vocab + c.other_params * b
    return c.embed_params * b, (c.head_params + c.other_params) * b


def runner_kind(spec: ModelSpec, device_type: str, fast_path: str) -> str:
    """The runner the engine will use: 'graphs', 'static' (lean forward, no graphs), 'eager' or 'cpu'."""
    if device_type != "cuda":
        return "cpu"
    if fast_path == "eager" or spec.census.model_type not in LEAN_TYPES:
        return "eager"
    kind = spec.census.prequantized if spec.census.prequantized in CAPTURABLE else spec.precision
    return "static" if CAPTURABLE.get(kind, True) is False else "graphs"


def cache_positions(census: ModelCensus, context: int, kind: str) -> int:
    """Static caches allocate the whole context up front (rounded up); dynamic ones grow to it."""
    positions = min(context, census.max_positions)
    if kind in ("graphs", "static"):
        positions = -(-positions // CACHE_ALIGN) * CACHE_ALIGN
    return positions


def kv_layer_bytes(spec: ModelSpec, positions: int) -> int:
    c = spec.census
    return 2 * c.kv_heads * c.head_dim * positions * _float_bytes(spec)


def forward_transient(spec: ModelSpec, width: int, span: int) -> tuple[int, int]:
    """(layer part, head part): peak bytes a forward of `width` tokens allocates beyond weights and cache.

    Layer part, freed layer by layer, so it counts once whatever the depth: the normed input, q/k/v,
    gate/up and their product, the attention output, the additive mask [G*W, span], a 4-bit weight
    dequantized whole for a multi-row matmul, LLM.int8()'s int8 activations and int32 products.
    Head part: logits in the float dtype and their float32 copy.
    """
    c, b = spec.census, _float_bytes(spec)
    group = max(1, c.heads // max(1, c.kv_heads))
    qkv = (c.heads + 2 * c.kv_heads) * c.head_dim
    layer = width * (qkv + 3 * c.intermediate + 4 * c.hidden) * b + group * width * span * b
    largest = max((layer_.largest_linear for layer_ in c.layers), default=0)
    if spec.precision == "nf4" and width > 1:
        layer += largest * b
    elif is_fast(spec.precision) and width > FAST_ROWS:
        layer += 2 * largest * b  # wider than the 8-bit kernel's tile: fused gate/up dequantized for cuBLAS
    elif spec.precision == "int8":
        layer += width * c.intermediate * 5
    return layer, width * c.vocab * (b + 4)


def _graph_widths(role: str, k_max: int) -> tuple[int, ...]:
    return tuple(range(1, k_max + 2)) if role == "target" else (1, 2)


def head_items(inputs: PlanInputs, t_kind: str, t_pos: int, span: int) -> list[PlanItem]:
    """What attaching the draft head adds where the target's logits come out.

    The head: its weights (1 byte each plus a float32 scale per row in int8-wo / fp8), the target's output rows of
    its vocabulary gathered once, its KV cache (one per layer), its graphs' catch-up logits. With CUDA graphs the
    target captures the widths of the default dynamic tree (engine/decoding/engine.py set_tree; limits.tree_widths),
    each with a float32 [W, V] output, in a pool sized by the widest tree, and the layers the head reads per width.
    """
    h, t = inputs.head, inputs.target
    if h is None or (inputs.device_type == "cuda" and inputs.gpus > 1):
        return []  # a split target loads without its head (engine/assemble.py)
    b = FLOAT_BYTES.get(t.compute, 2)
    weights = h.parameters * (1 if is_fast(h.precision) else b) + (h.draft_vocab * h.hidden) * b
    cache = 2 * h.n_kv_heads * h.head_dim * t_pos * b * h.layers
    catch_up = 3 * (inputs.k_max + 1) * h.draft_vocab * 4
    items = [PlanItem("weights", "head", "draft head (weights, output rows, cache)",
                      weights + cache + catch_up)]
    if t_kind == "graphs":
        trees = tree_widths()
        layer_part, head_part = forward_transient(t, trees[-1], span)
        kept = (sum(trees) + sum(_graph_widths("target", inputs.k_max))) * h.n_features * t.census.hidden * b
        items.append(PlanItem("graphs", "head", "tree CUDA graphs of the target (outputs and pool)",
                              sum(trees) * t.census.vocab * 4 + layer_part + head_part + kept))
    return items


def batch_items(inputs: PlanInputs, t_kind: str, d_kind: str | None) -> list[PlanItem]:
    """What decoding `inputs.sequences` together adds (engine/decoding/batch.py, serve --max-seqs).

    Per model a BatchedDecoder: a cache row of the whole context for every sequence, allocated up front
    (runners/batched.py), and where the model's runner has no lean decoder to share (an eager runner, a CPU
    model without a head) the lean decoder the batch builds, with its own one-row cache. With the head, its
    cache rows and catch-up inputs (heads/batched.py). A model the lean forward cannot run adds nothing.
    """
    n, h = inputs.sequences, inputs.head
    items = []
    for role, spec, kind in (("target", inputs.target, t_kind), ("draft", inputs.draft, d_kind)):
        if spec is None or spec.census.model_type not in LEAN_TYPES:
            continue
        positions = cache_positions(spec.census, inputs.context, "static")  # aligned, as the lean cache
        # A CPU target with a head runs on the lean decoder already (engine/assemble.py), which the batch shares.
        shared = kind in ("graphs", "static") or (kind == "cpu" and role == "target" and inputs.head is not None)
        rows = n + (not shared)
        items.append(PlanItem("kv", role, f"{role} KV cache of {n} served sequences ({positions:,} each)",
                              rows * kv_layer_bytes(spec, positions) * len(spec.census.layers)))
        if kind == "graphs":  # every row in one forward per width, prompts a row at a time (runners/batched_graphs.py)
            kept = h.n_features * spec.census.hidden * _float_bytes(spec) if role == "target" and h else 0
            pool = max(sum(forward_transient(spec, n * BATCH_WIDTHS[-1], positions)),  # the widest forward's own,
                       forward_transient(spec, PREFILL_WIDTHS[-1], positions)[0])  # or a prompt chunk's (no logits)
            items.append(PlanItem("graphs", role, f"{role} CUDA graphs of {n} rows at once", pool + sum(PREFILL_WIDTHS)
                                  * kept + n * sum(BATCH_WIDTHS) * (spec.census.vocab * 4 + kept)))
    if h is not None and inputs.target.census.model_type in LEAN_TYPES:
        b, w = FLOAT_BYTES.get(inputs.target.compute, 2), inputs.k_max + 1  # catch-ups of widths 1..w
        rows = -(-(min(inputs.context, inputs.target.census.max_positions) + 2 * w) // CACHE_ALIGN) * CACHE_ALIGN
        per_row = (2 * h.n_kv_heads * h.head_dim * rows * h.layers + w * (w + 1) // 2 * h.n_features * h.hidden) * b \
            + 3 * h.draft_vocab * 4
        items.append(PlanItem("kv", "head", f"draft head caches of {n} served sequences", n * per_row))
    return items


# --------------------------------------------------------------------------- placement

def balanced_split(layer_bytes: list[int], first: int, last: int, gpus: int) -> list[int]:
    """Device index per layer: contiguous runs that even out each GPU's total.

    `first` is what the first GPU holds besides layers (the embedding), `last` what the last one
    holds (output head, the draft, their caches). The cut points follow the cumulative load, so the
    busiest GPU carries as little as the layer granularity allows.
    """
    if gpus <= 1:
        return [0] * len(layer_bytes)
    total = first + last + sum(layer_bytes)
    placement: list[int] = []
    device, load, here = 0, first, 0  # here: layers on the current GPU
    for i, n in enumerate(layer_bytes):
        left = len(layer_bytes) - i  # layers still to place, this one included
        later = gpus - 1 - device  # GPUs after the current one, each of which needs a layer
        past_share = load + n / 2 > total * (device + 1) / gpus
        if later and here and (past_share or left <= later):
            device, here = device + 1, 0
        placement.append(device)
        load += n
        here += 1
    return placement


# --------------------------------------------------------------------------- the plan

def build_plan(inputs: PlanInputs, capacities: list[int | None], capacity_source: str,
               device_names: list[str] | None = None) -> MemoryPlan:
    """The plan for one set of inputs (no suggestion); capacities per device used."""
    t, d = inputs.target, inputs.draft
    cuda = inputs.device_type == "cuda"
    gpus = max(1, inputs.gpus) if cuda else 1
    names = device_names or ([f"cuda:{i}" for i in range(gpus)] if cuda else ["cpu"])
    items: list[list[PlanItem]] = [[] for _ in range(gpus)]
    t_kind = runner_kind(t, inputs.device_type, inputs.fast_path)
    t_pos = cache_positions(t.census, inputs.context, t_kind)
    t_layers = layer_weight_bytes(t, inputs.device_type)
    t_kv = kv_layer_bytes(t, t_pos)
    t_embed, t_head = outside_weight_bytes(t, inputs.device_type)
    tied = t.census.head_params == 0

    # The draft (weights, cache, graphs) goes where the target's logits come out.
    draft_items: list[PlanItem] = []
    d_kind = None
    if d is not None:
        d_kind = runner_kind(d, inputs.device_type, inputs.fast_path)
        d_pos = cache_positions(d.census, inputs.context, d_kind)
        d_embed, d_head = outside_weight_bytes(d, inputs.device_type)
        d_weights = sum(layer_weight_bytes(d, inputs.device_type)) + d_embed + d_head
        draft_items.append(PlanItem("weights", "draft", f"draft weights ({_label(d)})", d_weights))
        draft_items.append(PlanItem("kv", "draft", f"draft KV cache ({d_pos:,} positions)",
                                    kv_layer_bytes(d, d_pos) * len(d.census.layers)))
        packs = d_kind == "cpu" and inputs.fast_path == "auto" and not is_quantized(d.precision)
        if packs and d.census.head_params == 0:
            draft_items.append(PlanItem("weights", "draft", "draft head packed for oneDNN", d_embed))
    out_device = 0 if (tied or gpus == 1) else gpus - 1
    placement = balanced_split(
        [w + t_kv for w in t_layers], t_embed + (t_head if out_device == 0 else 0),
        (t_head if out_device else 0) + sum(i.bytes for i in draft_items), gpus,
    )
    for g in range(gpus):
        on = [i for i, p in enumerate(placement) if p == g]
        weights = sum(t_layers[i] for i in on) + (t_embed if g == 0 else 0) + (t_head if g == out_device else 0)
        split_note = f", layers {on[0]}-{on[-1]}" if gpus > 1 and on else ""
        items[g].append(PlanItem("weights", "target", f"target weights ({_label(t)}{split_note})", weights))
        items[g].append(PlanItem("kv", "target", f"target KV cache ({t_pos:,} positions)", t_kv * len(on)))
    if t_kind == "cpu" and inputs.fast_path == "auto" and not is_quantized(t.precision) and tied:
        items[0].append(PlanItem("weights", "target", "target head packed for oneDNN", t_embed))
    items[out_device].extend(draft_items)

    # CUDA graphs: each runner keeps a float32 [W, V] output per captured width, and one pool that
    # holds the largest captured forward's intermediates (graphs of a runner share it).
    span = t_pos if t_kind in ("graphs", "static") else min(inputs.context, t.census.max_positions)
    has_layers = [any(p == g for p in placement) for g in range(gpus)]
    if t_kind == "graphs":
        widths = _graph_widths("target", inputs.k_max)
        layer_part, head_part = forward_transient(t, widths[-1], span)
        for g in range(gpus):
            pool = layer_part * has_layers[g] + (head_part if g == out_device else 0)
            outputs = sum(widths) * t.census.vocab * 4 if g == out_device else 0
            items[g].append(PlanItem("graphs", "target", "target CUDA graphs (outputs and pool)", outputs + pool))
    if d is not None and d_kind == "graphs":
        widths = _graph_widths("draft", inputs.k_max)
        layer_part, head_part = forward_transient(d, widths[-1], cache_positions(d.census, inputs.context, d_kind))
        items[out_device].append(PlanItem("graphs", "draft", "draft CUDA graphs (outputs and pool)",
                                          sum(widths) * d.census.vocab * 4 + layer_part + head_part))

    items[out_device].extend(head_items(inputs, t_kind, t_pos, span))
    batched = inputs.sequences > 1 and gpus == 1  # a split target is served one sequence at a time
    if batched:
        items[0].extend(batch_items(inputs, t_kind, d_kind))

    # Activations outside graphs: a prompt chunk through each model (one at a time), and the
    # acceptance maths over [K+1, V] float32 tensors on the output device.
    chunk = min(PREFILL_CHUNK, inputs.context)
    for g in range(gpus):
        prefill = forward_transient(t, chunk, span)[0] * has_layers[g]
        loop = 0
        if g == out_device:
            if d is not None:
                prefill = max(prefill, forward_transient(d, chunk, span)[0])
            loop = LOOP_BUFFERS * (inputs.k_max + 1) * t.census.vocab * 4
            if t_kind in ("eager", "cpu"):
                loop += forward_transient(t, inputs.k_max + 1, span)[1]  # HF's logits, then their float copy
            if batched:  # every sequence's widest verify in one forward, beside its neighbours' rows
                prefill = max(prefill, sum(forward_transient(t, inputs.sequences * (inputs.k_max + 1), span)))
        items[g].append(PlanItem("activations", "", "activations (prompt chunk, acceptance maths)", prefill + loop))

    for g in range(gpus):
        tensors = sum(i.bytes for i in items[g])
        runtime = RUNTIME_CUDA if cuda else RUNTIME_CPU
        if cuda and (t.precision in QUANTIZED or (d is not None and d.precision in QUANTIZED and g == out_device)):
            runtime += RUNTIME_BNB
        label = "runtime (CUDA context, libraries, allocator)" if cuda else "runtime (Python, torch, allocator)"
        items[g].append(PlanItem("runtime", "", label, runtime + int(SLACK * tensors)))

    devices = tuple(DevicePlan(names[g] if g < len(names) else f"cuda:{g}", tuple(items[g]),
                               capacities[g] if g < len(capacities) else None, capacity_source)
                    for g in range(gpus))
    runner = {"graphs": "cuda-graphs", "static": "static-eager", "eager": "eager", "cpu": "eager"}[t_kind]
    return MemoryPlan(
        target_name=t.census.name, draft_name=d.census.name if d else None, target_precision=_label(t),
        draft_precision=_label(d) if d else None, context=inputs.context, runner=runner, devices=devices,
        target_layers=tuple(placement), output_device=out_device,
    )


def _label(spec: ModelSpec) -> str:
    if spec.census.prequantized:
        return f"{spec.census.prequantized}, pre-quantized"
    return spec.precision


# --------------------------------------------------------------------------- suggestions

# What each change costs a person, roughly: quality first (the target's precision), then speed.
_COST_TARGET = {"int8": 2.0, "int8-wo": 2.0, "nf4": 3.0}
_COST_DRAFT = {"int8": 1.0, "int8-wo": 1.0, "nf4": 1.5}
_COST_HALVING = 1.0  # per halving of the context
_COST_OTHER_DRAFT = 2.0
_COST_NO_DRAFT = 6.0
MIN_CONTEXT = 1024


@dataclass(frozen=True)
class DraftOption:
    """A draft the suggestion may switch to."""

    spec: ModelSpec | None  # None: no draft model at all (n-gram drafts)
    name: str  # display name


def _stronger(precision: str, device_type: str) -> list[str]:
    """The precisions below `precision` a suggestion may try. On a GPU the 8-bit step is int8-wo: the same
    bytes as bitsandbytes' LLM.int8, but it decodes faster than bf16 where LLM.int8 decodes 30x slower
    (docs/quantization.md); elsewhere it is bitsandbytes' int8."""
    eight = "int8-wo" if device_type == "cuda" else "int8"
    bits = {"float32": 32, "float16": 16, "bfloat16": 16, "int8-wo": 8, "fp8": 8, "int8": 8, "nf4": 4}
    if precision not in bits:
        return []
    return [p for p in (eight, "nf4") if bits[p] < bits[precision]]


def suggest(inputs: PlanInputs, capacities: list[int | None], capacity_source: str,
            draft_options: tuple[DraftOption, ...] = ()) -> PlanChange | None:
    """The cheapest change (by _COST_*) that makes the plan fit, or None when nothing tried does."""
    if any(c is None for c in capacities):
        return None
    t, d = inputs.target, inputs.draft
    contexts = [inputs.context]
    while contexts[-1] // 2 >= MIN_CONTEXT:
        contexts.append(contexts[-1] // 2)
    t_options = [t.precision] + ([] if t.census.prequantized else _stronger(t.precision, inputs.device_type))
    drafts: list[tuple[DraftOption | None, float]] = [(None, 0.0)]  # None: keep the current draft
    drafts += [(o, _COST_NO_DRAFT if o.spec is None else _COST_OTHER_DRAFT) for o in draft_options]
    best: tuple[float, int, PlanChange] | None = None
    for t_prec, (draft_choice, draft_cost), (halvings, ctx) in itertools.product(
        t_options, drafts, enumerate(contexts)
    ):
        new_draft = d if draft_choice is None else draft_choice.spec
        d_options = [None] if new_draft is None else [new_draft.precision] + (
            [] if new_draft.census.prequantized else _stronger(new_draft.precision, inputs.device_type))
        for d_prec in d_options:
            cost = _COST_TARGET.get(t_prec, 0.0) * (t_prec != t.precision) + draft_cost + _COST_HALVING * halvings
            if d_prec is not None and new_draft is not None and d_prec != new_draft.precision:
                cost += _COST_DRAFT[d_prec]
            if cost == 0:
                continue  # that is the plan that does not fit
            changed = replace(
                inputs, target=replace(t, precision=t_prec), context=ctx,
                draft=None if new_draft is None else replace(new_draft, precision=d_prec or new_draft.precision),
            )
            plan = build_plan(changed, capacities, capacity_source)
            if not plan.fits:
                continue
            needed = max(dev.total for dev in plan.devices)
            if best is None or (cost, needed) < (best[0], best[1]):
                best = (cost, needed, _change(inputs, changed, draft_choice, needed))
    return best[2] if best else None


def _change(old: PlanInputs, new: PlanInputs, draft_choice: DraftOption | None, needed: int) -> PlanChange:
    parts = []
    if new.target.precision != old.target.precision:
        parts.append(f"quantize the target to {new.target.precision}")
    if draft_choice is not None:
        parts.append("drop the draft model (n-gram drafts only)" if draft_choice.spec is None
                     else f"use the draft {draft_choice.name}")
    if new.draft is not None:
        before = draft_choice.spec if draft_choice is not None else old.draft
        if before is not None and new.draft.precision != before.precision:
            parts.append(f"quantize the draft to {new.draft.precision}")
    if new.context != old.context:
        parts.append(f"shorten the context to {new.context:,} tokens")
    text = ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]
    return PlanChange(
        description=text[0].upper() + text[1:], target_precision=new.target.precision,
        draft_precision=new.draft.precision if new.draft else "auto", context=new.context,
        draft=new.draft.spec if new.draft else None, with_draft=new.draft is not None, needed=needed,
        draft_name=draft_choice.name if draft_choice is not None and draft_choice.spec is not None else None,
    )


# --------------------------------------------------------------------------- text

def format_plan(plan: MemoryPlan) -> str:
    """The plan as the CLI prints it (and the GUI shows in a tooltip)."""
    draft = f" + {plan.draft_name} ({plan.draft_precision})" if plan.draft_name else " (no draft)"
    lines = [f"Memory plan: {plan.target_name} ({plan.target_precision}){draft}, "
             f"context {plan.context:,}, target runner {plan.runner}"]
    for dev in plan.devices:
        cap = f"{gib(dev.capacity)} {dev.capacity_source}" if dev.capacity is not None else "capacity unknown"
        lines.append(f"  {dev.device} ({cap})")
        for item in dev.items:
            lines.append(f"    {item.label:<58}{gib(item.bytes):>12}")
        verdict = ("fits" if dev.fits else "DOES NOT FIT")
        spare = "" if dev.capacity is None else (
            f", {gib(dev.capacity - dev.total)} spare" if dev.fits else f", {gib(dev.total - dev.capacity)} short")
        lines.append(f"    {'total':<58}{gib(dev.total):>12}  {verdict}{spare}")
    if not plan.fits:
        if plan.suggestion is not None:
            lines.append(f"Cheapest change that fits: {plan.suggestion.description} "
                         f"(needs {gib(plan.suggestion.needed)} on the busiest device).")
        else:
            lines.append("No change tried makes it fit: choose a smaller target, more GPUs or more memory.")
    lines.extend(f"Note: {n}" for n in plan.notes)
    return "\n".join(lines)
