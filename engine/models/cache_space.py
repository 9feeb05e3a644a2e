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
from engine.models.cache import (
    COSTS_FILE,
    MARKER,
    cache_dir,
    cache_lock,
    read_marker,
    upgrade_marker,
    verify_fully,
    write_marker,
)

log = logging.getLogger(__name__)

STALE_AFTER_S = 24 * 3600  # a temp file nobody has written for a day is a leftover, whatever its pid says
# The cache's own names (engine/models/store.py writes them): nothing else is ever removed.
_ENTRY = r"[A-Za-z0-9._-]{1,80}-[0-9a-f]{12}"  # <safe name>-<12 hex of a SHA-256>
_PARTIAL = re.compile(_ENTRY + r"\.gguf\.(\d+)\.partial")  # an assembled GGUF being written: <name>.<pid>.partial
_GGUF = re.compile(_ENTRY + r"\.gguf")  # an assembled GGUF
_VERIFIED = re.compile(_ENTRY + r"\.gguf\.verified\.json")  # its recorded SHA-256
_MODEL = re.compile(_ENTRY)  # a converted model folder
# .<entry>.pid<pid>.<mkdtemp's 8 random characters> (older: .<entry>-<8 random>, no pid)
_TEMP_DIR = re.compile(r"\." + _ENTRY + r"(?:\.pid(\d+)\.[A-Za-z0-9_]{8}|-[A-Za-z0-9_]{8})")
_COSTS_PART = re.compile(r"\." + re.escape(COSTS_FILE) + r"\.(\d+)\.part")  # the costs file being written
TAG = "CACHEDIR.TAG"  # the cache's root tag (https://bford.info/cachedir/): this folder is ours
TAG_TEXT = ("Signature: 8a477f597d28d172789f06886806bc55\n"
            "# This folder is the SpecDec Studio model cache; `specdec-studio cache clean` frees it.\n")
# What the cache root holds when SpecDec Studio made it (the lock, models, GGUFs, trained heads, AMX verdicts,
# kept forward costs).
ROOT_NAMES = frozenset({TAG, ".lock", "models", "gguf", "heads", "llamacpp-amx.json", COSTS_FILE})


class ForeignCacheError(ModelLoadError):
    """The cache folder holds things SpecDec Studio did not make: nothing there is removed."""


def check_root(root: Path) -> None:
    """Raises ModelLoadError when the cache path cannot be a cache folder (a file, say)."""
    if root.exists() and not root.is_dir():
        raise ModelLoadError(f"The model cache {root} is not a folder; set SPECDEC_CACHE_DIR to a folder.")


def foreign(root: Path) -> list[Path]:
    """What in an untagged cache folder SpecDec Studio did not make (empty for a tagged one, or a cache of ours
    from before the tag); a few paths, for the message."""
    if (root / TAG).is_file() or not root.is_dir():
        return []
    found: list[Path] = []
    for path in sorted(root.iterdir()):
        if path.name not in ROOT_NAMES and not _COSTS_PART.fullmatch(path.name):
            found.append(path)
        elif path.name in ("models", "gguf") and path.is_dir() and not path.is_symlink():
            found += [p for p in sorted(path.iterdir()) if _kind(p)[0] == "foreign"]
        elif path.name in ("models", "gguf", "heads") and not path.is_dir():
            found.append(path)
        if len(found) >= 3:
            break
    return found


def claim(root: Path) -> None:
    """Tags a cache folder that holds only what SpecDec Studio makes; ForeignCacheError if it holds anything else."""
    check_root(root)
    if (root / TAG).is_file() or not root.exists():
        return
    others = foreign(root)
    if others:
        names = ", ".join(str(p.relative_to(root)) for p in others[:3])
        raise ForeignCacheError(f"The model cache {root} holds files SpecDec Studio did not make ({names}); nothing "
                                f"was removed. Set SPECDEC_CACHE_DIR to an empty or new folder.")
    try:
        (root / TAG).write_text(TAG_TEXT, encoding="utf-8")
    except OSError as e:  # a read-only cache: it stays untagged, and is checked again next time
        log.info("could not tag the cache %s: %s", root, e)


@dataclass(frozen=True)
class CacheItem:
    """One thing in the cache folder, as `cache info` lists it."""

    path: Path  # the file or folder
    kind: str  # "model" (converted), "gguf" (assembled, rebuildable), "costs" (kept forward costs, measured again),
    # "leftover" (temp of a dead process), "busy",
    # or "foreign" (not made by SpecDec Studio: listed, never removed)
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


def _kind(path: Path) -> tuple[str, int | None]:
    """What a thing in models/ or gguf/ is, by the cache's own names and markers: ("temp", pid or None),
    ("model", None), ("incomplete", None), ("gguf", None), ("verified", None) or ("foreign", None)."""
    name, sub = path.name, path.parent.name
    if path.is_symlink():
        return "foreign", None  # the cache never makes links: whatever it points at is not ours
    if sub == "gguf" and path.is_file():
        m = _PARTIAL.fullmatch(name)
        if m:
            return "temp", int(m.group(1))
        if _GGUF.fullmatch(name):
            return "gguf", None
        if _VERIFIED.fullmatch(name):
            return "verified", None
    elif sub == "models" and path.is_dir():
        m = _TEMP_DIR.fullmatch(name)
        if m:
            return "temp", int(m.group(1)) if m.group(1) else None
        if _MODEL.fullmatch(name) and (path / MARKER).is_file():
            return ("model" if read_marker(path) else "incomplete"), None
    return "foreign", None


def _root_kind(path: Path, root: Path) -> tuple[str, int | None] | None:
    """What a file in the cache root is when the cache may remove it: ("costs", None), ("temp", pid); else None."""
    if path.is_symlink() or not path.is_file() or path.parent != root:
        return None
    if path.name == COSTS_FILE:
        return "costs", None
    m = _COSTS_PART.fullmatch(path.name)
    return ("temp", int(m.group(1))) if m else None


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
    check_root(root)
    items: list[CacheItem] = []
    for sub in ("models", "gguf"):
        folder = root / sub
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            what, pid = _kind(path)
            if what == "temp":
                # An old-style temp folder names no process: only its age tells it is a leftover.
                kind = "leftover" if _is_stale(path, pid) else "busy"
                name = f"temp file of process {pid}" if pid is not None else "temp file"
            elif what == "model":
                kind, name = "model", str((read_marker(path) or {}).get("name", path.name))
            elif what == "incomplete":
                kind, name = "leftover", "incomplete model"  # a marker of another format, or damaged
            elif what == "gguf":
                kind, name = "gguf", "assembled GGUF (rebuilt from the installed parts when needed)"
            elif what == "foreign":
                kind, name = "foreign", "not made by SpecDec Studio (left alone)"
            else:
                continue  # a GGUF's recorded hash goes with it
            with contextlib.suppress(OSError):
                items.append(CacheItem(path, kind, name, _size(path)))
    for path in sorted(root.iterdir()) if root.is_dir() else ():
        what = _root_kind(path, root)
        if what is None:
            continue
        if what[0] == "costs":
            kind, name = "costs", "forward costs measured on this machine (measured again when missing)"
        else:
            kind, name = ("leftover" if _is_stale(path, what[1]) else "busy"), f"temp file of process {what[1]}"
        with contextlib.suppress(OSError):
            items.append(CacheItem(path, kind, name, _size(path)))
    return items


def _remove(path: Path) -> None:
    if _kind(path)[0] == "foreign" and _root_kind(path, cache_dir()) is None:  # checked again at the last moment: never
        return  # anything the cache did not make
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        if _GGUF.fullmatch(path.name):
            with contextlib.suppress(OSError):
                path.with_name(path.name + ".verified.json").unlink()


def sweep(root: Path | None = None) -> int:
    """Removes the temp files of processes that died (kill -9, power loss); returns the bytes freed."""
    freed = 0
    root = root or cache_dir()
    try:
        claim(root)
        items = cache_items(root)
    except ModelLoadError as e:  # a folder of someone else's: loading still works, nothing is removed
        log.warning("%s", e)
        return 0
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
    """Frees space: leftovers, assembled GGUFs and the kept forward costs, and with `models` the converted models too.

    Takes the lock without waiting: a process converting right now keeps its files. Returns bytes freed.
    """
    check_root(cache_dir())
    with cache_lock(wait=False) as locked:
        if not locked:
            raise ModelLoadError("Another SpecDec Studio process is preparing models in the cache; try again "
                                 "when it has finished.")
        claim(cache_dir())
        kinds = {"leftover", "gguf", "costs"} | ({"model"} if models else set())
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
    return [p for p in sorted(folder.iterdir()) if _kind(p)[0] in ("model", "incomplete")]


@dataclass(frozen=True)
class Verified:
    """What `cache verify` found for one converted model."""

    entry: Path  # the converted folder
    name: str  # the model's display name
    problem: str | None  # None: every file matches its recorded SHA-256


def verify_all(on_bytes: Callable[[int], None] | None = None) -> list[Verified]:
    """Hashes every converted model; a damaged one is removed (the next load converts it again)."""
    check_root(cache_dir())
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
