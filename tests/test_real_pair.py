"""End to end on the real default pair (Qwen2.5-Coder 1.5B target / 0.5B draft), kept short."""
from __future__ import annotations

import json
import os

import pytest

from app.cli import main

pytestmark = pytest.mark.real_models


@pytest.fixture
def real_cache(monkeypatch):
    # The user's cache (converted once, seconds to load afterwards), unless told otherwise.
    if os.environ.get("SPECDEC_REAL_CACHE"):
        monkeypatch.setenv("SPECDEC_CACHE_DIR", os.environ["SPECDEC_REAL_CACHE"])
    else:
        monkeypatch.delenv("SPECDEC_CACHE_DIR", raising=False)


def _generate(capsys, mode: str) -> dict:
    code = main(["generate", "--prompt", "用一句话解释什么是快速排序。", "--mode", mode, "--k", "4",
                 "--max-new-tokens", "12", "--dtype", "float32", "--device", "cpu", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def test_cli_json_on_the_real_pair_is_lossless_in_float32(real_cache, capsys):
    spec = _generate(capsys, "speculative")
    assert spec["config"]["target"] == "Qwen2.5-Coder-1.5B-Instruct"
    assert spec["config"]["draft"] == "Qwen2.5-Coder-0.5B-Instruct"
    summary = spec["summary"]
    assert summary["new_tokens"] == 12 or summary["stop_reason"] == "eos"
    assert summary["drafted"] > 0 and 0 <= summary["acceptance_rate"] <= 1
    statuses = {t["status"] for t in spec["tokens"]}
    assert statuses <= {"accepted", "rejected", "corrected", "bonus"} and "accepted" in statuses
    assert "".join(t["text"] for t in spec["tokens"] if t["status"] != "rejected") == spec["text"]
    assert any("\u4e00" <= ch <= "\u9fff" for ch in spec["text"]), spec["text"]  # a Chinese answer
    assert "\ufffd" not in spec["text"]
    std = _generate(capsys, "standard")
    assert {t["status"] for t in std["tokens"]} == {"target"}
    assert std["text"] == spec["text"]  # float32 greedy: token for token the same answer
    auto = _generate(capsys, "auto")  # K and (draft) proposer chosen per step, standard steps included
    assert auto["summary"]["mode"] == "auto" and auto["summary"]["decision"] is not None
    assert auto["text"] == std["text"]
