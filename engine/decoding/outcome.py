"""One round's outcome: what was queued on the device (Launched) and what it decided, read on the host."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.decoding.proposers import Proposal
from engine.types import Decision


@dataclass
class RoundResult:
    """What one round decided, on the host, after the step's single device sync."""

    proposed: list[int]  # draft token ids
    q_shown: list[float]  # q(x) per draft token, as displayed
    p_shown: list[float]  # p(x) per draft token, as displayed
    accept_prob: list[float]  # min(1, p/q) per draft token
    accepted: int  # accepted prefix length
    added: int  # the target's token (correction, bonus or standard)
    added_p: float  # its displayed target probability
    draft_ms: float
    verify_ms: float
    prefill_ms: float = 0.0  # a proposer's one-off prefill before it drafted (Proposer.prepare), not drafting
    extra: int = -1  # a tree round: the target's token after the alternative it picked (-1: none)
    extra_p: float = 0.0  # its displayed target probability
    extra_row: int = 0  # the tree row of that alternative (runners/tree.py)
    ranks: list[int] | None = None  # a walked tree (verify_path): each shown token's rank among its siblings
    path_rows: list[int] | None = None  # its tree rows of the pending token and the accepted path, by depth
    # A walked tree: per depth from the pending token to where the walk stopped, the tokens drafted under the
    # path's node there in the drafter's order (what the target could take at each shown draft position).
    children: list[list[int]] | None = None


@dataclass
class Launched:
    """One round's device work, queued; `read_outcome` reads its outcome with the round's one host sync.

    On CUDA nothing here has run yet when it is created: the outcome is copied into pinned host
    memory behind the round's kernels and `done` marks when it has landed.
    """

    outcome: torch.Tensor  # [4n + 3] float: drafts, q(x), p(x), accept prob, accepted, added, p(added)
    n: int  # draft tokens in this round
    proposal: Proposal | None  # None for a standard round
    decision: Decision  # what the K controller chose for this round
    done: torch.cuda.Event | None  # CUDA: recorded after the copy to the host
    marks: tuple  # CUDA: timing events (begin, prepared, drafted, verified); CPU: perf_counter times
    token: torch.Tensor | None = None  # standard round: its token [1] on the device, the next round's input
    tree: bool = False  # the drafts were verified as a tree (the outcome carries extra, extra_p, extra_row)
    path: bool = False  # a tree the target walked (verify_path): n is its deepest depth, the layout its own


def read_outcome(launched: Launched) -> RoundResult:
    """Waits for a launched round (the step's one host sync) and reads its outcome."""
    if launched.done is not None:
        launched.done.synchronize()
    values = launched.outcome.tolist()
    n = launched.n
    tree: list[float] = []
    if launched.path:  # verify_path's layout: D slots per field, the path's rows, the counts, then the tree
        shown, accepted, added, added_p = values[6 * n + 1:6 * n + 5]
        tree = values[6 * n + 5:]
        values = (values[: int(shown)] + values[n : n + int(shown)] + values[2 * n : 2 * n + int(shown)]
                  + values[3 * n : 3 * n + int(shown)] + [accepted, added, added_p]
                  + values[4 * n : 4 * n + int(shown)] + values[5 * n : 5 * n + int(accepted) + 1])
        n = int(shown)
    begin, prepared, drafted, verified = launched.marks
    if isinstance(begin, float):  # CPU: the work ran inside the launch, so host times are exact
        prefill_ms = (prepared - begin) * 1e3
        draft_ms, verify_ms = (drafted - prepared) * 1e3, (verified - drafted) * 1e3
    else:  # CUDA: device time between the events
        prefill_ms = begin.elapsed_time(prepared) if prepared is not begin else 0.0
        draft_ms = prepared.elapsed_time(drafted) if n else 0.0
        verify_ms = drafted.elapsed_time(verified)
    result = RoundResult(
        proposed=[int(x) for x in values[:n]],
        q_shown=values[n : 2 * n],
        p_shown=values[2 * n : 3 * n],
        accept_prob=values[3 * n : 4 * n],
        accepted=int(values[4 * n]),
        added=int(values[4 * n + 1]),
        added_p=values[4 * n + 2],
        draft_ms=draft_ms,
        verify_ms=verify_ms,
        prefill_ms=prefill_ms,
    )
    if launched.tree:
        result.extra, result.extra_p, result.extra_row = int(values[4 * n + 3]), values[4 * n + 4], \
            int(values[4 * n + 5])
    if launched.path:
        result.ranks = [int(x) for x in values[4 * n + 3 : 5 * n + 3]]
        result.path_rows = [int(x) for x in values[5 * n + 3 :]]
        result.children = _children(tree, result.path_rows)
    return result


def _children(tree: list[float], path_rows: list[int]) -> list[list[int]]:
    """Per node of the path (its rows by depth), the tokens drafted under it, best rank first.

    `tree` is verify_path's tail: the N tokens, then their parent rows, then their ranks."""
    nodes = len(tree) // 3
    depth_of = {row: d for d, row in enumerate(path_rows)}
    kids: list[list[tuple[int, int]]] = [[] for _ in path_rows]
    for token, parent, rank in zip(tree[:nodes], tree[nodes:2 * nodes], tree[2 * nodes:]):
        d = depth_of.get(int(parent))
        if d is not None:
            kids[d].append((int(rank), int(token)))
    return [[token for _, token in sorted(k)] for k in kids]
