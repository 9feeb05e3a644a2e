"""Data rounds of an earlier distillation of the same target, trained on again (`distill --data WORK`).

A run on a lent machine writes its rounds into its work folder and loses them with the machine
unless they are copied back; a later run given that folder (or its `data` folder) trains on those
answers beside the fresh ones it writes. Its held-out answers stay its own fresh ones, its questions
avoid the kept ones, and its log repeats the kept rounds' own "data" records (with `"kept_from"`), so a
head whose history already holds those rounds shows them as data seen again (app/core/head_log.py).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from engine.errors import DistillError

STATE = "state.json"
ROUND = re.compile(r"round-\d{5,}\.pt")  # as the data phase names them (engine/heads/writing.py)


@dataclass(frozen=True)
class KeptData:
    """The data rounds of an earlier distillation's work folder."""

    work: Path  # that work folder (resolved)
    rounds: tuple[Path, ...]  # its data/round-*.pt, in order
    fingerprint: dict | None  # the target it was written by (its state file's), None when unreadable

    @cached_property
    def logged(self) -> dict[int, dict]:
        """Round number (1-based, as logged) -> that round's "data" record in its log, read when first asked
        (only the run that logs the kept rounds does; the checks before and after the load need no log)."""
        return _logged_rounds(self.work / "train_log.jsonl")


def find_kept(folder: Path) -> KeptData:
    """The earlier run's data in `folder` (its work folder, or the `data` folder inside it); DistillError
    (one line) when it is not one. The target's fingerprint is checked later (check_kept), once it is loaded."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DistillError(f"--data {folder}: " + ("a file, not a work folder" if folder.exists() else "no such folder"))
    work = folder if (folder / STATE).is_file() else folder.parent
    if not (work / STATE).is_file():
        raise DistillError(f"--data {folder}: not a distillation's work folder (no {STATE} in it or above it)")
    rounds = tuple(sorted(p for p in (work / "data").glob("round-*.pt") if ROUND.fullmatch(p.name)))
    if not rounds:
        raise DistillError(f"--data {folder}: the work folder has no data rounds (data/round-*.pt)")
    try:
        state = json.loads((work / STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        state = None
    fingerprint = state.get("fingerprint") if isinstance(state, dict) else None
    return KeptData(work.resolve(), rounds, fingerprint if isinstance(fingerprint, dict) else None)


def find_all_kept(folders: list[Path], work: Path) -> list[KeptData]:
    """find_kept for each folder; refuses this run's own work folder and a folder given twice."""
    kept: list[KeptData] = []
    for folder in folders:
        k = find_kept(folder)
        if k.work == Path(work).resolve():
            raise DistillError(f"--data {folder}: that is this run's own work folder (trained on anyway)")
        if any(k.work == other.work for other in kept):
            raise DistillError(f"--data {folder}: given twice")
        kept.append(k)
    return kept


def check_kept(kept: list[KeptData], fingerprint: dict) -> None:
    """DistillError when a kept folder's data was written by another target (or does not say by which)."""
    for k in kept:
        if k.fingerprint is None:
            raise DistillError(f"--data {k.work}: its {STATE} does not say which target wrote the data")
        if k.fingerprint != fingerprint:
            raise DistillError(f"--data {k.work}: the data was written by another target")


def _logged_rounds(path: Path) -> dict[int, dict]:
    """The "data" records of a work folder's log by round; unreadable lines are skipped."""
    out: dict[int, dict] = {}
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict) and record.get("kind") == "data" and all(
                isinstance(record.get(k), int) and not isinstance(record.get(k), bool) and record[k] >= 0
                for k in ("round", "answer_tokens")):  # a damaged line: the round file's own count is logged
            out[record["round"]] = record
    return out
