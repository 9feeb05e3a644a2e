"""The converted-model cache under faults: damage found and repaired, one converter at a time, no leftovers."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from app.cli import main
from engine.errors import ModelLoadError
from engine.loadspec import LoadProgress, LoadSpec
from engine.models import cache, cache_space, store
from engine.models.loader import load_pair
from engine.models.packaged import PackagedModel
from tests.test_store import _fake_packages
from tests.tiny import build_model, build_tokenizer
from tests.tiny_gguf import write_tiny_gguf

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    tok = build_tokenizer()
    model = build_model(len(tok), seed=3)
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tok, model)


@pytest.fixture
def packaged(tmp_path, monkeypatch, gguf_file):
    """The tiny GGUF shipped as three part packages, standing in for the default target."""
    data = gguf_file.read_bytes()
    third = len(data) // 3 + 1
    names = _fake_packages(tmp_path / "pkgs", [data[i:i + third] for i in range(0, len(data), third)],
                           "specdec_cache_part")
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    model = PackagedModel("Fake-Target", names, hashlib.sha256(data).hexdigest(), len(data))
    monkeypatch.setitem(store.DEFAULT_MODELS, "target", model)
    return model, tmp_path / "pkgs"


def _load(spec, events=None):
    return load_pair(LoadSpec(spec, None, device="cpu", dtype="float32", with_draft=False),
                     None if events is None else events.append)


def _entry(tmp_path) -> Path:
    (entry,) = cache_space.model_entries(tmp_path / "cache")
    return entry


def _logits(pair) -> torch.Tensor:
    with torch.no_grad():
        return pair.target(torch.tensor([[5, 6, 7, 8]])).logits


def _repairs(events: list[LoadProgress]) -> list[str]:
    return [e.message for e in events if e.stage == "repair"]


# --------------------------------------------------------------------------- damage found at load

def _overwrite_inside_weights(entry: Path) -> None:
    path = entry / "model.safetensors"
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(b"\xff" * 4096)  # what 64 MiB of garbage is to the real 3.5 GB file


def _flip_header(entry: Path) -> None:
    path = entry / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8] ^= 0xFF  # the header's opening brace
    path.write_bytes(bytes(data))


def _delete_tokenizer(entry: Path) -> None:
    (entry / "tokenizer.json").unlink()


def _wrong_layer_count(entry: Path) -> None:
    config = json.loads((entry / "config.json").read_text())
    config["num_hidden_layers"] = 20
    (entry / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("harm, reason", [
    (_overwrite_inside_weights, "checksum"),
    (_flip_header, "header"),
    (_delete_tokenizer, "tokenizer.json is missing"),
    (_wrong_layer_count, "num_hidden_layers = 20"),
])
def test_damaged_cache_is_reported_and_converted_again(gguf_file, tmp_path, harm, reason):
    good = _logits(_load(str(gguf_file)))
    entry = _entry(tmp_path)
    meta = cache.read_marker(entry)
    assert set(meta["files"]) >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert all(f["sha256"] and f["size"] > 0 for f in meta["files"].values())
    harm(entry)
    events: list[LoadProgress] = []
    pair = _load(str(gguf_file), events)
    (message,) = _repairs(events)
    assert reason in message and "converting it again" in message and "\n" not in message
    assert torch.equal(_logits(pair), good)
    assert cache.damage(entry, cache.read_marker(entry)) is None


def test_damaged_default_model_is_reassembled_from_its_parts(packaged, tmp_path):
    good = _logits(_load(None))
    assert not list((tmp_path / "cache" / "gguf").iterdir()), "the assembled GGUF is removed after converting"
    _overwrite_inside_weights(_entry(tmp_path))
    events: list[LoadProgress] = []
    pair = _load(None, events)
    assert _repairs(events) and any(e.stage == "assemble" for e in events)
    assert torch.equal(_logits(pair), good)


def test_cli_says_so_in_one_line_and_answers(gguf_file, tmp_path, capsys):
    _load(str(gguf_file))
    _wrong_layer_count(_entry(tmp_path))
    code = main(["generate", "--prompt", "hi", "--target", str(gguf_file), "--mode", "standard", "--device", "cpu",
                 "--max-new-tokens", "3", "--runtime", "torch"])  # the converted cache is torch's
    err = capsys.readouterr().err
    assert code == 0
    assert [line for line in err.splitlines() if "damaged" in line] == [
        line for line in err.splitlines() if line.startswith("specdec-studio: The cached")]
    assert "num_hidden_layers = 20" in err and "Traceback" not in err


def test_a_marker_from_before_checksums_is_upgraded(gguf_file, tmp_path):
    _load(str(gguf_file))
    entry = _entry(tmp_path)
    meta = cache.read_marker(entry)
    legacy = {k: v for k, v in meta.items() if k not in ("files", "config")}
    cache.write_marker(entry, legacy)
    _wrong_layer_count(entry)  # even without records, config.json must agree with the weights
    events: list[LoadProgress] = []
    _load(str(gguf_file), events)
    assert _repairs(events)
    cache.write_marker(entry, {k: v for k, v in cache.read_marker(entry).items() if k not in ("files", "config")})
    _load(str(gguf_file))
    upgraded = cache.read_marker(entry)
    assert "sha256" not in upgraded["files"]["model.safetensors"] and upgraded["files"]["model.safetensors"]["sample"]
    assert main(["cache", "verify"]) == 0  # records the full hashes it lacked
    assert cache.read_marker(entry)["files"]["model.safetensors"]["sha256"]


def test_cache_verify_finds_what_sampling_misses(gguf_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cache, "SAMPLE_BLOCK", 1024)
    monkeypatch.setattr(cache, "SAMPLE_STRIDE", 64 * 1024)
    _load(str(gguf_file))
    entry = _entry(tmp_path)
    path = entry / "model.safetensors"
    assert path.stat().st_size > 100 * 1024
    data = bytearray(path.read_bytes())
    data[32 * 1024 + 7] ^= 0x01  # one bit, between two sampled blocks
    path.write_bytes(bytes(data))
    events: list[LoadProgress] = []
    _load(str(gguf_file), events)
    assert not _repairs(events), "a single bit between samples is beyond the cheap check"
    capsys.readouterr()
    code = main(["cache", "verify"])
    out, err = capsys.readouterr()
    assert code == 2 and "DAMAGED" in out and "SHA-256" in out
    assert len(err.splitlines()) == 1 and "removed" in err
    assert not entry.exists()
    _load(str(gguf_file))  # converted again
    assert main(["cache", "verify"]) == 0


def test_sampled_blocks_catch_any_long_overwrite(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "SAMPLE_BLOCK", 1024)
    monkeypatch.setattr(cache, "SAMPLE_STRIDE", 16 * 1024)
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(300 * 1024))
    before = cache.sampled_hash(path)
    for start in range(0, 300 * 1024 - 32 * 1024, 5000):  # every run of two strides, wherever it starts
        data = bytearray(path.read_bytes())
        original = bytes(data[start:start + 32 * 1024])
        data[start:start + 32 * 1024] = b"\x00" * (32 * 1024)
        path.write_bytes(bytes(data))
        assert cache.sampled_hash(path) != before, start
        data[start:start + 32 * 1024] = original
        path.write_bytes(bytes(data))


# --------------------------------------------------------------------------- leftovers

def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_interrupt_during_assembly_leaves_no_partial(packaged, tmp_path):
    def progress(p: LoadProgress) -> None:
        if p.stage == "assemble" and p.fraction > 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        load_pair(LoadSpec(None, None, device="cpu", with_draft=False), progress)
    assert not list((tmp_path / "cache" / "gguf").glob("*.partial"))


def test_leftovers_of_dead_processes_are_swept_and_live_ones_kept(gguf_file, tmp_path, capsys):
    root = tmp_path / "cache"
    (root / "gguf").mkdir(parents=True)
    (root / "models").mkdir()
    dead = _dead_pid()
    partial = root / "gguf" / f"Fake-0123456789ab.gguf.{dead}.partial"
    partial.write_bytes(b"x" * 5000)
    temp = root / "models" / f".tiny-0123456789ab.pid{dead}.k2j3h4g5"
    temp.mkdir()
    (temp / "model.safetensors").write_bytes(b"y" * 7000)
    old_style = root / "models" / ".tiny-0123456789ab-a1b2c3d4"  # before temp folders named their process
    old_style.mkdir()
    os.utime(old_style, (time.time() - 2 * cache_space.STALE_AFTER_S,) * 2)
    mine = root / "gguf" / f"Other-0123456789ab.gguf.{os.getpid()}.partial"  # a live process: never touched
    mine.write_bytes(b"z")

    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert out.count("  leftover  ") == 3 and out.count("  busy  ") == 1
    _load(str(gguf_file))
    assert not partial.exists() and not temp.exists() and not old_style.exists() and mine.exists()


def test_cache_clean_frees_space_and_waits_for_no_one(packaged, tmp_path, capsys):
    _load(None)
    gguf_dir = tmp_path / "cache" / "gguf"
    (gguf_dir / "Fake-Target-0123456789ab.gguf").write_bytes(b"g" * 1000)  # an assembled copy kept by a failed convert
    assert main(["cache", "clean"]) == 0
    assert "freed 1.0 KB" in capsys.readouterr().out
    assert cache_space.model_entries() and not list(gguf_dir.iterdir())

    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with cache.cache_lock():
            held.set()
            release.wait(30)

    other = threading.Thread(target=hold)
    other.start()
    held.wait(30)
    try:
        with pytest.raises(ModelLoadError, match="Another SpecDec Studio process"):
            cache_space.clean(models=True)
    finally:
        release.set()
        other.join()
    assert main(["cache", "clean", "--all"]) == 0 and not cache_space.model_entries()


# --------------------------------------------------------------------------- two processes

_WORKER = """
import json, os, sys, time
sys.path[:0] = [{root!r}, {pkgs!r}]
from engine.loadspec import LoadSpec
from engine.models import loader, store
store.DEFAULT_MODELS["target"] = store.PackagedModel("Fake-Target", {names!r}, {sha!r}, {size!r})
slow = sys.argv[1] == "slow"
ready = {ready!r}  # the second process creates it once its imports are done
if not slow:
    open(ready, "w").close()

def progress(p):
    print(json.dumps([p.stage, p.message]), flush=True)
    if slow and p.stage == "convert" and p.fraction == 0.0:
        # Converting, with the lock held: go on only once the other process is about to ask for it.
        deadline = time.time() + 120
        while not os.path.exists(ready) and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(3)

pair = loader.load_pair(LoadSpec(None, None, device="cpu", dtype="float32", with_draft=False), progress)
print(json.dumps(["done", pair.info.target_name]), flush=True)
"""


def _worker(packaged, tmp_path, mode: str) -> subprocess.Popen:
    model, pkgs = packaged
    script = tmp_path / "worker.py"
    script.write_text(_WORKER.format(root=str(ROOT), pkgs=str(pkgs), names=model.packages, sha=model.sha256,
                                     size=model.size, ready=str(tmp_path / "second-ready")))
    return subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})


def _until_converting(proc: subprocess.Popen) -> list[list[str]]:
    seen = []
    for line in proc.stdout:
        seen.append(json.loads(line))
        if seen[-1][0] == "convert":
            return seen
    raise AssertionError(f"the first process never converted: {seen} {proc.stderr.read()}")


def test_two_first_runs_at_once_share_one_conversion(packaged, tmp_path):
    first = _worker(packaged, tmp_path, "slow")
    try:
        _until_converting(first)  # it holds the lock now
        second = _worker(packaged, tmp_path, "fast")
        out2, err2 = second.communicate(timeout=300)
        out1, err1 = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 0, err1
    assert second.returncode == 0, err2
    stages = [json.loads(line)[0] for line in out2.splitlines()]
    assert "wait" in stages, out2  # it said it was waiting, through its progress callback
    assert "assemble" not in stages and "convert" not in stages, "the second process used the first one's result"
    assert stages[-1] == "done"
    assert not list((tmp_path / "cache" / "gguf").glob("*")) and len(cache_space.model_entries()) == 1


def test_kill_during_conversion_leaves_files_the_next_start_sweeps(packaged, tmp_path):
    victim = _worker(packaged, tmp_path, "slow")
    try:
        _until_converting(victim)
        victim.kill()  # SIGKILL: no cleanup code runs
        victim.wait(30)
    finally:
        victim.kill()
    root = tmp_path / "cache"
    left = [p for p in (root / "models").iterdir() if p.name.startswith(".")] + list((root / "gguf").iterdir())
    assert left, "kill -9 mid-conversion leaves a temp folder or the assembled GGUF"
    _load(None)
    assert not [p for p in (root / "models").iterdir() if p.name.startswith(".")]
    assert not list((root / "gguf").glob("*.partial"))
