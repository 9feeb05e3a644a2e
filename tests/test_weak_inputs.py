"""Bad command-line values found at parse time, in one line, before any model loads."""
from __future__ import annotations

import json
import os

import pytest

from app.cli import main
from engine.models import loader


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def no_load(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(loader, "load_pair", refuse)


@pytest.mark.parametrize("argv,says", [
    (["--memory", "24"], "needs a unit"),
    (["--memory", "0"], "more than 0"),
    (["--memory", "0GiB"], "more than 0"),
    (["--memory", "-1GiB"], "more than 0"),
    (["--memory=-1GiB"], "more than 0"),
    (["--gpus", "4", "--device", "cpu"], "--device cpu"),
])
def test_plan_options_are_refused_at_parse_time(no_load, capsys, argv, says):
    assert main(["plan", *argv]) == 2
    assert says in _one_line(capsys)


def test_generate_refuses_gpus_on_the_cpu(no_load, capsys):
    assert main(["generate", "--prompt", "hi", "--gpus", "2", "--device", "cpu"]) == 2
    assert "--gpus 2" in _one_line(capsys)


def test_an_empty_output_folder_is_refused(no_load, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "category": "c", "prompt": "hi"}) + "\n", encoding="utf-8")
    assert main(["sweep", "--prompts", str(prompts), "--out", ""]) == 2
    assert "empty" in _one_line(capsys) and sorted(os.listdir(tmp_path)) == ["p.jsonl"]


@pytest.mark.parametrize("setting", ["train.depth=1000", "intermediate=99999999999", "train.lr=1e9",
                                     "question_tokens=10000000"])
def test_distill_plan_values_are_checked_before_the_load(no_load, capsys, tmp_path, setting):
    assert main(["distill", "--out", str(tmp_path / "out"), "--device", "cpu", "--plan", setting]) == 2
    assert setting.split("=")[0] in _one_line(capsys)


def test_a_huge_one_line_question_is_refused_before_the_load(no_load, capsys, tmp_path):
    prompts = tmp_path / "big.jsonl"
    prompts.write_text(json.dumps({"id": "x", "category": "c", "prompt": "word " * 200_000}) + "\n", encoding="utf-8")
    assert main(["distill", "--out", str(tmp_path / "out"), "--device", "cpu", "--prompts", str(prompts)]) == 2
    assert "characters" in _one_line(capsys)


def test_a_failed_results_write_names_the_file(tiny_pair, tmp_path, capsys):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "category": "c", "prompt": "hi"}) + "\n", encoding="utf-8")
    code = main(["bench", "--prompts", str(prompts), "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]),
                 "--device", "cpu", "--max-new-tokens", "2", "--warmup", "0", "--json", "/dev/full"])
    err = capsys.readouterr().err
    assert code == 2 and "(/dev/full)" in err and "None" not in err
