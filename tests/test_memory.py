"""Host memory on the CPU fast path: what packing replaced is released, mapped file pages are given back."""
from __future__ import annotations

import gc
import shutil
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.assemble import engine_for_pair, load_pair_packed
from engine.loadspec import LoadSpec
from engine.models.loader import load_pair
from engine.models.memory import MappedFiles
from engine.runners import cpu
from engine.types import GenerationRequest
from tests.tiny import build_model, build_tokenizer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not cpu.onednn_available(),
                                reason="reads /proc and needs oneDNN")


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory) -> Path:
    """A model saved in bfloat16, as the cache holds converted models (untied head too): ~20 MB of weights."""
    tok = build_tokenizer()
    model = build_model(len(tok), seed=4, layers=4, hidden=512)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    model = model.to(torch.bfloat16)
    model.config.eos_token_id = tok.eos_token_id
    folder = tmp_path_factory.mktemp("bf16") / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _mapped_rss(path: Path) -> int:
    """Bytes of `path` resident through this process's mappings of it (from /proc/self/smaps)."""
    total, inside = 0, False
    target = str(path.resolve())
    with open("/proc/self/smaps", encoding="utf-8", errors="replace") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                inside = len(head) >= 6 and head[5] == target
            elif inside and head and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def _weights(folder: Path) -> Path:
    return folder / "model.safetensors"


def test_packing_holds_one_replaced_layer_at_a_time(tiny_pair, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_pair[0]), dtype=torch.float32).eval()
    originals = [weakref.ref(m.weight) for m in model.modules() if type(m) is nn.Linear]
    alive_at_each_pack: list[int] = []
    real_init = cpu.PackedLinear.__init__

    def counting_init(self, linear, dtype=None):
        gc.collect()
        alive_at_each_pack.append(sum(r() is not None for r in originals))
        real_init(self, linear, dtype)

    monkeypatch.setattr(cpu.PackedLinear, "__init__", counting_init)
    assert cpu.pack_linears(model) == len(originals)
    gc.collect()
    # The tied head's weight is the embedding: it stays. Every other replaced weight is gone, and
    # while packing, layers already replaced were gone too (the old code held all of them: 2x peak).
    assert sum(r() is not None for r in originals) <= 1
    n = len(originals)
    assert all(alive <= n - i + 1 for i, alive in enumerate(alive_at_each_pack)), alive_at_each_pack


def test_packing_trims_the_heap_after_every_layer(tiny_pair, monkeypatch):
    """Each layer's cast copy is freed between packed weights, where glibc keeps it resident: trimmed
    once per model, the default draft's float32 packing ended 1.4 GB above its live size."""
    from transformers import AutoModelForCausalLM

    from engine.models import memory

    model = AutoModelForCausalLM.from_pretrained(str(tiny_pair[0]), dtype=torch.bfloat16).eval()
    trims: list[int] = []
    monkeypatch.setattr(memory, "trim_heap", lambda: trims.append(1))
    assert cpu.pack_linears(model, torch.float32) == len(trims)


@pytest.mark.skipif(not cpu.onednn_packs(torch.bfloat16), reason="oneDNN packs no bfloat16 on this CPU (AVX2 alone)")
def test_bfloat16_pages_of_packed_weights_are_given_back(bf16_folder):
    pair = load_pair(LoadSpec(str(bf16_folder), None, device="cpu", dtype="bfloat16", with_draft=False))
    size = _weights(bf16_folder).stat().st_size
    with torch.no_grad():
        pair.target(torch.tensor([[1, 2, 3]]))  # every weight touched: all pages resident
    assert _mapped_rss(_weights(bf16_folder)) > 0.9 * size
    engine = engine_for_pair(pair, LoadSpec(fast_path="auto"))
    assert engine.info.fast_path == "cpu-onednn"
    assert _mapped_rss(_weights(bf16_folder)) < 0.1 * size, "packed weights' file pages must not stay resident"
    list(engine.generate(GenerationRequest(prompt="def add(a, b):", mode="standard", max_new_tokens=4)))


def test_float32_from_a_bfloat16_file_is_exact_and_keeps_no_pages(bf16_folder, tmp_path):
    from transformers import AutoModelForCausalLM

    # A file of its own: pages another test still maps (a failed test's frames live on) are not ours to count.
    bf16_folder = Path(shutil.copytree(bf16_folder, tmp_path / "model"))
    reference = AutoModelForCausalLM.from_pretrained(str(bf16_folder), dtype=torch.float32).eval()
    pair = load_pair(LoadSpec(str(bf16_folder), None, device="cpu", dtype="float32", with_draft=False))
    assert pair.target.dtype == torch.float32 and all(p.dtype == torch.float32 for p in pair.target.parameters())
    assert _mapped_rss(_weights(bf16_folder)) < 0.1 * _weights(bf16_folder).stat().st_size
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(pair.target(ids).logits, reference(ids).logits)  # bf16 -> fp32 is exact either way
    engine = engine_for_pair(pair, LoadSpec(fast_path="auto"))
    embedding = engine.target.get_input_embeddings()
    # Only looked up now (the head is packed): an exact bfloat16 copy instead of float32 rows.
    assert isinstance(embedding, cpu.CompactEmbedding) and embedding.weight.dtype == torch.bfloat16
    assert engine.target.dtype == torch.float32
    assert not any(p.dtype != torch.float32 for p in engine.target.parameters())
    eager = engine_for_pair(load_pair(LoadSpec(str(bf16_folder), None, device="cpu", dtype="float32", with_draft=False)),
                            LoadSpec(fast_path="eager"))
    request = GenerationRequest(prompt="def add(a, b):", mode="standard", max_new_tokens=12)
    fast_run, eager_run = engine.generate(request), eager.generate(request)
    list(fast_run), list(eager_run)
    assert fast_run.token_ids == eager_run.token_ids


def test_pack_cpu_packs_each_model_before_the_next_loads(tiny_pair, monkeypatch):
    from engine.models import loader

    loaded: list[nn.Module] = []
    unpacked_when_loading: list[int] = []
    real = loader._load_model

    def recording(*args, **kwargs):
        unpacked_when_loading.append(sum(type(m) is nn.Linear for model in loaded for m in model.modules()))
        model = real(*args, **kwargs)
        loaded.append(model)
        return model

    monkeypatch.setattr(loader, "_load_model", recording)
    packed = load_pair_packed(LoadSpec(str(tiny_pair[0]), str(tiny_pair[1]), device="cpu", dtype="float32"))
    pair = packed.pair
    assert unpacked_when_loading == [0, 0]  # the draft loaded beside an already packed target
    assert not any(type(m) is nn.Linear for model in (pair.target, pair.draft) for m in model.modules())
    engine = engine_for_pair(packed, LoadSpec(fast_path="auto"))
    assert engine.info.fast_path == "cpu-onednn"
    plain = engine_for_pair(loader.load_pair(LoadSpec(str(tiny_pair[0]), str(tiny_pair[1]), device="cpu",
                                                      dtype="float32")), LoadSpec(fast_path="eager"))
    request = GenerationRequest(prompt="def add(a, b):", mode="speculative", k=3, max_new_tokens=12)
    a, b = engine.generate(request), plain.generate(request)
    list(a), list(b)
    assert a.token_ids == b.token_ids


def test_float32_pack_cpu_casts_each_weight_as_it_packs(bf16_folder, monkeypatch):
    from engine.models import loader

    seen: list[torch.dtype] = []
    real = cpu.PackedLinear.__init__

    def recording(self, linear, dtype=None):
        seen.append(linear.weight.dtype)  # what the packer was handed: still the file's bfloat16
        real(self, linear, dtype)

    monkeypatch.setattr(cpu.PackedLinear, "__init__", recording)
    packed = load_pair_packed(LoadSpec(str(bf16_folder), None, device="cpu", dtype="float32", with_draft=False))
    pair = packed.pair
    assert seen[1:] and set(seen[1:]) == {torch.bfloat16}  # after the 8x8 float32 probe of try_pack
    assert all(t.dtype == torch.float32 for t in pair.target.parameters())
    embedding = pair.target.get_input_embeddings()
    assert isinstance(embedding, cpu.CompactEmbedding) and embedding.weight.dtype == torch.bfloat16
    # The file's own tensor, memory-mapped: only rows looked up become resident, no 2-byte copy of it all.
    assert MappedFiles().contains(embedding.weight)
    monkeypatch.setattr(cpu.PackedLinear, "__init__", real)
    reference = engine_for_pair(loader.load_pair(LoadSpec(str(bf16_folder), None, device="cpu", dtype="float32",
                                                          with_draft=False)), LoadSpec(fast_path="eager"))
    engine = engine_for_pair(packed, LoadSpec(fast_path="auto"))
    request = GenerationRequest(prompt="def add(a, b):", mode="standard", max_new_tokens=12)
    a, b = engine.generate(request), reference.generate(request)
    list(a), list(b)
    assert a.token_ids == b.token_ids


def test_without_onednn_pack_cpu_still_gives_a_float32_model(bf16_folder, monkeypatch):
    from engine.models import loader

    monkeypatch.setattr(cpu, "onednn_available", lambda: False)
    pair = load_pair_packed(LoadSpec(str(bf16_folder), None, device="cpu", dtype="float32", with_draft=False)).pair
    assert all(t.dtype == torch.float32 for t in pair.target.parameters())
    assert any(type(m) is nn.Linear for m in pair.target.modules())
    assert not hasattr(pair.target.get_input_embeddings(), "file_weight")  # kept for a packer that did not run



def test_a_weight_cast_on_its_way_in_packs_to_the_same_layer():
    torch.manual_seed(0)
    linear = nn.Linear(64, 300, bias=True)
    linear.weight = nn.Parameter(linear.weight.detach().to(torch.bfloat16))  # as load_pair leaves it: still mapped
    packed = cpu.PackedLinear(linear, torch.float32)
    x = torch.randn(5, 64)
    want = nn.functional.linear(x, linear.weight.float(), linear.bias)
    assert torch.allclose(packed(x), want, atol=1e-4, rtol=1e-4)


def test_float32_pack_cpu_keeps_no_float32_embedding_for_the_head(tiny_head, tmp_path, monkeypatch):
    """The head binds to the target before packing; packing then keeps the input embedding in exact
    bfloat16, and the float32 one must go at once, not live on in the head while the draft loads
    (until the engine is built and rebinds it): for the default pair, 0.9 GB of the float32 load peak."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from engine.models import loader
    from tests.head_fixtures import load_target

    model, tok = load_target(tiny_head.target)
    folder = tmp_path / "bf16-target"
    model.to(torch.bfloat16).save_pretrained(folder)  # as the cache holds converted models
    tok.save_pretrained(folder)
    del model
    replaced: list[StorageWeakRef] = []
    real = cpu._compact_embedding

    def recording(target, to_be_packed):
        replaced.append(StorageWeakRef(target.get_input_embeddings().weight.untyped_storage()))
        real(target, to_be_packed)

    monkeypatch.setattr(cpu, "_compact_embedding", recording)
    packed = load_pair_packed(LoadSpec(str(folder), None, device="cpu", dtype="float32", with_draft=False,
                                       head=str(tiny_head.head)))
    embedding = packed.pair.target.get_input_embeddings()
    assert isinstance(embedding, cpu.CompactEmbedding) and packed.head is not None
    head = packed.head[0]
    assert head.embed.dtype == torch.bfloat16 and head.embed.data_ptr() == embedding.weight.data_ptr()
    gc.collect()
    assert len(replaced) == 1 and replaced[0].expired(), "the float32 embedding packing replaced is still alive"
    assert head.lm_rows.dtype == torch.float32  # the head itself still drafts in float32
