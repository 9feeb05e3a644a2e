"""The memory plan: its arithmetic against hand-computed cases, the figures it reads, and its suggestions."""
from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path
from dataclasses import replace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine.models.census import census_from_config, census_from_folder, census_from_gguf
from engine.models.plan import (
    RUNTIME_BNB,
    RUNTIME_CUDA,
    SLACK,
    DraftOption,
    GiB,
    MiB,
    ModelSpec,
    PlanInputs,
    balanced_split,
    build_plan,
    cache_positions,
    format_plan,
    layer_weight_bytes,
    outside_weight_bytes,
    parse_size,
    suggest,
)
from engine.models.presets import _models, other_drafts, preset, presets
from tests.tiny import build_model

# A Qwen2 layer small enough to count by hand: hidden 64, MLP 128, 4 query heads and 2 KV heads of 16.
TINY = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 512,
        "tie_word_embeddings": True}
# q 64x64, k and v 32x64, o 64x64, gate and up 128x64, down 64x128
TINY_LINEAR = 4096 + 2048 + 2048 + 4096 + 8192 + 8192 + 8192  # 36,864 weights
TINY_ROWS = 64 + 32 + 32 + 64 + 128 + 128 + 64  # 512 output rows
TINY_OTHER = 2 * 64 + (64 + 32 + 32)  # two RMSNorms + the q/k/v biases = 256


def test_census_of_a_tiny_qwen2_is_counted_by_hand():
    c = census_from_config(TINY, "tiny")
    layer = c.layers[0]
    assert (layer.linear_params, layer.linear_rows, layer.linears, layer.other_params) == (
        TINY_LINEAR, TINY_ROWS, 7, TINY_OTHER)
    assert layer.largest_linear == 8192
    assert c.embed_params == 320 * 64 and c.head_params == 0 and c.other_params == 64  # tied head, final norm
    assert c.params == 2 * (TINY_LINEAR + TINY_OTHER) + 320 * 64 + 64


def test_weight_bytes_per_precision_by_hand():
    c = census_from_config(TINY, "tiny")
    per_layer = {
        "float32": (TINY_LINEAR + TINY_OTHER) * 4,
        "bfloat16": (TINY_LINEAR + TINY_OTHER) * 2,
        # int8: a byte per weight + a float32 scale per output row; norms and biases stay bf16
        "int8": TINY_LINEAR + 4 * TINY_ROWS + 2 * TINY_OTHER,
        # nf4: half a byte per weight + a float32 absmax per 64 + a 16-float code book per module
        "nf4": TINY_LINEAR // 2 + 4 * (TINY_LINEAR // 64) + 7 * 64 + 2 * TINY_OTHER,
    }
    assert per_layer["int8"] == 39_424 and per_layer["nf4"] == 21_696
    for precision, expected in per_layer.items():
        compute = precision if precision in ("float32", "bfloat16") else "bfloat16"
        spec = ModelSpec(c, precision, compute)
        assert layer_weight_bytes(spec) == [expected, expected], precision
        assert outside_weight_bytes(spec) == (320 * 64 * (4 if compute == "float32" else 2),
                                              64 * (4 if compute == "float32" else 2))


@pytest.mark.parametrize("model_id", sorted(_models()))
def test_preset_configs_count_what_transformers_builds(model_id):
    """Each shipped config, built on the meta device: the same parameter count as the census."""
    config = dict(_models()[model_id].config)
    hf = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items()
                                                       if k not in ("model_type", "architectures", "torch_dtype")})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    assert census_from_config(config, model_id).params == sum(p.numel() for p in model.parameters())


def test_known_sizes_of_the_seeds_models():
    sizes = {m: census_from_config(_models()[m].config, m).params for m in
             ("Qwen/Qwen2.5-32B-Instruct", "Qwen/Qwen3-32B", "meta-llama/Llama-3.1-8B-Instruct")}
    assert sizes == {"Qwen/Qwen2.5-32B-Instruct": 32_763_876_352, "Qwen/Qwen3-32B": 32_762_123_264,
                     "meta-llama/Llama-3.1-8B-Instruct": 8_030_261_248}


def test_safetensors_headers_agree_with_the_config(tmp_path):
    model = build_model(320, seed=0)
    model.save_pretrained(tmp_path)
    from_headers = census_from_folder(tmp_path, "tiny")
    config = json.loads((tmp_path / "config.json").read_text())
    assert from_headers.source == "safetensors headers"
    assert from_headers.layers == census_from_config(config, "tiny").layers
    assert from_headers.params == sum(p.numel() for p in model.parameters())


def test_gguf_header_census(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    for key, value in (("block_count", 2), ("embedding_length", 64), ("feed_forward_length", 128),
                       ("attention.head_count", 4), ("attention.head_count_kv", 2), ("context_length", 512)):
        w.add_uint32(f"qwen2.{key}", value)
    shapes = {"token_embd.weight": (320, 64), "output_norm.weight": (64,)}
    for i in range(2):
        for name, shape in (("attn_q", (64, 64)), ("attn_k", (32, 64)), ("attn_v", (32, 64)),
                            ("attn_output", (64, 64)), ("ffn_gate", (128, 64)), ("ffn_up", (128, 64)),
                            ("ffn_down", (64, 128))):
            shapes[f"blk.{i}.{name}.weight"] = shape
        shapes.update({f"blk.{i}.attn_q.bias": (64,), f"blk.{i}.attn_k.bias": (32,), f"blk.{i}.attn_v.bias": (32,),
                       f"blk.{i}.attn_norm.weight": (64,), f"blk.{i}.ffn_norm.weight": (64,)})
    for name, shape in shapes.items():
        w.add_tensor(name, np.zeros(shape, dtype=np.float32))  # numpy shape [out, in]; GGUF stores [in, out]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    c = census_from_gguf(path, "tiny")
    assert c.layers == census_from_config(TINY, "tiny").layers
    assert (c.embed_params, c.head_params, c.vocab) == (320 * 64, 0, 320)


def test_kv_cache_and_context_rounding_by_hand():
    c = census_from_config(_models()["packaged:target"].config, "target")
    assert cache_positions(c, 1000, "graphs") == 1024  # the static cache rounds up to 64 slots
    assert cache_positions(c, 1000, "eager") == 1000  # a dynamic cache grows to what is used
    assert cache_positions(c, 10**6, "graphs") == 32768  # never past the model's own limit
    plan = build_plan(PlanInputs(ModelSpec(c, "bfloat16", "bfloat16"), None, "cuda", 8192), [80 * GiB], "given")
    kv = next(i for i in plan.devices[0].items if i.kind == "kv")
    # 2 (K and V) x 28 layers x 2 KV heads x 128 x 8192 positions x 2 bytes
    assert kv.bytes == 2 * 28 * 2 * 128 * 8192 * 2 == 234_881_024


def test_plan_total_is_its_lines_and_runtime_carries_the_slack():
    c = census_from_config(TINY, "tiny")
    plan = build_plan(PlanInputs(ModelSpec(c, "bfloat16", "bfloat16"), ModelSpec(c, "nf4", "bfloat16"), "cuda", 512),
                      [GiB], "given")
    dev = plan.devices[0]
    tensors = sum(i.bytes for i in dev.items if i.kind != "runtime")
    runtime = next(i for i in dev.items if i.kind == "runtime")
    assert runtime.bytes == RUNTIME_CUDA + RUNTIME_BNB + int(SLACK * tensors)  # the nf4 draft loads bitsandbytes
    assert dev.total == tensors + runtime.bytes and plan.fits
    assert [i.model for i in dev.items if i.kind == "weights"] == ["target", "draft"]
    plain = build_plan(PlanInputs(ModelSpec(c, "bfloat16", "bfloat16"), ModelSpec(c, "bfloat16", "bfloat16"), "cuda",
                                  512), [GiB], "given")
    tensors = sum(i.bytes for i in plain.devices[0].items if i.kind != "runtime")
    assert next(i for i in plain.devices[0].items if i.kind == "runtime").bytes == RUNTIME_CUDA + int(SLACK * tensors)


def test_int8_models_plan_no_graphs_and_nf4_models_do():
    c = census_from_config(TINY, "tiny")
    for precision, runner, graphs in (("int8", "static-eager", False), ("nf4", "cuda-graphs", True)):
        plan = build_plan(PlanInputs(ModelSpec(c, precision, "bfloat16"), None, "cuda", 512), [GiB], "given")
        assert plan.runner == runner
        assert any(i.kind == "graphs" for i in plan.devices[0].items) is graphs


def test_balanced_split_evens_out_the_gpus():
    # 64 equal layers of 1 unit, the embedding (3) on the first GPU, head + draft (5) on the last
    placement = balanced_split([1] * 64, 3, 5, 2)
    assert placement == sorted(placement) and set(placement) == {0, 1}
    loads = [3 + placement.count(0), 5 + placement.count(1)]
    assert loads == [36, 36]
    assert balanced_split([1] * 4, 0, 0, 1) == [0, 0, 0, 0]
    assert len(set(balanced_split([1] * 3, 100, 0, 3))) == 3  # every GPU still gets a layer


def test_a_split_plan_covers_each_gpu():
    t = census_from_config(_models()["Qwen/Qwen2.5-32B-Instruct"].config, "32B")
    d = census_from_config(_models()["Qwen/Qwen2.5-0.5B-Instruct"].config, "0.5B")
    bf16 = "bfloat16"
    inputs = PlanInputs(ModelSpec(t, bf16, bf16), ModelSpec(d, bf16, bf16), "cuda", 8192, gpus=2)
    plan = build_plan(inputs, [40 * GiB, 40 * GiB], "given")
    assert [dev.device for dev in plan.devices] == ["cuda:0", "cuda:1"]
    assert plan.fits and abs(plan.devices[0].total - plan.devices[1].total) < 2 * GiB
    assert not any(i.model == "draft" for i in plan.devices[0].items)  # the draft sits with the output head
    weights = sum(i.bytes for dev in plan.devices for i in dev.items if i.kind == "weights" and i.model == "target")
    assert weights == t.params * 2


def test_parse_size():
    assert parse_size("24GiB") == 24 * GiB and parse_size("24G") == 24 * GiB
    assert parse_size("512 MiB") == 512 * MiB and parse_size("80GB") == 80 * 10**9
    with pytest.raises(ValueError):
        parse_size("lots")


def _pair(name: str) -> tuple[ModelSpec, ModelSpec]:
    p = preset(name)
    return (ModelSpec(census_from_config(p.target.config, p.target.name), "bfloat16", "bfloat16", p.target.spec),
            ModelSpec(census_from_config(p.draft.config, p.draft.name), "bfloat16", "bfloat16", p.draft.spec))


def test_the_cheapest_change_quantizes_the_14b_target_to_fast_int8_on_a_24_gib_card():
    """On a GPU the 8-bit step is int8-wo (faster than bf16), never bitsandbytes' LLM.int8 (30x slower)."""
    t, d = _pair("r1-distill-14b")
    inputs = PlanInputs(t, d, "cuda", 8192)
    assert not build_plan(inputs, [24 * GiB], "given").fits
    change = suggest(inputs, [24 * GiB], "given", (DraftOption(None, "no draft"),))
    assert change is not None and change.target_precision == "int8-wo" and change.context == 8192
    assert change.description == "Quantize the target to int8-wo" and change.needed <= 24 * GiB
    cpu = suggest(PlanInputs(t, d, "cpu", 8192), [20 * GiB], "given", (DraftOption(None, "no draft"),))
    assert cpu is not None and cpu.target_precision in ("int8", "nf4")
    for eight_bit in ("int8", "int8-wo", "fp8"):  # from any 8-bit precision the next step is nf4
        tight = PlanInputs(replace(t, precision=eight_bit), d, "cuda", 8192)
        assert suggest(tight, [16 * GiB], "given", ()).target_precision == "nf4", eight_bit


def test_suggestions_reach_for_nf4_shorter_contexts_and_other_drafts():
    t, d = _pair("qwen3-32b")
    inputs = PlanInputs(t, d, "cuda", 32768)
    options = tuple(DraftOption(ModelSpec(census_from_config(m.config, m.name), "bfloat16", "bfloat16", m.spec), m.name)
                    for m in other_drafts("Qwen/Qwen3-32B", "Qwen/Qwen3-1.7B"))
    assert [o.name for o in options] == ["Qwen3-0.6B"]
    change = suggest(inputs, [24 * GiB], "given", options)
    assert change is not None and change.target_precision == "nf4"
    assert change.needed <= 24 * GiB and change.context < 32768
    assert suggest(inputs, [2 * GiB], "given", options) is None  # nothing makes 32B fit in 2 GiB


def test_format_plan_says_it_does_not_fit_and_what_to_do():
    t, d = _pair("qwen2.5-32b")
    inputs = PlanInputs(t, d, "cuda", 8192)
    plan = build_plan(inputs, [24 * GiB], "given")

    plan = replace(plan, suggestion=suggest(inputs, [24 * GiB], "given"))
    text = format_plan(plan)
    assert "DOES NOT FIT" in text and "Cheapest change that fits: Quantize the target to nf4" in text
    assert "24.00 GiB given" in text


def test_every_preset_names_shipped_configs():
    names = [p.name for p in presets()]
    assert names[0] == "default" and presets()[0].offline
    assert {"r1-distill-14b", "qwen2.5-14b", "qwen2.5-32b", "qwen3-32b", "qwen3-32b-0.6b", "llama3.1-8b"} <= set(names)
    for p in presets():
        for m in (p.target, p.draft):
            assert census_from_config(m.config, m.name).params > 0
    assert math.isclose(census_from_config(preset("default").target.config, "t").params / 1e9, 1.777, rel_tol=1e-3)


def test_cpu_packing_releases_each_original_linear_as_it_goes(monkeypatch):
    """The CPU fast path repacks linears in place; holding every original until the end doubled the peak."""
    import gc
    import weakref

    from engine.runners import cpu

    if not cpu.onednn_available():
        pytest.skip("no oneDNN in this torch build")
    model = build_model(320, seed=0, layers=3)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        before = model(ids).logits
    originals = [weakref.ref(m) for _, m in model.named_modules() if type(m) is torch.nn.Linear]
    alive_at_each_pack = []
    real_init = cpu.PackedLinear.__init__

    def counting_init(self, linear, dtype=None):
        real_init(self, linear, dtype)
        gc.collect()
        alive_at_each_pack.append(sum(r() is not None for r in originals))

    monkeypatch.setattr(cpu.PackedLinear, "__init__", counting_init)
    assert cpu.pack_linears(model) == len(originals)
    # While packing the n-th linear, only it and those not yet packed are alive.
    assert alive_at_each_pack == list(range(len(originals), 0, -1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, atol=1e-4, rtol=1e-4)


def test_an_attached_head_is_counted_by_hand_where_the_logits_come_out():
    from engine.limits import tree_widths
    from engine.models.plan import HeadSpec, forward_transient

    c = census_from_config(TINY, "tiny")
    spec = ModelSpec(c, "bfloat16", "bfloat16")
    head = HeadSpec("tiny head", parameters=10_000, hidden=64, n_kv_heads=2, head_dim=16, n_features=3,
                    draft_vocab=100)
    inputs = PlanInputs(spec, spec, "cuda", 512, head=head)
    plan = build_plan(inputs, [GiB], "given")
    items = {i.label: i.bytes for i in plan.devices[0].items if i.model == "head"}
    assert items["draft head (weights, output rows, cache)"] == (
        10_000 * 2 + 100 * 64 * 2 + 2 * 2 * 16 * 512 * 2 + 3 * (inputs.k_max + 1) * 100 * 4)
    trees = tree_widths()
    assert trees == (9, 65)  # the default dynamic tree: 8 nodes at depth 1, 64 deeper
    layer, logits = forward_transient(spec, trees[-1], 512)
    kept = (sum(trees) + sum(range(1, inputs.k_max + 2))) * 3 * 64 * 2
    assert items["tree CUDA graphs of the target (outputs and pool)"] == sum(trees) * 320 * 4 + layer + logits + kept
    without = build_plan(PlanInputs(spec, spec, "cuda", 512), [GiB], "given")
    assert plan.devices[0].total > without.devices[0].total

    eight_bit = build_plan(PlanInputs(spec, spec, "cuda", 512, head=replace(head, precision="int8-wo")), [GiB], "given")
    assert next(i.bytes for i in eight_bit.devices[0].items if i.model == "head") == items[
        "draft head (weights, output rows, cache)"] - 10_000  # one byte a weight instead of two
    two = build_plan(PlanInputs(spec, spec, "cuda", 512, head=replace(head, layers=2)), [GiB], "given")
    assert next(i.bytes for i in two.devices[0].items if i.model == "head") == items[
        "draft head (weights, output rows, cache)"] + 2 * 2 * 16 * 512 * 2  # a second layer's own cache
    cpu = build_plan(PlanInputs(spec, spec, "cpu", 512, head=head), [GiB], "given")
    assert [i.label for i in cpu.devices[0].items if i.model == "head"] == ["draft head (weights, output rows, cache)"]
    split = build_plan(PlanInputs(spec, spec, "cuda", 512, gpus=2, head=head), [GiB, GiB], "given")
    assert not [i for d in split.devices for i in d.items if i.model == "head"], "a split target loads no head"


def test_the_plan_finds_the_shipped_head_for_the_default_target_and_only_for_it(tmp_path):
    from engine.heads.shards import MANIFEST
    from engine.models.planner import HEAD_MANIFEST, head_spec, model_census

    assert HEAD_MANIFEST == MANIFEST
    target = model_census("default", "target")[0]
    shipped = head_spec("auto", target, "bfloat16")
    assert shipped is not None and shipped.hidden == target.hidden and shipped.draft_vocab > 0 and shipped.layers == 1
    manifest = json.loads((Path(str(resources.files("assets").joinpath("heads"))) / "qwen2.5-coder-1.5b-instruct"
                           / MANIFEST).read_text(encoding="utf-8"))
    manifest["config"]["layers"] = 2
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")
    assert head_spec(tmp_path / "two", target, "bfloat16") == replace(shipped, layers=2)
    assert head_spec("auto", census_from_config(TINY, "tiny"), "bfloat16") is None  # no head for this shape
    assert head_spec(None, target, "bfloat16") is None and head_spec("none", target, "bfloat16") is None
    for text in ("{not json", "[]", '{"config": {"hidden": "x"}, "target": [1]}',
                 '{"config": {"hidden": 8, "n_kv_heads": 1, "head_dim": 4, "feature_layers": 3, "draft_vocab": 5}}'):
        (tmp_path / "manifest.json").write_text(text)
        assert head_spec(tmp_path, target, "bfloat16") is None  # the load says what is wrong, in one line
    from engine.models.planner import plan_pair

    with_head = plan_pair("default", "default", device="cuda", memory=80 * GiB, gpus=1, head="auto")
    assert any(i.model == "head" for i in with_head.devices[0].items)
    assert "draft head" in format_plan(with_head)
