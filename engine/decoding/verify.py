"""Verification of one round from the target's logits: a standard token, a chain of drafts, or a tree.

Plain functions of tensors (p: the target, q: the draft), no host syncs: each returns the round's
outcome packed in one float tensor (engine/decoding/outcome.py reads it after the round's one sync).
Token ids stay exact in float32 (< 2**24).
"""
from __future__ import annotations

import torch

from engine.decoding.sampling import accept_draft, display_probs, draw, process
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
