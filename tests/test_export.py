"""CSV export: formula injection is neutralised in every text cell; numbers read back as numbers."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest

from app.core.export import ENCODING, AnswerRecord, cell, neutralise, restore, write_session_csv, write_trace_csv
from app.core.session import build_request
from engine.measure.stats import summarize
from engine.settings import GenerationSettings
from engine.types import Message, ModelInfo, Step, TokenView

HOSTILE = ['=HYPERLINK("http://evil.example","x")', "+1+1", "-2+3", "@SUM(A1)", "\tx", "\rx", "'=quoted"]


def _step(index: int, text: str) -> Step:
    token = TokenView(token_id=1, text=text, status="accepted", step=index, draft_pos=0, q=0.5, p=0.5,
                      accept_prob=1.0)
    return Step(index=index, mode="speculative", proposed=(1,), proposed_q=(0.5,), proposed_p=(0.5,),
                sources=("draft",), accepted=1, added=2, added_status="bonus", tokens=(token,), text=text,
                new_tokens=2, total_tokens=2 * (index + 1), draft_ms=1.0, verify_ms=-0.25, elapsed_s=0.1)


def _record(text: str, name: str, rid: int, question: str = "q") -> AnswerRecord:
    steps = (_step(0, text),)
    summary = summarize(steps, mode="speculative", k=1, prompt_tokens=3, seconds=2.0, stop_reason="eos")
    info = ModelInfo(target_name=name, draft_name="@draft", device="cpu", dtype="float32", fast_path="eager",
                     vocab_size=10)
    request = build_request(GenerationSettings(k=1, seed=7),
                            (Message("user", "an earlier one"), Message("assistant", "a"), Message("user", question)),
                            rid)
    return AnswerRecord(request, summary, info, "2025-01-01T00:00:00+00:00", steps)


def _read(path: Path) -> list[dict[str, str]]:
    with open(path, encoding=ENCODING, newline="") as f:
        return list(csv.DictReader(f))


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("text", HOSTILE)
def test_neutralise_round_trips_and_defuses(text):
    safe = neutralise(text)
    assert not safe.startswith(("=", "+", "-", "@", "\t", "\r")) and restore(safe) == text


def test_cells_keep_numbers_numbers():
    assert cell(-3) == -3 and cell(-0.5) == "-0.5" and cell((-1, 2)) == "-1;2"
    assert cell(("=a", "b")) == "'=a;b" and cell("-x") == "'-x" and cell("plain") == "plain"
    assert cell(True) == "true" and cell(None) == ""


def test_session_and_trace_csv_neutralise_text_cells(tmp_path):
    records = [_record(text, text, i) for i, text in enumerate(HOSTILE, 1)]
    write_session_csv(tmp_path / "session.csv", records)
    write_trace_csv(tmp_path / "trace.csv", records)
    session, trace = _read(tmp_path / "session.csv"), _read(tmp_path / "trace.csv")
    dangerous = ("=", "+", "-", "@", "\t", "\r")
    for rows in (session, trace):
        for row in rows:
            for column, value in row.items():
                if _is_number(value):
                    continue  # a negative number (verify_ms, and the verify_s it sums to), not text
                assert not value.startswith(dangerous), (column, value)
    for row, text in zip(session, HOSTILE):
        assert restore(row["text"]) == text and restore(row["target_model"]) == text
        assert row["draft_model"] == "'@draft"
        assert int(row["seed"]) == 7 and float(row["seconds"]) == 2.0
    for row, text in zip(trace, HOSTILE):
        assert restore(row["text"]) == text
        assert float(row["verify_ms"]) == -0.25  # numeric columns hold numbers, even negative ones


def test_the_session_csv_has_the_question_and_rows_for_race_and_sweep_runs(tmp_path):
    from app.core.export import KINDS, SweepRun
    from app.core.race_logic import race_result
    from engine.measure.experiment import BenchPrompt, RunRecord

    chat = [_record("answer", "target", i, question=q) for i, q in enumerate(HOSTILE, 1)]
    steps = (_step(0, "x"),)
    std = summarize(steps, mode="speculative", k=1, prompt_tokens=3, seconds=2.0, stop_reason="eos")
    spec = summarize(steps, mode="speculative", k=1, prompt_tokens=3, seconds=1.0, stop_reason="eos")
    info = chat[0].info
    race = race_result(race_id=1, repeat=0, prompt=BenchPrompt("code-1", "code", "=sum(A1)"), k=1, temperature=0.0,
                       seed=3, standard=(steps, std), speculative=(steps, spec), info=info, proposer="draft")
    run = RunRecord(prompt_id="chat-2", category="chat", mode="draft K=2 T=0", new_tokens=10, seconds=0.5,
                    tokens_per_s=20.0, target_forwards=4, draft_forwards=8, drafted=8, accepted=6, text="-out",
                    token_ids=(1, 2), position_reached=(4, 3), position_accepted=(3, 3))
    sweep = SweepRun(run, "speculative", "draft", 2, "+what", info, "2025-01-01T00:00:00+00:00")
    path = tmp_path / "session.csv"
    assert write_session_csv(path, chat, [race], [sweep]) == len(HOSTILE) + 3
    rows = _read(path)
    assert [r["kind"] for r in rows] == ["chat"] * len(HOSTILE) + ["race standard", "race speculative", "sweep"]
    assert {r["kind"] for r in rows} <= set(KINDS)
    for row, question in zip(rows, HOSTILE):
        assert restore(row["question"]) == question and not row["question"].startswith(("=", "+", "-", "@"))
    standard, speculative, swept = rows[len(HOSTILE):]
    assert standard["question"] == speculative["question"] == "'=sum(A1)" and standard["prompt_id"] == "code-1"
    assert (standard["request_mode"], standard["request_k"], standard["proposer"]) == ("standard", "0", "")
    assert (speculative["request_mode"], speculative["request_k"], speculative["proposer"]) == ("speculative", "1",
                                                                                                "draft")
    assert float(speculative["tokens_per_s"]) == spec.tokens_per_s and speculative["target_model"] == "target"
    assert swept["question"] == "'+what" and swept["text"] == "'-out" and swept["request_k"] == "2"
    assert float(swept["acceptance_rate"]) == 0.75 and float(swept["tokens_per_target_forward"]) == 2.5
    assert swept["per_position_acceptance"] == "0.75;1.0" and swept["prompt_tokens"] == ""
