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


def _record(text: str, name: str, rid: int) -> AnswerRecord:
    steps = (_step(0, text),)
    summary = summarize(steps, mode="speculative", k=1, prompt_tokens=3, seconds=2.0, stop_reason="eos")
    info = ModelInfo(target_name=name, draft_name="@draft", device="cpu", dtype="float32", fast_path="eager",
                     vocab_size=10)
    request = build_request(GenerationSettings(k=1, seed=7), (Message("user", "q"),), rid)
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
