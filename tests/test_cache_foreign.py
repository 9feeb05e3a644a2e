"""The model cache removes only what it made: a user's own files in the cache path survive every load and clean."""
from __future__ import annotations

import os
import time

import pytest

from app.cli import main
from engine.models import cache_space
from engine.models.cache_space import TAG, sweep


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _user_model(folder):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}", encoding="utf-8")
    (folder / "model.safetensors").write_bytes(b"my fine-tune")
    old = time.time() - 3 * cache_space.STALE_AFTER_S  # old enough to look like any leftover
    os.utime(folder, (old, old))
    return folder


def test_a_users_model_folder_in_models_survives_a_sweep(root):
    mine = _user_model(root / "models" / "my-finetune")
    sweep()
    assert (mine / "model.safetensors").read_bytes() == b"my fine-tune"


def test_a_users_folder_in_a_tagged_cache_survives_too(root):
    (root / "models").mkdir(parents=True)
    (root / TAG).write_text(cache_space.TAG_TEXT, encoding="utf-8")
    mine = _user_model(root / "models" / "my-finetune-0123456789ab")  # even with a cache-like name: no marker
    assert sweep() == 0 and mine.is_dir()


def test_cache_clean_refuses_a_folder_holding_foreign_files(root, capsys):
    (root / "gguf").mkdir(parents=True)
    (root / "gguf" / "my-own.gguf").write_bytes(b"weights")
    _user_model(root / "models" / "my-finetune")
    assert main(["cache", "clean", "--all"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did not make" in err and "nothing was removed" in err
    assert (root / "gguf" / "my-own.gguf").exists() and (root / "models" / "my-finetune").exists()


def test_clean_in_a_tagged_cache_removes_only_its_own_names(root, capsys):
    gguf = root / "gguf"
    gguf.mkdir(parents=True)
    (root / TAG).write_text(cache_space.TAG_TEXT, encoding="utf-8")
    ours = gguf / "Qwen-0123456789ab.gguf"
    ours.write_bytes(b"g" * 100)
    (gguf / "Qwen-0123456789ab.gguf.verified.json").write_text("{}", encoding="utf-8")
    theirs = gguf / "my-own.gguf"
    theirs.write_bytes(b"t")
    assert main(["cache", "clean"]) == 0
    assert not ours.exists() and not (gguf / "Qwen-0123456789ab.gguf.verified.json").exists() and theirs.exists()
    assert main(["cache", "info"]) == 0
    assert "not made by SpecDec Studio" in capsys.readouterr().out


def test_a_link_in_the_cache_is_never_followed(root, tmp_path):
    target = _user_model(tmp_path / "elsewhere" / "model")
    (root / "models").mkdir(parents=True)
    (root / TAG).write_text(cache_space.TAG_TEXT, encoding="utf-8")
    (root / "models" / ".x-0123456789ab.pid1.abcdefgh").symlink_to(target, target_is_directory=True)
    assert main(["cache", "clean", "--all"]) == 0
    assert (target / "model.safetensors").exists()


def test_an_old_cache_of_ours_is_tagged_and_swept(root):
    (root / "models").mkdir(parents=True)
    (root / ".lock").write_bytes(b"")
    leftover = root / "models" / ".tiny-0123456789ab-a1b2c3d4"  # an old-style temp folder, a day old
    leftover.mkdir()
    os.utime(leftover, (time.time() - 2 * cache_space.STALE_AFTER_S,) * 2)
    sweep()
    assert (root / TAG).is_file() and not leftover.exists()


@pytest.mark.parametrize("action", ["info", "verify", "clean"])
def test_a_cache_path_that_is_a_file_is_one_line(root, capsys, action):
    root.write_text("not a folder", encoding="utf-8")
    assert main(["cache", action]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a folder" in err
    assert root.read_text(encoding="utf-8") == "not a folder"
