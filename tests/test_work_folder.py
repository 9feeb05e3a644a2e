"""A distillation work folder handed over by someone else: nothing in it runs, foreign files are refused in one line."""
from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from engine.heads.distill import DistillError
from engine.heads.fitting import load_round
from tests.head_fixtures import distiller, quick_plan


class _Payload:
    """Unpickling it creates a file: what a planted pickle would do with a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _plant(path: Path, marker: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump([_Payload(marker)], f)


@pytest.fixture(scope="module")
def finished_work(tiny_head, tmp_path_factory) -> Path:
    """A work folder of a short real run: one data round, a checkpoint, the state file."""
    root = tmp_path_factory.mktemp("work")
    distiller(tiny_head.target, root / "out", root / "work", quick_plan(max_rounds=1, max_steps=2)).run()
    return root / "work"


def test_a_planted_data_round_never_runs(tiny_head, tmp_path):
    marker = tmp_path / "ran"
    _plant(tmp_path / "work" / "data" / "round-00000.pt", marker)
    with pytest.raises(DistillError, match="never done") as e:
        distiller(tiny_head.target, tmp_path / "out", tmp_path / "work", quick_plan(max_rounds=1)).run()
    assert not marker.exists()
    assert "io.open" in str(e.value)  # the refusal names what the file would have run


def test_a_planted_checkpoint_never_runs(tiny_head, finished_work, tmp_path):
    work = tmp_path / "work"
    shutil.copytree(finished_work, work)
    state = json.loads((work / "state.json").read_text(encoding="utf-8"))
    (work / "state.json").write_text(json.dumps({**state, "phase": "train"}), encoding="utf-8")
    marker = tmp_path / "ran"
    _plant(work / "checkpoint.pt", marker)
    with pytest.raises(DistillError, match="checkpoint"):
        distiller(tiny_head.target, tmp_path / "out", work, quick_plan(max_rounds=1, max_steps=2)).run()
    assert not marker.exists()


def test_rounds_this_app_wrote_still_load(finished_work):
    (path,) = sorted((finished_work / "data").glob("round-*.pt"))
    records = load_round(path)
    assert records and all(isinstance(r["ids"], torch.Tensor) for r in records)


@pytest.mark.parametrize("content", [b"", b"not a torch file", b"\x80\x04K\x05."])  # the last: a pickled int
def test_damaged_or_foreign_files_are_one_line(tiny_head, finished_work, tmp_path, content):
    work = tmp_path / "work"
    shutil.copytree(finished_work, work)
    (work / "data" / "round-00000.pt").write_bytes(content)
    state = json.loads((work / "state.json").read_text(encoding="utf-8"))
    (work / "state.json").write_text(json.dumps({**state, "phase": "data"}), encoding="utf-8")
    with pytest.raises(DistillError, match="round-00000.pt") as e:
        distiller(tiny_head.target, tmp_path / "out", work, quick_plan(max_rounds=1, max_steps=2)).run()
    assert "\n" not in str(e.value)
    assert "asks to run" not in str(e.value)  # damaged bytes are not said to ask to run code


@pytest.mark.parametrize("state", ["{not json", "[1, 2]", '{"spent_s": "x"}'])
def test_a_foreign_state_file_is_one_line(tiny_head, tmp_path, state):
    work = tmp_path / "work"
    work.mkdir()
    (work / "state.json").write_text(state, encoding="utf-8")
    with pytest.raises(DistillError, match="state.json"):
        distiller(tiny_head.target, tmp_path / "out", work, quick_plan(max_rounds=1))
