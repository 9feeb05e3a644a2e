"""A fast reader for GGUF metadata (key/values and tensor shapes), enough to compare tokenizers.

gguf.GGUFReader builds a numpy view per string, which takes tens of seconds for a 150k-token
vocabulary plus its merges; this reads the same header in well under a second and never touches
the tensor data.
"""
from __future__ import annotations

import contextlib
import functools
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from engine.errors import ModelLoadError

_MAGIC = b"GGUF"
# GGUF value type id -> struct format of one scalar (8 = string, 9 = array are handled apart).
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_LIMIT = 1 << 30  # no honest header string or array is this large
_MAX_DEPTH = 4  # arrays of arrays: real files nest one level; a crafted one could nest until Python's stack ends


@dataclass(frozen=True)
class GgufHeader:
    """What the start of a GGUF file says, without its tensor data."""

    version: int  # GGUF format version
    fields: dict[str, Any]  # metadata key -> value (arrays as lists, strings decoded)
    tensor_shapes: dict[str, tuple[int, ...]]  # tensor name -> dims in GGUF order (fastest first)


class _Buffer:
    """Reads little-endian GGUF values from a file in large blocks."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.data = b""
        self.pos = 0

    def offset(self) -> int:
        """Position in the file of the next byte to be read."""
        return self.f.tell() - (len(self.data) - self.pos)

    def take(self, n: int) -> bytes:
        if n > _LIMIT:
            raise ValueError(f"a header entry claims {n} bytes")  # garbage length: damaged file
        if self.pos + n > len(self.data):
            rest = self.data[self.pos:]
            more = self.f.read(max(n - len(rest), 4 << 20))
            self.data, self.pos = rest + more, 0
            if len(self.data) < n:
                raise ValueError("file ends inside the GGUF header")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str) -> Any:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("Q")
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, vtype: int, depth: int = 0) -> Any:
        if depth > _MAX_DEPTH:
            raise ValueError(f"its metadata nests arrays more than {_MAX_DEPTH} deep")
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            sub, count = self.scalar("I"), self.scalar("Q")
            if count > _LIMIT:
                raise ValueError(f"a header array claims {count} entries")
            if sub == _STRING:
                return [self.string() for _ in range(count)]
            if sub in _SCALAR:
                fmt = _SCALAR[sub]
                return list(struct.unpack(f"<{count}{fmt}", self.take(count * struct.calcsize(fmt))))
            return [self.value(sub, depth + 1) for _ in range(count)]
        if vtype in _SCALAR:
            return self.scalar(_SCALAR[vtype])
        raise ValueError(f"unknown GGUF value type {vtype}")


def read_gguf_header(path: Path) -> GgufHeader:
    """Parses the metadata and tensor table; a damaged or foreign file is a ModelLoadError."""
    try:
        with open(path, "rb") as f:
            return read_gguf_stream(f, path.stat().st_size, str(path))
    except OSError as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {e}.") from None


def read_gguf_stream(f: BinaryIO, size: int, label: str) -> GgufHeader:
    """read_gguf_header for a stream of `size` bytes (the packaged parts read as one file, say) called `label`."""
    try:
        buf = _Buffer(f)
        if buf.take(4) != _MAGIC:
            raise ValueError("it does not start with the GGUF magic bytes")
        version = buf.scalar("I")
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old")
        n_tensors, n_fields = buf.scalar("Q"), buf.scalar("Q")
        fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = buf.string()
            fields[key] = buf.value(buf.scalar("I"))
        shapes: dict[str, tuple[int, ...]] = {}
        placed: list[tuple[str, tuple[int, ...], int, int]] = []  # name, dims, ggml type, data offset
        for _ in range(n_tensors):
            name = buf.string()
            n_dims = buf.scalar("I")
            if n_dims > 8:
                raise ValueError(f"tensor {name[:60]!r} claims {n_dims} dimensions")
            shapes[name] = tuple(buf.scalar("Q") for _ in range(n_dims))
            placed.append((name, shapes[name], buf.scalar("I"), buf.scalar("Q")))
        _check_tensor_data(size, fields, placed, buf.offset())
    except (OSError, ValueError, OverflowError, struct.error, MemoryError, RecursionError) as e:
        raise ModelLoadError(f"{label} is not a readable GGUF file: {e}.") from None
    return GgufHeader(version=version, fields=fields, tensor_shapes=shapes)


def _check_tensor_data(size: int, fields: dict[str, Any], placed: list, header_end: int) -> None:
    """Every tensor's bytes lie inside the file: a damaged table must not send a reader past its end."""
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError:  # without the gguf package nothing here can read tensor data either
        return
    alignment = fields.get("general.alignment", 32)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1 or alignment > 1 << 20:
        raise ValueError(f"its alignment {alignment!r} is not a usable number")
    start = -(-header_end // alignment) * alignment
    for name, dims, kind, offset in placed:
        try:
            block, width = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name[:60]!r} has unknown type {kind}") from None
        count = 1
        for d in dims:
            count *= d
        if count % block:
            raise ValueError(f"tensor {name[:60]!r} does not fill whole blocks")
        if start + offset + count // block * width > size:
            raise ValueError(f"tensor {name[:60]!r} lies beyond the end of the file")


@contextlib.contextmanager
def quiet_gguf_bars() -> Iterator[None]:
    """transformers' GGUF reader draws its own tqdm bar, ignoring disable_progress_bar(); make it listen.

    The CLI turns progress bars off so stderr holds its one-line messages; this bar printed anyway.
    """
    try:
        from transformers import modeling_gguf_pytorch_utils as reader
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    original = getattr(reader, "tqdm", None)
    if original is None or hf_logging.is_progress_bar_enabled():
        yield
        return
    reader.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        reader.tqdm = original
