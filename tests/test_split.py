"""A target split over several GPUs: the placement the plan makes, and the fast path run as stages."""
from __future__ import annotations

import pytest
import torch

from engine.models.census import census_from_config
from engine.models.plan import GiB, ModelSpec, PlanInputs, build_plan
from engine.models.planner import device_maps
from engine.models.presets import preset
from engine.runners.graphs import StaticGraphRunner
from tests.tiny import build_model

VOCAB = 320


def test_stages_on_one_cpu_match_transformers_through_steps_and_rollbacks():
    """The split-model path (hidden state handed from stage to stage, a write position per stage)."""
    model = build_model(VOCAB, seed=4, layers=4)
    runner = StaticGraphRunner(model, max_length=128, graph_widths=(1,), stage_breaks=(1, 3))
    assert len(runner.decoder.stages) == 3
    assert [len(s.layers) for s in runner.decoder.stages] == [1, 2, 1]
    tokens = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    history: list[int] = []

    def feed(new: list[int]) -> None:
        out = runner.forward(torch.tensor(new))
        history.extend(new)
        with torch.no_grad():
            ref = model(torch.tensor([history])).logits[0, -len(new):].float()
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)

    feed(tokens[:17])
    feed(tokens[17:18])
    feed(tokens[18:23])
    runner.rollback(runner.length - 3)
    del history[-3:]
    feed(tokens[30:32])
    runner.prefill(torch.tensor(tokens[32:35]))
    history.extend(tokens[32:35])
    feed(tokens[35:36])


def _plan_32b(gpus: int):
    p = preset("qwen2.5-32b")
    t = ModelSpec(census_from_config(p.target.config, "32B"), "bfloat16", "bfloat16")
    d = ModelSpec(census_from_config(p.draft.config, "0.5B"), "bfloat16", "bfloat16")
    return build_plan(PlanInputs(t, d, "cuda", 8192, gpus=gpus), [48 * GiB] * gpus, "given")


def test_device_map_keeps_layers_contiguous_and_the_head_with_the_draft():
    plan = _plan_32b(2)
    mapping, draft_device = device_maps(plan, "cuda")
    layers = [mapping[f"model.layers.{i}"] for i in range(64)]
    assert layers == sorted(layers) and set(layers) == {"cuda:0", "cuda:1"}
    assert mapping["model.embed_tokens"] == "cuda:0" and mapping["lm_head"] == mapping["model.norm"] == "cuda:1"
    assert draft_device == "cuda:1"
    assert plan.fits and all(d.total < 48 * GiB for d in plan.devices)
    one, draft_one = device_maps(_plan_32b(1), "cuda:0")
    assert one is None and draft_one == "cuda:0"


def test_plan_pair_splits_only_when_one_gpu_is_not_enough():
    from engine.models.planner import plan_pair

    p = preset("qwen2.5-32b")
    one = plan_pair(p.target.spec, p.draft.spec, device="cuda", memory=80 * GiB, gpus=None)
    assert len(one.devices) == 1 and one.fits
    two = plan_pair(p.target.spec, p.draft.spec, device="cuda", memory=40 * GiB, gpus=2)
    assert [d.device for d in two.devices] == ["cuda:0", "cuda:1"] and two.fits


def _untied_target(tmp_path, tiny_pair):
    """Big models keep their output head apart from the embedding, so a split puts it on the last GPU."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    torch.manual_seed(7)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, initializer_range=0.3, eos_token_id=tok.eos_token_id)
    folder = tmp_path / "untied"
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_split_target_decodes_like_one_gpu(tiny_pair, tmp_path):
    from engine.assemble import engine_for_pair
    from engine.loadspec import LoadSpec
    from engine.models.loader import load_pair
    from engine.types import GenerationRequest

    target = _untied_target(tmp_path, tiny_pair)
    prompt = "def add(a, b):\n    return a + b\ndef add(a, b):"
    texts = []
    for gpus in (2, 1):
        pair = load_pair(LoadSpec(str(target), str(tiny_pair[1]), device="cuda", dtype="float32", gpus=gpus, force=True))
        engine = engine_for_pair(pair, LoadSpec())
        if gpus == 2:
            assert len(pair.info.devices) == 2 and engine.info.fast_path == "cuda-graphs", engine.info.fast_path_note
        texts.append("".join(s.text for s in engine.generate(
            GenerationRequest(prompt=prompt, mode="speculative", k=4, max_new_tokens=32))))
        texts.append("".join(s.text for s in engine.generate(
            GenerationRequest(prompt=prompt, mode="standard", max_new_tokens=32))))
    assert texts[0] == texts[1] == texts[2] == texts[3]
