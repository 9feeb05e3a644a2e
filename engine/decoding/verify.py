"""Verification of one round from the target's logits: a standard token, a chain of drafts, or a tree.

Plain functions of tensors (p: the target, q: the draft), no host syncs: each returns the round's
outcome packed in one float tensor (engine/decoding/outcome.py reads it after the round's one sync).
Token ids stay exact in float32 (< 2**24).
"""
from __future__ import annotations

import torch

from engine.decoding.host_walk import walk_on_host
from engine.decoding.sampling import accept_draft, display_probs, draw, process
from engine.runners.tree import TreeDraft
from engine.types import Sampling


def verify_standard(logits: torch.Tensor, sampling: Sampling,
                    generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A standard round from the target's logits [V]: (outcome [3]: 0, token, p(token); the token [1])."""
    if sampling.greedy:
        token = logits.argmax()
        p_shown = torch.softmax(logits, -1).gather(0, token.view(1))[0]
    else:
        probs = process(logits, sampling)  # [V]
        token = draw(probs.unsqueeze(0), generator)[0]
        p_shown = probs.gather(0, token.view(1))[0]
    outcome = torch.stack([torch.zeros((), device=logits.device), token.float(), p_shown])
    return outcome, token.view(1)


def verify_chain(logits: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None, q_display: torch.Tensor | None,
                 sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """A chain of n drafts [n] against the target's logits [n+1, V] (Leviathan et al. 2023; greedy: argmax).

    q: the draft's processed distributions [n, V] (None: point masses); q_display: q(x) to show [n].
    Returns [4n + 3]: drafts, q(x), p(x), accept prob, accepted, added, p(added).
    """
    n = draft.shape[0]
    p = process(logits, sampling)  # [n+1, V]
    accepted, added, accept_prob = accept_draft(draft, q, p, sampling.greedy, generator)
    shown_p = display_probs(logits, p, sampling)  # [n+1, V]
    rows = torch.arange(n, device=logits.device)
    p_x = shown_p[rows, draft]  # [n]
    if q_display is not None:
        q_x = q_display
    elif q is not None:
        q_x = q[rows, draft]
    else:
        q_x = torch.ones(n, device=logits.device)
    added_p = shown_p[accepted.view(1), added.view(1)]  # [1]
    return torch.cat([draft.float(), q_x.float(), p_x.float(), accept_prob.float(),
                      torch.stack([accepted.float(), added.float()]), added_p.float()])


def verify_rows_greedy(logits: torch.Tensor, ids: torch.Tensor, n: torch.Tensor,
                       q_display: torch.Tensor) -> torch.Tensor:
    """verify_chain under greedy for every row of a batched forward at once (engine/decoding/batch.py).

    logits [R, W, V]: the target's after each row's tokens ids [R, W] (its pending token, then its drafts, then
    padding); n [R] long: each row's drafts (0: a standard step); q_display [R, W - 1]: q(x) to show.
    Returns [R, 4 (W - 1) + 3]: per row its drafts, q(x), p(x), accept prob (each W - 1 wide, valid for the
    first n), then accepted, added, p(added) — verify_chain's values, laid out by the widest row.
    """
    r, w = ids.shape
    draft = ids[:, 1:]  # [R, W-1]
    best = logits.argmax(-1)  # [R, W] the target's token after each row
    live = torch.arange(w - 1, device=ids.device) < n[:, None]  # [R, W-1]
    ok = (draft == best[:, :-1]) & live
    accepted = torch.cumprod(ok.long(), 1).sum(1)  # [R]
    added = best.gather(1, accepted[:, None])  # [R, 1]
    shown = logits.softmax(-1)  # [R, W, V] a one-hot says nothing: the softmax at T = 1
    p_x = shown[:, :-1].gather(2, draft[:, :, None])[..., 0]  # [R, W-1]
    added_p = shown.gather(1, accepted[:, None, None].expand(r, 1, shown.shape[-1]))[:, 0].gather(1, added)
    return torch.cat([draft.float(), q_display.float(), p_x, ok.float(), accepted[:, None].float(), added.float(),
                      added_p], 1)


def chain_values(row: list[float], width: int, n: int) -> list[float]:
    """One row of verify_rows_greedy (laid out for `width` tokens a row) as verify_chain's [4n + 3] values."""
    d = width - 1
    return [*row[:n], *row[d: d + n], *row[2 * d: 2 * d + n], *row[3 * d: 3 * d + n], *row[4 * d: 4 * d + 3]]


def verify_tree(logits: torch.Tensor, draft: torch.Tensor, alts: torch.Tensor, q_display: torch.Tensor | None,
                sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """A chain [n] with S alternatives per draft [n, S], verified as one tree forward (logits [W, V]).

    The drafts are point masses (the head's best tokens), so the acceptance rule is exact with
    q = one-hot: draft d is accepted with probability p_d(x_d) (greedy: when it is the target's
    argmax). At the first rejection the target's token `added` is drawn from p_d without x_d
    (the residual of a point mass; greedy: the argmax), after a fully accepted chain from the
    bonus row. Each output token is thus drawn from the target's law, whatever was drafted. When
    `added` is one of the alternatives at that depth, that alternative's own row of the same
    forward gives the target's next token too (`extra`, drawn from that row's law).
    Returns the chain's layout, then extra, its p and its tree row.
    """
    n, s = draft.shape[0], alts.shape[1]
    device = logits.device
    rows = torch.arange(n, device=device)
    if sampling.greedy:
        best = logits.argmax(-1)  # [W] the target's token after each row
        ok = draft == best[:n]  # [n]
        accept_prob = ok.float()
        accepted = torch.cumprod(ok.long(), 0).sum()
        added = best.index_select(0, accepted.view(1))  # [1]
    else:  # the chain's rule with point masses (q = None), on the chain's rows of the tree forward
        chain = process(logits[: n + 1], sampling)  # [n + 1, V]
        accepted, added, accept_prob = accept_draft(draft, None, chain, False, generator)
        added = added.view(1)  # [1]
    beside = torch.cat([alts, alts.new_full((1, s), -1)]).index_select(0, accepted.view(1))[0]  # [S]
    hit = beside == added  # [S] (no alternative after a fully accepted chain: -1 never matches)
    row = torch.where(hit.any(), 1 + n + accepted * s + hit.long().argmax(), torch.zeros_like(accepted))
    if sampling.greedy:
        after = best.index_select(0, row.view(1))[0]
        row_law = logits.index_select(0, row.view(1)).softmax(-1)  # [1, V] what the hover shows
    else:
        row_law = process(logits.index_select(0, row.view(1)), sampling)  # [1, V]
        after = draw(row_law, generator)[0]  # drawn every round (no host sync), kept only on a hit
    extra = torch.where(hit.any(), after, torch.full_like(accepted, -1))
    # What the hover shows: under greedy the softmax of the chain's rows (and of the kept
    # alternative's row), when sampling the processed law; the other alternatives' rows never.
    shown = logits[: n + 1].softmax(-1) if sampling.greedy else chain  # [n + 1, V]
    p_x = shown[rows, draft]
    q_x = q_display if q_display is not None else torch.ones(n, device=device)
    added_p = shown[accepted.view(1), added]  # [1]
    extra_p = row_law.gather(1, extra.clamp_min(0).view(1, 1))[0]  # [1]
    return torch.cat([draft.float(), q_x.float(), p_x.float(), accept_prob.float(),
                      torch.stack([accepted.float(), added[0].float()]), added_p.float(),
                      torch.stack([extra.float(), extra_p[0].float(), row.float()])])


def tree_choices(logits: torch.Tensor, tree: TreeDraft, sampling: Sampling,
                 generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which tree nodes the target accepts once their parent is reached, and its token after every row.

    Recursive rejection sampling over siblings (SpecInfer, Miao et al. 2023; EAGLE's
    evaluate_posterior) with point-mass drafts: the first child x1 is accepted with r(x1), r = p; on
    a rejection r loses x1 and is renormalised, the next child is tried with r(x2) = p(x2) / (1 -
    p(x1)), and so on; once every child is rejected the token is drawn from r. Child i is thus
    accepted with probability p(x_i) and the token after rejecting them all follows p without the
    children: the law of drawing y ~ p once and going down to the child that is y. That is how it
    runs here, every row at once, one draw per row (greedy: y is the argmax). Rows the walk never
    reaches draw too; their draws are discarded, so each reached row's token is a fresh draw from p.
    Returns ok [N] (row i + 1 is y of its parent), y [W] and the law people are shown [W, V].
    """
    if sampling.greedy:
        y = logits.argmax(-1)  # [W]
        shown = logits.softmax(-1)  # a one-hot says nothing: the softmax at T = 1
    else:
        shown = process(logits, sampling)  # [W, V]
        y = draw(shown, generator)  # [W]
    return tree.tokens == y.index_select(0, tree.parents), y, shown


# Devices whose trees are walked row by row on the host (host_walk.py: no sync to avoid, every row paid for).
WALK_ON_HOST = ("cpu",)


def verify_path(logits: torch.Tensor, tree: TreeDraft, sampling: Sampling,
                generator: torch.Generator | None) -> torch.Tensor:
    """A tree of drafts (rows 1..N under the pending token, logits [N + 1, V]): the path the target walks.

    From row 0 the walk goes down to the child that is the target's token (tree_choices) while
    there is one; the target's token after the last row of the path is the round's added token.
    Shown like a chain: the path's tokens (accepted), then where the walk stopped the drafter's
    best child there (rejected; none at a leaf, where the added token is a bonus).
    Returns [6D + 5 + 3N] (D = tree.max_depth): shown tokens, q(x), p(x), accept prob, branch rank (each
    [D], the first `shown` valid), the path's rows [D + 1], then shown, accepted, added, p(added), then the
    tree itself (its N tokens, parent rows and ranks), from which the host reads what was drafted under each
    node of the path (outcome.read_outcome: RoundResult.children) in the round's one sync.
    Logits in host memory take the same walk row by row (host_walk.walk_on_host), the same outcome.
    """
    if logits.device.type in WALK_ON_HOST:
        return walk_on_host(logits, tree, sampling, generator)
    depth_max, device = tree.max_depth, logits.device
    ok, y, shown = tree_choices(logits, tree, sampling, generator)  # [N], [W], [W, V]
    depth, ancestors = tree.shape.depth, tree.shape.ancestors  # [W], [W, W]
    width = depth.shape[0]
    reached = torch.cat([ok.new_ones(1), ok])  # [W] row 0, the pending token, always
    on_path = ~(ancestors & ~reached[None, :]).any(-1)  # [W] it and every ancestor accepted
    last = torch.where(on_path, depth, -1).argmax()  # one row per depth is on the path: the deepest
    accepted = depth.index_select(0, last.view(1))  # [1]
    added = y.index_select(0, last.view(1))  # [1]
    slot = torch.where(on_path, depth, depth_max + 1)  # rows off the path go to a slot that is dropped
    path = torch.zeros(depth_max + 2, dtype=torch.long, device=device)
    path.scatter_(0, slot, torch.arange(width, device=device))  # [D + 2] the path's row at each depth
    parent = torch.cat([tree.parents.new_full((1,), -1), tree.parents])  # [W]
    rank = torch.cat([tree.ranks.new_zeros(1), tree.ranks])  # [W]
    children = parent == last  # [W]
    stopped = children.any()  # the walk stopped at a node with drafted children (not a leaf)
    best_child = torch.where(children, rank, width).argmin()  # the drafter's first choice there
    i = torch.arange(depth_max, device=device)  # [D]
    rows = torch.where(i < accepted, path[1 : depth_max + 1], best_child)  # [D] shown rows
    token = torch.cat([tree.tokens.new_zeros(1), tree.tokens]).index_select(0, rows)  # [D]
    p_x = shown[parent.index_select(0, rows).clamp_min(0), token]  # [D] p of each at its parent's row
    q_x = torch.cat([tree.q.new_ones(1), tree.q]).index_select(0, rows)  # [D]
    # A point mass is accepted with p(x) (greedy: when it is the argmax).
    accept_prob = (i < accepted).float() if sampling.greedy else p_x
    added_p = shown[last.view(1), added]  # [1]
    return torch.cat([token.float(), q_x.float(), p_x.float(), accept_prob.float(),
                      rank.index_select(0, rows).float(), path[: depth_max + 1].float(),
                      torch.stack([(accepted[0] + stopped).float(), accepted[0].float(), added[0].float()]),
                      added_p.float(), torch.stack([tree.tokens, tree.parents, tree.ranks]).view(-1).float()])
