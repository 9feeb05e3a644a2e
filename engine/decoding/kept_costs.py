"""Forward costs kept between starts in the cache folder (costs.json), per machine, model pair, runtime,
precision and thread count, so a second start is Ready without measuring first.

An entry is found by the SHA-256 of its key and holds the key itself, checked again on reading: a
key is the machine (CPU model and logical cores; each GPU's name, memory and driver), the content of
both models (size and sampled hash of each weights file: engine/models/cache.sampled_hash), the
runtime and its version, precision, fast path, threads, context and draft head. Anything else (a
changed model, another runtime or thread count) misses and measures again.

Reading is JSON only, size-limited and validated field by field; a file that is damaged or not ours
is ignored with one log line (the figures are measured again and the file is rewritten). Writes are
atomic (a temp file in the same folder, then os.replace). `specdec-studio cache clean` removes it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.limits import K_MAX
from engine.models.cache import COSTS_FILE, cache_dir, sampled_hash
from engine.types import ProposerCost

if TYPE_CHECKING:  # annotations only
    from engine.decoding.engine import Engine

log = logging.getLogger(__name__)

COSTS_FORMAT = 1  # bump when what a pass measures changes: every kept figure is then measured again
MAX_BYTES = 1 << 20  # no honest costs file is larger; a bigger one is not read
MAX_ENTRIES = 32  # machines x pairs x runtimes kept; the oldest go first
SOURCES = ("draft", "ngram", "head")  # proposers whose costs are kept


@dataclass(frozen=True)
class KeptCosts:
    """One entry's figures, as costs.measure_pass measures them (all in ms)."""

    target_ms: tuple[tuple[int, float], ...]  # verify width -> ms, every width 1..K_MAX+1
    proposer_costs: tuple[ProposerCost, ...]  # greedy drafting, per proposer
    sampled_costs: tuple[ProposerCost, ...]  # sampled drafting, per proposer
    sampled_target_ms: tuple[tuple[int, float], ...] = ()  # sampled verify widths (GPU only)
    saved_at: float = 0.0  # when they were measured (seconds since the epoch)
    # False: they never held together (a machine always busy); used so Ready comes at once, but with no
    # verdict, and measured again until a consistent measurement replaces them (cost_check.py)
    steady: bool = True


# --------------------------------------------------------------------------- the key

def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "?"


def _gpu_driver() -> str:
    with contextlib.suppress(OSError, IndexError):
        return Path("/proc/driver/nvidia/version").read_text(errors="replace").splitlines()[0].strip()[:200]
    try:
        import torch

        return str(torch._C._cuda_getDriverVersion())
    except Exception:
        return "?"


def machine(device: str = "cpu") -> dict:
    """What the figures were measured on: the CPU and, on a GPU, every GPU's name, memory and driver."""
    found: dict = {"cpu": _cpu_model(), "cores": os.cpu_count() or 0, "system": platform.system()}
    if device.startswith("cuda"):
        import torch

        found["gpus"] = [f"{torch.cuda.get_device_name(i)} {torch.cuda.get_device_properties(i).total_memory}"
                         for i in range(torch.cuda.device_count())]
        found["driver"] = _gpu_driver()
    return found


def file_identity(path: Path) -> str:
    """A weights file's content, cheaply: its size and sampled hash (~3% of it is read)."""
    size = path.stat().st_size
    return f"{size}:{sampled_hash(path, size)[:32]}"


def folder_identity(folder: Path) -> str:
    """A model folder's content: config.json and each weights file's identity."""
    digest = hashlib.sha256()
    files = sorted(p for p in folder.iterdir() if p.is_file() and (
        p.name == "config.json" or p.suffix in (".safetensors", ".bin", ".gguf")))
    for p in files:
        digest.update(f"{p.name}={file_identity(p)};".encode())
    return digest.hexdigest()[:32]


def _model_identity(runner, model) -> str:
    path = getattr(runner, "path", None)  # llama.cpp: the GGUF file
    if isinstance(path, Path) and path.is_file():
        return file_identity(path)
    folder = getattr(model, "name_or_path", "") if model is not None else ""
    if folder and Path(folder).is_dir():
        return folder_identity(Path(folder))
    return f"unnamed:{getattr(runner, 'label', type(runner).__name__)}"  # a model built in memory: its name only


def _versions(runtime: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in (("llama_cpp_python",) if runtime == "llamacpp" else ("torch", "transformers")):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "?"
    return found


def cost_key(engine: Engine) -> dict:
    """Everything the figures depend on, for the loaded engine (reads ~3% of each weights file)."""
    info = engine.info
    threads = info.threads
    if not threads and info.runtime == "torch":
        import torch

        threads = torch.get_num_threads()
    return {
        "format": COSTS_FORMAT, "k_max": K_MAX, "machine": machine(info.device),
        "device": info.device, "devices": list(info.devices), "runtime": info.runtime,
        "versions": _versions(info.runtime), "fast_path": info.fast_path, "dtype": info.dtype,
        "precisions": [info.target_precision, info.draft_precision], "threads": threads,
        "context": engine.target_runner.max_length, "head": info.head_name or "",
        "target": _model_identity(engine.target_runner, engine.target),
        "draft": _model_identity(engine.draft_runner, engine.draft) if engine.draft_runner is not None else "",
    }


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, ensure_ascii=True).encode()).hexdigest()[:32]


# --------------------------------------------------------------------------- the file

def costs_path() -> Path:
    return cache_dir() / COSTS_FILE


def _ms(value: object) -> float:
    """A figure in ms: a finite non-negative number below an hour, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0.0 <= value < 3.6e6:
        raise ValueError(f"{value!r} is not a time in ms")
    return float(value)


def _widths(raw: object, every: bool) -> tuple[tuple[int, float], ...]:
    if not isinstance(raw, dict) or len(raw) > K_MAX + 1:
        raise ValueError("widths are not a table")
    widths = {}
    for w, ms in raw.items():
        if not (isinstance(w, str) and w.isdigit() and 1 <= int(w) <= K_MAX + 1):
            raise ValueError(f"width {w!r}")
        widths[int(w)] = _ms(ms)
    if every and (set(widths) != set(range(1, K_MAX + 2)) or widths[1] <= 0):
        raise ValueError("a verify width is missing")
    return tuple(sorted(widths.items()))


def _proposers(raw: object) -> tuple[ProposerCost, ...]:
    if not isinstance(raw, dict) or not set(raw) <= set(SOURCES):
        raise ValueError("proposers are not a table of known proposers")
    costs = []
    for source, pair in raw.items():
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"{source}: not [per token, per proposal]")
        costs.append(ProposerCost(source, _ms(pair[0]), _ms(pair[1])))
    return tuple(costs)


def _parse_entry(entry: object, key: dict) -> KeptCosts:
    if not isinstance(entry, dict) or entry.get("key") != key:
        raise ValueError("its key does not match")
    costs = entry.get("costs")
    if not isinstance(costs, dict):
        raise ValueError("no figures")
    return KeptCosts(_widths(costs.get("target_ms"), True), _proposers(costs.get("proposers")),
                     _proposers(costs.get("sampled", {})), _widths(costs.get("sampled_target_ms", {}), False),
                     _saved_at(entry), entry.get("steady", True) is not False)


def _saved_at(entry: dict) -> float:
    value = entry.get("saved_at", 0.0)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    return float(value) if ok else 0.0


def _read_entries(path: Path) -> dict:
    """The file's entries; {} (with one log line) when it is absent, damaged or not ours."""
    try:
        if path.is_symlink() or not path.is_file():
            if path.exists() or path.is_symlink():
                log.warning("ignoring kept forward costs %s: not a plain file", path)
            return {}
        if path.stat().st_size > MAX_BYTES:
            raise ValueError(f"larger than {MAX_BYTES} bytes")
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != COSTS_FORMAT or not isinstance(data.get("entries"), dict):
            raise ValueError("not a SpecDec Studio costs file of this version")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError, UnicodeDecodeError) as exc:
        log.warning("ignoring kept forward costs %s (%s): they are measured again", path, exc)
        return {}
    return data["entries"]


def read_kept(key: dict, path: Path | None = None) -> KeptCosts | None:
    """The figures kept for `key`, or None (absent, damaged, or kept for something else)."""
    path = path or costs_path()
    entry = _read_entries(path).get(key_digest(key))
    if entry is None:
        return None
    try:
        return _parse_entry(entry, key)
    except (ValueError, TypeError) as exc:
        log.warning("ignoring the kept forward costs of this pair in %s (%s): they are measured again", path, exc)
        return None


def _table(costs: tuple[ProposerCost, ...]) -> dict:
    return {c.source: [c.per_token_ms, c.per_proposal_ms] for c in costs if c.source in SOURCES}


def keep(key: dict, costs: KeptCosts, path: Path | None = None) -> bool:
    """Writes the figures for `key` (replacing its old ones; the oldest entries beyond MAX_ENTRIES go).
    False, with one log line, when the cache folder cannot be written."""
    path = path or costs_path()
    entries = {d: e for d, e in _read_entries(path).items() if isinstance(e, dict)}
    entries[key_digest(key)] = {
        "key": key, "saved_at": costs.saved_at or time.time(), "steady": costs.steady,
        "costs": {"target_ms": {str(w): ms for w, ms in costs.target_ms}, "proposers": _table(costs.proposer_costs),
                  "sampled": _table(costs.sampled_costs),
                  "sampled_target_ms": {str(w): ms for w, ms in costs.sampled_target_ms}},
    }
    newest = sorted(entries, key=lambda d: _saved_at(entries[d]))[-MAX_ENTRIES:]
    return _write(path, {"format": COSTS_FORMAT, "entries": {d: entries[d] for d in newest}})


def forget(key: dict, path: Path | None = None) -> None:
    """Removes the figures kept for `key` (the next start measures them again)."""
    path = path or costs_path()
    entries = _read_entries(path)
    if entries.pop(key_digest(key), None) is not None:
        _write(path, {"format": COSTS_FORMAT, "entries": entries})


def _write(path: Path, data: dict) -> bool:
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(part, path)
        return True
    except OSError as exc:  # figures not kept are measured again next time
        log.warning("could not keep the forward costs in %s: %s", path, exc)
        with contextlib.suppress(OSError):
            part.unlink()
        return False
