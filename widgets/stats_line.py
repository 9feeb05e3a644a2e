"""The one-line summary shown under each finished answer ("speculative · K=5 · 78% accepted · ...")."""
from __future__ import annotations

from engine.measure.explain import describe_decision, describe_unsettled
from engine.types import GenerationRequest, Summary

# Stop reasons worth telling a reader; eos / stop strings / max tokens are the normal endings.
_NOTABLE_STOPS = {"cancelled": "stopped", "context_full": "context full"}


def _rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s:.1f}" if tokens_per_s < 10 else f"{tokens_per_s:.0f}"


def format_stats_line(summary: Summary, request: GenerationRequest | None = None, *, unsettled: bool = False) -> str:
    """e.g. "speculative · K=5 · 78% accepted · 3.9 tokens/step · 41 tok/s · 256 tokens · 6.2 s ·
    draft 30% · verify 64% · overhead 6%"; with K chosen per step, the mean K and the last decision too
    (unsettled: the forward costs looked disturbed, so no verdict on whether drafting pays)."""
    parts: list[str] = []
    adaptive = summary.mode == "auto" or (summary.mode == "speculative" and summary.k == 0 and summary.k_mean)
    if summary.mode != "standard":
        proposer = request.proposer if request is not None else "draft"
        parts.append(summary.mode if proposer == "draft" else f"{summary.mode} ({proposer})")
        if adaptive:
            parts.append(f"K auto, mean {summary.k_mean:.1f}")
            steps = summary.target_forwards
            if summary.standard_steps and steps:
                parts.append(f"{summary.standard_steps / steps:.0%} standard steps")
        else:
            parts.append(f"K={summary.k or (request.k if request is not None else 0)}")
        parts.append(f"{summary.acceptance_rate * 100:.0f}% accepted")
    else:
        parts.append("standard")
    parts.append(f"{summary.tokens_per_target_forward:.1f} tokens/step")
    parts.append(f"{_rate(summary.tokens_per_s)} tok/s")
    parts.append(f"{summary.new_tokens} tokens")
    parts.append(f"{summary.seconds:.1f} s")
    if summary.new_tokens:
        parts.append(f"first token {summary.first_token_s:.1f} s")
    if summary.draft_s or summary.verify_s:
        # Shares of the answer's time; never over 100% (steps timed on the device can overlap the host).
        total = max(summary.seconds, summary.draft_s + summary.verify_s)
        other = total - summary.draft_s - summary.verify_s
        parts.append(f"draft {summary.draft_s / total:.0%} / verify {summary.verify_s / total:.0%}"
                     f" / other {other / total:.0%} of the time")
    if request is not None and not request.sampling.greedy:
        parts.append(f"T={request.sampling.temperature:g}")
    if summary.stop_reason in _NOTABLE_STOPS:
        parts.append(_NOTABLE_STOPS[summary.stop_reason])
    if adaptive and summary.decision is not None:
        parts.append((describe_unsettled if unsettled else describe_decision)(summary.decision))
    return " · ".join(parts)


def format_stats_plain(summary: Summary, request: GenerationRequest | None = None, *, unsettled: bool = False) -> str:
    """The visible line under an answer, in plain words (format_stats_line has the figures, for its tooltip):
    e.g. "Standard decoding was used for 92% of steps: drafting did not pay (3% of drafted tokens accepted) ·
    8.2 tok/s · 256 tokens in 31.0 s" (unsettled: the forward costs are still being measured, so no verdict)."""
    if summary.mode == "standard":
        lead = "Standard decoding"
    else:
        steps = summary.target_forwards
        standard_share = summary.standard_steps / steps if steps else 0.0
        accepted = f"{summary.acceptance_rate:.0%} of drafted tokens accepted" if summary.drafted else ""
        if standard_share >= 0.5 or not summary.drafted:
            why = "the forward costs are still being measured" if unsettled else "drafting did not pay"
            lead = (f"Standard decoding was used for {standard_share:.0%} of steps: {why}"
                    + (f" ({accepted})" if accepted else ""))
        else:
            lead = f"{accepted}, {summary.tokens_per_target_forward:.1f} tokens per step"
            lead = lead[0].upper() + lead[1:]
    parts = [lead, f"{_rate(summary.tokens_per_s)} tok/s", f"{summary.new_tokens} tokens in {summary.seconds:.1f} s"]
    if summary.new_tokens:
        parts.append(f"first token after {summary.first_token_s:.1f} s")
    if request is not None and not request.sampling.greedy:
        parts.append(f"T={request.sampling.temperature:g}")
    if summary.stop_reason in _NOTABLE_STOPS:
        parts.append(_NOTABLE_STOPS[summary.stop_reason])
    return " · ".join(parts)
