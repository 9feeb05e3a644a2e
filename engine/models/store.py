"""The model store: what a model spec means, and the cached folder it loads from (converted from GGUF once)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from engine.errors import ModelLoadError
from engine.loadspec import ProgressFn, emit
from engine.models.cache import (
    CACHE_FORMAT,
    MARKER,
    cache_dir,
    cache_lock,
    complete_marker,
    damage,
    read_marker,
    temp_dir_prefix,
    upgrade_marker,
    write_marker,
)
from engine.models.cache_space import sweep
from engine.models.device import (
    cpu_has_native_bf16,
    pick_device,
    pick_dtype,
)
from engine.models.gguf import quiet_gguf_bars
from engine.models.packaged import (
    DEFAULT_MODELS,
    INSTALL_HINT,
    PackagedModel,
    _safe,
    assemble_default,
    sha256_file,
    verified_marker,
)
from engine.models.presets import offline_message, preset_model

__all__ = [
    "ModelSource", "PackagedModel", "DEFAULT_MODELS", "INSTALL_HINT", "resolve_source", "pick_device", "pick_dtype",
    "cpu_has_native_bf16", "cache_dir", "MARKER", "CACHE_FORMAT",
]

log = logging.getLogger(__name__)


def __getattr__(name: str) -> Any:
    # transformers costs ~150 MB to import with its model classes; the llama.cpp runtime needs none
    # of it, so it is imported where a torch model or tokenizer is loaded (store.AutoModelForCausalLM
    # and store.AutoTokenizer still name the classes).
    if name in ("AutoModelForCausalLM", "AutoTokenizer"):
        import transformers

        return getattr(transformers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


Role = Literal["target", "draft"]
SourceKind = Literal["default", "folder", "gguf", "hub"]


@dataclass(frozen=True)
class ModelSource:
    kind: SourceKind  # where the weights come from
    ref: str  # role for "default", absolute path for folder/gguf, repo id for "hub"
    role: Role  # which side of the pair it is for
    name: str  # short display name


def _first_line(e: BaseException) -> str:
    """Exceptions from transformers can run to pages; a person needs the first line."""
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


# --------------------------------------------------------------------------- sources

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+|[A-Za-z0-9][\w.-]*")  # "owner/name" or "name"


def _looks_like_path(spec: str) -> bool:
    # "Qwen/Qwen2.5-0.5B" has a slash but is a hub id; "./x", "/x", "a/b/c", "~/x", "x.gguf" are paths.
    if spec.startswith((".", "~", "/")) or spec.lower().endswith(".gguf") or "\\" in spec:
        return True
    return _HUB_ID.fullmatch(spec) is None


def resolve_source(spec: str | None, role: Role) -> ModelSource:
    """Turns what a person typed (or nothing) into a model source; never touches weights."""
    if spec is None or spec.strip() in ("", "default"):
        return ModelSource("default", role, role, DEFAULT_MODELS[role].name)
    spec = spec.strip()
    try:
        path = Path(spec).expanduser()
        path.is_dir()
    except (OSError, ValueError, RuntimeError) as e:  # NUL bytes, names too long, "~nobody/x"
        shown = spec if len(spec) <= 80 else spec[:80] + "…"
        raise ModelLoadError(f"Model path {shown!r} cannot be used: {getattr(e, 'strerror', None) or e}.") from None
    if path.is_dir():
        path = path.resolve()
        return ModelSource("folder", str(path), role, path.name)
    if path.is_file() and path.suffix.lower() == ".gguf":
        path = path.resolve()
        return ModelSource("gguf", str(path), role, path.stem)
    if path.is_file():
        raise ModelLoadError(
            f"Model path {spec} is a file but not a .gguf: give a model folder or a .gguf file."
        )
    if _looks_like_path(spec):
        raise ModelLoadError(f"Model path not found: {spec} (give a model folder, a .gguf file or a hub id).")
    return ModelSource("hub", spec, role, spec)



# --------------------------------------------------------------------------- folders and cache

def _read_json(path: Path) -> dict:
    """A model folder's JSON object ({} when the file is absent); ModelLoadError when it is unreadable or not one."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as e:
        raise ModelLoadError(f"Could not read {path}: {_first_line(e)}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"Could not read {path}: it is {type(data).__name__}, not a JSON object")
    return data


def _cache_entry(source: ModelSource) -> Path:
    if source.kind == "default":
        model = DEFAULT_MODELS[source.ref]
        key = f"{_safe(model.name)}-{model.sha256[:12]}"
    else:
        key = f"{_safe(Path(source.ref).stem)}-{hashlib.sha256(source.ref.encode()).hexdigest()[:12]}"
    return cache_dir() / "models" / key


def converted_folder(spec: str | None, role: Role) -> Path | None:
    """The folder a spec loads from, if it is already on disk (a folder, or a converted cache entry)."""
    try:
        source = resolve_source(spec, role)
    except ModelLoadError:
        return None
    if source.kind == "folder":
        return Path(source.ref)
    if source.kind in ("default", "gguf"):
        entry = _cache_entry(source)
        return entry if read_marker(entry) is not None else None
    return None


def _cached_folder(source: ModelSource) -> tuple[Path | None, str | None]:
    """(the converted folder of a GGUF source if it is complete, intact and still matches its file,
    what is wrong with it if it is damaged)."""
    entry = _cache_entry(source)
    meta = read_marker(entry)
    if meta is None:
        return None, None
    if source.kind == "default":
        if meta.get("sha256") != DEFAULT_MODELS[source.ref].sha256:
            return None, None
    else:
        st = Path(source.ref).stat()
        if meta.get("size") != st.st_size or meta.get("mtime_ns") != st.st_mtime_ns:
            return None, None  # changed or touched: the caller re-hashes and reconverts if the content changed
    return _checked(entry, meta)


def _checked(entry: Path, meta: dict) -> tuple[Path | None, str | None]:
    """Checks a converted folder cheaply: (entry, None) if intact, (None, what is wrong) if not."""
    problem = damage(entry, meta)
    if problem is not None:
        log.info("cached model in %s is damaged: %s", entry, problem)
        return None, problem
    if "files" not in meta:
        upgrade_marker(entry, meta)  # converted before files were recorded: record them from now on
    return entry, None


def _convert(gguf: Path, entry: Path, meta: dict, name: str, progress: ProgressFn | None) -> Path:
    """GGUF -> bf16 safetensors folder, written to a temp dir and renamed so it is all-or-nothing."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=temp_dir_prefix(entry), dir=entry.parent))
    started = time.perf_counter()
    raised_by_progress: list[BaseException] = []  # a cancel from the caller passes through unchanged

    def report(stage: str, fraction: float, message: str) -> None:
        try:
            emit(progress, stage, fraction, message)
        except BaseException as e:
            raised_by_progress.append(e)
            raise

    try:
        report("convert", 0.0, f"Converting {name} from GGUF (once; dequantizing takes a minute)")
        with quiet_gguf_bars():
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16,
                quantization_config=GgufConfig(dequantize=True),
            )
        # A dequantized model still carries its GGUF quantizer, and save_pretrained refuses it.
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer = None
            model.is_quantized = False
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
        report("convert", 0.6, f"Saving {name} as safetensors")
        model.save_pretrained(str(tmp))
        del model
        report("convert", 0.75, f"Building the {name} tokenizer from GGUF")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer.save_pretrained(str(tmp))
        report("convert", 0.9, f"Recording checksums of {name}")
        meta = {**meta, "name": name, "transformers": transformers.__version__,
                "torch": torch.__version__, "converted_s": round(time.perf_counter() - started, 1)}
        write_marker(tmp, complete_marker(tmp, meta))
        if entry.exists():
            shutil.rmtree(entry)
        os.replace(tmp, entry)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # never leave a half-written folder behind
        if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
            raise ModelLoadError(f"Out of memory converting {name}; close other programs and try again.") from None
        if isinstance(e, Exception) and not isinstance(e, ModelLoadError) and e not in raised_by_progress:
            # transformers' GGUF reader fails on a crafted file with any exception type it meets.
            raise ModelLoadError(
                f"Could not convert {gguf} to a model folder ({type(e).__name__}: {_first_line(e)})."
            ) from None
        raise  # our own errors, a cancel raised from `progress`, KeyboardInterrupt: unchanged
    emit(progress, "convert", 1.0, f"Converted {name} in {time.perf_counter() - started:.0f} s → {entry}")
    return entry


@dataclass
class _Prepared:
    """A source on its way to a loadable folder (internal bookkeeping for load_pair)."""

    source: ModelSource
    folder: Path | None = None  # loadable folder once known
    gguf: Path | None = None  # GGUF to convert when folder is None
    meta: dict = field(default_factory=dict)  # what the cache marker will record
    hub_weights_pending: bool = False  # a hub snapshot that has its tokenizer but not yet its weights


def _prepare(source: ModelSource, progress: ProgressFn | None, stack: ExitStack) -> _Prepared:
    """Finds a loadable folder, or a verified GGUF that still needs converting.

    Assembling and converting happen under the cache's lock, entered on `stack`: the caller keeps
    it until the conversion is done, so a second process waits and then uses the result.
    """
    if source.kind == "folder":
        folder = Path(source.ref)
        if not (folder / "config.json").is_file():
            raise ModelLoadError(
                f"{folder} has no config.json, so it is not a model folder: give a folder with config.json, "
                f"weights (*.safetensors) and tokenizer files, a .gguf file or a hub id."
            )
        weights = ("*.safetensors", "*.bin", "*.safetensors.index.json")
        if not any(next(folder.glob(pattern), None) for pattern in weights):
            raise ModelLoadError(f"{folder} has config.json but no weights (*.safetensors or *.bin): copy the model's "
                                 f"weight files into it, or give a .gguf file or a hub id.")
        return _Prepared(source, folder=folder)
    if source.kind == "hub":
        # Tokenizer and config only: the weights come after the compatibility check passes.
        return _Prepared(source, folder=_hub_folder(source.ref, weights=False), hub_weights_pending=True)
    cached, problem = _cached_folder(source)
    if cached is not None:
        return _Prepared(source, folder=cached)
    stack.enter_context(cache_lock(lambda stage, fraction, message: emit(progress, stage, fraction, message)))
    sweep()  # temp files of processes that died converting
    cached, problem_now = _cached_folder(source)  # another process may have converted it while we waited
    if cached is not None:
        return _Prepared(source, folder=cached)
    path = Path(source.ref)
    if source.kind == "gguf":
        try:
            st = path.stat()
            sha = sha256_file(path, progress, path.name)
        except OSError as e:
            raise ModelLoadError(f"Could not read {path}: {e.strerror or e}.") from None
        entry = _cache_entry(source)
        meta = {"sha256": sha, "source": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        old = read_marker(entry)
        if old is not None and old.get("sha256") == sha:
            cached, problem_now = _checked(entry, old)
            if cached is not None:
                # Touched but identical: record the new mtime so the next load skips hashing.
                write_marker(entry, {**(read_marker(entry) or old), **meta})
                return _Prepared(source, folder=entry)
    problem = problem or problem_now
    if problem is not None:
        emit(progress, "repair", 0.0, f"The cached {source.name} is damaged ({problem}); converting it again")
    if source.kind == "default":
        model = DEFAULT_MODELS[source.ref]
        gguf = assemble_default(model, progress)
        return _Prepared(source, gguf=gguf, meta={"sha256": model.sha256, "source": "packaged"})
    return _Prepared(source, gguf=path, meta=meta)


def _hub_folder(repo_id: str, *, weights: bool) -> Path:
    """A hub model's local snapshot (downloaded when online, from the HF cache when offline)."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja"]  # never remote code
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns + (["*.safetensors"] if weights else [])))
    except Exception as e:
        kind = type(e).__name__
        if kind == "GatedRepoError":
            raise ModelLoadError(
                f"{repo_id} is gated: accept its licence on huggingface.co and log in (`hf auth login`), "
                f"then load it again."
            ) from None
        if preset_model(repo_id) is not None and kind in ("LocalEntryNotFoundError", "OfflineModeIsEnabled",
                                                          "ConnectionError", "ConnectTimeout", "ProxyError"):
            raise ModelLoadError(offline_message(repo_id)) from None  # a preset, plainly: no network
        text = str(e).strip()
        reason = text.splitlines()[0].split(". ")[0].rstrip(".") if text else kind
        raise ModelLoadError(
            f"{repo_id} is not a local path and could not be loaded from the Hugging Face cache "
            f"(offline?): {reason[:200]}. Give a model folder or .gguf file, or download it first."
        ) from None


def _ensure_folder(prepared: _Prepared, progress: ProgressFn | None = None) -> Path:
    """Converts a pending GGUF into its cache entry (once); returns the loadable folder."""
    if prepared.hub_weights_pending:
        emit(progress, "load", 0.0, f"Fetching {prepared.source.name} weights (Hugging Face cache)")
        prepared.folder = _hub_folder(prepared.source.ref, weights=True)
        prepared.hub_weights_pending = False
    if prepared.folder is None:
        assert prepared.gguf is not None, "a prepared source has a folder or a GGUF"
        prepared.folder = _convert(prepared.gguf, _cache_entry(prepared.source), prepared.meta,
                                   prepared.source.name, progress)
        if prepared.source.kind == "default":
            # The assembled GGUF can be rebuilt from the installed parts; do not keep 1.6 GB twice.
            prepared.gguf.unlink(missing_ok=True)
            verified_marker(prepared.gguf).unlink(missing_ok=True)
    return prepared.folder


def gguf_file(source: ModelSource, progress: ProgressFn | None = None) -> Path:
    """The GGUF llama.cpp loads: the packaged model assembled and SHA-checked (once), or the file given."""
    if source.kind == "default":
        # Under the cache's lock, as torch's loads: a second first start waits for the assembly in progress.
        with cache_lock(lambda stage, fraction, message: emit(progress, stage, fraction, message)):
            sweep()
            return assemble_default(DEFAULT_MODELS[source.ref], progress)
    if source.kind == "gguf":
        return Path(source.ref)
    raise ModelLoadError(f"{source.name} is not a GGUF model; the llama.cpp runtime needs a .gguf file.")
