"""On a CPU the head's dynamic trees are verified by the lean decoder over the oneDNN-packed target: the load
builds that runner when a head attaches, fits the tree to the costs it measured, and stays lossless."""
from __future__ import annotations

from dataclasses import replace

import pytest

from engine.assemble import build_engine
from engine.limits import TREE_NODES_MIN
from engine.loadspec import LoadSpec
from engine.runners.eager import EagerRunner
from engine.runners.graphs import StaticGraphRunner
from engine.types import GenerationRequest, Message
from tests.test_head_decoding import _messages


def _load(tiny_head, **changes):
    spec = LoadSpec(target=str(tiny_head.target), with_draft=False, device="cpu", dtype="float32",
                    head=str(tiny_head.head))
    return build_engine(replace(spec, **changes))


def _text(engine, messages, **kw) -> tuple[list[int], list]:
    gen = engine.generate(GenerationRequest(messages=messages, max_new_tokens=40, **kw))
    steps = list(gen)
    return list(gen.token_ids), steps


@pytest.fixture(scope="module")
def engine(tiny_head):
    return _load(tiny_head)


def test_a_cpu_load_with_a_head_verifies_dynamic_trees_losslessly(engine):
    assert isinstance(engine.target_runner, StaticGraphRunner) and engine.info.fast_path == "cpu-onednn"
    assert engine.tree_nodes in (TREE_NODES_MIN, 0)  # the default, fitted to what its verify measured here
    engine.set_dynamic_tree(TREE_NODES_MIN)  # as a person would choose it: kept whatever it costs
    widths = []
    for seed in range(6):
        messages = _messages(seed)
        standard, _ = _text(engine, messages, mode="standard")
        head, steps = _text(engine, messages, mode="speculative", proposer="head", k=5)
        assert head == standard, seed
        widths += [s.tree_width for s in steps if s.tree_width]
    assert widths and max(widths) > 6  # rounds verified trees wider than a K = 5 chain


@pytest.mark.parametrize("ratio, nodes", [(1.1, TREE_NODES_MIN), (1.2, TREE_NODES_MIN), (1.3, 0)])
def test_the_cpu_default_tree_is_fitted_to_its_measured_verify(engine, monkeypatch, ratio, nodes):
    """The smallest tree stays while its verify costs at most TREE_MIN_COST_LIMIT (1.25) times a chain's: it keeps
    about 1.3x the tokens a round; one that costs more gives chains."""
    chain = dict(engine.info.target_ms)[6]

    def measured(e, reuse=False):
        e.info = replace(e.info, tree_nodes=e.tree_nodes, tree_ms=tuple((k, ratio * chain) for k in range(1, 9)))

    monkeypatch.setattr("engine.decoding.engine.measure_trees", measured)
    engine.set_tree(None)
    assert engine.tree_nodes == nodes


def test_without_a_head_or_on_the_eager_path_the_cpu_keeps_its_eager_runner(tiny_head):
    assert isinstance(_load(tiny_head, head=None).target_runner, EagerRunner)
    eager = _load(tiny_head, fast_path="eager")
    assert isinstance(eager.target_runner, EagerRunner) and eager.tree_nodes == 0
    messages = (Message("user", "hello"),)
    head, _ = _text(eager, messages, mode="speculative", proposer="head", k=3)
    assert head == _text(eager, messages, mode="standard")[0]


def test_auto_drafts_the_head_only_as_deep_as_its_tree_grows(engine):
    """Past the tree's depth the head would draft a chain, which the tree's statistics do not describe."""
    from engine.limits import TREE_K_MAX

    engine.set_dynamic_tree(TREE_NODES_MIN)
    proposer = engine.tree_drafter
    assert proposer is not None and proposer.max_depth == TREE_K_MAX
    steps = []
    for seed in range(4):
        messages = _messages(seed)
        auto, run = _text(engine, messages, mode="auto", proposer="head")
        assert auto == _text(engine, messages, mode="standard")[0], seed
        steps += [s for s in run if s.proposed]
    assert steps, "auto never drafted: the test would not exercise its choice of K"
    assert all(s.tree_width and 1 <= s.tree_depth <= TREE_K_MAX for s in steps)
