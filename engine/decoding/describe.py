"""A round described for people: the Step with one TokenView per shown token, and its committed text."""
from __future__ import annotations

import time
from dataclasses import replace

from engine.decoding.detok import Detokenizer
from engine.decoding.outcome import Launched, RoundResult
from engine.types import Step, TokenView


def describe_step(index: int, r: RoundResult, committed: list[int], kept_draft: int, launched: Launched,
                  detok: Detokenizer, t0: float, overhead_ms: float, total_tokens: int) -> tuple[Step, str]:
    """The Step of round `index` with one TokenView per shown token; returns it and its committed text."""
    proposal = launched.proposal
    speculative = proposal is not None
    n_shown = kept_draft if len(committed) <= r.accepted else len(r.proposed)
    proposed = r.proposed[:n_shown]
    views: list[TokenView] = []
    pieces: list[str] = []
    rejected: list[TokenView] = []
    for i, tok in enumerate(proposed):
        src = proposal.sources[i] if proposal is not None else None
        common = dict(token_id=tok, step=index, draft_pos=i, q=r.q_shown[i], p=r.p_shown[i],
                      accept_prob=r.accept_prob[i], source=src, branch=r.ranks[i] if r.ranks is not None else None)
        if i < kept_draft:
            piece = detok.push(tok)
            pieces.append(piece)
            views.append(TokenView(text=piece, status="accepted", **common))
        else:
            rejected.append(TokenView(text=detok.peek(tok), status="rejected", **common))
    added: int | None = None
    status = None
    if len(committed) > kept_draft:
        added = committed[kept_draft]
        if not speculative or not r.proposed:
            status = "target"  # no draft this step: the target decoded on its own
        else:
            status = "bonus" if r.accepted == len(r.proposed) else "corrected"
    # Rejected tokens are shown before the correction that replaces them.
    views.extend(rejected)
    extra = committed[kept_draft + 1] if len(committed) > kept_draft + 1 else None
    if added is not None:
        piece = detok.push(added)
        pieces.append(piece)
        # A tree's alternative the target picked was drafted too: its source says so.
        views.append(
            TokenView(token_id=added, text=piece, status=status, step=index, draft_pos=None, q=None,
                      p=r.added_p, accept_prob=None, source=proposal.sources[0] if extra is not None else None)
        )
    if extra is not None:  # the target's token after that alternative, from the same forward
        piece = detok.push(extra)
        pieces.append(piece)
        views.append(TokenView(token_id=extra, text=piece, status="bonus", step=index, draft_pos=None, q=None,
                               p=r.extra_p, accept_prob=None, source=None))
    text = "".join(pieces)
    step = Step(
        index=index,
        mode="speculative" if speculative else "standard",
        proposed=tuple(proposed),
        proposed_q=tuple(r.q_shown[:n_shown]),
        proposed_p=tuple(r.p_shown[:n_shown]),
        sources=tuple(proposal.sources[:n_shown]) if proposal is not None else (),
        accepted=kept_draft,
        added=added,
        added_status=status,
        tokens=tuple(views),
        text=text,
        new_tokens=len(committed),
        total_tokens=total_tokens,
        draft_ms=r.draft_ms,
        verify_ms=r.verify_ms,
        elapsed_s=time.perf_counter() - t0,
        decision=launched.decision,
        overhead_ms=overhead_ms,
        extra=extra,
        tree_children=tuple(tuple(c) for c in r.children[:n_shown]) if r.children is not None else (),
        **_tree_shape(launched),
    )
    return step, text


def _tree_shape(launched: Launched) -> dict[str, int]:
    """The tree a round verified, as Step.tree_width / tree_depth (nothing for chains and standard steps)."""
    proposal = launched.proposal
    if proposal is None:
        return {}
    if launched.path and proposal.tree is not None:
        return {"tree_width": proposal.tree.nodes, "tree_depth": launched.decision.k}
    if launched.tree and proposal.alts is not None:
        return {"tree_width": int(proposal.alts.numel()) + launched.n, "tree_depth": launched.n}
    return {}


def with_text(step: Step, text: str) -> Step:
    """The step with `text`, its committed token views re-cut so their texts still add up to it.

    Text cut by a stop string leaves later views shorter or empty; text added by the final
    flush (the bytes of an unfinished character) goes to the last committed token, which ended it.
    """
    kept = [i for i, v in enumerate(step.tokens) if v.status != "rejected"]
    if not kept:
        return replace(step, text=text)
    views = list(step.tokens)
    rest = text
    for i in kept:
        piece, rest = rest[: len(views[i].text)], rest[len(views[i].text):]
        views[i] = replace(views[i], text=piece)
    if rest:
        views[kept[-1]] = replace(views[kept[-1]], text=views[kept[-1]].text + rest)
    return replace(step, text=text, tokens=tuple(views))
