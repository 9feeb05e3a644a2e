"""One answer streamed from a remote server, as the chat's Steps, its Summary and its stats line (no Qt).

This project's `serve` sends each decoding step's tokens with their statuses (the stream's `specdec`
extension), so its pieces become the same Steps the local engine yields and the colours, statistics and
charts work unchanged. Any other server sends text only: each piece is one standard-looking Step whose
bubble is shown without colours, and the stats line says what the server reported instead (the answer's
draft counts from llama-server's `timings`, the aggregates of `/metrics`) and what it cannot show.
Times are measured here, at the client: the network and the server's queue are part of them.
"""
from __future__ import annotations

from dataclasses import replace

from app.core.remote import RemoteFinish, RemoteMetrics, RemotePiece
from engine.measure.stats import summarize
from engine.types import Step, StopReason, Summary, TokenView

NO_COLOURS = "this server does not report per-token drafts: colours off"
_STOPS: dict[str, StopReason] = {"stop": "eos", "length": "max_new_tokens", "cancelled": "cancelled"}
_DRAFTED = ("accepted", "rejected")
_ADDED = ("corrected", "bonus", "target")


class RemoteAnswer:
    """Collects one streamed answer: `step(piece, now)` per piece, `finish(...)` once at the end."""

    def __init__(self, started: float) -> None:
        self.started = started  # time.perf_counter() when the request was sent
        self.steps: list[Step] = []  # every Step made so far
        self.colours: bool | None = None  # the stream carries token statuses (None: nothing arrived yet)
        self._last = started
        self._total = 0

    def step(self, piece: RemotePiece, now: float) -> Step:
        """The Step this piece stands for; its time is the wait since the previous piece."""
        if self.colours is None and (piece.tokens or piece.text):
            self.colours = bool(piece.tokens)
        interval_ms = (now - self._last) * 1e3
        self._last = now
        index = piece.tokens[0].step if piece.tokens else (self.steps[-1].index + 1 if self.steps else 0)
        if piece.tokens or self.colours:
            step = _our_step(piece, index)
        else:  # another server: one piece of text, status unknown (shown without colours)
            view = TokenView(0, piece.text, "target", index, None, None, None, None)
            step = Step(index, "standard", (), (), (), (), 0, 0, "target", (view,), piece.text, 1, 0, 0.0, 0.0, 0.0)
        self._total += step.new_tokens
        step = replace(step, total_tokens=self._total, verify_ms=interval_ms, elapsed_s=now - self.started)
        self.steps.append(step)
        return step

    def finish(self, end: RemoteFinish, now: float) -> Summary:
        """The answer's Summary: from its Steps where the server sent statuses, else from what it reported."""
        seconds = now - self.started
        drafting = any(s.proposed for s in self.steps)
        k = max((len(s.proposed) for s in self.steps), default=0)
        summary = summarize(self.steps, mode="speculative" if drafting else "standard", k=k, prompt_tokens=0,
                            seconds=seconds, stop_reason=_STOPS.get(end.finish_reason, "eos"))
        summary = replace(summary, verify_s=0.0, overhead_s=0.0)  # no split of the time is known here
        if self.colours:
            return summary
        tokens = end.completion_tokens if end.completion_tokens is not None else summary.new_tokens
        drafted, accepted = end.draft_n or 0, end.draft_n_accepted or 0
        return replace(summary, mode="speculative" if drafted else "standard", new_tokens=tokens,
                       tokens_per_s=tokens / seconds if seconds > 0 else 0.0, drafted=drafted, accepted=accepted,
                       acceptance_rate=accepted / drafted if drafted else 0.0, k=0, per_position_acceptance=(),
                       accepted_length_histogram=(), tokens_per_target_forward=0.0, target_forwards=0,
                       draft_forwards=0)


def _our_step(piece: RemotePiece, index: int) -> Step:
    """A Step of this project's server from its token statuses (display order: accepted, rejected, added)."""
    drafted = sorted((t for t in piece.tokens if t.status in _DRAFTED), key=lambda t: t.draft_pos or 0)
    added = [t for t in piece.tokens if t.status in _ADDED]
    accepted = sum(t.status == "accepted" for t in drafted)
    return Step(index=index, mode="speculative" if drafted else "standard",
                proposed=tuple(t.token_id for t in drafted), proposed_q=tuple(t.q or 0.0 for t in drafted),
                proposed_p=tuple(t.p or 0.0 for t in drafted), sources=tuple(t.source or "draft" for t in drafted),
                accepted=accepted,
                added=added[0].token_id if added else None, added_status=added[0].status if added else None,
                tokens=piece.tokens, text=piece.text, new_tokens=accepted + len(added), total_tokens=0,
                draft_ms=0.0, verify_ms=0.0, elapsed_s=0.0, extra=added[1].token_id if len(added) > 1 else None,
                tree_width=piece.tree_width, tree_depth=piece.tree_depth)


def stats_line(summary: Summary, end: RemoteFinish, colours: bool, metrics: RemoteMetrics | None,
               metrics_note: str = "") -> str:
    """e.g. "remote · speculative · K=3 · 71% accepted · 2.4 tokens/step · 9.3 tok/s · 48 tokens · 5.2 s", or for
    another server "remote · 48 tokens · 12 tok/s · 4.0 s · drafts: 30 proposed, 21 accepted (70%) · /metrics: …
    · this server does not report per-token drafts: colours off"."""
    parts = ["remote"]
    rate = f"{summary.tokens_per_s:.1f}" if summary.tokens_per_s < 10 else f"{summary.tokens_per_s:.0f}"
    if colours:
        if summary.mode == "speculative":
            parts += [f"speculative · K={summary.k}", f"{summary.acceptance_rate:.0%} accepted"]
        else:
            parts.append("standard")
        parts.append(f"{summary.tokens_per_target_forward:.1f} tokens/step")
    parts += [f"{rate} tok/s", f"{summary.new_tokens} tokens", f"{summary.seconds:.1f} s"]
    if summary.stop_reason == "cancelled":
        parts.append("stopped")
    if not colours:
        if end.draft_n is not None:
            share = f" ({end.draft_n_accepted / end.draft_n:.0%})" if end.draft_n and end.draft_n_accepted is not None else ""
            parts.append(f"drafts: {end.draft_n} proposed, {end.draft_n_accepted} accepted{share}")
        else:
            parts.append("no draft counts in its timings")
        parts.append(metrics_line(metrics, metrics_note))
        parts.append(NO_COLOURS)
    return " · ".join(parts)


def metrics_line(metrics: RemoteMetrics | None, note: str = "") -> str:
    """What /metrics says about speculation on the whole server, or why it says nothing."""
    if metrics is None:
        return f"no /metrics ({note})" if note else "no /metrics"
    if metrics.acceptance is None:
        return "/metrics: no speculative counters"
    positions = list(metrics.by_position)
    while positions and not positions[-1]:  # positions no draft reached
        positions.pop()
    by_position = f", by position {'/'.join(f'{p:.0%}' for p in positions)}" if positions else ""
    return f"/metrics: {metrics.acceptance:.0%} of {metrics.draft_tokens:.0f} drafted accepted{by_position}"
