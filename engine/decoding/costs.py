"""What decoding costs on this machine, measured at load: every verify width as the loop runs it, each proposer's own cost.

The target side is timed through the loop's own round (Generation._launch / outcome.read_outcome) with drafts
that cost nothing, so a width's figure is what a step of the loop spends verifying: the forward,
the acceptance math and the outcome's copy to the host, timed like Step.verify_ms (CUDA events on
a GPU, the host clock on a CPU); standard steps queued as standard decoding queues them, and a dynamic
tree's rounds with its head drafting in them (round_parts). Proposers are timed through their own
propose() (proposers.py); a draft head's runner times its greedy round itself when it is attached
(ModelInfo.head_ms).

Sampled rounds (temperature > 0) cost more, and are measured apart (ModelInfo.sampled_costs,
sampled_target_ms): a sampled verify processes every row and draws its token, and a proposer that
draws its drafts does host-side work per token that a greedy one does not. The draft head proposes
its best tokens when sampling too (engine/decoding/head.py), inside its CUDA graphs; drawn from its
own law instead (SAMPLED_DRAFTS) it drafted 0.310 ms per token at T = 0.7 on an H200 against 0.228
greedy and 0.200 at load, which alone put the predicted speedup 12% over the measured one (1.40x
vs 1.25x).
"""
from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from engine.decoding.loop import Generation
from engine.decoding.outcome import Launched, read_outcome
from engine.decoding.proposers import Offer, Proposal, Proposer, ProposerSet, measure_proposer
from engine.errors import CostsInterrupted
from engine.heads.tree import TreeDrafter, canned_tree
from engine.limits import K_MAX, TREE_K_MAX
from engine.loadspec import LoadProgress
from engine.runners import ids_tensor
from engine.types import Decision, GenerationRequest, ProposerCost, Sampling

if TYPE_CHECKING:  # annotations only: the Engine measures its costs through here
    from engine.decoding.engine import Engine

log = logging.getLogger(__name__)

CPU_FILL = 64  # tokens in the target's cache while its widths are timed on a CPU: a short chat's context
# The sampling sampled costs are measured with. Their cost does not depend on the temperature;
# top-k and top-p add to it (a top-k, a sort over the vocabulary), which this leaves out.
SAMPLED = Sampling(temperature=1.0)


Interrupted = Callable[[], bool]  # True: stop measuring now (a person's request is waiting)


def _check(interrupted: Interrupted | None) -> None:
    if interrupted is not None and interrupted():
        raise CostsInterrupted()


class _CannedDrafts(Proposer):
    """A proposer of fixed random tokens: the round times the verify alone, but for a dynamic tree's
    drafting, which its head does as in a real round (its tokens are not the ones verified)."""

    def __init__(self, vocab: int, device: torch.device, alternatives: int = 0,
                 tree: TreeDrafter | None = None) -> None:
        self.tokens = torch.randint(1, max(vocab, 2), (K_MAX,), device=device)  # [K_MAX]
        # alternatives > 0: a tree round (greedy), as a head proposes where trees are on
        self.alts = torch.randint(1, max(vocab, 2), (K_MAX, alternatives), device=device) if alternatives else None
        # tree: a dynamic tree's round of K levels (its width, any shape: a verify costs its width), drafted
        # by the head as a real round drafts (rehearsed: its own tree is not verified, the canned one is)
        self.drafter = tree
        self.trees = {} if tree is None else {
            k: canned_tree(torch.randint(1, max(vocab, 2), (tree.nodes_at(k),), device=device), tree.frontier,
                           tree.max_depth) for k in range(1, tree.max_depth + 1)}

    def start(self, prompt: list[int]) -> None:
        pass

    def offer(self, k: int) -> Offer:
        return Offer("canned", k)  # type: ignore[arg-type]  # never reaches a controller

    def propose(self, k: int) -> Proposal:
        tree = self.trees.get(k)
        if tree is not None:
            if self.drafter is not None:
                self.drafter.rehearse(k)
            return Proposal(tokens=tree.tokens, q=None, sources=("canned",) * tree.nodes,  # type: ignore[arg-type]
                            forwards=0, tree=tree)
        return Proposal(tokens=self.tokens[:k], q=None, sources=("canned",) * k, forwards=0,  # type: ignore[arg-type]
                        alts=None if self.alts is None else self.alts[:k])

    def commit(self, proposal: Proposal, accepted: int, new_tokens: list[int]) -> None:
        pass


def measure_rounds(engine: Engine, widths: Iterable[int], iters: int, warm: bool = True,
                   sampling: Sampling | None = None, alternatives: int = 0, tree: TreeDrafter | None = None,
                   interrupted: Interrupted | None = None) -> dict[int, list[float]]:
    """Ms of `iters` rounds per width (K = width - 1 canned drafts; width 1 is a standard round), greedy
    unless `sampling` says otherwise: round_parts' drafting and verify together."""
    parts = round_parts(engine, widths, iters, warm, sampling, alternatives, tree, interrupted)
    return {w: [d + v for d, v in timed] for w, timed in parts.items()}


def round_parts(engine: Engine, widths: Iterable[int], iters: int, warm: bool = True,
                sampling: Sampling | None = None, alternatives: int = 0, tree: TreeDrafter | None = None,
                interrupted: Interrupted | None = None) -> dict[int, list[tuple[float, float]]]:
    """(drafting ms, verify ms) of `iters` rounds per width, split and timed as Step.draft_ms / verify_ms are.

    K = width - 1 canned drafts; width 1 is a standard round, queued as standard decoding queues it: on a
    GPU two ahead, each fed the token the one before left on the device (loop.Generation._top_up), so the
    device never waits for the host; a GPU step costs its forward, not a host sync besides (2.38 ms against
    2.44 timed one at a time on an H100). alternatives > 0: greedy tree rounds of K = width - 1 drafts with
    that many alternatives beside each; tree: rounds of its dynamic tree K levels deep (both keyed by K + 1
    all the same), its head drafting each round as the loop's does (TreeDrafter.rehearse) before the
    canned tree is verified, so the host's launches after the last round's sync fall in the drafting, as
    in a real round. CostsInterrupted between two rounds once `interrupted()` says so."""
    request = GenerationRequest(prompt="x", max_new_tokens=1, sampling=sampling or Sampling())
    generation = Generation(engine, request, [1], None)
    proposers = ProposerSet((_CannedDrafts(engine.vocab, engine.device, alternatives, tree),), engine.device)
    proposers.offers(K_MAX)
    generator = torch.Generator(device=engine.device).manual_seed(0)
    target = engine.target_runner
    saved = target.length
    queued = engine.device.type == "cuda" if engine.lookahead is None else engine.lookahead
    times: dict[int, list[tuple[float, float]]] = {}
    for width in widths:
        decision = Decision(width - 1, "canned" if width > 1 else None, "fixed")  # type: ignore[arg-type]
        depth = 2 if queued and width == 1 else 1  # rounds in flight
        queue: list[Launched] = []
        results = []
        pending: int | torch.Tensor = 1
        for _ in range(iters + 1 if warm else iters):
            _check(interrupted)
            queue.append(generation._launch(proposers, decision, pending, generator))
            if depth > 1:  # the next standard round reads this one's token on the device
                pending = queue[-1].token  # type: ignore[assignment]
            if len(queue) == depth:
                results.append(read_outcome(queue.pop(0)))
                if depth == 1:
                    target.rollback(saved)
        results += [read_outcome(launched) for launched in queue]
        target.rollback(saved)
        times[width] = [(r.draft_ms, r.verify_ms) for r in results[1 if warm else 0:]]
    return times


def _pattern(engine: Engine, n: int) -> list[int]:
    """n ids of a repeating pattern, so that n-gram lookup finds matches as it does on real text."""
    cycle = [(7 * i) % max(engine.vocab - 1, 1) + 1 for i in range(12)]
    return (cycle * (n // len(cycle) + 1))[:n]


def _measurable_sources(engine: Engine) -> list[str]:
    # A draft head reads the target's rows, so its runner measured its own cost when it was attached.
    return [s for s in engine.proposer_sources() if s != "head"]


def _proposers(engine: Engine, iters: int, warm: bool, interrupted: Interrupted | None = None
               ) -> dict[str, ProposerCost]:
    greedy = GenerationRequest().sampling
    prompt = _pattern(engine, 24)
    costs = {}
    for s in _measurable_sources(engine):
        _check(interrupted)
        costs[s] = measure_proposer(engine.proposer(s, greedy, None), s, prompt, engine.device, iters=iters, warm=warm)
    return costs


def _sampled_proposers(engine: Engine, iters: int, warm: bool, interrupted: Interrupted | None = None
                       ) -> dict[str, ProposerCost]:
    """Every proposer's cost when it samples its drafts, the head's included (through its own propose(),
    as the loop calls it). Never fails: what cannot be measured is priced at its greedy cost."""
    generator = torch.Generator(device=engine.device).manual_seed(0)
    costs = {}
    for source in engine.proposer_sources():
        # The head catches up on 2 rows, as after a partly accepted draft (HeadRunner.measure_ms too);
        # n-gram lookup needs a repeating context to find matches.
        prompt = _pattern(engine, 3 if source == "head" else 24)
        _check(interrupted)
        try:
            proposer = engine.proposer(source, SAMPLED, generator)
            costs[source] = measure_proposer(proposer, source, prompt, engine.device, iters=iters, warm=warm)
        except Exception as exc:  # advice, as every cost
            log.warning("could not measure the sampled cost of %s: %s", source, exc)
    return costs


# One CPU pass: width -> ms (greedy rounds), source -> cost (greedy drafts), source -> cost (sampled drafts).
CostPass = tuple[dict[int, float], dict[str, ProposerCost], dict[str, ProposerCost]]


def measure_pass(engine: Engine, interrupted: Interrupted | None = None) -> CostPass:
    """One CPU pass: every verify width (a warm round, then a timed one) after a context of at least
    CPU_FILL tokens (what the target caches, topped up), then every proposer once. The target's
    cache is left as it was.

    Each width is timed as a fixed K runs it: right after a round of the same width (which also warms
    it: page faults, oneDNN primitives). A round of a new width costs more: on llama.cpp it rebuilds
    the compute graph, which a same-width round reuses: 1-token rounds measured 37.3 ms after other
    widths against 35.2 after one another (2-token 68.5 vs 66.6, 6-token 160.6 vs 156.8): 6% on the
    standard step, which every predicted speedup divides by. And after a context of a chat's size:
    attention's cost grows with it (llama.cpp, a 6-token verify: 134.7 ms after no context, 139 after
    80 tokens, 142-145 in the runs). CostsInterrupted between two rounds once `interrupted()` says so.
    """
    target_runner = engine.target_runner
    saved = target_runner.length
    fill = max(0, min(CPU_FILL - saved, target_runner.max_length - saved - (K_MAX + 1)))
    if fill:
        target_runner.prefill(ids_tensor(_pattern(engine, fill), engine.device))
    try:
        rounds = measure_rounds(engine, range(1, K_MAX + 2), 1, warm=True, interrupted=interrupted)
    finally:
        target_runner.rollback(saved)
    # Sampled drafts after the rounds: the head reads rows the target's last forward left.
    return ({w: ms[0] for w, ms in rounds.items()}, _proposers(engine, 1, False, interrupted),
            _sampled_proposers(engine, 1, False, interrupted))


def gpu_pass(engine: Engine, interrupted: Interrupted | None = None) -> tuple[CostPass, dict[int, float]]:
    """On a GPU, one whole measurement: the median of 20 rounds per width (greedy, then sampled) and of
    5 timed proposals per proposer, greedy and sampled (about a second): (pass, sampled widths)."""
    widths = range(1, K_MAX + 2)  # every verify width the loop may use
    target = {w: statistics.median(ms) for w, ms in measure_rounds(engine, widths, 20, interrupted=interrupted).items()}
    # A sampled verify processes all K+1 rows and draws its token: about 1 s more, on a GPU only.
    sampled_target = {w: statistics.median(ms) for w, ms in
                      measure_rounds(engine, widths, 20, sampling=SAMPLED, interrupted=interrupted).items()}
    return (target, _proposers(engine, 5, True, interrupted), _sampled_proposers(engine, 5, True, interrupted)), \
        sampled_target


def _median_costs(tables: list[dict[str, ProposerCost]]) -> dict[str, ProposerCost]:
    sources = [s for s in tables[0] if all(s in t for t in tables)]
    return {s: ProposerCost(s, statistics.median(t[s].per_token_ms for t in tables),
                            statistics.median(t[s].per_proposal_ms for t in tables)) for s in sources}


def pooled(passes: list[CostPass]) -> CostPass:
    """The median of every figure over the passes."""
    target = {w: statistics.median(t[w] for t, _, _ in passes) for w in passes[0][0]}
    return target, _median_costs([p for _, p, _ in passes]), _median_costs([p for _, _, p in passes])


def publish(engine: Engine, target: dict[int, float], costs: dict[str, ProposerCost], seconds: float,
            sampled: dict[str, ProposerCost], sampled_target: dict[int, float]) -> None:
    """Puts figures into ModelInfo (target_ms, proposer_costs with the head's own, draft_ms, sampled ones)."""
    if engine.head_runner is not None:
        costs["head"] = ProposerCost("head", engine.info.head_ms, 0.0)
    draft = costs["draft"].per_token_ms if "draft" in costs else 0.0
    engine.info = replace(engine.info, draft_ms=draft, target_ms=tuple(sorted(target.items())),
                          proposer_costs=tuple(costs.values()), measure_s=seconds,
                          sampled_costs=tuple(sampled.values()), sampled_target_ms=tuple(sorted(sampled_target.items())))
    log.info("measured costs in %.1f s: target %s ms, proposers %s; sampled: target %s ms, proposers %s",
             engine.info.measure_s, {w: round(ms, 2) for w, ms in target.items()}, costs,
             {w: round(ms, 2) for w, ms in sampled_target.items()}, sampled)


def measure_costs(engine: Engine, progress=None, rounds: int = 3) -> None:
    """Engine.measure_costs: fills ModelInfo.target_ms (every verify width 1..K_MAX+1), proposer_costs,
    draft_ms (the draft model's per-token cost) and measure_s."""
    if progress is not None:
        progress(LoadProgress("warmup", 0.95, "Measuring forward costs for the cost model"))
    started = time.perf_counter()
    try:
        if engine.device.type == "cuda":
            (target, costs, sampled), sampled_target = gpu_pass(engine)
            engine.cost_passes = []
        else:
            # Interleaved passes, so slow drift of the machine's speed hits every width and proposer
            # alike; the median of an odd number of them, so one slow pass (a neighbour's burst, the
            # seconds right after load) is dropped: the median of two is their mean, and llama.cpp on
            # 2 shared cores once measured a 1-token target round at 60.6 ms against 36.6 ms in the
            # runs (every predicted speedup of that sweep 60-80% too high).
            # Sampled verify widths are not timed on a CPU: they would double the pass, for the
            # processing of K+1 rows (about 1% of a forward there), below the pass's own noise.
            engine.cost_passes = [measure_pass(engine) for _ in range(rounds)]
            target, costs, sampled = pooled(engine.cost_passes)
            sampled_target = {}
    except Exception as exc:  # measuring is advice, not a reason to refuse the models
        log.warning("could not measure forward costs: %s", exc)
        return
    publish(engine, target, costs, time.perf_counter() - started, sampled, sampled_target)
    measure_trees(engine)


def measure_trees(engine: Engine, iters: int | None = None, reuse: bool = False) -> None:
    """ModelInfo.tree_ms: the verify of greedy tree rounds for K = 1..TREE_K_MAX with the engine's
    alternatives (Engine.alternatives) or dynamic tree, median of `iters` (20 on a GPU, 3 elsewhere);
    empty without trees. A dynamic tree's drafting (ModelInfo.tree_draft_ms) is timed in the same rounds, as
    the loop times it: timed apart, its rounds back to back without a sync between them, it left out what
    the host's launches add after a round's sync (on an H100 a 4-level round drafted 1.51 ms in the loop
    against 1.41 ms timed that way). reuse: a tree measured since the last full measurement is not measured
    again (switching trees back and forth, as a sweep does, costs nothing); otherwise the kept ones are dropped."""
    s, drafter = engine.alternatives(), engine.tree_drafter
    key = (s, drafter.nodes, drafter.frontier) if drafter is not None else (s, 0, 0)
    if reuse and key in engine.tree_costs:
        engine.info = replace(engine.info, **engine.tree_costs[key])
        return
    if not reuse:
        engine.tree_costs.clear()
    tree: dict[int, float] = {}
    drafting: dict[int, float] = {}
    if s or drafter is not None:
        iters = iters or (20 if engine.device.type == "cuda" else 3)
        try:
            rounds = round_parts(engine, range(2, TREE_K_MAX + 2), iters, alternatives=s, tree=drafter)
            if drafter is not None:  # the head drafted each round as the loop's does: its drafting apart
                tree = {w - 1: statistics.median(v for _, v in timed) for w, timed in rounds.items()}
                drafting = {w - 1: statistics.median(d for d, _ in timed) for w, timed in rounds.items()}
            else:
                tree = {w - 1: statistics.median(d + v for d, v in timed) for w, timed in rounds.items()}
        except Exception as exc:  # advice only, as the other costs
            log.warning("could not measure the tree rounds: %s", exc)
            tree = {}
    nodes = drafter.nodes if drafter is not None and tree else 0
    engine.tree_costs[key] = dict(tree_ms=tuple(sorted(tree.items())), tree_alternatives=s if tree else 0,
                                  tree_nodes=nodes, tree_draft_ms=tuple(sorted(drafting.items())) if nodes else ())
    engine.info = replace(engine.info, **engine.tree_costs[key])
    if tree:
        log.info("tree rounds (%s): %s ms by K%s", f"{nodes} nodes" if nodes else f"{s} alternatives",
                 {k: round(ms, 2) for k, ms in tree.items()},
                 f", drafting {({k: round(ms, 2) for k, ms in drafting.items()})} ms" if nodes else "")


def measure_again(engine: Engine) -> None:
    """Engine.measure_again: on a CPU, one more pass, pooled (median) with every pass since load.

    A CPU shared with other work drifts: on this project's 2 cores the 1-token forward, the 6-token
    verify and the draft forward each moved by up to 8% from one 5-second window to the next, and not
    together, so the 15 seconds measured at load can misstate their ratios for a quarter of an hour
    of runs. A sweep measures a
    pass beside every prompt, so its prediction uses costs from the same minutes as its runs.
    On a GPU (or before any CPU pass) it does nothing.
    """
    if engine.device.type == "cuda" or not getattr(engine, "cost_passes", None):
        return
    started = time.perf_counter()
    try:
        engine.cost_passes.append(measure_pass(engine))
    except Exception as exc:
        log.warning("could not measure forward costs again: %s", exc)
        return
    target, costs, sampled = pooled(engine.cost_passes)
    publish(engine, target, costs, engine.info.measure_s + time.perf_counter() - started, sampled, {})
