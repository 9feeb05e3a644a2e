"""The Train dialog's head folders for a target: the answers earlier runs wrote there, offered to the next run (the
app's `distill --data`: the data rounds in the work folders of the dialog's own head folders and of the head a run
starts from), and a fresh folder for a new head (never one whose head a new run would replace)."""
from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from app.core.head_log import MANIFEST
from engine.errors import DistillError
from engine.heads.reuse import STATE, KeptData, find_kept  # no torch: the window opens without it

WORK = "work"  # a head folder's work folder (distill's default: OUT/work)


@dataclass(frozen=True)
class EarlierData:
    """Work folders with data rounds, and how much they hold."""

    works: tuple[Path, ...]  # resolved, in the order found
    rounds: int
    answer_tokens: int | None  # as their logs say; None when a log lacks a round (not read from the rounds here)

    def describe(self) -> str:
        runs = f"{len(self.works)} run" + ("s" if len(self.works) != 1 else "")
        tokens = "" if self.answer_tokens is None else f", {_tokens(self.answer_tokens)} answer tokens"
        return f"{runs}, {self.rounds} round{'s' if self.rounds != 1 else ''}{tokens}"


def head_family(anchor: Path) -> list[Path]:
    """The dialog's head folders for one target: its default folder and the `-2`, `-3`… and `-continued…` folders
    the dialog names beside it."""
    named = re.compile(re.escape(anchor.name) + r"(-\d+)?(-continued(-\d+)?)*")
    found = [anchor]
    try:
        found += sorted(p for p in anchor.parent.glob(anchor.name + "-*") if named.fullmatch(p.name) and p.is_dir())
    except OSError:
        pass
    return found


def holds_finished_head(folder: Path) -> bool:
    """Whether a new run saving in `folder` would find nothing of its own to go on with: a head there that no run
    in its work folder started (distill refuses to replace it), or a run there that has finished."""
    state = _state(Path(folder))
    if state is None:
        return (Path(folder) / MANIFEST).is_file()
    return state.get("phase") == "done"


def fresh_head_folder(wanted: Path) -> Path:
    """`wanted`, or wanted-2, wanted-3…: the first that holds no finished head (a new head's folder)."""
    for n in range(1, 1000):
        candidate = wanted if n == 1 else wanted.with_name(f"{wanted.name}-{n}")
        try:
            if not holds_finished_head(candidate):
                return candidate
        except (OSError, ValueError):
            continue
    return wanted


def earlier_data(head_folders: Iterable[Path], exclude: Path | None = None) -> EarlierData | None:
    """The data of every head folder's work folder (each once), leaving out `exclude` (a work folder: the run's own,
    whose rounds it trains on anyway); None when there is none."""
    kept: list[KeptData] = []
    skip = _resolved(exclude) if exclude is not None else None
    for folder in head_folders:
        work = Path(folder) / WORK
        try:
            k = find_kept(work)
        except (DistillError, OSError, ValueError):  # no work folder, no rounds, an unreadable name
            continue
        if k.work == skip or any(k.work == other.work for other in kept):
            continue
        kept.append(k)
    if not kept:
        return None
    logged = [k.logged.get(int(p.stem.rsplit("-", 1)[1]) + 1) for k in kept for p in k.rounds]
    tokens = None if any(r is None for r in logged) else sum(r["answer_tokens"] for r in logged)
    return EarlierData(tuple(k.work for k in kept), sum(len(k.rounds) for k in kept), tokens)


def next_head_folder(done: Path) -> Path:
    """Where the head after the one just finished in `done` goes: the next free number of its series (t-2 → t-3,
    not t-2-2)."""
    numbered = re.fullmatch(r"(.+)-\d+", done.name)
    base = done.with_name(numbered.group(1)) if numbered and done.with_name(numbered.group(1)).is_dir() else done
    return fresh_head_folder(base)


def kept_by(out: Path) -> tuple[str, ...] | None:
    """The data folders a run saving in `out` was started with (its work folder's state), None for a new run:
    starting again in that folder continues that run, which must be given the same ones."""
    state = _state(Path(out))
    kept = state.get("kept") if state is not None else None
    return tuple(kept) if isinstance(kept, list) and all(isinstance(k, str) for k in kept) else None


def _state(out: Path) -> dict | None:
    """The state of the run whose work folder is out/work; None when there is none (or it is unreadable)."""
    try:
        state = json.loads((out / WORK / STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return state if isinstance(state, dict) else None


def _resolved(path: Path) -> Path | None:
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError, ValueError):
        return None


def _tokens(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1_000_000 else f"{n / 1e3:.0f}k" if n >= 10_000 else f"{n:,}"
