"""End to end on the real default pair (Qwen2.5-Coder 1.5B target / 0.5B draft), kept short.

Every test that loads the real pair lives in this file, so one process runs them one after another
(--dist loadfile) and each frees its pair before the next loads: in float32 (a CPU without native bf16)
two pairs loaded at once by the two processes need most of a 24 GiB machine."""
from __future__ import annotations

import gc
import json
import os

import pytest

from app.cli import main

pytestmark = pytest.mark.real_models


@pytest.fixture(autouse=True)
def _one_pair_at_a_time():
    """The test's pair (and its engine's cycles) freed before the next test loads another."""
    yield
    gc.collect()


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


def _load_once(monkeypatch) -> None:
    """The commands of one test share one load of the pair (on 2 cores a load with its cost measurement takes
    30-80 s): the first loads it through the CLI as a person's would, the others decode on that same engine
    (standard decoding never asks its draft), so they compare decoding, token for token, on the same weights."""
    from app.cli import common

    load, loaded = common.load_engine, []

    def load_once(args, needs_draft, *a, **kw):
        if not loaded:
            loaded.append(load(args, True, *a, **kw))
        return loaded[0]

    monkeypatch.setattr(common, "load_engine", load_once)


def test_cli_json_on_the_real_pair_is_lossless_in_float32(real_cache, capsys, monkeypatch):
    _load_once(monkeypatch)
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


def test_llamacpp_runtime_on_the_real_pair(real_cache, capsys, monkeypatch):
    """The packaged GGUFs straight into llama.cpp: no conversion, llama.cpp's own tokenizer."""
    _load_once(monkeypatch)  # both commands decode on one load of the pair
    outputs = {}
    for mode in ("speculative", "standard"):
        code = main(["generate", "--prompt", "用一句话解释什么是快速排序。", "--mode", mode, "--k", "4",
                     "--max-new-tokens", "16", "--runtime", "llamacpp", "--json"])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        outputs[mode] = json.loads(captured.out)
    config = outputs["standard"]["config"]
    assert (config["runtime"], config["fast_path"], config["dtype"]) == ("llamacpp", "llama.cpp", "Q4_K_M")
    assert any("\u4e00" <= ch <= "\u9fff" for ch in outputs["standard"]["text"]), outputs["standard"]["text"]
    assert outputs["speculative"]["summary"]["drafted"] > 0
    # Greedy on one runtime: the batched verify and single-token decoding agree on this answer.
    assert outputs["speculative"]["text"] == outputs["standard"]["text"]


def test_llamacpp_tokenizer_matches_the_real_hugging_face_tokenizer(real_cache):
    from transformers import AutoTokenizer

    from engine.models.store import gguf_file
    from engine.models.store import resolve_source
    from engine.runners.llamacpp import LlamaCppRunner
    from engine.runners.llamacpp_tokenizer import LlamaCppTokenizer

    path = gguf_file(resolve_source(None, "target"))
    ours = LlamaCppTokenizer(LlamaCppRunner(path, n_ctx=256, threads=1))
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in ("def quicksort(xs):\n    return sorted(xs)  # 🙂", "用Python写一个快速排序，并解释它的时间复杂度。",
                 "<|im_start|>user\nhi<|im_end|>\n", "Hello,   world!\n\n\tTabs and 3.14159 numbers"):
        ids = reference(text, add_special_tokens=False)["input_ids"]
        assert ours(text)["input_ids"] == ids, text
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    chat = [{"role": "user", "content": "用Python写一个快速排序"}]
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


def test_real_default_pair_loads_from_cache(real_cache):
    from engine.errors import ModelLoadError
    from engine.loadspec import LoadSpec
    from engine.models.loader import load_pair
    from engine.models.tokenizers import check_compatible, tokenizer_info

    try:
        t = tokenizer_info(None, "target")
        d = tokenizer_info(None, "draft")
    except ModelLoadError as e:
        pytest.skip(f"default pair not installed: {e}")
    assert check_compatible(t, d) == 151936
    pair = load_pair(LoadSpec(None, None, device="cpu"))
    assert pair.info.target_name == "Qwen2.5-Coder-1.5B-Instruct"
    ids = pair.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hi"}], add_generation_prompt=True, return_dict=False
    )
    assert len(ids) > 5
