"""The memory plan of a pair on the llama.cpp runtime: each GGUF as it is (its own quantization), a KV cache of the
runtime's cell type up to its context, the logits and compute buffers; read from the GGUF headers, never the weights."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError
from engine.models.gguf import GgufHeader, read_gguf_header, read_gguf_stream
from engine.models.packaged import DEFAULT_MODELS, open_default
from engine.models.plan import RUNTIME_CPU, MiB
from engine.models.planner import device_capacity
from engine.models.store import resolve_source
from engine.runners.llamacpp import DEFAULT_N_CTX, KV_TYPE, NAME, RESERVED_OUTPUTS, file_type_name
from engine.types import DevicePlan, MemoryPlan, PlanItem

# Bytes per cached value: q8_0 stores blocks of 32 int8 values with one fp16 scale (34 bytes); f16 two bytes.
KV_VALUE_BYTES = {"q8_0": 34 / 32, "f16": 2.0}
# Calibrated: llama.cpp's compute buffer at DEFAULT_N_UBATCH (128) tokens measured ~25 MiB for the default pair
# (engine/runners/llamacpp.py), shared here per model.
COMPUTE_PER_MODEL = 13 * MiB
# Calibrated from llama.cpp's log: a context reserving more outputs reserves a larger compute buffer (the default
# target's: 15.7 MiB at 13 outputs, 31.5 MiB at 52), about 0.7 of each extra output's float32 logits row.
COMPUTE_PER_OUTPUT_ROW = 0.7


@dataclass(frozen=True)
class GgufFacts:
    """What the plan needs of one GGUF, from its header."""

    name: str  # display name
    file_type: str  # llama.cpp's name of its quantization ("Q4_K_M")
    size: int  # bytes of the file: llama.cpp reads the tensors into memory (USE_MMAP is off)
    layers: int  # decoder blocks
    kv_values: int  # K values cached per token and layer (kv heads × head dim); V holds as many
    max_positions: int  # the training context (llama.cpp never makes a longer one)
    vocab: int  # rows of logits per output


def gguf_facts(spec: str | None, role: str) -> GgufFacts:
    """The figures of the packaged model (from the assembled file or its installed parts) or of a .gguf file.

    A header with a 150k-token vocabulary takes about a second to read: each file is read once while it is unchanged.
    """
    source = resolve_source(spec, role)  # type: ignore[arg-type]
    if source.kind == "default":
        return _default_facts(source.ref)
    if source.kind == "gguf":
        path = Path(source.ref)
        try:
            st = path.stat()
        except OSError as e:
            raise ModelLoadError(f"{path} cannot be read: {e.strerror or e}.") from None
        return _file_facts(str(path), source.name, st.st_size, st.st_mtime_ns)
    raise ModelLoadError(f"The llama.cpp runtime loads .gguf files and the packaged pair; {source.name} is not "
                         "one: choose the torch runtime for it.")


@functools.lru_cache(maxsize=4)
def _default_facts(role: str) -> GgufFacts:
    model = DEFAULT_MODELS[role]
    with open_default(model) as f:
        return _facts(read_gguf_stream(f, model.size, model.name), model.name, model.size)


@functools.lru_cache(maxsize=16)
def _file_facts(path: str, name: str, size: int, _mtime_ns: int) -> GgufFacts:
    return _facts(read_gguf_header(Path(path)), name, size)


def _facts(header: GgufHeader, name: str, size: int) -> GgufFacts:
    f = header.fields
    arch = str(f.get("general.architecture", "llama"))

    def number(key: str, default: int | None = None) -> int:
        value = f.get(f"{arch}.{key}", default)
        if isinstance(value, list):  # per-layer values: the largest is what a cell must hold
            value = max(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ModelLoadError(f"{name} has no usable {arch}.{key} in its GGUF header; it cannot be planned.")
        return value

    heads = number("attention.head_count")
    head_dim = number("attention.key_length", number("embedding_length") // max(1, heads))
    vocab = len(f.get("tokenizer.ggml.tokens", ())) or number("vocab_size")
    return GgufFacts(name=name, file_type=file_type_name(int(f.get("general.file_type", -1))), size=size,
                     layers=number("block_count"), kv_values=number("attention.head_count_kv", heads) * head_dim,
                     max_positions=number("context_length"), vocab=vocab)


def kv_bytes(facts: GgufFacts, cells: int, kv_type: str = KV_TYPE) -> int:
    return int(2 * facts.layers * facts.kv_values * cells * KV_VALUE_BYTES[kv_type])


def plan_llamacpp(target: str | None, draft: str | None, *, with_draft: bool = True, context: int | None = None,
                  memory: int | None = None, sequences: int = 1) -> MemoryPlan:
    """What the llama.cpp runtime holds at the longest context it may grow to, against the RAM available.

    context: the KV cells each model may grow to (None: DEFAULT_N_CTX), never beyond a model's training context.
    sequences: decoded together (serve --max-seqs); more than one counts each model's multi-sequence pool.
    """
    models = [("target", gguf_facts(target, "target"))]
    if with_draft:
        models.append(("draft", gguf_facts(draft, "draft")))
    return build_llamacpp_plan(models, context, memory, sequences)


def batch_pool_items(models: list[tuple[str, GgufFacts]], cells: dict[str, int], sequences: int) -> list[PlanItem]:
    """A multi-sequence context per model beside its runner's own (runners/llamacpp_batch.py): one pool of cells
    that doubles as the sequences need, up to sequences × the model's context, a logits buffer of a widest verify
    per sequence, and a compute buffer reserved for that many outputs."""
    outputs = sequences * RESERVED_OUTPUTS
    rows = {role: min(cells[role], cells["target"]) for role, _ in models}  # a row holds what the target's does
    items = [PlanItem("kv", role, f"{role} KV pool of {sequences} served sequences ({sequences * n:,} cells)",
                      kv_bytes(facts, sequences * n)) for (role, facts), n in zip(models, rows.values())]
    buffers = sum(outputs * f.vocab * 4 + COMPUTE_PER_MODEL
                  + int(COMPUTE_PER_OUTPUT_ROW * (outputs - RESERVED_OUTPUTS) * f.vocab * 4) for _, f in models)
    items.append(PlanItem("activations", "", f"batch logits and compute buffers ({sequences} sequences)",
                          buffers))
    return items


def build_llamacpp_plan(models: list[tuple[str, GgufFacts]], context: int | None, memory: int | None,
                        sequences: int = 1) -> MemoryPlan:
    _kind, names, capacities, source = device_capacity("cpu", memory, None)
    asked = context or DEFAULT_N_CTX
    items: list[PlanItem] = []
    cells: dict[str, int] = {}
    for role, facts in models:
        cells[role] = max(8, min(asked, facts.max_positions))
        items.append(PlanItem("weights", role, f"{role} weights ({facts.file_type} GGUF, as the file is)", facts.size))
        items.append(PlanItem("kv", role, f"{role} KV cache ({KV_TYPE}, {cells[role]:,} positions)",
                              kv_bytes(facts, cells[role])))
    buffers = sum(RESERVED_OUTPUTS * f.vocab * 4 + COMPUTE_PER_MODEL for _, f in models)
    items.append(PlanItem("activations", "", "logits and compute buffers", buffers))
    if sequences > 1:
        items.extend(batch_pool_items(models, cells, sequences))
    items.append(PlanItem("runtime", "", "runtime (Python, torch, llama.cpp)", RUNTIME_CPU))
    target = models[0][1]
    draft = models[1][1] if len(models) > 1 else None
    return MemoryPlan(
        target_name=target.name, draft_name=draft.name if draft else None,
        target_precision=f"{target.file_type} GGUF", draft_precision=f"{draft.file_type} GGUF" if draft else None,
        context=cells["target"], runner=NAME, devices=(DevicePlan(names[0], tuple(items), capacities[0], source),),
        notes=(f"llama.cpp grows each KV cache with use, from 1,024 cells up to {cells['target']:,}; the plan counts "
               "the longest.",),
    )
