"""A trained head's history from its folder (manifest.json, train_log.jsonl), read as plain JSON without torch."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from importlib import resources
from numbers import Real
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"  # the same names engine.heads writes, read here without importing torch
LOG = "train_log.jsonl"
_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}


@dataclass(frozen=True)
class HeadLog:
    """How one head was trained: its log's records and its manifest's summary."""

    folder: Path  # the head's folder
    name: str  # display name from the manifest, e.g. "Qwen2.5-Coder-1.5B-Instruct head"
    source: Literal["folder", "shipped"]  # trained by the person in the dialog's folder, or shipped in assets/heads
    records: tuple[dict, ...]  # the log's readable records; "train"/"eval" steps continue across runs, and a
    # "continue" marker carries the step it continues from
    runs: int  # training runs in the log: one, plus one per "continue" marker
    minutes: float | None  # training time in all runs (None: the manifest does not say)
    steps: int  # training steps in all runs
    held_out_acceptance: tuple[float, ...]  # of the saved head, by draft position (0..1)
    device: str  # where it was trained ("" when the manifest does not say)


def read_log(path: Path) -> tuple[list[dict], int]:
    """(records, runs) from a train_log.jsonl; lines that are not a readable record are skipped.

    After a "continue" marker the step counter restarts at 0: later steps are offset by the last
    step before the marker, so the curves of a continued head go on where the earlier run stopped.
    """
    records: list[dict] = []
    runs, offset, last = 1, 0, 0
    skipped = 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # damaged, or nested past what the reader recurses through
            skipped += 1
            continue
        if not isinstance(record, dict) or not _readable(record):
            skipped += 1
            continue
        kind = record.get("kind")
        if kind == "continue":
            runs += 1
            offset = last
            record = {**record, "step": last}  # where the curves show the continuation
        elif kind in ("train", "eval"):
            record = {**record, "step": record["step"] + offset}
            last = max(last, record["step"])
        records.append(record)
    if skipped:
        log.info("%s: %d unreadable line(s) skipped", path, skipped)
    mark_repeats(records)
    return records, runs


# A data round is the same round of an earlier run when all of these match (a deterministic target and the same
# seed write the same answers): its tokens were seen before, and the run trains again on old data.
DATA_KEY = ("round", "seed", "sampled", "kept", "answers", "answer_tokens", "greedy")


def data_key(record: dict) -> tuple[str, ...]:
    """What identifies a "data" record's round across runs (DATA_KEY)."""
    return tuple(str(record.get(k)) for k in DATA_KEY)


def mark_repeats(records: list) -> None:
    """Sets "repeat": true on each data record that repeats a round of an earlier run (DATA_KEY), and on the
    "continue" marker of the run that trained on it again, with "fresh": true there when that run also wrote
    data of its own (a run given an earlier run's rounds with --data); entries that are not records are left alone."""
    earlier: set[tuple[str, ...]] = set()
    this_run: set[tuple[str, ...]] = set()
    marker = None
    for i, record in enumerate(records):
        kind = record.get("kind") if isinstance(record, dict) else None
        if kind == "continue":
            earlier |= this_run
            this_run, marker = set(), i
        elif kind == "data":
            key = data_key(record)
            this_run.add(key)
            if marker is None:
                continue
            if key in earlier:
                records[i] = {**record, "repeat": True}
                records[marker] = {**records[marker], "repeat": True}
            else:
                records[marker] = {**records[marker], "fresh": True}


def read_head_log(folder: Path, source: Literal["folder", "shipped"]) -> HeadLog | None:
    """The folder's head log, or None when it has no readable manifest and log."""
    manifest = _manifest(folder)
    if manifest is None or not (folder / LOG).is_file():
        return None
    try:
        records, runs = read_log(folder / LOG)
    except OSError as e:
        log.info("training log of %s not shown: %s", folder, e)
        return None
    training = manifest.get("training") if isinstance(manifest.get("training"), dict) else {}
    minutes = training.get("used_minutes_in_all", training.get("used_minutes"))
    steps = max((r["step"] for r in records if r.get("kind") in ("train", "eval")), default=0)
    acceptance = training.get("held_out_acceptance") or []
    return HeadLog(
        folder=folder, name=str(manifest.get("name") or folder.name), source=source, records=tuple(records),
        runs=runs, minutes=float(minutes) if isinstance(minutes, Real) else None,
        steps=int(steps or training.get("steps") or 0),
        held_out_acceptance=tuple(float(a) for a in acceptance if isinstance(a, Real)),
        device=str(training.get("device") or ""))


def shipped_head_folders() -> list[Path]:
    """Head folders packaged in assets/heads (as engine.heads.shards.shipped_heads finds them)."""
    root = Path(str(resources.files("assets").joinpath("heads")))
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / MANIFEST).is_file())


def head_log_for(head_name: str | None, folder: Path) -> HeadLog | None:
    """The log to show for a target: a head trained in its dialog folder, else the shipped head named `head_name`."""
    trained = read_head_log(folder, "folder")
    if trained is not None or head_name is None:
        return trained
    shipped = shipped_head_named(head_name)
    return read_head_log(shipped, "shipped") if shipped is not None else None


def shipped_head_named(head_name: str) -> Path | None:
    """The folder in assets/heads whose manifest names the head `head_name`, if any."""
    for shipped in shipped_head_folders():
        manifest = _manifest(shipped)
        if manifest is not None and manifest.get("name") == head_name:
            return shipped
    return None


def head_choices(head_name: str | None, folder: Path) -> list[tuple[str, Path]]:
    """Heads the dialog can continue training from, as (label, folder): the shipped head named `head_name` (the
    head in use, or the one it was continued from: a continued head keeps its name), and a head already trained in
    the dialog's folder; each folder once."""
    choices: list[tuple[str, Path]] = []
    shipped = shipped_head_named(head_name) if head_name is not None else None
    if shipped is not None:
        choices.append((f"The shipped head ({head_name})", shipped))
    manifest = _manifest(folder)
    if manifest is not None and all(f.resolve() != folder.resolve() for _label, f in choices):
        choices.append((f"Your head in this folder ({manifest.get('name') or folder.name})", folder))
    return choices


def describe(head: HeadLog) -> str:
    """One line for the dialog: whose log it is, how long, how many runs and steps, how well it drafts."""
    whose = ("the head in use" if head.source == "shipped" else "your head in this folder") + f" ({head.name})"
    spent = [f"{head.minutes:.1f} minutes" if head.minutes is not None else "",
             f"on {head.device}" if head.device else "",
             f"in {_WORDS.get(head.runs, str(head.runs))} runs" if head.runs > 1 else ""]
    spent_text = " ".join(s for s in spent if s)
    steps = f"{head.steps:,} steps"
    parts = f"{spent_text}, {steps}" if spent_text else steps
    if head.held_out_acceptance:
        parts += "; held-out acceptance by draft position " + " ".join(f"{a:.0%}" for a in head.held_out_acceptance)
    ending = " Start to train your own." if head.source == "shipped" else ""
    return f"Training log of {whose}: {parts}.{ending}"


def _manifest(folder: Path) -> dict | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _readable(record: dict) -> bool:
    """Whether the dialog can draw a train/eval record (every other kind is kept as it is)."""
    kind = record.get("kind")
    if kind == "train":
        acc = record.get("acc")
        return (_number(record.get("step")) and _number(record.get("loss")) and isinstance(acc, list) and bool(acc)
                and all(_number(a) for a in acc))
    if kind == "eval":
        acceptance = record.get("acceptance")
        return (_number(record.get("step")) and isinstance(acceptance, list) and bool(acceptance)
                and all(_number(a) for a in acceptance))
    return True


def _number(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)
