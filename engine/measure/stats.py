"""Turns the Steps of one generation into a Summary; shared by the engine, the app and fakes."""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from engine.types import Mode, Step, StopReason, Summary


def drafted_depth(step: Step) -> int:
    """Draft positions the round offered: its drafts, or a dynamic tree's levels (tree_depth). The walk
    through a tree shows drafts only down to where the branch it took ended; a branch that ends early is a
    miss at the next level, as a rejection is (the K controller and the draft check count it so too)."""
    return max(len(step.proposed), step.tree_depth)


def summarize(
    steps: Sequence[Step],
    *,
    mode: Mode,
    k: int,
    prompt_tokens: int,
    seconds: float,
    stop_reason: StopReason,
    draft_forwards: int | None = None,
    prefill_s: float = 0.0,
) -> Summary:
    """Every Summary figure is derived from the Steps, so views and exports cannot disagree.

    `draft_forwards` is passed by the engine (it knows about catch-up forwards); when absent it is
    estimated as one forward per proposed token. `prefill_s` (the prompt's share of `seconds`) is
    the engine's too; the rest of the time split (drafting, verifying, overhead) comes from the Steps.
    """
    new_tokens = sum(s.new_tokens for s in steps)
    drafted = sum(len(s.proposed) for s in steps)
    accepted = sum(s.accepted for s in steps)
    drafting = mode != "standard"
    depths = [drafted_depth(s) for s in steps]
    k_max = max([k] + depths) if drafting else 0
    reached = [0] * k_max
    hits = [0] * k_max
    histogram = [0] * (k_max + 1)
    for s, depth in zip(steps, depths):
        if not s.proposed:
            continue
        histogram[s.accepted] += 1
        # Position i was "reached" if every earlier draft token was accepted.
        for i in range(min(depth, s.accepted + 1)):
            reached[i] += 1
            hits[i] += i < s.accepted
    per_position = tuple(h / r if r else 0.0 for h, r in zip(hits, reached))
    target_forwards = len(steps)
    chosen = [s.decision.k if s.decision is not None else len(s.proposed) for s in steps]
    draft_s = sum(s.draft_ms for s in steps) / 1000
    verify_s = sum(s.verify_ms for s in steps) / 1000
    first = next((s for s in steps if s.new_tokens), None)  # the first step that committed a token
    by_source = Counter(source for s in steps for source in s.sources)
    return Summary(
        mode=mode,
        k=k if drafting else 0,
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        seconds=seconds,
        tokens_per_s=new_tokens / seconds if seconds > 0 else 0.0,
        drafted=drafted,
        accepted=accepted,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        tokens_per_target_forward=new_tokens / target_forwards if target_forwards else 0.0,
        per_position_acceptance=per_position,
        accepted_length_histogram=tuple(histogram) if drafting else (),
        target_forwards=target_forwards,
        draft_forwards=drafted if draft_forwards is None else draft_forwards,
        stop_reason=stop_reason,
        text="".join(s.text for s in steps),
        k_mean=sum(chosen) / len(chosen) if chosen else 0.0,
        standard_steps=sum(1 for s in steps if s.decision is not None and s.decision.k == 0) if drafting else 0,
        prefill_s=prefill_s,
        first_token_s=first.elapsed_s if first is not None else 0.0,
        draft_s=draft_s,
        verify_s=verify_s,
        overhead_s=max(seconds - prefill_s - draft_s - verify_s, 0.0),
        decision=steps[-1].decision if steps else None,
        drafter=by_source.most_common(1)[0][0] if by_source else None,
    )
