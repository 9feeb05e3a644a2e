"""The draft head grows a dynamic tree of drafts (EAGLE-2): the continuations it rates most likely, whole.

The catch-up's last row gives the head's law for depth 1; its F best tokens are the first frontier.
Each further level runs the head's layer once over the frontier (F rows): every frontier node
proposes its F best children, each scored by the head's probability of its whole path (a sum of
log-probabilities), and the F best of those F * F children are the next frontier. After `depth`
levels the N best nodes of all levels are the tree the target verifies. A child's score is below
its parent's (log-probabilities are clamped below zero, in float64 so no two meet), so the N best
always hold every chosen node's parent: the tree is whole. Siblings are distinct tokens, so each
node is a point-mass draft (engine/decoding/verify.py walks the tree).

Frontier rows attend to the committed cache and to their own ancestors only: a level-d node's K/V
sit at slot pos + (d - 1) * F + j, at position pos + d - 1 (pos: the first position after the
catch-up), past the committed length, where the next catch-up overwrites them as it does a chain's.
Everything lives in static buffers moved on by device-side counters, so a level is one CUDA graph
replay (per attention span) and the selection one more: no host sync while drafting.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.heads.runner import HeadRunner
from engine.limits import tree_nodes, tree_widths
from engine.runners import ids_tensor
from engine.runners.tree import Tree, TreeDraft

log = logging.getLogger(__name__)

# Each step's log-probability is at most this: a child's score is strictly below its parent's.
CLAMP = -1e-9
SCORE = torch.float64  # path scores: float32 could round a parent and its child to one value


@dataclass
class _Picked:
    """Static outputs of the selection of n nodes (one set per n: graphs write into them)."""

    tokens: torch.Tensor  # [n] long target ids, rows 1..n
    parents: torch.Tensor  # [n] long parent rows
    ranks: torch.Tensor  # [n] long rank among the parent's children
    q: torch.Tensor  # [n] float32 the head's probability of the token after its parent
    depth: torch.Tensor  # [n + 1] long, row 0 (the pending token) at depth 0
    ancestors: torch.Tensor  # [n + 1, n + 1] bool


class TreeDrafter:
    """Dynamic trees over a HeadRunner's cache: F frontier nodes per level, the N best nodes verified."""

    def __init__(self, runner: HeadRunner, *, frontier: int, nodes: int, max_depth: int) -> None:
        assert frontier >= 1 and nodes >= 1 and max_depth >= 1, "a tree has at least one node"
        assert frontier <= runner.config.draft_vocab, "the frontier cannot exceed the head's vocabulary"
        self.runner = runner
        self.frontier, self.nodes, self.max_depth = frontier, nodes, max_depth
        self.slots = max_depth * frontier  # head cache slots a tree uses past the committed length
        f, dev = frontier, runner.device
        self.candidates = f + (max_depth - 1) * f * f  # level 1: F; every further level: F * F
        with torch.inference_mode(False), torch.no_grad():
            self.lane = torch.arange(f, device=dev)  # [F]
            self.lanes = torch.arange(f * f, device=dev)  # [F * F]
            self.child_rank = self.lane.repeat(f)  # [F * F] each child's rank under its parent
            self.slot_ids = torch.arange(self.slots, device=dev)  # [D * F]
            depth = [1] * f + [d for d in range(2, max_depth + 1) for _ in range(f * f)]
            self.c_depth = torch.tensor(depth, dtype=torch.long, device=dev)  # [C] by layout
            # Candidates of this round: every level's children, in level order.
            self.c_token = torch.zeros(self.candidates, dtype=torch.long, device=dev)  # [C] target ids
            self.c_score = torch.full((self.candidates,), float("-inf"), dtype=SCORE, device=dev)  # [C]
            self.c_parent = torch.full((self.candidates,), -1, dtype=torch.long, device=dev)  # [C] (-1: root)
            self.c_q = torch.zeros(self.candidates, dtype=torch.float32, device=dev)  # [C]
            self.c_rank = torch.zeros(self.candidates, dtype=torch.long, device=dev)  # [C]
            self.row_of = torch.zeros(self.candidates, dtype=torch.long, device=dev)  # [C] candidate -> tree row
            # The frontier: the level being expanded.
            self.f_state = torch.zeros(f, runner.config.hidden, dtype=runner.dtype, device=dev)  # [F, H]
            self.f_token = torch.zeros(f, dtype=torch.long, device=dev)  # [F]
            self.f_score = torch.zeros(f, dtype=SCORE, device=dev)  # [F]
            self.f_id = torch.zeros(f, dtype=torch.long, device=dev)  # [F] candidate index
            self.f_seen = torch.zeros(f, self.slots, dtype=torch.bool, device=dev)  # [F, D * F] ancestors' slots
            self.level = torch.zeros((), dtype=torch.long, device=dev)  # the frontier's depth, 1..
        self.picked: dict[int, _Picked] = {}
        self.key = ("tree", frontier, nodes)  # its graphs' keys in the runner begin with it

    def nodes_at(self, depth: int) -> int:
        return tree_nodes(self.nodes, self.frontier, depth)

    def widths(self) -> tuple[int, ...]:
        """The target's tree widths (nodes + the pending token) over every depth."""
        return tree_widths(self.nodes, self.frontier)

    # -- drafting --------------------------------------------------------------------------------

    def draft(self, depth: int, span: int) -> TreeDraft:
        """After a catch-up: grows the tree `depth` levels deep and picks its nodes (no host sync).

        The result views static buffers: it holds until the next draft, and the loop verifies a
        round before it drafts the next.
        """
        assert 1 <= depth <= self.max_depth, f"depth {depth} outside 1..{self.max_depth}"
        self._run((*self.key, "root"), self._root_body)
        for _ in range(depth - 1):
            self._run((*self.key, "level", span), lambda: self._level_body(span))
        n = self.nodes_at(depth)
        self._run((*self.key, "pick", n), lambda: self._pick_body(n))
        p = self.picked[n]
        return TreeDraft(p.tokens, p.parents, p.ranks, p.q, Tree(p.depth, p.ancestors), self.max_depth)

    def rehearse(self, depth: int) -> None:
        """One round's drafting as the loop spends it, for costs.round_parts to time: the head's catch-up of
        width 2 (a partly accepted round), the levels, the pick. A level expands F nodes at once and ranks
        F * F children, so it costs more than a chain step (HeadRunner.measure_ms).

        Writes past the committed length only (as drafting does), so the head's cache is left as it was.
        """
        r = self.runner
        saved = r.length
        feats = torch.zeros(2, r.config.features, device=r.device, dtype=r.dtype)
        span = r.span(saved + 2 + self.slots)
        r.catch_up(feats, ids_tensor([0, 0], r.device), span)
        self.draft(depth, span)
        r.length = saved

    def _run(self, key: tuple, body) -> None:
        graph = self.runner.graphs.get(key)
        if graph is not None:
            graph.replay()
        else:
            body()

    # -- the bodies (captured as graphs on CUDA) ---------------------------------------------------

    def _root_body(self) -> None:
        """Level 1: the catch-up's F best tokens (HeadRunner._tail left its logits and state)."""
        r, f = self.runner, self.frontier
        top = torch.log_softmax(r.last_logits, -1).topk(f)  # [F] best first
        self.c_score.fill_(float("-inf"))  # deeper levels of an earlier round are no candidates
        self.c_token[:f].copy_(r.head.d2t.index_select(0, top.indices))
        self.c_score[:f].copy_(top.values.to(SCORE).clamp(max=CLAMP))
        self.c_parent[:f].fill_(-1)
        self.c_q[:f].copy_(top.values.exp())
        self.c_rank[:f].copy_(self.lane)
        self.f_state.copy_(r.state.expand(f, -1))
        self.f_token.copy_(self.c_token[:f])
        self.f_score.copy_(self.c_score[:f])
        self.f_id.copy_(self.lane)
        self.f_seen.copy_(self.slot_ids[None, :] == self.lane[:, None])
        self.level.fill_(1)

    def _level_body(self, span: int) -> None:
        """Expands the frontier at depth d = level: its children become candidates of depth d + 1."""
        r, f = self.runner, self.frontier
        d = self.level
        rel = r.key_pos[:span] - r.pos  # [span] slot relative to the tree's first
        inside = (rel >= 0) & (rel < self.slots)
        seen = self.f_seen.index_select(1, rel.clamp(0, self.slots - 1)) & inside[None, :]  # [F, span]
        visible = (rel < 0)[None, :] | seen  # the committed cache, then its own ancestors and itself
        positions = (r.pos + d - 1).view(1).expand(f)  # [F] siblings share a position
        slots = r.pos + (d - 1) * f + self.lane  # [F]
        out = r.attend(self.f_state, r.head.embed_ids(self.f_token), positions, slots, visible, span)  # [F, H]
        top = torch.log_softmax(r.head.logits(out).float(), -1).topk(f, dim=-1)  # [F, F] each row best first
        score = (self.f_score[:, None] + top.values.to(SCORE).clamp(max=CLAMP)).flatten()  # [F * F]
        tokens = r.head.d2t.index_select(0, top.indices.flatten())  # [F * F]
        at = f + (d - 1) * f * f + self.lanes  # [F * F] where level d + 1's candidates go
        self.c_token.index_copy_(0, at, tokens)
        self.c_score.index_copy_(0, at, score)
        self.c_parent.index_copy_(0, at, self.f_id.repeat_interleave(f))
        self.c_q.index_copy_(0, at, top.values.exp().flatten())
        self.c_rank.index_copy_(0, at, self.child_rank)
        best = score.topk(f)  # the next frontier
        parent = best.indices // f  # [F] their parents' frontier rows
        self.f_state.copy_(out.index_select(0, parent))
        self.f_token.copy_(tokens.index_select(0, best.indices))
        self.f_score.copy_(best.values)
        self.f_id.copy_(at.index_select(0, best.indices))
        own = self.slot_ids[None, :] == (d * f + self.lane)[:, None]  # [F, D * F] their own slots
        self.f_seen.copy_(self.f_seen.index_select(0, parent) | own)
        self.level.add_(1)

    def _pick_body(self, n: int) -> None:
        """The n best candidates as tree rows 1..n in level order (parents first), with their shape."""
        p = self._outputs(n)
        chosen = self.c_score.topk(n).indices.sort().values  # [n] candidate indices, level by level
        rows = torch.arange(1, n + 1, device=chosen.device)  # [n]
        self.row_of.index_copy_(0, chosen, rows)
        parent = self.c_parent.index_select(0, chosen)  # [n] candidate ids (-1: the pending token)
        parents = torch.where(parent < 0, 0, self.row_of.index_select(0, parent.clamp(min=0)))  # [n]
        p.tokens.copy_(self.c_token.index_select(0, chosen))
        p.parents.copy_(parents)
        p.ranks.copy_(self.c_rank.index_select(0, chosen))
        p.q.copy_(self.c_q.index_select(0, chosen))
        p.depth[1:].copy_(self.c_depth.index_select(0, chosen))
        up = torch.cat([parents.new_zeros(1), parents])  # [n + 1] row 0 is its own parent
        seen = torch.eye(n + 1, dtype=torch.bool, device=chosen.device)
        seen[:, 0] = True
        for _ in range(self.max_depth):  # each pass adds one more generation of ancestors
            seen = seen | seen.index_select(0, up)
        p.ancestors.copy_(seen)

    def _outputs(self, n: int) -> _Picked:
        if n not in self.picked:
            dev = self.runner.device
            with torch.inference_mode(False), torch.no_grad():
                self.picked[n] = _Picked(
                    torch.zeros(n, dtype=torch.long, device=dev), torch.zeros(n, dtype=torch.long, device=dev),
                    torch.zeros(n, dtype=torch.long, device=dev), torch.zeros(n, dtype=torch.float32, device=dev),
                    torch.zeros(n + 1, dtype=torch.long, device=dev),
                    torch.zeros(n + 1, n + 1, dtype=torch.bool, device=dev))
        return self.picked[n]

    # -- CUDA graphs -----------------------------------------------------------------------------

    def warmup(self) -> None:
        """Captures the root, a level per attention span and a pick per node count (CUDA); eager elsewhere.

        A capture that fails leaves the tree eager (correct, slower) and says so in the log."""
        r = self.runner
        for depth in range(1, self.max_depth + 1):
            self._outputs(self.nodes_at(depth))
        if not r.use_graphs or r.pool is None:
            return
        saved = r.pos.clone()

        def reset() -> None:
            r.pos.fill_(0)
            self.level.fill_(1)

        todo: list[tuple[tuple, object]] = [((*self.key, "root"), self._root_body)]
        todo += [((*self.key, "level", s), (lambda s=s: self._level_body(s))) for s in r.buckets]
        todo += [((*self.key, "pick", n), (lambda n=n: self._pick_body(n))) for n in sorted(self.picked)]
        try:
            with torch.cuda.device(r.device), torch.inference_mode(False), torch.no_grad():
                for key, body in todo:
                    r.capture_graph(key, body, reset, r.pool)
        except Exception as exc:  # an optimisation: eager trees stay correct
            log.warning("draft-tree graph capture failed, drafting trees eagerly: %s", exc, exc_info=True)
            for key, _ in todo:
                r.graphs.pop(key, None)
            torch.cuda.synchronize(r.device)
        r.pos.copy_(saved)

    def drop(self) -> None:
        """Forgets this drafter's graphs (its runner is replaced, or memory is wanted back)."""
        for key in [k for k in self.runner.graphs if k[: len(self.key)] == self.key]:
            del self.runner.graphs[key]


def canned_tree(tokens: torch.Tensor, frontier: int, max_depth: int) -> TreeDraft:
    """A tree of these tokens [N] with `frontier` children per node, level by level (a round's shape
    for timing its verify: engine/decoding/costs.py); fails if it would be deeper than max_depth."""
    n, dev = tokens.shape[0], tokens.device
    rows = torch.arange(1, n + 1)
    parents = torch.where(rows <= frontier, 0, (rows - frontier - 1) // frontier + 1)  # [N]
    up = torch.cat([torch.zeros(1, dtype=torch.long), parents])  # [N + 1]
    depth = torch.zeros(n + 1, dtype=torch.long)
    for i in range(1, n + 1):
        depth[i] = depth[up[i]] + 1
    assert int(depth.max()) <= max_depth, f"{n} nodes, {frontier} per node, are deeper than {max_depth}"
    seen = torch.eye(n + 1, dtype=torch.bool)
    seen[:, 0] = True
    for _ in range(max_depth):
        seen = seen | seen.index_select(0, up)
    ranks = (rows - 1) % frontier
    return TreeDraft(tokens, parents.to(dev), ranks.to(dev), torch.ones(n, device=dev),
                     Tree(depth.to(dev), seen.to(dev)), max_depth)
