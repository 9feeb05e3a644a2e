"""Plain words for measured numbers: the K controller's decisions, the time split, diagnoses (no torch, no Qt).

The data stays numbers (engine.types); the CLI, the app and the widgets all word it here, so a
decision reads the same under an answer, in the status bar and on the command line.
"""
from __future__ import annotations

from engine.measure.verdict import NOISE_FLOOR
from engine.types import Decision, Diagnosis, PrefillProgress, Summary

SOURCE_WORDS = {"draft": "the draft", "ngram": "n-gram lookup", None: "drafting"}


def describe_decision(d: Decision) -> str:
    """One sentence with the number behind it, e.g.
    "standard here: at 41% acceptance the draft costs more than it saves (best K=2: 0.91x)"."""
    who = SOURCE_WORDS.get(d.source, d.source or "drafting")
    acceptance = f"{d.acceptance:.0%} acceptance" if d.acceptance is not None else "the acceptance measured"
    if d.reason == "standard":
        return "standard decoding"
    if d.reason == "fixed":
        return f"K={d.k} as set"
    if d.reason == "no_match":
        return "standard here: n-gram lookup found nothing to copy"
    if d.reason == "no_gain":
        what = f" (best K={d.best_k}: {d.best_speedup:.2f}x)" if d.best_speedup is not None and d.best_k else ""
        drafter = "the draft" if d.best_k else "drafting"
        return f"standard here: at {acceptance} {drafter} costs more than it saves{what}"
    if d.reason == "probe":
        return f"probing {who} with K={d.k}: checking whether the {acceptance} still does not pay"
    speed = f", predicted {d.predicted_speedup:.2f}x" if d.predicted_speedup is not None else ""
    return f"K={d.k} with {who}: {acceptance}{speed}"


def plain_verdict(draft_share: float | None, acceptance: float | None, speedup: float | None, *,
                  spread: float = NOISE_FLOOR, drafter: str = "the draft") -> str:
    """The one verdict Chat, Race and Tune give, e.g. "Standard decoding is fastest here: the draft costs 60%
    of a forward and 45% of its tokens are accepted"; speculation "pays" only beyond the measured spread."""
    why = " and ".join(part for part in (
        f"{drafter} costs {draft_share:.0%} of a forward" if draft_share is not None else "",
        f"{acceptance:.0%} of its tokens are accepted" if acceptance is not None else "") if part)
    if speedup is not None and speedup - 1 > max(spread, NOISE_FLOOR):
        return f"Speculative decoding pays here: about {speedup:.2f}× faster" + (f" ({why})" if why else "")
    return "Standard decoding is fastest here" + (f": {why}" if why else "")


def plain_decision(d: Decision) -> str:
    """What auto does now, in plain words (describe_decision has the figures, for a tooltip)."""
    who = SOURCE_WORDS.get(d.source, d.source or "drafting")
    accepted = f"{d.acceptance:.0%} of drafted tokens accepted" if d.acceptance is not None else ""
    if d.reason == "standard":
        return "Standard decoding"
    if d.reason == "fixed":
        return f"Drafting {d.k} tokens a step, as set"
    if d.reason == "no_match":
        return "Standard decoding now: n-gram lookup found nothing to copy"
    if d.reason == "no_gain":
        return "Standard decoding now: drafting would not pay" + (f" ({accepted})" if accepted else "")
    if d.reason == "probe":
        return f"Trying {who} again to see whether it pays now"
    faster = f", about {d.predicted_speedup:.2f}× faster" if d.predicted_speedup is not None else ""
    return f"Drafting {d.k} tokens a step with {who}" + (f": {accepted}" if accepted else "") + faster


def describe_prefill(progress: PrefillProgress) -> str:
    """e.g. "Reading the prompt: 2,100 / 4,449 tokens" (the draft model's and the head's say whose)."""
    who = {"target": "Reading the prompt", "draft": "The draft model is reading the prompt",
           "head": "The draft head is reading the prompt"}[progress.part]
    return f"{who}: {progress.done:,} / {progress.total:,} tokens"


def describe_unsettled(d: Decision) -> str:
    """A decision taken on forward costs not settled yet (ModelInfo.costs_state in UNSETTLED): what was
    done, without a verdict on whether drafting pays."""
    if d.reason in ("no_gain", "probe"):
        return "Standard decoding for now: the forward costs are still being measured"
    return plain_decision(d) + " (the forward costs are still being measured)"


UNSETTLED = ("measuring", "disturbed", "unsteady")  # ModelInfo.costs_state values no verdict is given on


def time_split(s: Summary) -> str:
    """e.g. "draft 31% · verify 62% · overhead 7%" (prefill counts as overhead here)."""
    total = max(s.seconds, s.draft_s + s.verify_s)  # device-timed steps can overlap the host's clock
    if total <= 0:
        return "no time measured"
    other = total - s.draft_s - s.verify_s
    return f"draft {s.draft_s / total:.0%} · verify {s.verify_s / total:.0%} · overhead {other / total:.0%}"


def describe_diagnosis(d: Diagnosis) -> tuple[str, str]:
    """(what was measured, what to do) for one diagnosis."""
    if d.kind == "position_one":
        return (f"Draft position 1 is accepted {d.value:.0%} of the time, the later positions {d.reference:.0%}.",
                "The first drafted token is the one that sees the chat template: check that the draft and "
                "the target use the same chat template and tokenizer.")
    if d.kind == "temperature":
        return (f"Acceptance falls from {d.reference:.0%} at T={d.temperature:g} to {d.value:.0%} at higher "
                "temperatures.",
                f"Sample cooler (T={d.temperature:g}), or decode greedily for code.")
    if d.kind == "draft_cost":
        return (f"The draft costs more than it saves: speculative decoding measured {d.value:.2f}x of standard "
                f"(a draft forward costs {d.reference:.0%} of a target forward).",
                "Use n-gram lookup, a cheaper draft, or auto mode (it decodes standard where drafting loses).")
    if d.kind == "best_k":
        return (f"K={d.k} measured {d.value:.2f}x, better than the current setting ({d.reference:.2f}x).",
                f"Apply K={d.k}, or K auto to choose per step.")
    if d.kind == "memory":
        return (f"Memory is {d.value:.0%} used ({d.reference:.1f} GiB in all).",
                "Lower max new tokens, load in bfloat16, or choose smaller models before it runs out.")
    return (f"In {d.category} prompts speculative decoding measured {d.value:.2f}x of standard.",
            f"Auto mode decodes standard in {d.category} prompts: use it there.")
