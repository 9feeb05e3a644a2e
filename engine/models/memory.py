"""Host memory of a model pair: pages of memory-mapped weights given back, and what a pair will take.

Weights load memory-mapped from safetensors files (no copy when the dtype matches). Once such a
tensor has been copied (packed for oneDNN, or cast to float32), its pages still count as resident
until the whole file is unmapped, which never happens while one small tensor of it (a norm, a bias)
lives. `release_pages` gives the pages of one tensor back to the kernel; they are read again from
the file if that tensor is ever touched, so it is safe for weights nobody writes to.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import torch
from engine.models.cache import safetensors_header
from engine.models import store

log = logging.getLogger(__name__)

_MADV_DONTNEED = 4  # Linux
_PAGE = mmap.PAGESIZE
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


class MappedFiles:
    """The address ranges of safetensors files mapped into this process (read once from /proc)."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []
        if _LIBC is None:
            return
        try:
            with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[5].rstrip().endswith(".safetensors"):
                        start, end = (int(x, 16) for x in parts[0].split("-"))
                        self.ranges.append((start, end))
        except OSError:
            self.ranges = []

    def contains(self, t: torch.Tensor) -> bool:
        begin, size = t.data_ptr(), t.untyped_storage().nbytes()
        return size > 0 and any(a <= begin and begin + size <= b for a, b in self.ranges)


def release_pages(tensors: Iterable[torch.Tensor], mapped: MappedFiles | None = None) -> int:
    """Gives back the resident pages of file-mapped tensors that have been copied; returns bytes released.

    Only ranges inside a mapped safetensors file are touched: anonymous memory would be zeroed.
    The pages come back from the file, unchanged, if the tensor is read again (a tied embedding).
    """
    mapped = mapped or MappedFiles()
    if not mapped.ranges:
        return 0
    released = 0
    for t in tensors:
        if t.device.type != "cpu" or not mapped.contains(t):
            continue
        begin = t.data_ptr()
        end = begin + t.untyped_storage().nbytes()
        first = -(-begin // _PAGE) * _PAGE  # whole pages only: a neighbour may share the edge pages
        last = end // _PAGE * _PAGE
        if last > first and _LIBC.madvise(first, last - first, _MADV_DONTNEED) == 0:
            released += last - first
    return released


def trim_heap() -> None:
    """Hands memory the C heap kept after large frees back to the system (glibc; elsewhere nothing).

    Packing frees hundreds of weights of a few MB each; glibc keeps such chunks for reuse. Trimmed
    once after each model, they measured 1.4 GB at the end of the default draft's float32 packing
    (the pair's load peak, 12.0 GB); trimmed after every layer, 0.03 GB, for 0.1 s per pair.
    """
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


def cast_releasing_pages(model: torch.nn.Module, dtype: torch.dtype, *, keep_linear_weights: bool = False) -> None:
    """model.to(dtype) one tensor at a time, giving back each file-mapped source as it is copied.

    Casting all at once keeps every page of the mapped files resident beside the new copies until
    the end (bfloat16 files to float32: 4.8 GB of pages plus 9.6 GB of copies for the default pair).
    keep_linear_weights: leave nn.Linear weights as they are (still mapped), for a caller that
    packs them next and casts each on its way (see engine.runners.cpu.pack_linears).
    """
    mapped = MappedFiles()
    done: dict[int, torch.Tensor] = {}  # id(old) -> new: tied weights stay one tensor
    with torch.no_grad():
        for module in model.modules():
            skip_weight = keep_linear_weights and type(module) is torch.nn.Linear
            for name, t in list(module._parameters.items()) + list(module._buffers.items()):
                if t is None or not t.is_floating_point() or t.dtype == dtype or (skip_weight and name == "weight"):
                    continue
                if id(t) not in done:
                    new = t.detach().to(dtype)
                    done[id(t)] = torch.nn.Parameter(new, requires_grad=False) if name in module._parameters else new
                    release_pages([t], mapped)
                if name in module._parameters:
                    module._parameters[name] = done[id(t)]
                else:
                    module._buffers[name] = done[id(t)]
    if hasattr(model, "config"):
        model.config.dtype = dtype


# --------------------------------------------------------------------------- estimates

def stored_dtypes(folder: Path) -> set[str]:
    """The safetensors dtypes of a model folder's weights ({"BF16"}, …); empty if it cannot tell."""
    kinds: set[str] = set()
    for path in sorted(folder.glob("*.safetensors")):
        try:
            header = safetensors_header(path)
        except (OSError, ValueError):
            return set()
        kinds |= {t["dtype"] for name, t in header.items() if name != "__metadata__"}
    return kinds


def folder_bytes(folder: Path, dtype: torch.dtype) -> int | None:
    """Bytes a folder's weights take in `dtype` (from the safetensors headers: no weights read)."""
    width = torch.empty((), dtype=dtype).element_size()
    total = 0
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    for path in files:
        try:
            header = safetensors_header(path)
        except (OSError, ValueError):
            return None
        for name, t in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for d in t["shape"]:
                count *= int(d)
            total += count * (width if t["dtype"] in ("F32", "F16", "BF16", "F64") else _DTYPE_BYTES.get(t["dtype"], 1))
    return total


def available_bytes() -> int | None:
    """Memory the system can give this process now without swapping (None if it cannot tell)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # psutil missing or an unusual platform: no estimate, no decision
        return None


def total_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:
        return None


def headroom_bytes() -> int:
    """Memory left to the rest of the system when deciding whether a second pair fits beside the first.

    A quarter of the machine: loading has transient peaks, other programs grow, and running out is
    the OOM killer, not an error message. Measured: float32 reload on a 24 GiB machine with 15 GB
    free and a 10% margin kept both pairs and peaked at 19.6 GB; with this margin it releases first.
    """
    total = total_bytes() or 0
    return max(2 << 30, total // 4)


def process_rss() -> int | None:
    try:
        import psutil

        return int(psutil.Process(os.getpid()).memory_info().rss)
    except Exception:
        return None


def model_bytes(*models: object) -> int:
    """Bytes held by loaded models' tensors, packed oneDNN weights included (0 for non-modules)."""
    total, seen = 0, set()
    for model in models:
        if not isinstance(model, torch.nn.Module):
            continue
        for module in model.modules():
            tensors = list(module._parameters.values()) + list(module._buffers.values())
            packed = getattr(module, "packed", None)  # a oneDNN-packed weight (engine.runners.cpu)
            if isinstance(packed, torch.Tensor):
                tensors.append(packed)
            for t in tensors:
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
    return total


def pair_bytes(target: str | None, draft: str | None, *, with_draft: bool, device: str, dtype: str) -> int | None:
    """What a pair will hold in host memory once loaded, from file headers only; None if unknown or on a GPU."""
    torch_device = store.pick_device(device)
    if torch_device.type != "cpu":
        return None  # weights live on the device; host memory is only borrowed while loading
    torch_dtype = store.pick_dtype(torch_device, dtype)
    total = 0
    specs = [(target, "target")] + ([(draft, "draft")] if with_draft else [])
    for spec, role in specs:
        folder = store.converted_folder(spec, role)
        size = folder_bytes(folder, torch_dtype) if folder is not None else None
        if size is None:
            return None
        total += size
    return total
