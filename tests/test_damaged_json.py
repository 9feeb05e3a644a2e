"""A JSON file nested past what Python's reader recurses through (it raises RecursionError, not ValueError) or of
another type than the object expected reads as damaged wherever the app reads one: a model folder's config, tokenizer
files, index and safetensors header, a head's manifest, the cache's markers and notes. One line each, never a
traceback or an "internal error"."""
from __future__ import annotations

import struct
from pathlib import Path

import pytest

from engine.errors import ModelLoadError

DEEP = "[" * 100_000 + "]" * 100_000


def _write(path: Path, text: str = DEEP) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_a_model_folders_deep_config_and_index_are_refused_in_one_line(tmp_path):
    from engine.models.census import _weight_files, census_from_folder
    from engine.models.store import _read_json

    folder = tmp_path / "model"
    _write(folder / "config.json")
    with pytest.raises(ModelLoadError, match="config.json"):
        census_from_folder(folder, "model")
    with pytest.raises(ModelLoadError, match="config.json"):
        _read_json(folder / "config.json")
    _write(folder / "model.safetensors.index.json")
    with pytest.raises(ModelLoadError, match="index"):
        _weight_files(folder)


def test_a_deep_safetensors_header_is_refused_in_one_line(tmp_path):
    from engine.models.census import read_safetensors_header

    header = DEEP.encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        read_safetensors_header(path)


def test_a_deep_head_manifest_is_no_head(tmp_path):
    from app.core.head_log import _manifest
    from engine.heads.shards import read_manifest
    from engine.models.planner import _head_manifest

    folder = tmp_path / "head"
    _write(folder / "manifest.json")
    with pytest.raises(ModelLoadError, match="not a draft head folder"):
        read_manifest(folder)
    assert _manifest(folder) is None and _head_manifest(folder) is None


def test_deep_cache_notes_read_as_absent(tmp_path):
    from engine.models.packaged import still_verified, verified_marker
    from engine.models.presets import weights_cached
    from engine.runners.llamacpp_probe import _read

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    _write(verified_marker(gguf))
    assert still_verified(gguf, "0" * 64) is False
    _write(tmp_path / "snapshot" / "model.safetensors.index.json")
    assert weights_cached(tmp_path / "snapshot") is False
    assert _read(_write(tmp_path / "amx.json")) == {}


@pytest.mark.parametrize("text", ["[]", '"text"', "5", "null"])
def test_a_model_folders_json_of_another_type_is_refused_in_one_line(tmp_path, text):
    """tokenizer_config.json, tokenizer.json…: the loader reads each as an object (an "internal error" before)."""
    from engine.models.store import _read_json

    with pytest.raises(ModelLoadError, match="not a JSON object"):
        _read_json(_write(tmp_path / "tokenizer_config.json", text))


@pytest.mark.parametrize("header", ["[]", '"text"', "null", '{"w": []}', '{"w": {"dtype": "F32"}}',
                                    '{"w": {"dtype": "F32", "shape": [2, -1]}}', '{"w": {"dtype": 5, "shape": [2]}}'])
def test_a_safetensors_header_that_is_no_table_of_tensors_is_refused_in_one_line(tmp_path, header):
    from engine.models.census import read_safetensors_header

    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode())
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        read_safetensors_header(path)
    good = '{"__metadata__": {"format": "pt"}, "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}'
    path.write_bytes(struct.pack("<Q", len(good)) + good.encode())
    assert read_safetensors_header(path) == {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}


def _manifest_of(head: Path) -> dict:
    import json

    return json.loads((head / "manifest.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("change,says", [
    (lambda m: [], "not a JSON object"),
    (lambda m: {**m, "shards": None}, "lists no weight shards"),
    (lambda m: {**m, "shards": [5]}, "lacks its file name or SHA-256"),
    (lambda m: {**m, "shards": [{**m["shards"][0], "file": "../../etc/passwd"}]}, "not a file name in the head folder"),
    (lambda m: {**m, "shards": [{**m["shards"][0], "file": "/etc/passwd"}]}, "not a file name in the head folder"),
    (lambda m: {**m, "shards": [{**m["shards"][0], "sha256": "xyz"}]}, "not 64 hex digits"),
    (lambda m: {**m, "config": []}, "is incomplete"),
])
def test_a_damaged_head_manifest_is_refused_in_one_line_before_any_weight_is_read(tiny_head, tmp_path, change, says):
    """A head folder is a thing people pass around: its manifest names the shards to read, never a file elsewhere."""
    import json
    import shutil

    from engine.heads.shards import read_manifest

    head = tmp_path / "head"
    shutil.copytree(tiny_head.head, head)
    (head / "manifest.json").write_text(json.dumps(change(_manifest_of(head))), encoding="utf-8")
    with pytest.raises(ModelLoadError, match=says):
        read_manifest(head)


@pytest.mark.parametrize("data", [b"", b"\x08\x00\x00\x00\x00\x00\x00\x00[1,2,3] ", b"\xff" * 300])
def test_a_head_shard_safetensors_cannot_read_is_refused_in_one_line(tiny_head, tmp_path, data):
    """Its SHA-256 matches (a manifest written for it) but safetensors cannot read it: damaged, in one line."""
    import hashlib
    import json
    import shutil

    import torch

    from engine.heads.shards import load_head, read_manifest

    head = tmp_path / "head"
    shutil.copytree(tiny_head.head, head)
    manifest = _manifest_of(head)
    (head / manifest["shards"][0]["file"]).write_bytes(data)
    manifest["shards"][0]["sha256"] = hashlib.sha256(data).hexdigest()
    (head / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        load_head(read_manifest(head), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("harm,says", [("drop d2t", r"lacks weights: \['d2t'\]"), ("reshape", "has shape")])
def test_head_weights_that_do_not_fit_the_configuration_are_refused_in_one_line(tiny_head, tmp_path, harm, says):
    import hashlib
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from engine.heads.shards import load_head, read_manifest

    head = tmp_path / "head"
    shutil.copytree(tiny_head.head, head)
    manifest = _manifest_of(head)
    shard = head / manifest["shards"][0]["file"]
    tensors = load_file(str(shard))
    if harm == "drop d2t":
        tensors.pop("d2t")
    else:
        name = next(k for k, v in tensors.items() if k != "d2t" and v.dim() == 2)
        tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(shard))
    manifest["shards"][0]["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    (head / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(ModelLoadError, match=says):
        load_head(read_manifest(head), torch.device("cpu"), torch.float32)
