"""Dynamic draft trees (engine/heads/tree.py): lossless greedy output, the sampling law, whole trees, caches."""
from __future__ import annotations

import pytest
import torch

from engine.decoding import host_walk, verify
from engine.decoding.outcome import Launched, read_outcome
from engine.decoding.sampling import draw, process
from engine.decoding.verify import verify_path
from engine.heads.tree import canned_tree
from engine.limits import TREE_K_MAX
from engine.runners.tree import Tree, TreeDraft
from engine.types import GenerationRequest, Message, Sampling
from tests.head_fixtures import head_engine
from tests.test_decoding import check_sampling_law
from tests.test_head_decoding import _messages, _run, check_caches_follow_the_committed_text


@pytest.fixture(scope="module")
def engine(tiny_head):
    return head_engine(tiny_head.target, tiny_head.head, static=True)


def _branches(steps) -> int:
    """Tokens the target accepted through a branch: not the head's first choice after their parent."""
    return sum(1 for s in steps for t in s.tokens if t.status == "accepted" and t.branch)


@pytest.mark.parametrize(("frontier", "nodes"), [(1, 1), (2, 5), (4, 16), (8, 40)])
def test_greedy_through_dynamic_trees_equals_standard(engine, frontier, nodes):
    """Every depth 1..TREE_K_MAX (longer K drafts chains), cuts by max_new_tokens inside the tree; and
    tokens are accepted through branches, so the walk leaves the head's first choices."""
    engine.set_dynamic_tree(nodes, frontier)
    branches = 0
    try:
        for k in range(1, TREE_K_MAX + 3):
            for seed in range(2):
                messages = _messages(seed * 31 + k + 7 * nodes)
                max_new = 5 + (seed * 11 + k) % 29
                std, _ = _run(engine, messages=messages, mode="standard", max_new_tokens=max_new)
                spec, steps = _run(engine, messages=messages, mode="speculative", proposer="head", k=k,
                                   max_new_tokens=max_new)
                assert spec.token_ids == std.token_ids, f"K={k} F={frontier} N={nodes} messages={messages!r}"
                assert spec.summary.text == std.summary.text
                branches += _branches(steps)
                for step in steps:
                    assert step.extra is None and len(step.proposed) <= max(k, 1)
                    assert step.accepted <= len(step.proposed)
    finally:
        engine.set_dynamic_tree(0)
    if frontier > 1:
        assert branches > 0, "no token was accepted through a branch: the test would not exercise the walk"


def test_a_two_layer_head_is_lossless_in_chains_and_dynamic_trees(tiny_head, tiny_two_layer_head):
    """A head of two decoder layers (the second with its own cache) drafts chains and dynamic trees losslessly,
    and its drafts are accepted: the second layer's cache follows the committed text as the first's does."""
    engine = head_engine(tiny_head.target, tiny_two_layer_head, static=True)
    assert engine.head_runner.head.config.layers == 2
    accepted = 0
    for nodes in (0, 12):
        engine.set_dynamic_tree(nodes, 4)
        for k in (1, 3, 6):
            for seed in range(2):
                messages = _messages(seed * 7 + k + nodes)
                max_new = 7 + (seed * 5 + k) % 23
                std, _ = _run(engine, messages=messages, mode="standard", max_new_tokens=max_new)
                spec, _ = _run(engine, messages=messages, mode="speculative", proposer="head", k=k,
                               max_new_tokens=max_new)
                assert spec.token_ids == std.token_ids, f"K={k} N={nodes} messages={messages!r}"
                accepted += spec.summary.accepted
    engine.set_dynamic_tree(0)
    assert accepted > 0


def test_eos_inside_a_branch_stops_both_modes_at_the_same_token(engine):
    """EOS set to a token accepted through a branch, mid-path: both modes stop right there."""
    engine.set_dynamic_tree(24, 4)
    saved = engine.eos_ids
    hits = 0
    try:
        for seed in range(12):
            messages = _messages(500 + seed)
            engine.eos_ids = set()
            _, steps = _run(engine, messages=messages, mode="speculative", proposer="head", k=6, max_new_tokens=30)
            done, candidate = 0, None
            for step in steps:
                for i, view in enumerate(t for t in step.tokens if t.status == "accepted"):
                    if view.branch and i + 1 < step.new_tokens:
                        candidate = view.token_id
                        break
                if candidate is not None:
                    break
                done += step.new_tokens
            if candidate is None:
                continue
            engine.eos_ids = {candidate}
            std, _ = _run(engine, messages=messages, mode="standard", max_new_tokens=30)
            spec, _ = _run(engine, messages=messages, mode="speculative", proposer="head", k=6, max_new_tokens=30)
            assert spec.token_ids == std.token_ids and spec.token_ids[-1] == candidate
            assert spec.summary.stop_reason == "eos"
            hits += 1
    finally:
        engine.eos_ids = saved
        engine.set_dynamic_tree(0)
    assert hits > 0, "no branch token was ever accepted mid-path"


def test_tree_rounds_leave_both_caches_at_the_committed_prefix(engine):
    engine.set_dynamic_tree(32, 4)
    try:
        gen, steps = check_caches_follow_the_committed_text(engine, GenerationRequest(
            messages=_messages(3), mode="speculative", proposer="head", k=7, max_new_tokens=60))
        assert steps > 10 and gen.summary.accepted > 0
    finally:
        engine.set_dynamic_tree(0)


def test_the_head_grows_whole_trees_of_distinct_siblings(engine):
    """Each drafted tree: parents come first, every depth is its parent's plus one, siblings differ,
    the ancestors are the parent chain, and the nodes are the best-scored of all candidates."""
    engine.set_dynamic_tree(20, 3)
    drafter = engine.tree_drafter
    trees = []
    real = drafter.draft

    def keep(depth, span):
        tree = real(depth, span)
        trees.append((depth, TreeDraft(*(t.clone() for t in (tree.tokens, tree.parents, tree.ranks, tree.q)),
                                       Tree(tree.shape.depth.clone(), tree.shape.ancestors.clone()),
                                       tree.max_depth)))
        return tree

    drafter.draft = keep
    try:
        _run(engine, messages=_messages(3), mode="speculative", proposer="head", k=5, max_new_tokens=40)
    finally:
        del drafter.draft
        engine.set_dynamic_tree(0)
    assert trees
    for depth, tree in trees:
        n = tree.nodes
        assert n == min(20, 3 + (depth - 1) * 9)
        parents, d, anc = tree.parents.tolist(), tree.shape.depth.tolist(), tree.shape.ancestors
        assert d[0] == 0 and max(d) <= depth
        for row in range(1, n + 1):
            parent = parents[row - 1]
            assert 0 <= parent < row and d[row] == d[parent] + 1
            chain, node = {row, 0}, parent
            while node:
                chain.add(node)
                node = parents[node - 1]
            assert {j for j in range(n + 1) if anc[row, j]} == chain
        for parent in set(parents):
            kids = [tree.tokens[i].item() for i in range(n) if parents[i] == parent]
            assert len(kids) == len(set(kids)), "siblings must be distinct tokens"
        assert all(0 < q <= 1 for q in tree.q.tolist())
    assert len(trees) > 10


def _tiny_tree() -> tuple[TreeDraft, torch.Tensor]:
    """Rows: 0 pending; 1 (a) and 2 (b) under it; 3 (c) under 1; 4 (d) under 2. Vocabulary of 8."""
    tokens = torch.tensor([1, 2, 3, 4])
    parents = torch.tensor([0, 0, 1, 2])
    depth = torch.tensor([0, 1, 1, 2, 2])
    anc = torch.eye(5, dtype=torch.bool)
    anc[:, 0] = True
    anc[3, 1] = anc[4, 2] = True
    tree = TreeDraft(tokens, parents, torch.tensor([0, 1, 0, 0]), torch.full((4,), 0.5), Tree(depth, anc), 3)
    return tree, torch.full((5, 8), -5.0)


def test_the_walk_follows_the_targets_tokens_into_a_branch():
    tree, logits = _tiny_tree()
    logits[0, 2] = logits[2, 4] = logits[4, 7] = 5.0  # the target picks b (a branch), then d, then 7
    values = verify_path(logits, tree, Sampling(), None).tolist()
    d = tree.max_depth
    shown, accepted, added = (int(v) for v in values[6 * d + 1: 6 * d + 4])
    assert (shown, accepted, added) == (2, 2, 7)  # a leaf: nothing rejected, 7 is a bonus
    assert [int(v) for v in values[:2]] == [2, 4]
    assert [int(v) for v in values[4 * d: 4 * d + 2]] == [1, 0]  # b was the head's second choice
    assert [int(v) for v in values[5 * d: 5 * d + 3]] == [0, 2, 4]  # the path's rows
    logits = torch.full((5, 8), -5.0)
    logits[0, 1] = logits[1, 6] = 5.0  # a, then the target's 6 where the head drafted c
    values = verify_path(logits, tree, Sampling(), None).tolist()
    assert [int(v) for v in values[6 * d + 1: 6 * d + 4]] == [2, 1, 6]  # a accepted, c shown rejected
    assert [int(v) for v in values[:2]] == [1, 3]


@pytest.mark.parametrize("greedy", [True, False])
def test_the_walk_on_the_host_is_the_walk_of_every_row_at_once(monkeypatch, greedy):
    """Row by row on the host (the CPU's walk) and every row at once (a GPU's) give the same outcome: greedy
    token for token, and sampled with the same token at each reached row when each row's law is a point mass."""
    gen = torch.Generator().manual_seed(3)
    sampling = Sampling() if greedy else Sampling(temperature=0.7)
    compared = branches = 0
    for trial in range(60):
        nodes, frontier = 6 + trial % 20, 2 + trial % 4
        tokens = torch.randperm(40, generator=gen)[:nodes]  # siblings are distinct tokens (the drafter's choices)
        tree = canned_tree(tokens, frontier, TREE_K_MAX)
        logits = torch.randn(nodes + 1, 40, generator=gen)
        logits[:, tree.tokens[0]] += 3.0 * (trial % 2)  # often the drafter's first token, so walks go deep
        if not greedy:  # point masses: both walks reach the same rows, whatever their draws
            logits = torch.where(logits == logits.max(-1, keepdim=True).values, 30.0, -30.0)
        host = _read_path(verify.verify_path(logits, tree, sampling, None), tree.max_depth)
        monkeypatch.setattr(verify, "WALK_ON_HOST", ())
        every = _read_path(verify.verify_path(logits, tree, sampling, None), tree.max_depth)
        monkeypatch.undo()
        assert (host.proposed, host.accepted, host.added, host.ranks, host.path_rows, host.children) == \
            (every.proposed, every.accepted, every.added, every.ranks, every.path_rows, every.children), trial
        assert host.p_shown == pytest.approx(every.p_shown, abs=1e-5)
        assert host.added_p == pytest.approx(every.added_p, abs=1e-5)
        compared += 1
        branches += host.accepted > 0
    assert compared == 60 and branches > 10


def _read_path(values: torch.Tensor, depth: int):
    return read_outcome(Launched(values, depth, None, None, None, (0.0, 0.0, 0.0, 0.0), path=True))


def test_the_host_reads_what_was_drafted_under_each_node_of_the_path():
    """RoundResult.children: per depth of the walk, the tokens under the path's node, best rank first; the
    check prices a sampled round's acceptance there as the sum of their p (verify.tree_choices)."""
    tree, logits = _tiny_tree()
    logits[0, 2] = logits[2, 4] = logits[4, 7] = 5.0  # b (the second choice), then d, then 7 at a leaf
    result = _read_path(verify_path(logits, tree, Sampling(), None), tree.max_depth)
    assert (result.proposed, result.accepted, result.added) == ([2, 4], 2, 7)
    assert result.children == [[1, 2], [4], []]  # a and b under the pending token, d under b, none under d
    logits = torch.full((5, 8), -5.0)
    logits[0, 1] = logits[1, 6] = 5.0  # a, then 6 where the head drafted c
    result = _read_path(verify_path(logits, tree, Sampling(), None), tree.max_depth)
    assert (result.proposed, result.accepted, result.children) == ([1, 3], 1, [[1, 2], [3]])


def _sequential_siblings(logits, tree, sampling, generator):
    """A wrong rule, for the test to catch: children tried in rank order, each accepted with p(x)
    WITHOUT renormalising after a rejection, the token after a full rejection drawn from p without them."""
    probs = process(logits, sampling)  # [W, V]
    width = probs.shape[0]
    parents = [-1] + tree.parents.tolist()
    ranks = [0] + tree.ranks.tolist()
    tokens = [-1] + tree.tokens.tolist()
    ok = torch.zeros(width - 1, dtype=torch.bool)
    y = torch.zeros(width, dtype=torch.long)
    for row in range(width):
        kids = sorted((i for i in range(1, width) if parents[i] == row), key=lambda i: ranks[i])
        chosen = None
        for kid in kids:
            if torch.rand((), generator=generator) < probs[row, tokens[kid]]:
                chosen = kid
                break
        if chosen is not None:
            ok[chosen - 1] = True
            y[row] = tokens[chosen]
        else:
            rest = probs[row].clone()
            rest[[tokens[k] for k in kids]] = 0
            rest = rest if rest.sum() > 0 else probs[row]  # the children held all the mass
            y[row] = draw((rest / rest.sum()).unsqueeze(0), generator)[0]
    return ok, y, probs


def _sequential_on_host(law, logits, children, sampling, generator):
    """The same wrong rule for the walk on the host (host_walk.row_token): one reached row's token."""
    for token in children:
        if torch.rand((), generator=generator) < law[token]:
            return token
    rest = law.clone()
    rest[children] = 0
    rest = rest if rest.sum() > 0 else law
    return int(draw((rest / rest.sum()).unsqueeze(0), generator)[0])


@pytest.mark.parametrize("walk", ["host", "device"])
@pytest.mark.parametrize("rule", ["exact", "mutated"])
def test_sampling_through_dynamic_trees_keeps_the_targets_law(engine, monkeypatch, rule, walk):
    """Sampled rounds walk trees with several children per node: the output law is the target's
    (chi-square over the first two tokens), with many tokens taken through a branch; the same test
    fails a rule that does not renormalise the residual between siblings. Both walks: row by row on the
    host (the CPU's) and every row at once (a GPU's, run here on the CPU)."""
    engine.set_dynamic_tree(12, 4)
    if walk == "device":
        monkeypatch.setattr(verify, "WALK_ON_HOST", ())
    if rule == "mutated":
        monkeypatch.setattr(verify, "tree_choices", _sequential_siblings)
        monkeypatch.setattr(host_walk, "row_token", _sequential_on_host)
    counted = []
    try:
        if rule == "exact":
            check_sampling_law(engine, "", proposer="head", messages=(Message("user", "hello world"),),
                               trials=1200, count=lambda steps: counted.append(_branches(steps)))
            assert sum(counted) > 100, sum(counted)
        else:  # its bias (p(x1) p(x2) taken from a second child) shows at p about 1e-4 in 1,500 trials
            with pytest.raises(AssertionError, match="pvalue"):
                check_sampling_law(engine, "", proposer="head", messages=(Message("user", "hello world"),),
                                   trials=2500)
    finally:
        engine.set_dynamic_tree(0)


def test_dynamic_tree_rounds_are_measured_for_the_prediction(engine):
    from engine.decoding.costs import measure_trees

    saved, length = engine.info, engine.target_runner.length
    try:
        engine.set_dynamic_tree(16, 4)
        measure_trees(engine, iters=1)
        assert engine.info.tree_nodes == 16 and engine.info.tree_alternatives == 0
        assert [k for k, _ in engine.info.tree_ms] == list(range(1, TREE_K_MAX + 1))
        # the tree's drafting too, at every depth: its levels rank F * F children, dearer than chain steps
        assert [k for k, _ in engine.info.tree_draft_ms] == list(range(1, TREE_K_MAX + 1))
        assert all(ms > 0 for _, ms in engine.info.tree_draft_ms)
        head_length = engine.head_runner.length
        engine.tree_drafter.rehearse(3)
        assert engine.head_runner.length == head_length, "measuring leaves the head's cache as it was"
        assert engine.target_runner.length == length
        costs = engine.step_costs()
        assert costs.tree_ms and costs.tree_draft_ms == dict(engine.info.tree_draft_ms)  # the controller's prices
        engine.set_dynamic_tree(0)
        measure_trees(engine)
        assert engine.info.tree_ms == () and engine.info.tree_nodes == 0 and engine.info.tree_draft_ms == ()
    finally:
        engine.set_dynamic_tree(0)
        engine.info = saved


def test_a_canned_tree_of_any_width_stays_within_its_depth():
    tree = canned_tree(torch.arange(1, 64), 8, TREE_K_MAX)
    assert tree.nodes == 63 and int(tree.shape.depth.max()) == 2
    with pytest.raises(AssertionError):
        canned_tree(torch.arange(1, 20), 1, 4)


def test_wrong_tree_settings_are_one_clear_error(engine):
    from engine.errors import GenerationError

    with pytest.raises(GenerationError, match="nodes"):
        engine.set_dynamic_tree(10_000)
    with pytest.raises(GenerationError, match="nodes"):
        engine.set_dynamic_tree(8, 0)


@pytest.mark.gpu
def test_dynamic_trees_on_cuda_graphs_are_lossless_in_float32(tiny_head):
    """The head's levels and pick replayed as CUDA graphs, the target's tree widths too: greedy output is
    the target's own, token for token, and tokens are taken through branches."""
    from tests.head_fixtures import cuda_head_engine

    engine = cuda_head_engine(tiny_head.target, tiny_head.head)
    runner = engine.target_runner
    engine.set_dynamic_tree(24, 4)
    drafter = engine.tree_drafter
    assert any(key[: len(drafter.key)] == drafter.key for key in engine.head_runner.graphs), "no tree graphs"
    assert all((w, runner.buckets[0]) in runner.tree_graphs for w in drafter.widths())
    branches = 0
    for seed in range(6):
        messages = _messages(300 + seed)
        std, _ = _run(engine, messages=messages, mode="standard", max_new_tokens=40)
        for k in (2, 5, 8):
            spec, steps = _run(engine, messages=messages, mode="speculative", proposer="head", k=k, max_new_tokens=40)
            assert spec.token_ids == std.token_ids, (seed, k)
            branches += _branches(steps)
    assert branches > 0


def test_the_default_tree_is_fitted_to_the_measured_costs(engine):
    """A default tree whose verify costs more than TREE_COST_LIMIT times a chain's is halved, down to chains
    (on a CPU a forward's cost grows with its width, so the tiny model's trees all cost too much); a tree
    a person chose is kept as it is."""
    from engine.limits import DEFAULT_K, TREE_COST_LIMIT

    from dataclasses import replace

    saved = engine.info
    try:
        # The chain's verify as a CPU might measure it; each tree's own rounds are measured (costs.measure_trees).
        chain = {w: 0.01 * w for w in range(1, 14)}
        engine.info = replace(engine.info, target_ms=tuple(chain.items()))
        engine.set_dynamic_tree(48, 4)
        assert engine.tree_nodes == 48  # chosen: kept
        tree = dict(engine.info.tree_ms)[DEFAULT_K]
        assert tree > TREE_COST_LIMIT * chain[DEFAULT_K + 1], "a 49-row verify costs more than a 6-row one here"
        engine.set_dynamic_tree(48, 4, fit=True)
        assert engine.tree_drafter is None and engine.alternatives() == 0  # 48, 24, then chains below 16
        engine.info = replace(engine.info, target_ms=tuple((w, 1e3) for w in range(1, 14)))
        engine.set_dynamic_tree(48, 4, fit=True)
        assert engine.tree_nodes == 48  # where a chain costs as much, the tree stays whole
    finally:
        engine.set_tree(None)
        engine.info = saved


def test_the_controller_counts_a_walk_by_the_trees_depth(engine, monkeypatch):
    """A walked tree's round tells the K controller it drafted the tree's depth, not the tokens the walk
    showed: a walk that ends on a branch with no children reached the next depth and found nothing
    there (a miss), and the verify cost it prices is the K-deep tree's."""
    from engine.decoding.control import FixedK

    seen = []
    monkeypatch.setattr(FixedK, "observe", lambda self, decision, drafted, accepted, *a, **kw:
                        seen.append((drafted, accepted, kw.get("tree"))))
    engine.set_dynamic_tree(5, 1)  # a frontier of 1: a chain-shaped tree, so walks often end early
    try:
        _, steps = _run(engine, messages=_messages(4), mode="speculative", proposer="head", k=4, max_new_tokens=40)
    finally:
        engine.set_dynamic_tree(0)
    tree_rounds = [(s, o) for s, o in zip(steps, seen) if s.tree_depth]
    assert tree_rounds
    for step, (drafted, accepted, tree) in tree_rounds:
        assert tree and drafted == step.tree_depth >= accepted == step.accepted
    assert any(len(s.proposed) < s.tree_depth for s, _ in tree_rounds)  # walks that showed fewer tokens
