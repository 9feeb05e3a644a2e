"""8-bit and 4-bit models through bitsandbytes: precision choices, loading, the plan's bytes, the fast path.

Where bitsandbytes cannot quantize here (not installed, or a build without this device's kernels)
the tests that need it skip with the reason; the checks of the error messages always run.
"""
from __future__ import annotations

import importlib.util
import json
import warnings
from functools import lru_cache

import pytest
import torch

from engine.errors import ModelLoadError
from engine.models import quant
from engine.models.census import census_from_folder
from engine.loadspec import normalize_precision
from engine.models.quant import checkpoint_quantization
from tests.tiny import build_model


@lru_cache(maxsize=1)
def _bnb_problem() -> str | None:
    """None when bitsandbytes quantizes a layer on this machine's default device, else why not."""
    problem = quant.bitsandbytes_problem()
    if problem:
        return problem
    try:
        import bitsandbytes as bnb

        device = "cuda" if torch.cuda.is_available() else "cpu"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            layer = bnb.nn.Linear4bit(64, 64, compute_dtype=torch.float32, quant_type="nf4").to(device)
            layer(torch.zeros(2, 64, device=device))
    except Exception as e:  # a build without kernels for this device
        return f"bitsandbytes cannot quantize on {device} here: {type(e).__name__}: {str(e)[:120]}"
    return None


needs_bnb = pytest.mark.skipif(_bnb_problem() is not None, reason=str(_bnb_problem()))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# --------------------------------------------------------------------------- choices and messages

def test_precision_names_and_aliases():
    assert [normalize_precision(x) for x in ("bf16", "FP16", "fp32", "8bit", "4bit", "int4", None, "none")] == [
        "bfloat16", "float16", "float32", "int8", "nf4", "nf4", "auto", "auto"]
    with pytest.raises(ModelLoadError, match="int8-wo or fp8"):
        normalize_precision("int3")


def test_checkpoint_quantization_reads_config():
    assert checkpoint_quantization({}) is None
    int8 = {"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}}
    assert checkpoint_quantization(int8) == "int8"
    assert checkpoint_quantization({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                                            "bnb_4bit_quant_type": "nf4"}}) == "nf4"
    assert checkpoint_quantization({"quantization_config": {"quant_method": "awq", "bits": 4}}) == "awq"


def test_without_bitsandbytes_quantizing_is_one_clear_line(monkeypatch, tiny_pair):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    from engine.loadspec import LoadSpec
    from engine.models.loader import load_pair

    with pytest.raises(ModelLoadError) as e:
        load_pair(LoadSpec(str(tiny_pair[0]), str(tiny_pair[1]), device="cpu", target_precision="nf4"))
    message = str(e.value)
    assert "\n" not in message and "pip install" in message and "bitsandbytes" in message
    load_pair(LoadSpec(str(tiny_pair[0]), str(tiny_pair[1]), device="cpu", dtype="float32"))  # float still loads


# --------------------------------------------------------------------------- loading (needs bitsandbytes)

def _bytes(model: torch.nn.Module) -> int:
    """Bytes the model holds: parameters, buffers and bitsandbytes' quantization state."""
    seen, n = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            n += t.numel() * t.element_size()
    for m in model.modules():
        weight = getattr(m, "weight", None)
        state = getattr(weight, "quant_state", None)
        if state is not None:
            n += sum(x.numel() * x.element_size() for x in (state.absmax, state.code))
        # LLM.int8()'s row scales: on the weight, or moved to the layer's state by its first forward.
        scb = getattr(weight, "SCB", None)
        if scb is None:
            scb = getattr(getattr(m, "state", None), "SCB", None)
        if scb is not None and scb.data_ptr() not in seen:
            n += scb.numel() * scb.element_size()
    return n


@needs_bnb
@pytest.mark.parametrize("precision", ["int8", "nf4"])
def test_quantized_target_loads_and_the_plan_counts_its_bytes(tiny_pair, precision):
    from engine.loadspec import LoadSpec
    from engine.models.loader import load_pair
    from engine.models.quant import quantized_kind

    pair = load_pair(LoadSpec(str(tiny_pair[0]), str(tiny_pair[1]), device=DEVICE, dtype="float32", target_precision=precision))
    assert quantized_kind(pair.target) == precision and quantized_kind(pair.draft) is None
    assert pair.info.target_precision == precision and pair.info.draft_precision == "float32"
    planned = next(i.bytes for i in pair.plan.devices[0].items if i.kind == "weights" and i.model == "target")
    rotary = sum(b.numel() * b.element_size() for b in pair.target.buffers())  # RoPE tables: not weights
    assert planned == _bytes(pair.target) - rotary


@needs_bnb
def test_a_prequantized_checkpoint_loads_as_it_is(tiny_pair, tmp_path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from engine.loadspec import LoadSpec
    from engine.models.loader import load_pair
    from engine.models.quant import quantized_kind

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(
            tiny_pair[0], dtype=torch.float32, device_map={"": DEVICE},
            quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_compute_dtype=torch.float32))
    folder = tmp_path / "prequantized"
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny_pair[0] / name).read_bytes())
    census = census_from_folder(folder, "pre")
    assert census.prequantized == "nf4" and census.layers[0].stored_bytes > 0
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["load_in_4bit"]
    pair = load_pair(LoadSpec(str(folder), str(tiny_pair[1]), device=DEVICE, dtype="float32"))
    assert quantized_kind(pair.target) == "nf4"
    assert "pre-quantized" in pair.plan.target_precision


@needs_bnb
@pytest.mark.parametrize("precision", ["int8", "nf4"])
def test_lean_forward_over_quantized_layers_matches_transformers(tiny_pair, precision):
    from engine.loadspec import LoadSpec
    from engine.models.loader import load_pair
    from engine.runners import EagerRunner
    from engine.runners.graphs import StaticGraphRunner, capture_problem

    pair = load_pair(LoadSpec(str(tiny_pair[0]), None, device=DEVICE, dtype="float32", target_precision=precision, with_draft=False))
    model = pair.target
    assert (capture_problem(model) is None) == (precision == "nf4")  # LLM.int8() cannot be captured
    runner = StaticGraphRunner(model, max_length=128, graph_widths=(1, 4))
    assert runner.decoder.quantized
    # transformers' own forward, fed the same chunks: LLM.int8() picks outlier columns per call, so
    # both sides must see the same rows to run the same arithmetic.
    reference = EagerRunner(model)
    tokens = torch.randint(0, runner.vocab_size, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    for new in (tokens[:20], tokens[20:21], tokens[21:25], tokens[25:26]):
        ids = torch.tensor(new, device=DEVICE)
        torch.testing.assert_close(runner.forward(ids), reference.forward(ids), atol=2e-3, rtol=2e-3)
    runner.rollback(22)
    reference.rollback(22)
    ids = torch.tensor(tokens[5:9], device=DEVICE)
    torch.testing.assert_close(runner.forward(ids), reference.forward(ids), atol=2e-3, rtol=2e-3)


@needs_bnb
def test_greedy_speculative_equals_standard_with_an_nf4_target(tiny_pair):
    from engine.decoding import Engine
    from engine.loadspec import LoadSpec
    from engine.models.loader import load_pair
    from engine.runners.graphs import build_runners
    from engine.types import GenerationRequest

    pair = load_pair(LoadSpec(str(tiny_pair[0]), str(tiny_pair[1]), device=DEVICE, dtype="float32",
                              target_precision="nf4"))
    t, d, _ = build_runners(pair.target, pair.draft, max_length=256, k_max=6)
    engine = Engine(pair.target, pair.tokenizer, pair.info, draft=pair.draft, target_runner=t, draft_runner=d)
    prompt = "def add(a, b):\n    return a + b\ndef add(a, b):"
    ref = "".join(s.text for s in engine.generate(GenerationRequest(prompt=prompt, mode="standard", max_new_tokens=32)))
    for k in (1, 4):
        steps = list(engine.generate(GenerationRequest(prompt=prompt, mode="speculative", k=k, max_new_tokens=32)))
        assert "".join(s.text for s in steps) == ref
        assert sum(s.accepted for s in steps) > 0


@needs_bnb
def test_engine_reports_why_int8_runs_without_graphs(tiny_pair):
    from engine.assemble import engine_for_pair
    from engine.loadspec import LoadSpec
    from engine.models.loader import load_pair

    pair = load_pair(LoadSpec(str(tiny_pair[0]), str(tiny_pair[1]), device=DEVICE, dtype="float32", target_precision="int8"))
    engine = engine_for_pair(pair, LoadSpec())
    if DEVICE == "cuda":
        assert engine.info.fast_path == "static-eager" and "int8" in engine.info.fast_path_note
    else:
        assert engine.info.fast_path == "eager"  # no oneDNN packing for quantized layers on a CPU


@pytest.mark.gpu
@needs_bnb
def test_nf4_is_captured_in_cuda_graphs(tiny_pair):
    from engine.loadspec import LoadSpec
    from engine.models.loader import load_pair
    from engine.runners.graphs import build_runners

    pair = load_pair(LoadSpec(str(tiny_pair[0]), str(tiny_pair[1]), device="cuda", dtype="bfloat16", target_precision="nf4"))
    t, d, name = build_runners(pair.target, pair.draft, max_length=256, k_max=4)
    assert name == "cuda-graphs", t.fallback_reason


def test_bnb_model_is_never_moved_with_to(tiny_pair, monkeypatch):
    """transformers refuses .to() on 8-bit models: loading must place weights with device_map instead."""
    import transformers

    from engine.loadspec import LoadSpec
    from engine.models import loader

    calls = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        calls.append(kwargs)
        model = real(*args, **kwargs)
        monkeypatch.setattr(model, "to", lambda *a, **k: pytest.fail(".to() called on a loaded model"))
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    loader.load_pair(LoadSpec(str(tiny_pair[0]), None, device="cpu", dtype="float32", with_draft=False))
    assert calls and calls[0]["dtype"] == torch.float32


def test_tiny_model_sizes_match_the_census(tmp_path):
    build_model(320, seed=0).save_pretrained(tmp_path)
    assert census_from_folder(tmp_path, "t").params == sum(p.numel() for p in build_model(320, seed=0).parameters())


def test_without_accelerate_float_loads_still_work_and_quantized_ones_say_why(monkeypatch, tiny_pair):
    from engine.loadspec import LoadSpec
    from engine.models.loader import load_pair

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "accelerate" else real(name, *a))
    load_pair(LoadSpec(str(tiny_pair[0]), None, device="cpu", dtype="float32", with_draft=False))
    if _bnb_problem() is None:
        with pytest.raises(ModelLoadError, match="needs the accelerate package"):
            load_pair(LoadSpec(str(tiny_pair[0]), None, device="cpu", dtype="float32", target_precision="nf4", with_draft=False))


def test_importing_bitsandbytes_never_asks_the_hub_for_a_kernel(tmp_path):
    """bitsandbytes' import, on a CPU with AVX512-BF16, asks the Hub for a 4-bit kernel (kernels.get_kernel):
    nothing is fetched at run time here, so the project's import of it (the plan, the load) keeps bitsandbytes'
    own kernel, quietly. A stand-in `kernels` package records any call; a fresh interpreter imports through the
    project's helpers first, as the app and the CLI do."""
    import subprocess
    import sys
    from pathlib import Path

    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed")
    fake = tmp_path / "kernels"
    fake.mkdir()
    called = tmp_path / "called"
    (fake / "__init__.py").write_text(
        f"def get_kernel(*args, **kwargs):\n    open({str(called)!r}, 'a').write(repr(args))\n"
        "    raise RuntimeError('no kernels here')\n", encoding="utf-8")
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "import kernels  # imported first, as transformers may\n"
            "from engine.models import quant\n"
            "assert quant.bitsandbytes_problem() is None\n"
            "quant.nf4_absmax_bytes_on_cpu()\n"
            "import bitsandbytes.functional\n"
            "import kernels as again; assert again.get_kernel  # the package itself is left as it was\n")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not called.exists(), called.read_text()
    assert "kernels-community" not in done.stderr, done.stderr[-2000:]
