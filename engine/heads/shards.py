"""A head on disk: safetensors shards checked by SHA-256, a manifest, and the heads shipped in assets/heads.

The shards hold only the head's own weights (bf16) and its draft vocabulary; the embeddings,
output rows and RoPE come from the target at load. Shards stay under 15 MiB each, the most the
GPU machine returns per file. The manifest names the target the head was trained on
(engine.heads.config.TargetFingerprint): a head is used automatically only for that target.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from engine.errors import IncompatibleModelsError, ModelLoadError
from engine.heads.config import FORMAT, HeadConfig, TargetFingerprint, check_matches, fingerprint
from engine.heads.model import DraftHead

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_SHA256 = re.compile(r"[0-9a-f]{64}")
SHARD_BYTES = 15 * 2**20  # per file: the GPU machine returns files of at most 16 MiB


@dataclass(frozen=True)
class HeadFiles:
    """A head folder as its manifest describes it."""

    folder: Path  # where the manifest and shards are
    name: str  # display name, e.g. "Qwen2.5-Coder-1.5B-Instruct head"
    config: HeadConfig  # shapes
    target: TargetFingerprint  # the target it was trained on
    manifest: dict  # everything else (training summary, shard list)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 * 2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_head(head: DraftHead, folder: Path, *, name: str, target: TargetFingerprint, training: dict) -> list[Path]:
    """Writes bf16 shards and the manifest (last, so a folder with a manifest is complete); returns the files."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in head.state_dict().items() if k != "d2t"}
    tensors["d2t"] = head.d2t.detach().to("cpu", torch.int32).contiguous()
    groups: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for key in sorted(tensors, key=lambda k: -tensors[k].numel() * tensors[k].element_size()):
        size = tensors[key].numel() * tensors[key].element_size()
        assert size <= SHARD_BYTES, f"{key} alone is {size} bytes, more than a shard holds"
        target_group = next((g for g in groups if sum(t.numel() * t.element_size() for t in g.values()) + size
                             <= SHARD_BYTES), None)
        if target_group is None:
            groups.append({})
            target_group = groups[-1]
        target_group[key] = tensors[key]
        used += size
    for old in folder.glob("head-*.safetensors"):
        old.unlink()
    files, shards = [], []
    for i, group in enumerate(groups, 1):
        path = folder / f"head-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, str(path), metadata={"format": str(FORMAT)})
        files.append(path)
        shards.append({"file": path.name, "sha256": _sha256(path), "bytes": path.stat().st_size})
    manifest = {
        "format": FORMAT,
        "name": name,
        "config": head.config.to_json(),
        "target": target.to_json(),
        "shards": shards,
        "parameters": head.num_trained(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "training": training,
    }
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, folder / MANIFEST)
    files.append(folder / MANIFEST)
    log.info("saved head %s: %d shards, %.1f MiB", name, len(shards), used / 2**20)
    return files


def read_manifest(folder: Path) -> HeadFiles:
    """The manifest of a head folder; ModelLoadError when it is missing, unreadable or of another format."""
    path = folder / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise ModelLoadError(f"{folder} is not a draft head folder (cannot read {MANIFEST}: {e}).") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{folder} is not a draft head folder ({MANIFEST} is not a JSON object).")
    if data.get("format") != FORMAT:
        raise ModelLoadError(
            f"The draft head in {folder} has format {data.get('format')}; this version reads format {FORMAT}. "
            "Train it again with specdec-studio distill."
        )
    problem = _shards_problem(data.get("shards"))
    if problem is not None:
        raise ModelLoadError(f"The draft head manifest in {folder} is damaged: {problem}.")
    try:
        return HeadFiles(folder, str(data["name"]), HeadConfig.from_json(data["config"]),
                         TargetFingerprint.from_json(data["target"]), data)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ModelLoadError(f"The draft head manifest in {folder} is incomplete ({e}).") from None


def _shards_problem(shards: object) -> str | None:
    """Why a manifest's shard list is not one this app writes: files named in the head folder itself (a name with
    a path in it would read a file elsewhere), each with its SHA-256."""
    if not isinstance(shards, list) or not shards:
        return "it lists no weight shards"
    for shard in shards:
        if not isinstance(shard, dict) or not isinstance(shard.get("file"), str) \
                or not isinstance(shard.get("sha256"), str):
            return "a shard entry lacks its file name or SHA-256"
        name = shard["file"]
        if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
            return f"the shard name {name[:80]!r} is not a file name in the head folder"
        if not _SHA256.fullmatch(shard["sha256"]):
            return f"the SHA-256 of {name[:80]!r} is not 64 hex digits"
    return None


def load_head(files: HeadFiles, device: torch.device, dtype: torch.dtype) -> DraftHead:
    """The head's weights, each shard checked against its SHA-256 first (unbound: call bind())."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for shard in files.manifest["shards"]:
        path = files.folder / shard["file"]
        if not path.is_file():
            raise ModelLoadError(f"The draft head {files.name} is incomplete: {path} is missing.")
        if _sha256(path) != shard["sha256"]:
            raise ModelLoadError(
                f"The draft head {files.name} is damaged: {path.name} does not match its SHA-256. "
                "Reinstall it or train it again."
            )
        try:
            tensors.update(load_file(str(path)))
        except Exception as e:  # safetensors' own error type: a header or layout it cannot read
            why = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
            raise ModelLoadError(f"The draft head {files.name} is damaged: {path.name} is not a readable "
                                 f"safetensors file ({why}).") from None
    if "d2t" not in tensors:
        raise ModelLoadError(f"The draft head {files.name} lacks weights: ['d2t'].")
    head = DraftHead(files.config, tensors.pop("d2t").long())
    missing = set(head.state_dict()) - set(tensors) - {"d2t"}
    if missing:
        raise ModelLoadError(f"The draft head {files.name} lacks weights: {sorted(missing)}.")
    params = head.state_dict()  # the tensors themselves (layers after the first are nested: "more.0.wqkv")
    unknown = set(tensors) - set(params)
    if unknown:
        raise ModelLoadError(f"The draft head {files.name} has weights its configuration does not: {sorted(unknown)}.")
    with torch.no_grad():
        for key, value in tensors.items():
            if tuple(value.shape) != tuple(params[key].shape):
                raise ModelLoadError(f"The draft head {files.name} is damaged: {key} has shape {tuple(value.shape)} "
                                     f"where its configuration makes {tuple(params[key].shape)}.")
            params[key].copy_(value)
    head.requires_grad_(False)
    return head.to(device=device, dtype=dtype).eval()


def shipped_heads() -> list[Path]:
    """Head folders packaged in assets/heads (each with a manifest)."""
    root = Path(str(resources.files("assets").joinpath("heads")))
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / MANIFEST).is_file())


def head_for(target: nn.Module, folders: list[Path] | None = None) -> HeadFiles | None:
    """The first head (shipped ones by default) trained for this target; None when none matches."""
    loaded = fingerprint(target)
    for folder in shipped_heads() if folders is None else folders:
        try:
            files = read_manifest(folder)
            check_matches(files.target, loaded, files.name)
        except (ModelLoadError, IncompatibleModelsError) as e:
            log.info("draft head %s not used: %s", folder.name, e)
            continue
        return files
    return None


def open_head(folder: Path, target: nn.Module) -> HeadFiles:
    """A head folder a person named, checked against the loaded target (clear errors when it does not fit)."""
    files = read_manifest(folder)
    check_matches(files.target, fingerprint(target), files.name)
    return files


def resolve_head(target: nn.Module, spec: str | Path | None) -> tuple[DraftHead, HeadFiles] | None:
    """The head for a freshly loaded target, bound to it (before any CPU packing).

    spec: "auto" (a shipped head trained for this target, or none), a head folder (checked: a head
    for another target is refused with IncompatibleModelsError), or None / "none" (no head).
    """
    if spec is None or str(spec) == "none":
        return None
    files = head_for(target) if str(spec) == "auto" else open_head(Path(spec), target)
    if files is None:
        return None
    param = next(target.parameters())
    head = load_head(files, param.device, param.dtype).bind(target, dtype=param.dtype)
    log.info("draft head %s (%d parameters) for %s", files.name, head.num_trained(), files.folder)
    return head, files
