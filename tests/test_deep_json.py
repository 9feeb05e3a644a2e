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
