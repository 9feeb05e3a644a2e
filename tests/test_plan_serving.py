"""The memory plan counts what serving several sequences at once holds: the batch's cache rows on torch, the
multi-sequence KV pools on llama.cpp (serve --max-seqs, plan --max-seqs)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from app.cli import main as cli_main
from engine.models.census import census_from_config
from engine.models.plan import GiB, HeadSpec, ModelSpec, PlanInputs, build_plan, cache_positions, kv_layer_bytes
from engine.runners.batched import BatchedDecoder
from engine.runners.llamacpp import RESERVED_OUTPUTS
from engine.runners.llamacpp_plan import COMPUTE_PER_MODEL, GgufFacts, build_llamacpp_plan, kv_bytes
from tests.tiny import build_model

SERVED = "served sequences"


def _served(plan) -> dict[str, int]:
    return {i.model: i.bytes for d in plan.devices for i in d.items if SERVED in i.label}


def test_the_plan_counts_the_cache_rows_the_batch_allocates():
    model = build_model(320, seed=0, context=512)
    spec = ModelSpec(census_from_config(model.config.to_dict(), "tiny"), "float32", "float32")
    for context in (200, 512):
        plan = build_plan(PlanInputs(spec, spec, "cpu", context, sequences=3), [GiB], "given")
        served = _served(plan)
        decoder = BatchedDecoder(model, context, 3)  # on a CPU runner the batch builds its own lean decoder
        allocated = decoder.kv.numel() * decoder.kv.element_size() + decoder.lean.cache_bytes()
        assert served["target"] == served["draft"] == allocated
    # With a head the CPU target runs on the lean decoder already, which the batch shares: its rows alone.
    head = HeadSpec("h", 1000, 64, 2, 16, 3, 100, "float32")
    with_head = _served(build_plan(PlanInputs(spec, spec, "cpu", 512, head=head, sequences=3), [GiB], "given"))
    assert with_head["target"] == 3 * kv_layer_bytes(spec, 512) * 2 and with_head["draft"] == served["draft"]
    # One sequence at a time adds nothing; a graph runner's lean decoder is shared, so only the batch's rows count.
    assert _served(build_plan(PlanInputs(spec, spec, "cpu", 512), [GiB], "given")) == {}
    on_gpu = _served(build_plan(PlanInputs(spec, None, "cuda", 512, sequences=3), [GiB], "given"))
    assert on_gpu == {"target": 3 * kv_layer_bytes(spec, cache_positions(spec.census, 512, "static")) * 2}


def test_the_plan_counts_the_batched_graphs_static_buffers():
    """On a GPU every row goes through one captured forward per width (runners/batched_graphs.py): the plan counts
    its static ids, logits and kept rows, and the widest forward's own activations in the graphs' pool."""
    model = build_model(320, seed=0, context=512)
    spec = ModelSpec(census_from_config(model.config.to_dict(), "tiny"), "float32", "float32")
    head = HeadSpec("h", 1000, 64, 2, 16, 3, 100, "float32")
    plan = build_plan(PlanInputs(spec, None, "cuda", 512, head=head, sequences=3), [GiB], "given")
    graphs = [i for i in plan.devices[0].items if i.label.startswith("target CUDA graphs of 3 rows")]
    decoder = BatchedDecoder(model, 512, 3)
    decoder.use_all_rows(keep=(1, 2, 3))  # on a CPU the buffers, no graphs
    static = decoder.all_rows.buffer_bytes()
    assert len(graphs) == 1 and static < graphs[0].bytes < 4 * static


def test_the_plan_counts_the_batched_heads_cache_rows_and_static_inputs(tiny_head):
    from engine.heads.batched import BatchedHeadRunner
    from engine.heads.shards import load_head, read_manifest
    from engine.limits import K_MAX
    from engine.models.planner import head_spec
    from tests.head_fixtures import load_target

    model, _ = load_target(tiny_head.target)
    files = read_manifest(tiny_head.head)
    head = load_head(files, torch.device("cpu"), torch.float32).bind(model)
    spec = ModelSpec(census_from_config(model.config.to_dict(), "tiny"), "float32", "float32")
    h = head_spec(tiny_head.head, spec.census, "float32")
    plan = build_plan(PlanInputs(spec, None, "cpu", 512, head=h, sequences=3), [GiB], "given")
    item = next(i for i in plan.devices[0].items if i.label == "draft head caches of 3 served sequences")
    runner = BatchedHeadRunner(head, 3, 512, K_MAX)
    assert runner.buffer_bytes() <= item.bytes < 1.2 * runner.buffer_bytes()


def test_a_split_target_or_a_model_the_batch_cannot_run_adds_nothing():
    model = build_model(320, seed=0, context=512)
    census = census_from_config(model.config.to_dict(), "tiny")
    spec = ModelSpec(census, "bfloat16", "bfloat16")
    split = build_plan(PlanInputs(spec, None, "cuda", 512, gpus=2, sequences=4), [GiB, GiB], "given")
    assert _served(split) == {}  # a split target is served one sequence at a time
    other = ModelSpec(replace(census, model_type="gpt2"), "bfloat16", "bfloat16")
    assert _served(build_plan(PlanInputs(other, None, "cuda", 512, sequences=4), [GiB], "given")) == {}


def test_the_served_rows_make_a_plan_that_fit_alone_not_fit():
    model = build_model(320, seed=0, context=512)
    spec = ModelSpec(census_from_config(model.config.to_dict(), "tiny"), "float32", "float32")
    alone = build_plan(PlanInputs(spec, spec, "cuda", 512), [GiB], "given")
    room = alone.devices[0].total + 50 * 2**20
    assert build_plan(PlanInputs(spec, spec, "cuda", 512), [room], "given").fits
    many = build_plan(PlanInputs(spec, spec, "cuda", 512, sequences=512), [room], "given")
    assert not many.fits and sum(_served(many).values()) > 50 * 2**20


def _facts(name: str, layers: int, kv_values: int, max_positions: int) -> GgufFacts:
    return GgufFacts(name=name, file_type="Q4_K_M", size=10**8, layers=layers, kv_values=kv_values,
                     max_positions=max_positions, vocab=1000)


def test_the_llamacpp_plan_counts_each_models_pool_up_to_its_sequences_contexts():
    target, draft = _facts("t", 28, 256, 32768), _facts("d", 24, 128, 4096)
    one = build_llamacpp_plan([("target", target), ("draft", draft)], 8192, 64 * GiB)
    four = build_llamacpp_plan([("target", target), ("draft", draft)], 8192, 64 * GiB, sequences=4)
    assert _served(one) == {}
    # A row holds what the target's context does; the draft's own is shorter here, so its rows are.
    assert _served(four) == {"target": kv_bytes(target, 4 * 8192), "draft": kv_bytes(draft, 4 * 4096)}
    buffers = next(i.bytes for i in four.devices[0].items if i.label.startswith("batch logits"))
    outputs = 4 * RESERVED_OUTPUTS
    assert buffers > 2 * (outputs * 1000 * 4 + COMPUTE_PER_MODEL)  # logits of every row's widest verify, and more
    assert four.devices[0].total > one.devices[0].total + sum(_served(four).values())


def test_cli_plan_counts_max_seqs_and_refuses_a_bad_count(capsys):
    assert cli_main(["plan", "--device", "cpu", "--context", "4096", "--max-seqs", "4"]) == 0
    out = capsys.readouterr().out
    assert "target KV cache of 4 served sequences (4,096 each)" in out and "draft head caches of 4" in out
    assert cli_main(["plan", "--device", "cpu", "--max-seqs", "0"]) == 2
    assert "--max-seqs must be from 1 to 1024, got 0" in capsys.readouterr().err


def test_serve_refuses_before_loading_when_its_sequences_do_not_fit(tiny_pair, capsys, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("weights loaded although the plan said no"))
    args = ["serve", "--port", "0", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--device", "cpu",
            "--memory", "520MiB", "--proposer", "draft"]
    code = cli_main([*args, "--max-seqs", "1024"])
    err = capsys.readouterr().err
    assert code == 2 and "it will not fit" in err and "fewer than 1024 sequences at once (--max-seqs)" in err
