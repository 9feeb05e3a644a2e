"""CSV export of a session: one row per answer (every Summary figure plus its settings) and the step trace."""
from __future__ import annotations

import contextlib
import csv
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from pathlib import Path

from engine.types import GenerationRequest, ModelInfo, Step, Summary

ENCODING = "utf-8-sig"  # the BOM makes Excel read UTF-8 (Chinese text) instead of the ANSI code page

SUMMARY_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Summary))
SESSION_COLUMNS: tuple[str, ...] = (
    "request_id", "timestamp", "target_model", "draft_model", "device", "dtype", "fast_path",
    "proposer", "request_mode", "request_k", "temperature", "top_k", "top_p", "seed", "max_new_tokens",
) + SUMMARY_FIELDS
TRACE_COLUMNS: tuple[str, ...] = (
    "request_id", "step", "mode", "proposed", "accepted", "added_status", "new_tokens", "total_tokens",
    "draft_ms", "verify_ms", "elapsed_s", "stop_reason", "text",
)


@dataclass(frozen=True)
class AnswerRecord:
    """One finished (or stopped) answer, with what it took to make it."""

    request: GenerationRequest  # exactly what was sent (request_id included)
    summary: Summary  # what the engine reported
    info: ModelInfo | None  # the pair that produced it
    timestamp: str  # ISO 8601, local time with offset, when the answer finished
    steps: tuple[Step, ...] = ()  # the trace, for the step export


def now_iso() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


# A spreadsheet runs a cell that starts with one of these as a formula (=HYPERLINK(...) and worse).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def neutralise(text: str) -> str:
    """Text as a spreadsheet shows it, never runs it (the OWASP CSV-injection rule: a leading quote).

    Text that already starts with a quote gets one too, so `restore` gives back exactly what was written.
    """
    return "'" + text if text.startswith(FORMULA_STARTS + ("'",)) else text


def restore(text: str) -> str:
    """The text `neutralise` was given (for readers of our own CSV files)."""
    return text[1:] if text.startswith("'") else text


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


def session_rows(records: Iterable[AnswerRecord]) -> list[dict[str, object]]:
    rows = []
    for r in records:
        req, info = r.request, r.info
        row: dict[str, object] = {
            "request_id": req.request_id,
            "timestamp": r.timestamp,
            "target_model": info.target_name if info else "",
            "draft_model": (info.draft_name or "") if info else "",
            "device": info.device if info else "",
            "dtype": info.dtype if info else "",
            "fast_path": info.fast_path if info else "",
            "proposer": req.proposer if req.mode == "speculative" else "",
            "request_mode": req.mode,
            "request_k": req.k if req.mode == "speculative" else 0,
            "temperature": req.sampling.temperature,
            "top_k": req.sampling.top_k,
            "top_p": req.sampling.top_p,
            "seed": req.sampling.seed,
            "max_new_tokens": req.max_new_tokens,
        }
        for name in SUMMARY_FIELDS:
            row[name] = getattr(r.summary, name)
        rows.append({k: cell(v) for k, v in row.items()})
    return rows


def trace_rows(records: Iterable[AnswerRecord]) -> list[dict[str, object]]:
    rows = []
    for r in records:
        for s in r.steps:
            rows.append({k: cell(v) for k, v in {
                "request_id": r.request.request_id,
                "step": s.index,
                "mode": s.mode,
                "proposed": len(s.proposed),
                "accepted": s.accepted,
                "added_status": s.added_status,
                "new_tokens": s.new_tokens,
                "total_tokens": s.total_tokens,
                "draft_ms": s.draft_ms,
                "verify_ms": s.verify_ms,
                "elapsed_s": s.elapsed_s,
                "stop_reason": s.stop_reason,
                "text": s.text,
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


def write_session_csv(path: str | os.PathLike[str], records: Iterable[AnswerRecord]) -> int:
    """One row per answer; returns the number of rows. Raises OSError if the path is not writable."""
    return write_csv(path, SESSION_COLUMNS, session_rows(records))


def write_trace_csv(path: str | os.PathLike[str], records: Iterable[AnswerRecord]) -> int:
    """One row per Step of every answer; returns the number of rows. Raises OSError on failure."""
    return write_csv(path, TRACE_COLUMNS, trace_rows(records))
