"""The headless CLI: generate/bench JSON contracts and one-line errors with exit code 2."""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import json

import pytest

from app.cli import main
from engine.models import store
from engine.types import Summary

STATUSES = {"accepted", "rejected", "corrected", "bonus", "target"}


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _models(tiny_pair) -> list[str]:
    return ["--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--device", "cpu", "--dtype", "float32"]


def test_generate_json_contract(tiny_pair, capsys):
    code = main(["generate", "--prompt", "def add(a, b):", "--max-new-tokens", "24", "--k", "3", "--json",
                 *_models(tiny_pair)])
    out = capsys.readouterr().out
    assert code == 0
    result = json.loads(out)
    assert set(result) == {"text", "tokens", "summary", "config"}
    assert set(result["summary"]) == {f.name for f in dataclasses.fields(Summary)}
    assert {t["status"] for t in result["tokens"]} <= STATUSES
    assert all(set(t) == {"text", "status", "branch"} for t in result["tokens"])  # branch: None for chains
    assert "rejected" in {t["status"] for t in result["tokens"]} or result["summary"]["acceptance_rate"] == 1.0
    kept = "".join(t["text"] for t in result["tokens"] if t["status"] != "rejected")
    assert result["text"] == kept == result["summary"]["text"]
    assert result["summary"]["new_tokens"] == 24 or result["summary"]["stop_reason"] == "eos"
    assert result["config"]["k"] == 3 and result["config"]["mode"] == "speculative"


def test_generate_streams_text(tiny_pair, capsys):
    code = main(["generate", "--prompt", "hello", "--mode", "standard", "--max-new-tokens", "8", "--raw",
                 *_models(tiny_pair)])
    captured = capsys.readouterr()
    assert code == 0 and captured.out.endswith("\n")
    assert "[standard]" in captured.err


def test_bench_json_contract(tiny_pair, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"id": "a", "category": "code", "prompt": "def add(a, b):"}\n'
        '{"id": "b", "category": "chat", "prompt": "Hello world!"}\n'
    )
    out_json, out_csv = tmp_path / "bench.json", tmp_path / "bench.csv"
    code = main(["bench", "--prompts", str(prompts), "--modes", "standard,speculative", "--max-new-tokens", "16",
                 "--json", str(out_json), "--csv", str(out_csv), *_models(tiny_pair)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(out_json.read_text())
    assert set(result) == {"config", "runs", "summary"}
    for key in ("target", "draft", "device", "dtype", "fast_path", "k", "temperature", "seed", "max_new_tokens",
                "prompts", "torch", "transformers", "cpu", "gpu"):
        assert key in result["config"], key
    runs = result["runs"]
    # The mode order rotates per prompt, so no mode always pays a prompt's first run for the other.
    assert [(r["prompt_id"], r["mode"]) for r in runs] == [
        ("a", "standard"), ("a", "speculative"), ("b", "speculative"), ("b", "standard")]
    for r in runs:
        assert set(r) == {"prompt_id", "category", "mode", "new_tokens", "seconds", "tokens_per_s",
                          "target_forwards", "draft_forwards", "drafted", "accepted", "text", "token_ids",
                          "round_seconds", "repeat", "prefill_s", "draft_s", "verify_s", "overhead_s", "k_mean",
                          "standard_steps", "position_reached", "position_accepted", "drafted_steps", "drafted_by",
                          "catch_up_widths", "position_alternative", "tree", "tree_nodes", "temperature"}
        assert len(r["token_ids"]) == r["new_tokens"]
        assert 0 < r["round_seconds"] <= r["seconds"]  # rounds are a part of the generation's time
        # The time split adds up to the generation's time.
        parts = r["prefill_s"] + r["draft_s"] + r["verify_s"] + r["overhead_s"]
        assert parts == pytest.approx(r["seconds"], rel=1e-6)
        assert (r["draft_s"] > 0) == (r["mode"] == "speculative")
    summary = result["summary"]
    for mode in ("standard", "speculative"):
        assert set(summary[mode]) == {"tokens_per_s", "acceptance_rate", "tokens_per_target_forward",
                                      "new_tokens", "seconds", "in_rounds", "time_split", "k_mean",
                                      "standard_steps", "per_position_acceptance", "runs"}
        assert 0 < summary[mode]["in_rounds"] <= 1
        assert sum(summary[mode]["time_split"].values()) == pytest.approx(1.0)
    assert summary["standard"]["per_position_acceptance"] == [] and len(summary["speculative"]["per_position_acceptance"]) == 5
    assert "speculative acceptance by draft position: " in captured.out
    assert set(summary["categories"]) == {"code", "chat"}
    assert set(summary["categories"]["code"]["vs_standard"]) == {"speculative"}
    assert summary["compared"] == 2
    # float32 greedy on CPU: speculative output is the target's own, token for token.
    assert summary["identical_outputs"] == 2 and summary["divergences"] == []
    assert summary["speedup"] > 0
    with open(out_csv) as f:
        assert len(list(csv.DictReader(f))) == 4
    assert "speedup" in captured.out and "identical outputs: 2/2" in captured.out


def _assert_one_line_error(code: int, capsys, *fragments: str) -> str:
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("specdec-studio: error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_missing_model_path(capsys):
    code = main(["generate", "--prompt", "x", "--target", "./no/such/model", "--device", "cpu"])
    _assert_one_line_error(code, capsys, "Model path not found")


def test_hub_id_while_offline(tiny_pair, capsys):
    code = main(["generate", "--prompt", "x", "--target", "nobody/not-cached-model", "--draft", str(tiny_pair[1]),
                 "--device", "cpu"])
    _assert_one_line_error(code, capsys, "not a local path", "offline?")


def test_corrupted_default_gguf_sha_mismatch(tmp_path, monkeypatch, tiny_pair, capsys):
    pkg = tmp_path / "pkgs" / "specdec_cli_fake_part1"
    (pkg / "data").mkdir(parents=True)
    (pkg / "data" / "part01.bin").write_bytes(b"GGUF not really a model")
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    wrong = hashlib.sha256(b"what the file should have been").hexdigest()
    monkeypatch.setitem(store.DEFAULT_MODELS, "target",
                        store.PackagedModel("Fake-Target", ("specdec_cli_fake_part1",), wrong, 23))
    code = main(["generate", "--prompt", "x", "--draft", str(tiny_pair[1]), "--device", "cpu"])
    _assert_one_line_error(code, capsys, "SHA-256 mismatch", "Fake-Target")


def test_prompt_longer_than_context(tiny_pair, capsys):
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 200  # tiny models hold 512 positions
    code = main(["generate", "--prompt", long_prompt, *_models(tiny_pair)])
    _assert_one_line_error(code, capsys, "context")


@pytest.mark.parametrize("k", ["0", "-2", "two"])
def test_k_below_one(k, capsys):
    code = main(["generate", "--prompt", "x", "--k", k])
    _assert_one_line_error(code, capsys, "K")


@pytest.mark.parametrize("content", [None, "not json\n", '{"id": "a"}\n', ""])
def test_unreadable_prompts_file(tmp_path, content, capsys):
    path = tmp_path / "prompts.jsonl"
    if content is not None:
        path.write_text(content)
    code = main(["bench", "--prompts", str(path), "--max-new-tokens", "4", "--device", "cpu"])
    _assert_one_line_error(code, capsys, str(path))


def test_unknown_mode(tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt": "hi"}\n')
    code = main(["bench", "--prompts", str(path), "--modes", "standard,warp", "--device", "cpu"])
    _assert_one_line_error(code, capsys, "warp")


def test_out_of_memory_is_one_line(tiny_pair, monkeypatch, capsys):
    import torch

    import engine.decoding

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\nmore text")

    monkeypatch.setattr(engine.decoding.Engine, "generate", oom)
    code = main(["generate", "--prompt", "x", *_models(tiny_pair)])
    _assert_one_line_error(code, capsys, "out of memory")


def test_divergences_are_reported_not_hidden(tiny_pair):
    from transformers import AutoTokenizer

    from engine.measure.bench import RunRecord, summarize_runs

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))

    def run(pid: str, mode: str, ids: tuple[int, ...]) -> RunRecord:
        return RunRecord(pid, "code", mode, len(ids), 1.0, float(len(ids)), len(ids), 0, 0, 0, "", ids)

    runs = [run("a", "standard", (5, 6, 7)), run("a", "speculative", (5, 6, 7)),
            run("b", "standard", (5, 6, 7, 8)), run("b", "speculative", (5, 6, 9, 8)),
            run("c", "standard", (5, 6)), run("c", "speculative", (5, 6, 7))]
    summary = summarize_runs(runs, ["standard", "speculative"], tok)
    assert (summary["identical_outputs"], summary["compared"]) == (1, 3)
    b, c = summary["divergences"]
    assert (b["prompt_id"], b["position"]) == ("b", 2)
    assert b["standard_token"] == tok.decode([7]) and b["speculative_token"] == tok.decode([9])
    assert (c["position"], c["standard_token"], c["speculative_token"]) == (2, None, tok.decode([7]))
    assert summary["speedup"] == pytest.approx((10 / 3) / (9 / 3))


def test_bench_hf_baselines_fidelity_and_cost_model(tiny_pair, tmp_path, capsys):
    """hf, hf-static and hf-assisted run in the same process; fidelity and the cost model are reported."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "category": "code", "prompt": "def add(a, b):"}\n')
    out_json = tmp_path / "bench.json"
    code = main(["bench", "--prompts", str(prompts), "--modes", "standard,speculative,hf,hf-static,hf-assisted",
                 "--max-new-tokens", "12", "--json", str(out_json), *_models(tiny_pair)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads(out_json.read_text())["summary"]
    assert set(summary["vs_standard"]) == {"speculative", "hf", "hf-static", "hf-assisted"}
    for mode in ("speculative", "hf", "hf-static", "hf-assisted"):
        fidelity = summary["fidelity"][mode]
        assert fidelity["compared"] == 1
        # fp32 greedy: every implementation of the same target agrees with our standard decoding.
        assert fidelity["identical"] == 1, fidelity
    cost = summary["cost_model"]
    assert cost["draft_ms"] > 0 and set(cost["target_ms"]) >= {"1", "6"}
    assert cost["predicted_speedup"] > 0 and cost["verdict"].startswith("Speculative decoding")
    assert "hf-assisted / standard" in captured.out and "cost model" in captured.out


def test_distill_plan_settings_are_checked_before_loading(tmp_path, capsys):
    assert main(["distill", "--out", str(tmp_path / "h"), "--plan", "answer_segmnet=96"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown plan setting 'answer_segmnet'" in err[0]
    assert main(["distill", "--out", str(tmp_path / "h"), "--init", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a draft head folder" in err[0]
