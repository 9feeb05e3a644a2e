"""Space in the model cache: leftovers of dead processes swept, what `cache info` lists, `cache clean` and `cache verify`."""
from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError
from engine.models.cache import cache_dir, cache_lock, read_marker, upgrade_marker, verify_fully, write_marker

log = logging.getLogger(__name__)

STALE_AFTER_S = 24 * 3600  # a temp file nobody has written for a day is a leftover, whatever its pid says
_PARTIAL = re.compile(r".+\.(\d+)\.partial")  # an assembled GGUF being written: <name>.<pid>.partial
_TEMP_DIR = re.compile(r"\..+?(?:\.pid(\d+)\..*|-[A-Za-z0-9_]{8})")  # .<entry>.pid<pid>.<random> (older: no pid)


@dataclass(frozen=True)
class CacheItem:
    """One thing in the cache folder, as `cache info` lists it."""

    path: Path  # the file or folder
    kind: str  # "model" (converted), "gguf" (assembled, rebuildable), "leftover" (temp of a dead process), "busy"
    name: str  # what it is, for people
    size: int  # bytes on disk


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        import psutil

        return psutil.pid_exists(pid)
    except ImportError:
        pass
    if sys.platform == "win32":  # os.kill would terminate it there: assume the worst
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists but belongs to someone else
        return True
    return True


def _temp_owner(path: Path) -> tuple[bool, int | None]:
    """(is this a temp file of ours, the pid that writes it if its name says)."""
    m = _PARTIAL.fullmatch(path.name)
    if m and path.parent.name == "gguf":
        return True, int(m.group(1))
    m = _TEMP_DIR.fullmatch(path.name)
    if m and path.is_dir() and path.parent.name == "models":
        return True, int(m.group(1)) if m.group(1) else None
    return False, None


def _is_stale(path: Path, pid: int | None) -> bool:
    try:
        idle = time.time() - path.stat().st_mtime
    except OSError:
        return False
    if idle > STALE_AFTER_S:
        return True
    return pid is not None and not _alive(pid)


def cache_items(root: Path | None = None) -> list[CacheItem]:
    """Everything in the cache folder: converted models, assembled GGUFs, temp files live and dead."""
    root = root or cache_dir()
    items: list[CacheItem] = []
    for sub in ("models", "gguf"):
        folder = root / sub
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            temp, pid = _temp_owner(path)
            if temp:
                kind = "leftover" if _is_stale(path, pid) else "busy"
                name = f"temp file of process {pid}" if pid is not None else "temp file"
            elif sub == "models" and path.is_dir():
                meta = read_marker(path)
                kind, name = ("model", str(meta.get("name", path.name))) if meta else ("leftover", "incomplete model")
            elif sub == "gguf" and path.suffix == ".gguf":
                kind, name = "gguf", "assembled GGUF (rebuilt from the installed parts when needed)"
            else:
                continue
            with contextlib.suppress(OSError):
                items.append(CacheItem(path, kind, name, _size(path)))
    return items


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def sweep(root: Path | None = None) -> int:
    """Removes the temp files of processes that died (kill -9, power loss); returns the bytes freed."""
    freed = 0
    try:
        items = cache_items(root)
    except OSError as e:  # an unreadable cache is reported where it is used, not here
        log.info("cannot sweep the cache: %s", e)
        return 0
    for item in items:
        if item.kind == "leftover":
            log.info("removing leftover %s (%d bytes)", item.path, item.size)
            _remove(item.path)
            freed += item.size
    return freed


def clean(*, models: bool = False) -> int:
    """Frees space: leftovers and assembled GGUFs, and with `models` the converted models too.

    Takes the lock without waiting: a process converting right now keeps its files. Returns bytes freed.
    """
    with cache_lock(wait=False) as locked:
        if not locked:
            raise ModelLoadError("Another SpecDec Studio process is preparing models in the cache; try again "
                                 "when it has finished.")
        kinds = {"leftover", "gguf"} | ({"model"} if models else set())
        freed = 0
        for item in cache_items():
            if item.kind in kinds:
                _remove(item.path)
                freed += item.size
        return freed


def model_entries(root: Path | None = None) -> list[Path]:
    root = root or cache_dir()
    folder = root / "models"
    if not folder.is_dir():
        return []
    return [p for p in sorted(folder.iterdir()) if p.is_dir() and not p.name.startswith(".")]


@dataclass(frozen=True)
class Verified:
    """What `cache verify` found for one converted model."""

    entry: Path  # the converted folder
    name: str  # the model's display name
    problem: str | None  # None: every file matches its recorded SHA-256


def verify_all(on_bytes: Callable[[int], None] | None = None) -> list[Verified]:
    """Hashes every converted model; a damaged one is removed (the next load converts it again)."""
    results = []
    for entry in model_entries():
        meta = read_marker(entry)
        if meta is None:
            continue  # incomplete: a leftover, not a model (`cache clean` removes it)
        if "files" not in meta:
            meta = upgrade_marker(entry, meta)
        problem, checked = verify_fully(entry, meta, on_bytes)
        name = str(meta.get("name", entry.name))
        if problem is not None:
            with cache_lock(wait=False) as locked:
                if locked:  # a process converting right now will replace it anyway
                    _remove(entry)
        elif checked != meta:
            write_marker(entry, checked)
        results.append(Verified(entry, name, problem))
    return results
