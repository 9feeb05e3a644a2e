"""Exports: the session as CSV (one row per answer, race run and sweep run; and the step trace), a conversation as
Markdown or JSON."""
from __future__ import annotations

import contextlib
import csv
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from pathlib import Path
from typing import Protocol

from app.core.chat_tree import Conversation
from app.core.conversations import encode, write_atomically
from engine.limits import K_AUTO
from engine.measure.csvsafe import neutralise, restore  # noqa: F401 (restore: readers of our CSVs import it here)
from engine.measure.experiment import RunRecord
from engine.types import GenerationRequest, Message, ModelInfo, Step, Summary

ENCODING = "utf-8-sig"  # the BOM makes Excel read UTF-8 (Chinese text) instead of the ANSI code page

SUMMARY_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Summary) if f.name != "decision")
# The controller's last decision, as numbers (a Decision is not one cell).
DECISION_COLUMNS: tuple[str, ...] = ("decision_k", "decision_reason", "decision_acceptance",
                                     "decision_predicted_speedup")
# kind: "chat" (an answer), "race standard" / "race speculative" (one run of a race repeat), "sweep" (one run of
# a Tune sweep). question: what was asked (the last user message, or the race's / sweep's prompt).
KINDS = ("chat", "race standard", "race speculative", "sweep")
SESSION_COLUMNS: tuple[str, ...] = (
    "kind", "request_id", "timestamp", "question", "prompt_id", "target_model", "draft_model", "device", "dtype", "fast_path", "runtime", "threads",
    "proposer", "request_mode", "request_k", "temperature", "top_k", "top_p", "seed", "max_new_tokens",
) + SUMMARY_FIELDS + DECISION_COLUMNS
# branch: a round verified as a draft tree, each shown draft token's rank among the drafter's choices after its
# parent, in draft order ("0;2;0": the 2nd came through a branch); empty for chains. tree_width / tree_depth: the
# draft tokens the round verified as a tree and its levels (0 for chains). Added last: older readers keep working.
TRACE_COLUMNS: tuple[str, ...] = (
    "request_id", "step", "mode", "k_chosen", "k_reason", "proposed", "accepted", "added_status", "new_tokens",
    "total_tokens", "draft_ms", "verify_ms", "overhead_ms", "elapsed_s", "stop_reason", "text",
    "branch", "tree_width", "tree_depth",
)


@dataclass(frozen=True)
class AnswerRecord:
    """One finished (or stopped) answer, with what it took to make it."""

    request: GenerationRequest  # exactly what was sent (request_id included)
    summary: Summary  # what the engine reported
    info: ModelInfo | None  # the pair that produced it
    timestamp: str  # ISO 8601, local time with offset, when the answer finished
    steps: tuple[Step, ...] = ()  # the trace, for the step export


class RaceRunLike(Protocol):
    """What a race repeat gives the session CSV (app.core.race_logic.RaceResult has it)."""

    race_id: int
    prompt_id: str
    k: int
    temperature: float
    seed: int
    standard: Summary
    speculative: Summary
    question: str
    timestamp: str
    info: ModelInfo | None
    proposer: str


@dataclass(frozen=True)
class SweepRun:
    """One timed run of a Tune sweep, with the configuration and the prompt it ran."""

    record: RunRecord  # what the run measured
    mode: str  # the configuration's mode: "standard", "speculative" or "auto"
    proposer: str | None  # its proposer (None for standard)
    k: int  # its K (K_AUTO: chosen per step; 0 for standard)
    question: str  # the bench prompt's text
    info: ModelInfo | None  # the pair that ran it
    timestamp: str  # ISO 8601, when the sweep ended


def question_of(messages: Sequence[Message]) -> str:
    """The question an answer replies to: the last user message."""
    return next((m.content for m in reversed(messages) if m.role == "user"), "")


def now_iso() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


def cell(value: object) -> object:
    """One CSV cell: sequences become "a;b;c" (one answer stays one row), floats keep full precision
    (the file reads back to the same floats), booleans are "true"/"false", None is empty.

    Text (model output, prompt ids, model names) is neutralised; numbers stay numbers, negative ones too.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        joined = ";".join(v if isinstance(v, str) else str(cell(v)) for v in value)
        numeric = all(isinstance(v, (int, float)) for v in value)
        return joined if numeric else neutralise(joined)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, int) or value is None:
        return "" if value is None else value
    return neutralise(str(value))


def _pair(info: ModelInfo | None) -> dict[str, object]:
    return {
        "target_model": info.target_name if info else "",
        "draft_model": (info.draft_name or "") if info else "",
        "device": info.device if info else "",
        "dtype": info.dtype if info else "",
        "fast_path": info.fast_path if info else "",
        "runtime": info.runtime if info else "",
        "threads": info.threads if info else "",
    }


def _k_cell(mode: str, k: int) -> object:
    return ("auto" if k == K_AUTO or mode == "auto" else k) if mode != "standard" else 0


def _summary_cells(summary: Summary) -> dict[str, object]:
    row: dict[str, object] = {name: getattr(summary, name) for name in SUMMARY_FIELDS}
    d = summary.decision
    row.update(decision_k=d.k if d else None, decision_reason=d.reason if d else None,
               decision_acceptance=d.acceptance if d else None,
               decision_predicted_speedup=d.predicted_speedup if d else None)
    return row


def session_rows(records: Iterable[AnswerRecord], races: Iterable[RaceRunLike] = (),
                 sweeps: Iterable[SweepRun] = ()) -> list[dict[str, object]]:
    """The chat's answers, then every race run (two per repeat), then every sweep run: one row each."""
    rows = []
    for r in records:
        req, info = r.request, r.info
        row: dict[str, object] = {
            "kind": "chat",
            "request_id": req.request_id,
            "timestamp": r.timestamp,
            "question": question_of(req.messages),
            **_pair(info),
            "proposer": req.proposer if req.mode != "standard" else "",
            "request_mode": req.mode,
            "request_k": _k_cell(req.mode, req.k),
            "temperature": req.sampling.temperature,
            "top_k": req.sampling.top_k,
            "top_p": req.sampling.top_p,
            "seed": req.sampling.seed,
            "max_new_tokens": req.max_new_tokens,
        }
        row.update(_summary_cells(r.summary))
        rows.append({k: cell(v) for k, v in row.items()})
    for race in races:
        for mode, summary in (("standard", race.standard), ("speculative", race.speculative)):
            row = {"kind": f"race {mode}", "timestamp": race.timestamp, "question": race.question,
                   "prompt_id": race.prompt_id, **_pair(race.info),
                   "proposer": race.proposer if mode != "standard" else "", "request_mode": mode,
                   "request_k": _k_cell(mode, race.k), "temperature": race.temperature, "seed": race.seed,
                   **_summary_cells(summary)}
            rows.append({k: cell(v) for k, v in row.items()})
    for run in sweeps:
        rows.append({k: cell(v) for k, v in _sweep_row(run).items()})
    return rows


def _sweep_row(run: SweepRun) -> dict[str, object]:
    """A sweep run in the answer's columns: what a RunRecord measures under the Summary's names."""
    rec = run.record
    row: dict[str, object] = {
        "kind": "sweep", "timestamp": run.timestamp, "question": run.question, "prompt_id": rec.prompt_id,
        **_pair(run.info), "proposer": run.proposer or "", "request_mode": run.mode,
        "request_k": _k_cell(run.mode, run.k), "temperature": rec.temperature,
    }
    row.update({name: getattr(rec, name) for name in SUMMARY_FIELDS if name in _RUN_FIELDS})
    row.update(mode=run.mode, k=run.k, acceptance_rate=rec.accepted / rec.drafted if rec.drafted else 0.0,
               tokens_per_target_forward=rec.new_tokens / rec.target_forwards if rec.target_forwards else 0.0,
               per_position_acceptance=tuple(a / n for a, n in zip(rec.position_accepted, rec.position_reached) if n))
    return row


_RUN_FIELDS = frozenset(f.name for f in fields(RunRecord))


def trace_rows(records: Iterable[AnswerRecord]) -> list[dict[str, object]]:
    rows = []
    for r in records:
        for s in r.steps:
            rows.append({k: cell(v) for k, v in {
                "request_id": r.request.request_id,
                "step": s.index,
                "mode": s.mode,
                "k_chosen": s.decision.k if s.decision is not None else len(s.proposed),
                "k_reason": s.decision.reason if s.decision is not None else None,
                "proposed": len(s.proposed),
                "accepted": s.accepted,
                "added_status": s.added_status,
                "new_tokens": s.new_tokens,
                "total_tokens": s.total_tokens,
                "draft_ms": s.draft_ms,
                "verify_ms": s.verify_ms,
                "overhead_ms": s.overhead_ms,
                "elapsed_s": s.elapsed_s,
                "stop_reason": s.stop_reason,
                "text": s.text,
                "branch": tuple(t.branch for t in s.tokens if t.draft_pos is not None and t.branch is not None),
                "tree_width": s.tree_width,
                "tree_depth": s.tree_depth,
            }.items()})
    return rows


def write_csv(path: str | os.PathLike[str], columns: Sequence[str], rows: list[dict[str, object]]) -> int:
    """Writes to a temp file then renames, so a failed export never leaves half a CSV behind."""
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(f"{target} is a folder; choose a file name")
    tmp = target.with_name(f".{target.name}.partial")
    try:
        with open(tmp, "w", encoding=ENCODING, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(columns), quoting=csv.QUOTE_MINIMAL)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    return len(rows)


def write_session_csv(path: str | os.PathLike[str], records: Iterable[AnswerRecord], races: Iterable[RaceRunLike] = (),
                      sweeps: Iterable[SweepRun] = ()) -> int:
    """One row per answer, race run and sweep run; returns the number of rows. Raises OSError if not writable."""
    return write_csv(path, SESSION_COLUMNS, session_rows(records, races, sweeps))


def write_trace_csv(path: str | os.PathLike[str], records: Iterable[AnswerRecord]) -> int:
    """One row per Step of every answer; returns the number of rows. Raises OSError on failure."""
    return write_csv(path, TRACE_COLUMNS, trace_rows(records))


# --- conversations ----------------------------------------------------------------------------------

StatsLine = Callable[[Summary, "GenerationRequest | None"], str]


def conversation_markdown(conversation: Conversation, stats_line: StatsLine | None = None) -> str:
    """The shown branch as Markdown: a heading per message; answers keep their own markdown as written,
    followed by their figures (`stats_line`, e.g. widgets.stats_line.format_stats_line) in italics."""
    lines = [f"# {conversation.title or 'Untitled conversation'}", "",
             f"_Exported from SpecDec Studio on {now_iso()}; started {conversation.created}._", ""]
    for turn in conversation.path():
        if turn.role == "user":
            lines += ["## You", "", turn.content, ""]
            continue
        lines += [f"## Assistant ({turn.model})" if turn.model else "## Assistant", "", turn.content, ""]
        if turn.summary is not None and stats_line is not None:
            lines += [f"_{stats_line(turn.summary, turn.request)}_", ""]
        if turn.error:
            lines += [f"> ⚠ {turn.error}", ""]
    return "\n".join(lines)


def write_conversation_markdown(path: str | os.PathLike[str], conversation: Conversation,
                                stats_line: StatsLine | None = None) -> None:
    """Raises OSError if the path is not writable; an existing file is replaced whole or not at all."""
    write_atomically(_file_path(path), conversation_markdown(conversation, stats_line).encode("utf-8"))


def write_conversation_json(path: str | os.PathLike[str], conversation: Conversation) -> None:
    """Every branch, figure and token status: the same format as the saved file (it can be put back)."""
    write_atomically(_file_path(path), encode(conversation.to_json()))


def _file_path(path: str | os.PathLike[str]) -> Path:
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(f"{target} is a folder; choose a file name")
    return target
