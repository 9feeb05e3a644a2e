"""The converted-model cache: its marker, cheap and full checks, and the inter-process lock.

A converted folder is trusted only as far as it can be checked. Its marker (specdec.json, written
last) records the size, a sampled hash and the SHA-256 of every file, and what config.json said.
Every load checks the cheap part (sizes, sampled blocks, safetensors headers, config.json against
the weights, tokenizer files present); `specdec-studio cache verify` hashes everything.
Leftovers, `cache info` and `cache clean` are in cache_space.py.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from engine.errors import ModelLoadError

log = logging.getLogger(__name__)

MARKER = "specdec.json"  # written last into a converted folder: its presence means "complete"
CACHE_FORMAT = 1  # bump to invalidate every converted folder after a change in conversion
COSTS_FILE = "costs.json"  # in the cache root: forward costs kept between starts (engine/decoding/kept_costs.py)
LOCK_NAME = ".lock"  # one lock for every process that assembles or converts into this cache
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # what a converted folder cannot load without
SAMPLE_BLOCK = 1 << 20  # bytes hashed at each sampled offset
SAMPLE_STRIDE = 32 << 20  # sampled offsets: any damaged run of 2 strides covers a whole sampled block
_CHUNK = 8 << 20  # streaming block size for full hashes
_MAX_HEADER = 100 << 20  # no honest safetensors header is larger
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}

Emit = Callable[[str, float, str], None]  # (stage, fraction, message), as engine.models.store reports


def cache_dir() -> Path:
    """Where converted models live: $SPECDEC_CACHE_DIR, else the platform's user cache folder."""
    env = os.environ.get("SPECDEC_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("specdec-studio"))


def temp_dir_prefix(entry: Path) -> str:
    """The prefix of a conversion's temp folder beside `entry`: hidden, and naming its process."""
    return f".{entry.name}.pid{os.getpid()}."


# --------------------------------------------------------------------------- marker

def read_marker(entry: Path) -> dict | None:
    """The marker of a complete converted folder, or None (absent, damaged or of another format)."""
    try:
        meta = json.loads((entry / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == CACHE_FORMAT else None


def write_marker(folder: Path, meta: dict) -> None:
    """Replaces the marker in one step, so a reader never sees half of it."""
    tmp = folder / f".{MARKER}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(meta, indent=2, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, folder / MARKER)


def sampled_hash(path: Path, size: int | None = None) -> str:
    """SHA-256 over SAMPLE_BLOCK bytes every SAMPLE_STRIDE bytes and the last block: ~3% of a big file."""
    size = path.stat().st_size if size is None else size
    h = hashlib.sha256()
    offsets = list(range(0, size, SAMPLE_STRIDE)) + [max(0, size - SAMPLE_BLOCK)]
    with open(path, "rb") as f:
        for offset in offsets:
            f.seek(offset)
            h.update(f.read(SAMPLE_BLOCK))
    return h.hexdigest()


def full_hash(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
            if on_bytes is not None:
                on_bytes(len(block))
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name != MARKER and not p.name.startswith("."))


def record_files(folder: Path, *, hashes: bool = True) -> dict[str, dict]:
    """name -> size, sampled hash and (with `hashes`) SHA-256, for every file of a converted folder."""
    files = {}
    for p in _files(folder):
        size = p.stat().st_size
        files[p.name] = {"size": size, "sample": sampled_hash(p, size)}
        if hashes:
            files[p.name]["sha256"] = full_hash(p)
    return files


def config_facts(config: dict) -> dict[str, int]:
    """The numbers of config.json that weights must agree with."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return {k: text[k] for k in ("num_hidden_layers", "hidden_size", "vocab_size")
            if isinstance(text.get(k), int) and not isinstance(text.get(k), bool)}


def complete_marker(folder: Path, meta: dict) -> dict:
    """`meta` plus what a later load checks: every file, and config.json's facts."""
    config = _read_config(folder)
    return {**meta, "format": CACHE_FORMAT, "files": record_files(folder), "config": config_facts(config or {})}


# --------------------------------------------------------------------------- checks

def _read_config(folder: Path) -> dict | None:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return config if isinstance(config, dict) else None


def safetensors_header(path: Path) -> dict:
    """The header of a safetensors file, checked against the file's size; ValueError if it does not hold."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if not 2 <= n <= min(_MAX_HEADER, size - 8):
            raise ValueError(f"header length {n} does not fit the file")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise ValueError("header is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a table of tensors")
    data = size - 8 - n
    end = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = (int(x) for x in t["data_offsets"])
            count = 1
            for d in t["shape"]:
                count *= int(d)
            width = _DTYPE_BYTES[t["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor {name[:60]} is described wrongly") from None
        if not 0 <= start <= stop <= data or stop - start != count * width:
            raise ValueError(f"tensor {name[:60]} lies outside the file")
        end = max(end, stop)
    if end != data:
        raise ValueError("the file's size does not match its tensors")
    return header


def _weights_facts(headers: list[dict]) -> dict[str, int]:
    """Layer count and hidden size as the weights say them (Qwen2/Llama names, as conversion writes them)."""
    layers = set()
    hidden = None
    for header in headers:
        for name, t in header.items():
            m = re.match(r"model\.layers\.(\d+)\.", name)
            if m:
                layers.add(int(m.group(1)))
            if name == "model.embed_tokens.weight" and isinstance(t, dict) and len(t.get("shape", ())) == 2:
                hidden = int(t["shape"][1])
    facts = {"num_hidden_layers": len(layers)} if layers else {}
    if hidden is not None:
        facts["hidden_size"] = hidden
    return facts


def damage(entry: Path, meta: dict) -> str | None:
    """What is wrong with a converted folder, found cheaply (no full hash), or None if nothing is.

    The most telling finding comes first: a missing file, a weights header, config.json against the
    weights, then sizes and the sampled checksums.
    """
    recorded = meta.get("files") if isinstance(meta.get("files"), dict) else {}
    plain = all(isinstance(facts, dict) and Path(name).name == name and name not in ("", ".", "..")
                for name, facts in recorded.items())
    if not plain:
        return "its marker is damaged"  # names are plain file names inside the folder, nothing else
    for name in list(recorded) + [n for n in TOKENIZER_FILES if n not in recorded]:
        if not (entry / name).is_file():
            return f"{name} is missing"
    weights = sorted(entry.glob("*.safetensors"))
    if not weights:
        return "it has no weights (*.safetensors)"
    headers = []
    for path in weights:
        try:
            headers.append(safetensors_header(path))
        except (OSError, ValueError) as e:
            return f"{path.name}: {e}"
    config = _read_config(entry)
    if config is None:
        return "config.json is missing or not JSON"
    facts = config_facts(config)
    expected = {**_weights_facts(headers), **(meta.get("config") or {})}
    for key, value in expected.items():
        if facts.get(key) != value:
            return f"config.json says {key} = {facts.get(key)}, the converted weights {value}"
    for name, facts in recorded.items():
        size = (entry / name).stat().st_size
        if size != facts.get("size"):
            return f"{name} has {size:,} bytes instead of {facts.get('size')}"
    for name, facts in recorded.items():
        try:
            if facts.get("sample") and sampled_hash(entry / name) != facts["sample"]:
                return f"{name} does not match its recorded checksum"
        except OSError as e:
            return f"{name} cannot be read ({e.strerror or e})"
    return None


def upgrade_marker(entry: Path, meta: dict) -> dict:
    """A marker from before files were recorded: record them now (sizes and samples; hashes on verify)."""
    config = _read_config(entry) or {}
    meta = {**meta, "files": record_files(entry, hashes=False), "config": config_facts(config)}
    try:
        write_marker(entry, meta)
    except OSError as e:  # a read-only cache still loads; it is just checked less next time
        log.info("could not record checksums in %s: %s", entry, e)
    return meta


def verify_fully(entry: Path, meta: dict, on_bytes: Callable[[int], None] | None = None) -> tuple[str | None, dict]:
    """Hashes every file of a converted folder. Returns (damage or None, the marker with any hash it lacked)."""
    problem = damage(entry, meta)
    if problem is not None:
        return problem, meta
    files = {name: dict(facts) for name, facts in (meta.get("files") or {}).items()}
    for name, facts in files.items():
        digest = full_hash(entry / name, on_bytes)
        if facts.get("sha256") is None:
            facts["sha256"] = digest  # recorded from now on (a marker from before full hashes)
        elif digest != facts["sha256"]:
            return f"{name} does not match its recorded SHA-256", meta
    return None, {**meta, "files": files}


# --------------------------------------------------------------------------- the lock

_held = threading.local()  # how deep this thread holds the cache lock (it is re-entrant per thread)


@contextlib.contextmanager
def cache_lock(emit: Emit | None = None, *, wait: bool = True) -> Iterator[bool]:
    """Holds the cache's lock file: one process at a time assembles or converts into the cache.

    A second process waits (saying so through `emit`) and then finds the finished result. With
    wait=False it yields False instead of waiting. Re-entrant within one thread.
    """
    depth = getattr(_held, "depth", 0)
    if depth:
        _held.depth = depth + 1
        try:
            yield True
        finally:
            _held.depth -= 1
        return
    root = cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
        f = open(root / LOCK_NAME, "a+b")
    except OSError as e:
        raise ModelLoadError(f"The model cache {root} cannot be used ({e.strerror or e}); set SPECDEC_CACHE_DIR "
                             f"to a writable folder.") from None
    try:
        if not _try_lock(f):
            if not wait:
                yield False
                return
            message = f"Another SpecDec Studio process is preparing models in {root}; waiting for it to finish"
            log.info(message)
            if emit is not None:
                emit("wait", 0.0, message)
            _lock(f)
        _held.depth = 1
        try:
            yield True
        finally:
            _held.depth = 0
            _unlock(f)
    finally:
        f.close()


if sys.platform == "win32":  # pragma: no cover - exercised on Windows only
    import msvcrt

    def _try_lock(f) -> bool:
        try:
            f.seek(0)
            msvcrt.locking(f.fileno(), msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False

    def _lock(f) -> None:
        while not _try_lock(f):
            time.sleep(0.5)

    def _unlock(f) -> None:
        f.seek(0)
        msvcrt.locking(f.fileno(), msvcrt.LK_UNLCK, 1)
else:
    import fcntl

    def _try_lock(f) -> bool:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def _lock(f) -> None:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)

    def _unlock(f) -> None:
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
