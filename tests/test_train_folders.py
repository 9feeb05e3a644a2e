"""The Train dialog's folders: it offers the answers earlier runs for the target wrote (their work folders' data
rounds) and hands the ticked ones to the run, as `distill --data` does; a folder whose run stopped goes on with the
data it began with; a new head is saved where no finished head is, never over one."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from app.core.earlier_data import (
    earlier_data,
    fresh_head_folder,
    head_family,
    holds_finished_head,
    kept_by,
    next_head_folder,
)
from app.ui.training import default_head_folder
from tests.test_app import FAKE_INFO
from tests.test_train_dialog import FakeTrainer, pick, window  # noqa: F401  (fixture)

INFO = replace(FAKE_INFO, draft_name=None, head_name=None)


def earlier_run(head_folder: Path, tokens: list[int | None], kept: list[str] = ()) -> Path:
    """A head folder whose work folder holds one data round per entry of `tokens` (its logged answer tokens; None:
    the log lacks that round), as distill leaves it; returns the work folder."""
    work = head_folder / "work"
    (work / "data").mkdir(parents=True)
    (work / "state.json").write_text(json.dumps({"fingerprint": {"model_type": "qwen2"}, "kept": list(kept),
                                                 "phase": "done", "spent_s": 60.0}), encoding="utf-8")
    log = []
    for i, n in enumerate(tokens):
        (work / "data" / f"round-{i:05d}.pt").write_bytes(b"")
        if n is not None:
            log.append(json.dumps({"kind": "data", "round": i + 1, "answers": 10, "answer_tokens": n}))
    (work / "train_log.jsonl").write_text("\n".join(log) + "\n", encoding="utf-8")
    return work.resolve()


def test_earlier_data_counts_each_work_folder_once_and_leaves_out_the_runs_own(tmp_path):
    anchor = tmp_path / "heads" / "fake-target"
    first = earlier_run(anchor, [4_000, 6_000])
    second = earlier_run(anchor.with_name("fake-target-continued-2"), [1_500_000])
    earlier_run(anchor.with_name("fake-target-coder"), [9])  # another target's folder: not of this family
    (anchor.with_name("fake-target-continued")).mkdir()  # a head folder without a work folder
    assert head_family(anchor) == [anchor, anchor.with_name("fake-target-continued"),
                                   anchor.with_name("fake-target-continued-2")]
    found = earlier_data(head_family(anchor) + [anchor])  # a folder named twice counts once
    assert found.works == (first, second) and found.rounds == 3 and found.answer_tokens == 1_510_000
    assert found.describe() == "2 runs, 3 rounds, 1.5M answer tokens"
    assert earlier_data(head_family(anchor), exclude=anchor / "work").describe() == "1 run, 1 round, 1.5M answer tokens"
    assert earlier_data([anchor.with_name("nowhere"), tmp_path / "a\x00b"]) is None
    third = earlier_run(tmp_path / "elsewhere", [100, None])  # a round its log lacks: no token count
    assert earlier_data([third.parent]).describe() == "1 run, 2 rounds"
    assert kept_by(anchor) == () and kept_by(tmp_path / "new") is None


def test_earlier_answers_are_offered_and_only_a_ticked_choice_hands_them_to_the_run(window, qtbot, tmp_path):
    anchor = default_head_folder(INFO.target_name)
    first = earlier_run(anchor, [4_000, 6_000])
    second = earlier_run(anchor.with_name(anchor.name + "-continued"), [2_000])
    trainer = FakeTrainer(steps=3)
    w = window(trainer, INFO)
    dialog = w.open_train_dialog()
    assert dialog.reuse.isVisibleTo(dialog) and not dialog.reuse.isChecked()
    assert dialog.reuse.text() == "Also train on them (2 runs, 3 rounds, 12k answer tokens)"
    for ticked, expected in ((False, ()), (True, (str(first), str(second)))):
        dialog.reuse.setChecked(ticked)
        dialog.folder.setText(str(tmp_path / f"new-{ticked}"))
        with qtbot.waitSignal(w.worker.training_finished, timeout=5000):
            dialog.start_button.click()
        qtbot.waitUntil(lambda: not w.training.running and dialog.start_button.text() == "Start")
        assert trainer.requests[-1].data == expected
    # Saving into the default folder itself: its own rounds are trained on anyway, not handed as earlier data.
    (anchor / "work" / "state.json").unlink()
    dialog.reuse.setChecked(True)
    dialog.folder.setText(str(anchor))
    with qtbot.waitSignal(w.worker.training_finished, timeout=5000):
        dialog.start_button.click()
    assert trainer.requests[-1].data == (str(second),)


def test_the_head_a_run_continues_brings_its_own_earlier_answers(window, qtbot, tmp_path, monkeypatch):
    from PySide6.QtWidgets import QFileDialog

    other = tmp_path / "elsewhere" / "my-head"
    work = earlier_run(other, [500])
    trainer = FakeTrainer(steps=3)
    w = window(trainer, INFO)
    dialog = w.open_train_dialog()
    assert not dialog.reuse.isVisibleTo(dialog)  # nothing written for this target yet: no choice shown
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *a, **k: str(other))
    pick(dialog, "\0other")
    assert dialog.reuse.isVisibleTo(dialog)
    assert dialog.reuse.text() == "Also train on them (1 run, 1 round, 500 answer tokens)"
    dialog.reuse.setChecked(True)
    with qtbot.waitSignal(w.worker.training_finished, timeout=5000):
        dialog.start_button.click()
    assert trainer.requests[-1].init == str(other) and trainer.requests[-1].data == (str(work),)
    pick(dialog, "")  # back to a new head: the choice goes, unticked
    assert not dialog.reuse.isVisibleTo(dialog) and not dialog.reuse.isChecked()


def test_a_stopped_run_goes_on_with_the_data_it_began_with(window, qtbot, tmp_path):
    anchor = default_head_folder(INFO.target_name)
    earlier_run(anchor, [4_000])
    began_with = str(tmp_path / "old" / "work")
    earlier_run(tmp_path / "stopped", [100], kept=[began_with])  # a run that stopped in this folder
    trainer = FakeTrainer(steps=3)
    w = window(trainer, INFO)
    dialog = w.open_train_dialog()
    dialog.folder.setText(str(tmp_path / "stopped"))
    dialog.reuse.setChecked(False)  # whatever the tick: distill refuses to continue a run with other data
    with qtbot.waitSignal(w.worker.training_finished, timeout=5000):
        dialog.start_button.click()
    assert trainer.requests[-1].data == (began_with,)


def finished_head(folder: Path, *, phase: str | None = "done") -> Path:
    """A head folder as a run leaves it: a manifest, and its work folder's state in `phase` (None: no work folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps({"name": "fake-target head"}), encoding="utf-8")
    if phase is not None:
        (folder / "work").mkdir(exist_ok=True)
        (folder / "work" / "state.json").write_text(json.dumps({"phase": phase, "kept": []}), encoding="utf-8")
    return folder


def test_a_new_head_goes_where_no_finished_head_is(tmp_path):
    anchor = tmp_path / "heads" / "t"
    assert fresh_head_folder(anchor) == anchor and not holds_finished_head(anchor)
    finished_head(anchor, phase=None)  # a head no run here started: distill would refuse to replace it
    finished_head(anchor.with_name("t-2"))  # a finished run
    stopped = finished_head(anchor.with_name("t-3"), phase="train")  # a stopped run with a head saved: goes on
    assert [holds_finished_head(anchor.with_name(n)) for n in ("t", "t-2", "t-3", "t-4")] == [True, True, False, False]
    assert fresh_head_folder(anchor) == stopped
    (anchor.with_name("t-3") / "work" / "state.json").write_text('{"phase": "done"}', encoding="utf-8")
    assert fresh_head_folder(anchor) == anchor.with_name("t-4")
    assert next_head_folder(anchor.with_name("t-2")) == anchor.with_name("t-4")  # the series goes on: not t-2-2
    lone = finished_head(tmp_path / "run-2024")  # a number in a name of its own, no series: a fresh folder beside
    assert next_head_folder(lone) == tmp_path / "run-2024-2"
    earlier_run(anchor.with_name("t-2-continued"), [7])
    assert head_family(anchor) == [anchor, anchor.with_name("t-2"), anchor.with_name("t-2-continued"),
                                   anchor.with_name("t-3")]


class HeadWritingTrainer(FakeTrainer):
    """Leaves a finished run in the folder it trained into, as distill does."""

    def __call__(self, request, engine, progress, cancel):
        out = super().__call__(request, engine, progress, cancel)
        finished_head(Path(request.out))
        return out


def test_the_dialog_opens_on_a_fresh_folder_and_moves_on_after_each_head(window, qtbot):
    anchor = default_head_folder(INFO.target_name)
    finished_head(anchor)
    trainer = HeadWritingTrainer(steps=3)
    w = window(trainer, INFO)
    dialog = w.open_train_dialog()
    second = anchor.with_name(anchor.name + "-2")
    assert dialog.chosen_folder() == str(second)
    for expected in (second, anchor.with_name(anchor.name + "-3")):
        with qtbot.waitSignal(w.worker.training_finished, timeout=5000):
            dialog.start_button.click()
        qtbot.waitUntil(lambda: not w.training.running and dialog.start_button.text() == "Start")
        assert trainer.requests[-1].out == str(expected)  # each run its own folder: no head replaced
    assert dialog.chosen_folder() == str(anchor.with_name(anchor.name + "-4"))
