"""CPU fast path: linear layers through oneDNN with weights packed once at load time.

PyTorch's float32 linear goes to MKL, whose small-M GEMM is slow on CPUs it does not tune for
(measured on this project's AMD EPYC, AVX2: 1536x8960 layer, 1 row 3.5 ms, 6 rows 12.8 ms). The
(K+1)-row verify of speculative decoding then costs several target forwards. oneDNN with a
pre-packed weight streams it once for any small width (2.4 ms for 1 row, 3.5 ms for 6), so a
verify costs about 1.4 forwards and single-token decoding gets faster too.
"""
from __future__ import annotations

import logging

import torch
from torch import nn
from engine.cpu_threads import ThreadPolicy
from engine.garbage import collect_garbage
from engine.models import memory  # memory.trim_heap: looked up per call (tests count the trims)

log = logging.getLogger(__name__)

BATCH_HINT = 8  # rows oneDNN tunes the packed layout for: the verify widths K+1 we expect


def use_torch_threads(policy: ThreadPolicy) -> int:
    """torch's intra-op threads for a CPU decode as the policy says; returns the count torch uses.

    torch's own default is every physical core: it is changed where the policy differs (a person's count,
    a core left spare), never otherwise (a process that chose its own count keeps it). One inter-op thread:
    a decode runs one op at a time.
    """
    if policy.chosen == "setting" or policy.decode < policy.cores:
        torch.set_num_threads(policy.decode)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # set once per process, before any inter-op work: a second load keeps the first
        pass
    return torch.get_num_threads()


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and runs a linear in `dtype` here: bfloat16 needs AVX-512 (or AVX-NE-CONVERT),
    so a CPU with AVX2 alone stays on the plain path in bfloat16 while float32 packs."""
    if dtype not in (torch.float32, torch.bfloat16) or not onednn_available():
        return False
    try:
        probe = nn.Linear(8, 8, dtype=dtype)
        PackedLinear(probe)(torch.zeros(2, 8, dtype=dtype))
    except Exception as exc:  # an old or unusual build, or a CPU without the instructions for this dtype
        log.info("oneDNN packed linears unavailable in %s: %s", dtype, exc)
        return False
    return True


class PackedLinear(nn.Module):
    """nn.Linear with its weight reordered for oneDNN; same maths, float32 or bfloat16.

    A weight still in its file's dtype (load_pair leaves them mapped for this) is cast on its way
    in; pack_linears packs the largest first, so the biggest such copy exists while little else does.
    One packed weight per layer: packing a head in row blocks measured 1.5-2.3x slower per forward.
    """

    def __init__(self, linear: nn.Linear, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            weight = linear.weight.detach()
            weight = weight if dtype is None or weight.dtype == dtype else weight.to(dtype)
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
            del weight
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.packed, self.bias, "none", [], "")
        return out.view(*shape[:-1], self.out_features)


class CompactEmbedding(nn.Module):
    """An input embedding kept in bfloat16 whose lookups come out in the model's dtype.

    For a float32 model on the fast path the embedding is only looked up, a few rows per step (its
    own head is separate, or packed): held in float32 it costs 1.5 GB for the default pair. Only
    taken when every value is a bfloat16 number (weights converted from a bfloat16 file), so
    lookups are exact. load_pair hands over the file's own tensor (`file_weight` on the embedding):
    memory-mapped, only the rows looked up are resident (0.7 GB less for the default pair than a
    copy). The weight is a buffer, so `model.dtype` stays float32.
    """

    def __init__(self, embedding: nn.Embedding, compact: torch.Tensor) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = compact.shape
        self.padding_idx = embedding.padding_idx
        self.out_dtype = embedding.weight.dtype
        self.register_buffer("weight", compact, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight, self.padding_idx).to(self.out_dtype)


def _exact_in_bf16(weight: torch.Tensor, rows: int = 8192) -> torch.Tensor | None:
    """weight as bfloat16 if that loses nothing (checked in blocks: no second full float32 copy), else None."""
    compact = torch.empty(weight.shape, dtype=torch.bfloat16)
    for i in range(0, weight.shape[0], rows):
        block = weight[i:i + rows]
        compact[i:i + rows] = block
        if not torch.equal(compact[i:i + rows].float(), block):
            return None
    return compact


def pack_linears(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Replaces every nn.Linear of a CPU model in place; returns how many were packed.

    What packing replaced is released: untied weights are dropped, and the pages of weights
    memory-mapped from their file are given back (otherwise the file stays resident beside the
    packed copies: 4.4 -> 8.3 GB for the default pair in bfloat16). The input embedding is only
    looked up: its pages are read back from the file as rows are needed (bfloat16), or it is held
    in bfloat16 when that is exact (float32, see CompactEmbedding).

    Peak memory is the result plus about one layer: mapped pages are given back before packing
    starts (each weight's pages come back from the page cache while it is packed, then go again),
    the largest weights go first, no reference to a replaced layer is kept, and the C heap is
    trimmed after every layer (see trim_heap). With `dtype`, weights still in another dtype (left
    mapped by load_pair for this) are cast as each is packed.
    """
    mapped = memory.MappedFiles()
    linears = [(name, m.weight.numel()) for name, m in model.named_modules() if type(m) is nn.Linear]
    names = [name for name, _ in sorted(linears, key=lambda nm: -nm[1])]
    memory.release_pages([model.get_submodule(name).weight for name in names], mapped)
    _compact_embedding(model, {id(model.get_submodule(name).weight) for name in names})
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        setattr(parent, child, PackedLinear(linear, dtype))
        memory.release_pages([linear.weight], mapped)
        del linear
        memory.trim_heap()  # the cast copy just freed sits between packed weights: glibc keeps it resident
    return len(names)


def _compact_embedding(model: nn.Module, to_be_packed: set[int]) -> None:
    """Before packing: a float32 input embedding nothing else will multiply by becomes exact bfloat16."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if get is not None else None
    if type(embedding) is not nn.Embedding:
        return
    source = embedding.__dict__.pop("file_weight", None)  # the bfloat16 file's tensor the weight was cast from
    if embedding.weight.dtype != torch.float32:
        return  # bfloat16 is compact already, and its file pages come back on demand
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if getattr(head, "weight", None) is embedding.weight and id(embedding.weight) not in to_be_packed:
        return  # a tied head that stays unpacked still multiplies by this weight in float32
    if source is not None and source.dtype == torch.bfloat16 and source.shape == embedding.weight.shape:
        compact = source  # exact: the float32 weight holds its values
    else:
        with torch.no_grad():
            compact = _exact_in_bf16(embedding.weight.detach())
    if compact is None:
        return  # real float32 values: keep them exact
    model.set_input_embeddings(CompactEmbedding(embedding, compact))
    del embedding
    collect_garbage()  # the replaced module can sit in a reference cycle: free its float32 weight before packing
    log.info("input embedding kept in bfloat16 (exact): %.0f MB saved", compact.numel() * 2 / 2**20)


def try_pack(model: nn.Module, dtype: torch.dtype | None = None) -> str | None:
    """Packs a CPU float32/bfloat16 model when oneDNN can; returns the fast path's name or None.

    dtype: the model's compute dtype when some linear weights are still in another one.
    """
    param = next(model.parameters())
    dtype, device = dtype or param.dtype, param.device
    del param  # it is the embedding's weight: held here, packing could not release it
    if device.type != "cpu" or not onednn_packs(dtype):
        return None
    count = pack_linears(model, dtype)
    log.info("packed %d linear layers for oneDNN", count)
    return "cpu-onednn"
