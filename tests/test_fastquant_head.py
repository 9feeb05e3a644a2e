"""An untied output head in int8-wo / fp8 (fastquant.quantize_model): the maths, the lean forward's passes,
losslessness, a draft head's rows and the memory plan."""
from __future__ import annotations

import pytest
import torch

from engine.models import fastquant as fq
from engine.models.plan import ModelSpec, outside_weight_bytes
from tests.tiny import build_model, noisy_copy

VOCAB = 320


def _dequantized_twin(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A float32 model holding `model`'s dequantized weights (layers and head)."""
    twin = build_model(VOCAB, seed=seed, tied=False)
    with torch.no_grad():
        for q_layer, f_layer in zip(model.model.layers, twin.model.layers):
            for name, module in q_layer.named_modules():
                if isinstance(module, fq.QuantLinear):
                    f_layer.get_submodule(name).weight.copy_(module.weight_float())
        twin.lm_head.weight.copy_(model.lm_head.weight_float())
    return twin


def test_an_untied_head_is_quantized_where_asked_and_a_tied_one_never():
    untied = build_model(VOCAB, seed=4, tied=False)
    assert fq.quantize_model(untied, "int8-wo") == 2 * 7 and type(untied.lm_head) is torch.nn.Linear  # CPU: kept
    untied = build_model(VOCAB, seed=4, tied=False)
    assert fq.quantize_model(untied, "fp8", head=True) == 2 * 7 + 1
    assert isinstance(untied.lm_head, fq.QuantLinear) and untied.lm_head.kind == "fp8"
    assert untied.model.embed_tokens.weight.dtype == torch.float32, "the embedding stays float"
    tied = build_model(VOCAB, seed=4)
    assert fq.quantize_model(tied, "int8-wo", head=True) == 2 * 7 and type(tied.lm_head) is torch.nn.Linear
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


@pytest.mark.parametrize("kind", fq.FAST_PRECISIONS)
def test_quantizing_on_a_device_in_blocks_of_rows_is_exact(kind):
    linear = build_model(VOCAB, seed=2, tied=False).lm_head
    whole = fq.QuantLinear.from_linear(linear, kind)
    blocks = fq.QuantLinear.from_linear(linear, kind, device=torch.device("cpu"), block=7)
    assert torch.equal(whole.qweight.view(torch.uint8), blocks.qweight.view(torch.uint8))
    assert torch.equal(whole.scale, blocks.scale)


def test_the_lean_forward_reads_an_8bit_head_in_passes_as_wide_as_the_kernel():
    from engine.runners.graphs import StaticGraphRunner

    model = build_model(VOCAB, seed=6, tied=False)
    fq.quantize_model(model, "int8-wo", head=True)
    twin = _dequantized_twin(model, seed=6)
    tokens = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = twin(tokens[None]).logits[0].float()
    runner = StaticGraphRunner(model, max_length=128, graph_widths=(1,))
    assert runner.decoder.lm_rows_per_call == fq.kernel.MAX_ROWS
    runner.decoder.lm_rows_per_call = 4  # ten rows: passes of 4, 4 and 2
    runner.prefill(tokens[:30])
    out = runner.forward(tokens[30:])
    assert out.dtype == torch.float32 and out.shape == (10, VOCAB)
    torch.testing.assert_close(out, full[30:], atol=1e-4, rtol=1e-4)


def test_speculative_equals_standard_with_8bit_heads(tiny_pair):
    """Untied 8-bit target and draft heads on the lean runners (float32 activations): speculative == standard."""
    from transformers import AutoTokenizer

    from engine.decoding import Engine
    from engine.runners.graphs import build_runners
    from engine.types import GenerationRequest, ModelInfo

    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    target = build_model(len(tok), seed=8, tied=False)
    draft = noisy_copy(target, noise=0.02, seed=9)
    for model in (target, draft):
        fq.quantize_model(model, "int8-wo", head=True)
        assert isinstance(model.lm_head, fq.QuantLinear)
    info = ModelInfo(target_name="t", draft_name="d", device="cpu", dtype="float32", fast_path="eager",
                     vocab_size=len(tok))
    eager = Engine(target, tok, info, draft=draft)
    t, d, _ = build_runners(target, draft, max_length=256, k_max=6)
    fast = Engine(target, tok, info, draft=draft, target_runner=t, draft_runner=d)
    prompt = "def add(a, b):\n    return a + b\ndef add(a, b):"
    ref = "".join(s.text for s in eager.generate(GenerationRequest(prompt=prompt, mode="standard", max_new_tokens=40)))
    accepted = 0
    for k in (1, 4):
        gen = fast.generate(GenerationRequest(prompt=prompt, mode="speculative", k=k, max_new_tokens=40))
        assert "".join(s.text for s in gen) == ref, k
        accepted += gen.summary.accepted
    assert accepted > 0, "no draft was accepted: the test would not exercise acceptance"


@pytest.mark.parametrize("kind", fq.FAST_PRECISIONS)
def test_a_draft_head_gathers_the_dequantized_rows_of_an_8bit_head(kind):
    model = build_model(VOCAB, seed=3, tied=False)
    reference = model.lm_head.weight.detach().clone()
    fq.quantize_model(model, kind, head=True)
    rows = torch.tensor([5, 0, 319, 17])
    weight, bias = fq.head_rows(model.lm_head, rows, torch.float32)
    assert bias is None and weight.shape == (4, 64)
    torch.testing.assert_close(weight, model.lm_head.weight_float()[rows])
    assert (weight - reference[rows]).abs().max() <= model.lm_head.scale[rows].max() * (32 if kind == "fp8" else 0.5)
    plain, _ = fq.head_rows(build_model(VOCAB, seed=3, tied=False).lm_head, rows)
    torch.testing.assert_close(plain, reference[rows])


def test_the_plan_counts_an_8bit_head_on_a_gpu_and_a_float_one_elsewhere(tmp_path):
    from engine.models.census import census_from_folder

    model = build_model(VOCAB, seed=0, tied=False)
    model.save_pretrained(tmp_path)
    census = census_from_folder(tmp_path, "tiny untied")
    assert census.head_params == VOCAB * 64
    embed, head = outside_weight_bytes(ModelSpec(census, "int8-wo", "float32"), "cuda")
    fq.quantize_model(model, "int8-wo", head=True)
    held = sum(b.numel() * b.element_size() for b in model.lm_head.buffers())
    held += model.model.norm.weight.numel() * 4
    assert (embed, head) == (VOCAB * 64 * 4, held)
    assert outside_weight_bytes(ModelSpec(census, "int8-wo", "float32"), "cpu")[1] == (VOCAB * 64 + 64) * 4
    assert outside_weight_bytes(ModelSpec(census, "bfloat16", "bfloat16"), "cuda")[1] == (VOCAB * 64 + 64) * 2


@pytest.mark.gpu
@pytest.mark.parametrize("kind", fq.FAST_PRECISIONS)
def test_cuda_graphs_run_an_8bit_head_in_passes(kind):
    from engine.runners.graphs import StaticGraphRunner

    if kind == "fp8" and fq.precision_problem("fp8", torch.device("cuda")):
        pytest.skip(fq.precision_problem("fp8", torch.device("cuda")))
    model = build_model(VOCAB, seed=7, tied=False).to("cuda", torch.bfloat16)
    fq.quantize_model(model, kind)  # on a GPU an untied head is quantized without being asked
    assert isinstance(model.lm_head, fq.QuantLinear)
    wide = fq.kernel.MAX_ROWS + 6
    runner = StaticGraphRunner(model, max_length=256, graph_widths=(1, wide))
    runner.warmup()
    assert runner.name == "cuda-graphs", runner.fallback_reason
    tokens = torch.randint(0, VOCAB, (100,), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    runner.prefill(tokens[:30])
    out = runner.forward(tokens[30:30 + wide]).clone()
    with torch.no_grad():
        full = model(tokens[None, :30 + wide]).logits[0, 30:].float()
    # bf16 through two kernel paths: within 5% of the logits' range, and the same next tokens
    torch.testing.assert_close(out, full, atol=5e-2 * float(full.abs().max()), rtol=0)
    assert (out.argmax(-1) == full.argmax(-1)).float().mean() > 0.95
