"""The draft check's prices: measured acceptance per position through the cost model's price of a round, per K."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from engine.limits import K_MAX
from engine.measure.check_math import Rounds, rescue_rates
from engine.measure.check_types import CandidateCheck
from engine.measure.costmodel import CostModel, answer_share, costs_at, expected_tokens, tree_costs_at
from engine.measure.experiment import alternative_tokens
from engine.types import ModelInfo, ProposerCost, Sampling


def _best(speedups: Sequence[float]) -> int:
    """1-based K of the highest speedup (the best K even when none pays: the verdict says so)."""
    return max(range(len(speedups)), key=lambda i: speedups[i]) + 1 if speedups else 0


def price_chain(info: ModelInfo, name: str, params: int, target_params: int, cost: ProposerCost | None,
                sampled_cost: ProposerCost | None, summary: dict, sampling: Sampling,
                positions_from: str, answer_tokens: int | None = None) -> CandidateCheck:
    """A draft model: for each K its rounds' per-position acceptance through CostModel.step_ms(K), for answers
    of `answer_tokens` tokens where given (costmodel.answer_share: the last rounds keep what is left).

    After a round that kept every draft the draft's next forward is 2 tokens wide (its last draft and
    the bonus), priced like the target's 2-token forward scaled to the draft, as the bench's prediction
    does (experiment.predicted_speedup): on llama.cpp a 2-token forward costs 1.8x a 1-token one.
    """
    sampled = not sampling.greedy
    target = costs_at(info, sampled)[0]
    c = sampled_cost if sampled and sampled_cost is not None else cost
    ratio = params / target_params if params and target_params else None
    base = dict(name=name, kind="draft", status="ok", params=params, size_ratio=ratio, kl=summary["kl"],
                top1=summary["top1"], positions_from=positions_from)
    if c is None or 1 not in target:
        return CandidateCheck(**base, greedy_positions=summary["greedy"][K_MAX].per_position,
                              sampled_positions=summary["sampled"][K_MAX].per_position)
    model = CostModel(draft_ms=c.per_token_ms, target_ms=target, draft_fixed_ms=c.per_proposal_ms)
    speedups = []
    for k in range(1, K_MAX + 1):
        r: Rounds = summary["sampled"][k]
        per_position = r.per_position or (0.0,)
        wide = r.all_accepted * c.per_token_ms * (model.target_cost(2) / model.target_cost(1) - 1.0)
        speedups.append(expected_tokens(per_position, k) * answer_share(per_position, k, answer_tokens)
                        * model.standard_ms() / (model.step_ms(k) + wide))
    k = _best(speedups)
    return CandidateCheck(**base, greedy_positions=summary["greedy"][k].per_position,
                          sampled_positions=summary["sampled"][k].per_position,
                          cost_ratio=c.per_token_ms / target[1], best_k=k, speedup=speedups[k - 1],
                          speedups=tuple(speedups))


def price_head(info: ModelInfo, head_runner, target_params: int, summary: dict, tally, sampling: Sampling,
               positions_from: str, answer_tokens: int | None = None) -> CandidateCheck:
    """The draft head: chains through CostModel.speedup_from_positions; where the engine verifies its
    drafts as sibling trees (ModelInfo.tree_ms), also each tree's measured verify with the alternatives'
    extra token (experiment.alternative_tokens, the bench's own count). Where it grows dynamic trees,
    only the tree: the acceptance its walked rounds showed, each K's verify and its own drafting
    (ModelInfo.tree_draft_ms; chain steps' cost where that was not measured).

    A round costs its forwards, as measured at load, and the host's work around them (reading the outcome
    back, the commit, a tree's bookkeeping): what the head's own rounds through the loop took beyond the
    price of their K (summary["round_ms"]) is added to every K's round. On a GPU that work is a share of a
    forward of a few ms; on a CPU it is lost in forwards of hundreds."""
    sampled = not sampling.greedy
    k_run = max(summary["sampled"])
    greedy, at_t = summary["greedy"][k_run].per_position, summary["sampled"][k_run].per_position
    params = head_runner.head.num_trained()
    trees = tree_costs_at(info, sampled) if info.tree_alternatives or info.tree_nodes else {}
    tree_draft = dict(info.tree_draft_ms) if info.tree_nodes else {}  # a dynamic tree's own drafting
    rescue = rescue_rates(tally.rejected or (), tally.rescued or ())

    def round_ms(model: CostModel, kt: int, verify_ms: float | None) -> float:
        """A round of kt drafts: a chain's (verify_ms None) or a tree's with its measured verify."""
        if verify_ms is None:
            return model.step_ms(kt)
        if kt in tree_draft:
            return verify_ms + tree_draft[kt] + model.overhead_ms
        return replace(model, target_ms={1: model.target_cost(1), kt + 1: verify_ms}).step_ms(kt)

    model = CostModel.from_info(info, "head", sampled=sampled)
    ran_as_tree = bool(trees)  # the loop drafts trees wherever their costs were measured
    if summary.get("round_ms") is not None and (k_run in trees or not ran_as_tree):
        host = summary["round_ms"] - round_ms(model, k_run, trees.get(k_run))
        model = replace(model, overhead_ms=max(host, 0.0))
    speedups = [model.speedup_from_positions(at_t, k) * answer_share(at_t, k, answer_tokens)
                for k in range(1, K_MAX + 1)] if at_t else []
    k, tree = _best(speedups), False
    best = speedups[k - 1] if speedups else None
    draft_ms = model.draft_ms

    def tree_speedup(kt: int, verify_ms: float) -> float:
        extra = alternative_tokens(at_t, rescue, kt) if info.tree_alternatives else 0.0
        return ((expected_tokens(at_t, kt) + extra) * answer_share(at_t, kt, answer_tokens) * model.standard_ms()
                / round_ms(model, kt, verify_ms))

    if info.tree_nodes and trees and at_t:
        # The rounds were a dynamic tree's walked paths: their acceptance is the tree's, which a chain of
        # the same head does not reach, so only the tree is priced, each K with its own verify and drafting.
        speedups = [tree_speedup(kt, trees[kt]) for kt in range(1, max(trees) + 1) if kt in trees]
        k, tree = _best(speedups), True
        best = speedups[k - 1]
        draft_ms = tree_draft.get(k, k * model.draft_ms) / k
    else:
        for kt, verify_ms in sorted(trees.items()):
            s = tree_speedup(kt, verify_ms)
            if at_t and best is not None and s > best:
                k, best, tree = kt, s, True
    return CandidateCheck(
        name=f"draft head {info.head_name}", kind="head", status="ok", params=params,
        size_ratio=params / target_params if target_params else None, top1=summary["top1"],
        greedy_positions=greedy[:k] if k else greedy, sampled_positions=at_t[:k] if k else at_t,
        cost_ratio=draft_ms / model.target_cost(1) if 1 in model.target_ms and model.target_cost(1) else None,
        best_k=k, speedup=best, speedups=tuple(speedups), tree=tree, positions_from=positions_from,
        round_overhead_ms=model.overhead_ms if summary.get("round_ms") is not None else None)


def price_ngram(info: ModelInfo, summary: dict, sampling: Sampling, positions_from: str) -> CandidateCheck:
    """N-gram lookup: proposals vary in length (none where nothing matches), so each K is priced from its
    rounds' counts (CostModel.predicted_from_counts) rather than from a fixed K."""
    sampled = not sampling.greedy
    model = CostModel.from_info(info, "ngram", sampled=sampled) if info.target_ms else None
    speedups = []
    if model is not None:
        for k in range(1, K_MAX + 1):
            r: Rounds = summary["sampled"][k]
            speedups.append(model.predicted_from_counts(r.tokens, r.rounds, r.drafted, 0))  # type: ignore[arg-type]
    k = _best(speedups)
    key = k or K_MAX
    return CandidateCheck(
        name="n-gram lookup", kind="ngram", status="ok", top1=summary["top1"],
        greedy_positions=summary["greedy"][key].per_position, sampled_positions=summary["sampled"][key].per_position,
        cost_ratio=model.draft_ms / model.target_cost(1) if model is not None else None, best_k=k,
        speedup=speedups[k - 1] if speedups else None, speedups=tuple(speedups), positions_from=positions_from)
