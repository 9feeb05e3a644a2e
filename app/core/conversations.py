"""Saved conversations: one JSON file each under the user's data folder, written atomically, listed fast."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.core.chat_tree import ID_PATTERN, Conversation, ConversationFormatError, check_header, search_text

log = logging.getLogger(__name__)

DATA_DIR_ENV = "SPECDEC_DATA_DIR"  # a folder to use instead of the platform's user data folder
INDEX_NAME = "index.json"  # a cache of titles and dates; the conversation files are the truth
INDEX_VERSION = 1
TRASH = ".deleted"  # deleted conversations wait here until the next start, so Undo can bring them back
SUFFIX = ".json"
MAX_FILE_BYTES = 64 << 20  # a conversation file beyond this is not read (a damaged or foreign file, not chat)
HEADER_FIELDS = {"id": str, "title": str, "created": str, "updated": str, "model": str, "turns": int}


def default_folder() -> Path:
    """<user data folder>/SpecDec Studio/conversations (platformdirs), or $SPECDEC_DATA_DIR/conversations."""
    override = os.environ.get(DATA_DIR_ENV)
    if override:
        return Path(override) / "conversations"
    import platformdirs

    return platformdirs.user_data_path("SpecDec Studio", appauthor=False) / "conversations"


@dataclass(frozen=True)
class ConversationHeader:
    """What the sidebar shows of a saved conversation, without reading its messages."""

    id: str  # the conversation id (and file stem)
    title: str  # shown title
    created: str  # ISO 8601
    updated: str  # ISO 8601; the list is sorted by it, newest first
    model: str  # pair of the latest answer
    turns: int  # messages in all branches


@dataclass(frozen=True)
class Problem:
    """A file in the folder that could not be read; it is left untouched and skipped."""

    path: Path  # the file
    reason: str  # one line a person can act on


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _indexed(key: str, hit: Any) -> ConversationHeader | None:
    """An index entry as a header, if every field it needs has its type and its id is the file's stem.

    Fields the header does not know (from a newer version) are ignored; anything else: None, and the
    file is read again.
    """
    if not isinstance(hit, dict) or not _count(hit.get("size")) or not _count(hit.get("mtime_ns")):
        return None
    raw = hit.get("header")
    if not isinstance(raw, dict) or raw.get("id") != key:
        return None
    if not all(isinstance(raw.get(name), kind) and not isinstance(raw.get(name), bool)
               for name, kind in HEADER_FIELDS.items()):
        return None
    return ConversationHeader(**{name: raw[name] for name in HEADER_FIELDS})


def _damaged(hit: Any) -> bool:
    return (isinstance(hit, dict) and _count(hit.get("size")) and _count(hit.get("mtime_ns"))
            and isinstance(hit.get("reason"), str) and len(hit["reason"]) <= 200)


def _header(raw: dict[str, Any]) -> ConversationHeader:
    return ConversationHeader(id=raw["id"], title=str(raw.get("title", "")) or "Untitled",
                              created=str(raw.get("created", "")), updated=str(raw.get("updated", "")),
                              model=str(raw.get("model", "")), turns=len(raw.get("turns", [])))


def write_atomically(path: Path, data: bytes) -> None:
    """Temp file in the same folder, fsync, then rename over the old file: a crash at any moment
    leaves either the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_folder(path.parent)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _fsync_folder(folder: Path) -> None:
    # The rename itself is durable only once the folder entry is on disk (POSIX); Windows cannot open folders.
    if os.name != "posix":
        return
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def encode(conversation_json: dict[str, Any]) -> bytes:
    # ensure_ascii=False: Chinese stays readable in the file and a raw-bytes search finds it.
    return json.dumps(conversation_json, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


class ConversationStore:
    """The folder of conversation files. Thread-safe: the writer thread and the UI both use it."""

    def __init__(self, folder: Path | str | None = None) -> None:
        self.folder = Path(folder) if folder is not None else default_folder()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.problems: list[Problem] = []  # files skipped by the last list()
        self._lock = threading.RLock()
        self._index: dict[str, dict[str, Any]] = {}
        self._damaged: dict[str, dict[str, Any]] | None = None  # file name -> size, mtime_ns, reason
        self._purge_trash()

    def path_of(self, conversation_id: str) -> Path:
        """The file of a conversation; ConversationFormatError for an id that is not a plain file stem."""
        if not isinstance(conversation_id, str) or not ID_PATTERN.fullmatch(conversation_id):
            raise ConversationFormatError(f"{str(conversation_id)[:60]!r} is not a conversation id")
        return self.folder / f"{conversation_id}{SUFFIX}"

    # --- listing --------------------------------------------------------------------------------

    def list(self) -> list[ConversationHeader]:
        """Every readable conversation, newest first. Files unchanged since the index was written are
        not opened, so 100 conversations list in milliseconds; unreadable ones land in `problems`."""
        with self._lock:
            cached = self._read_index()
            known_bad = self._read_damaged()
            headers: list[ConversationHeader] = []
            problems: list[Problem] = []
            fresh: dict[str, dict[str, Any]] = {}
            bad: dict[str, dict[str, Any]] = {}
            for entry in sorted(os.scandir(self.folder), key=lambda e: e.name):
                if entry.name.startswith(".") or entry.name == INDEX_NAME or not entry.is_file():
                    continue  # temp files of an interrupted write, the trash, the index
                path = Path(entry.path)
                if not entry.name.endswith(SUFFIX):
                    problems.append(Problem(path, "not a conversation file (SpecDec Studio saves .json files here)"))
                    continue
                stat = entry.stat()
                key = entry.name[: -len(SUFFIX)]
                hit = cached.get(key)
                header = _indexed(key, hit)
                if header is not None and hit["size"] == stat.st_size and hit["mtime_ns"] == stat.st_mtime_ns:
                    fresh[key] = hit
                    headers.append(header)
                    continue
                seen = known_bad.get(entry.name)
                if seen is not None and seen["size"] == stat.st_size and seen["mtime_ns"] == stat.st_mtime_ns:
                    bad[entry.name] = seen  # damaged and unchanged since: not parsed again (200 MB of junk)
                    problems.append(Problem(path, seen["reason"]))
                    continue
                try:
                    if stat.st_size > MAX_FILE_BYTES:
                        raise ConversationFormatError(f"{stat.st_size / 2**20:,.0f} MB, too large to be a "
                                                      "conversation; left untouched")
                    if not ID_PATTERN.fullmatch(key):
                        raise ConversationFormatError("its name is not a conversation id")
                    raw = _loads(path.read_bytes())
                    check_header(raw)
                    if raw["id"] != key:
                        raise ConversationFormatError(f"its id {raw['id']!r} does not match the file name")
                except (OSError, ValueError) as e:
                    problems.append(Problem(path, _reason(e)))
                    if not isinstance(e, OSError):
                        bad[entry.name] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "reason": _reason(e)}
                    continue
                header = _header(raw)
                fresh[key] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "header": header.__dict__}
                headers.append(header)
            self.problems = problems
            if fresh != cached or bad != known_bad:
                self._damaged = bad
                self._write_index(fresh)
            headers.sort(key=lambda h: h.updated, reverse=True)
            return headers

    # --- one conversation -----------------------------------------------------------------------

    def load(self, conversation_id: str) -> Conversation:
        """Raises ConversationFormatError (with a reason a person can read) or OSError."""
        path = self.path_of(conversation_id)
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ConversationFormatError("too large to be a conversation")
        try:
            raw = _loads(path.read_bytes())
        except ValueError as e:
            raise ConversationFormatError(_reason(e)) from e
        conversation = Conversation.from_json(raw)
        if conversation.id != conversation_id:
            raise ConversationFormatError(f"its id {conversation.id!r} does not match the file name")
        return conversation

    def save(self, conversation: Conversation) -> None:
        self.write(conversation.to_json())

    def write(self, conversation_json: dict[str, Any]) -> None:
        """Writes a snapshot (Conversation.to_json); safe from any thread."""
        data = encode(conversation_json)
        path = self.path_of(conversation_json["id"])
        with self._lock:
            write_atomically(path, data)
            stat = path.stat()
            index = self._read_index()
            index[conversation_json["id"]] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                                              "header": _header(conversation_json).__dict__}
            self._write_index(index)

    def delete(self, conversation_id: str) -> None:
        """Moves the file to the trash; `restore` brings it back until the app next starts."""
        with self._lock:
            path = self.path_of(conversation_id)
            trash = self.folder / TRASH
            trash.mkdir(exist_ok=True)
            if path.exists():
                os.replace(path, trash / path.name)
            index = self._read_index()
            if index.pop(conversation_id, None) is not None:
                self._write_index(index)

    def restore(self, conversation_id: str) -> bool:
        with self._lock:
            name = self.path_of(conversation_id).name
            source = self.folder / TRASH / name
            if not source.exists():
                return False
            os.replace(source, self.folder / name)
            return True

    # --- search ---------------------------------------------------------------------------------

    def search(self, query: str, cancelled: Callable[[], bool] = lambda: False) -> list[str]:
        """Ids of conversations whose title or any message contains `query` (case-insensitive).

        Reads files one at a time (memory stays flat); a cheap test on the raw text rules most out
        before parsing. Meant for a background thread; `cancelled` lets a newer query win.
        """
        needle = query.casefold().strip()
        if not needle:
            return [h.id for h in self.list()]
        raw_test = not _escaped_in_json(needle)
        hits: list[str] = []
        for header in self.list():
            if cancelled():
                break
            if needle in header.title.casefold():
                hits.append(header.id)
                continue
            try:
                text = self.path_of(header.id).read_text(encoding="utf-8")
                if raw_test and needle not in text.casefold():
                    continue
                if needle in search_text(Conversation.from_json(_loads(text))).casefold():
                    hits.append(header.id)
            except (OSError, ValueError, TypeError, AttributeError, KeyError):
                continue  # reported by list(); a search never fails because of one file
        return hits

    # --- internals ------------------------------------------------------------------------------

    def _read_index(self) -> dict[str, dict[str, Any]]:
        if self._index:
            return dict(self._index)
        raw = self._index_file()
        fits = raw.get("version") == INDEX_VERSION
        entries = raw.get("entries") if fits else None
        # Entries are checked field by field where they are used (_indexed): a bad one is read again.
        self._index = {k: v for k, v in entries.items() if isinstance(v, dict)} if isinstance(entries, dict) else {}
        if self._damaged is None:  # files found damaged before, with the size and time they had then
            found = raw.get("damaged") if fits else None
            self._damaged = ({k: v for k, v in found.items() if isinstance(k, str) and _damaged(v)}
                             if isinstance(found, dict) else {})
        return dict(self._index)

    def _read_damaged(self) -> dict[str, dict[str, Any]]:
        if self._damaged is None:
            self._read_index()
        return dict(self._damaged or {})

    def _index_file(self) -> dict[str, Any]:
        try:
            path = self.folder / INDEX_NAME
            if path.stat().st_size > MAX_FILE_BYTES:
                return {}
            raw = _loads(path.read_bytes())
        except (OSError, ValueError):
            return {}  # no index, or a damaged one: the files are read again and it is rebuilt
        return raw if isinstance(raw, dict) else {}

    def _write_index(self, entries: dict[str, dict[str, Any]]) -> None:
        self._index = dict(entries)
        try:
            write_atomically(self.folder / INDEX_NAME, json.dumps(
                {"version": INDEX_VERSION, "entries": entries, "damaged": self._read_damaged()},
                ensure_ascii=False).encode("utf-8"))
        except OSError as e:  # the index only saves time; the next start rebuilds it
            log.warning("could not write the conversation index: %s", e)

    def _purge_trash(self) -> None:
        trash = self.folder / TRASH
        if trash.exists():
            shutil.rmtree(trash, ignore_errors=True)
        for stale in self.folder.glob(".*.tmp"):  # a write interrupted by a crash or kill -9
            with contextlib.suppress(OSError):
                stale.unlink()


def _escaped_in_json(needle: str) -> bool:
    # json.dumps(ensure_ascii=False) escapes only quotes, backslashes and control characters, so a
    # needle without them appears verbatim in the file wherever it appears in a message.
    return any(ch in '"\\' or ord(ch) < 0x20 for ch in needle)


def _loads(data: str | bytes) -> Any:
    """json.loads, with a file nested deeper than Python's stack ("[[[[…") a damaged file, not a crash."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ConversationFormatError("damaged: nested too deeply") from None


def _reason(e: BaseException) -> str:
    if isinstance(e, ConversationFormatError):
        return str(e)
    if isinstance(e, UnicodeDecodeError):
        return "not UTF-8 text (damaged?)"
    if isinstance(e, json.JSONDecodeError):
        return f"damaged: not valid JSON (line {e.lineno}, column {e.colno})"
    if isinstance(e, OSError):
        return f"could not be read: {e.strerror or e}"
    return f"damaged: {e}"


class BackgroundWriter:
    """Saves conversations on one background thread, newest snapshot wins; the UI never waits on a disk.

    `on_error(conversation_id, message)` is called on the writer thread; hand it to the UI thread.
    """

    def __init__(self, store: ConversationStore, on_error: Callable[[str, str], None] | None = None) -> None:
        self.store = store
        self._on_error = on_error
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="conversation-writer")
        self._pending: dict[str, dict[str, Any]] = {}
        self._unwritten: set[str] = set()  # queued or being written: the disk does not have them yet
        self._lock = threading.Lock()
        self._closed = False

    def save(self, conversation: Conversation) -> None:
        snapshot = conversation.to_json()  # cheap: frozen turns are shared, not copied
        if self._closed:  # an answer that ended while the app closed: written here and now
            self._pending[conversation.id] = snapshot
            self._write(conversation.id)
            return
        with self._lock:
            queued = conversation.id in self._pending
            self._pending[conversation.id] = snapshot
            self._unwritten.add(conversation.id)
        if not queued:
            self._pool.submit(self._write, conversation.id)

    def flush(self) -> None:
        """Waits for every queued save (on close, and in tests)."""
        if not self._closed:
            self._pool.submit(lambda: None).result()

    def settle(self, conversation_id: str) -> None:
        """Waits until the newest save of this conversation is on the disk (before reading it back)."""
        with self._lock:
            unwritten = conversation_id in self._unwritten
        if unwritten:
            self.flush()

    def close(self) -> None:
        if not self._closed:
            self.flush()
            self._closed = True
            self._pool.shutdown(wait=True)

    def _write(self, conversation_id: str) -> None:
        with self._lock:
            snapshot = self._pending.pop(conversation_id, None)
        if snapshot is None:
            return
        try:
            self.store.write(snapshot)
        except Exception as e:
            log.warning("could not save conversation %s: %s", conversation_id, e)
            if self._on_error is not None:
                self._on_error(conversation_id, _reason(e) if isinstance(e, OSError) else str(e))
        finally:
            with self._lock:
                if conversation_id not in self._pending:  # a newer snapshot queued meanwhile keeps it unwritten
                    self._unwritten.discard(conversation_id)
