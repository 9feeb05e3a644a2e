"""The llama.cpp runtime on a tiny GGUF the tests write themselves: logits, rollback, lossless decoding, fallback."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from engine.errors import GenerationError, ModelLoadError
from engine.limits import K_AUTO, K_MAX
from engine import assemble
from engine.loadspec import LoadSpec
from engine.models.store import resolve_source
from engine.runners import llamacpp as llamacpp_mod
from engine.types import GenerationRequest, Message, Sampling

llama_cpp = pytest.importorskip("llama_cpp")

from engine.runners.llamacpp import LlamaCppRunner  # noqa: E402  (after the skip: it needs llama_cpp)


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """(target.gguf, draft.gguf, target folder, draft folder) of one tiny random Qwen2 pair."""
    from tests.tiny_gguf import save_gguf_pair

    return save_gguf_pair(tmp_path_factory.mktemp("llamacpp"), noise=0.02, seed=0)


@pytest.fixture(scope="module")
def engine(ggufs, tmp_path_factory):
    import os

    os.environ["SPECDEC_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    return assemble.build_engine(LoadSpec(str(ggufs[0]), str(ggufs[1]), runtime="llamacpp", threads=1))


def _ids(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- the runner

def test_forward_logits_equal_single_token_decoding(ggufs):
    runner = LlamaCppRunner(ggufs[0], n_ctx=256, threads=1)
    ids = _ids(16, runner.vocab_size)
    runner.prefill(ids[:10])
    batched = runner.forward(ids[10:16]).clone()  # [6, V]: one verify-shaped forward
    assert batched.shape == (6, runner.vocab_size) and batched.dtype == torch.float32
    runner.rollback(10)
    single = torch.stack([runner.forward(ids[i:i + 1])[0].clone() for i in range(10, 16)])  # [6, V]
    # Batched and single-token kernels round differently (flash attention works in float16 here);
    # they must agree far below the gaps that decide a token.
    assert (batched - single).abs().max() < 1e-2 * batched.abs().max()
    assert torch.equal(batched.argmax(-1), single.argmax(-1))


def test_logits_match_the_same_weights_in_torch(ggufs):
    """The GGUF holds the model the tests built: llama.cpp and transformers agree on its logits."""
    from transformers import AutoModelForCausalLM

    runner = LlamaCppRunner(ggufs[0], n_ctx=256, threads=1)
    model = AutoModelForCausalLM.from_pretrained(ggufs[2], dtype=torch.float32).eval()
    ids = _ids(12, runner.vocab_size, seed=1)
    runner.prefill(ids[:6])
    ours = runner.forward(ids[6:]).clone()
    with torch.no_grad():
        reference = model(ids.view(1, -1)).logits[0, 6:]
    # llama.cpp keeps K and V in float16, so the logits agree to about 1e-2 of their scale.
    assert (ours - reference).abs().max() < 0.05 * reference.abs().max()
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def test_a_forward_wider_than_the_logits_buffer_gives_its_last_rows(ggufs):
    """A draft catching up after many standard steps feeds more tokens than a verify: the last rows come back."""
    from engine.runners.llamacpp import RESERVED_OUTPUTS

    runner = LlamaCppRunner(ggufs[0], n_ctx=256, threads=1)
    ids = _ids(RESERVED_OUTPUTS + 7, runner.vocab_size, seed=3)
    wide = runner.forward(ids).clone()
    assert wide.shape == (RESERVED_OUTPUTS, runner.vocab_size) and runner.length == len(ids) == runner.kv_length()
    runner.reset()
    runner.prefill(ids[:-1])
    last = runner.forward(ids[-1:])[0]
    assert torch.equal(wide[-1].argmax(), last.argmax())
    assert (wide[-1] - last).abs().max() < 1e-2 * last.abs().max()


def test_rollback_reset_and_lengths(ggufs):
    runner = LlamaCppRunner(ggufs[0], n_ctx=64, threads=1)
    ids = _ids(20, runner.vocab_size, seed=2)
    assert runner.kv_length() == runner.length == 0
    runner.prefill(ids[:9])
    runner.forward(ids[9:13])
    assert runner.kv_length() == runner.length == 13
    runner.rollback(11)
    assert runner.kv_length() == runner.length == 11
    runner.forward(ids[11:12])  # positions continue at 11: llama.cpp refuses a gap, so this proves it
    assert runner.kv_length() == 12
    with pytest.raises(AssertionError):
        runner.rollback(13)
    runner.reset()
    assert runner.kv_length() == runner.length == 0
    with pytest.raises(Exception, match="context is full"):
        runner.prefill(_ids(runner.max_length + 1, runner.vocab_size))


def test_prefill_longer_than_a_batch_is_chunked(ggufs):
    runner = LlamaCppRunner(ggufs[0], n_ctx=256, n_batch=16, threads=1)
    ids = _ids(50, runner.vocab_size, seed=3)
    runner.prefill(ids[:49])
    whole = LlamaCppRunner(ggufs[0], n_ctx=256, threads=1)
    whole.prefill(ids[:49])
    assert runner.kv_length() == whole.kv_length() == 49
    chunked = runner.forward(ids[49:]).clone()
    assert torch.allclose(chunked, whole.forward(ids[49:]), atol=1e-2)


def test_the_cache_grows_and_keeps_what_it_held(ggufs):
    """A context starts small and is made again, bigger, when the sequence outgrows it; the cached
    tokens are fed again, so decoding goes on as if nothing happened."""
    grower = LlamaCppRunner(ggufs[0], threads=1, min_cells=256)
    steady = LlamaCppRunner(ggufs[0], threads=1, min_cells=512)
    assert (grower.cells, steady.cells, grower.max_length) == (256, 512, 512)
    ids = _ids(300, grower.vocab_size, seed=5)
    for start in range(0, 299, 13):  # verify-sized forwards past the first context's 256 cells
        chunk = ids[start:start + 13]
        ours, reference = grower.forward(chunk).clone(), steady.forward(chunk)
        assert torch.equal(ours.argmax(-1), reference.argmax(-1))
        assert (ours - reference).abs().max() < 1e-2 * reference.abs().max()
    assert grower.cells == 512 and grower.kv_length() == grower.length == 299
    grower.rollback(100)
    assert grower.kv_length() == 100 and len(grower._tokens) == 100


def test_a_new_prompt_reserves_room_for_an_answer(ggufs):
    runner = LlamaCppRunner(ggufs[0], threads=1, min_cells=256)
    runner.prefill(_ids(10, runner.vocab_size))
    assert runner.cells == 512  # 10 + ANSWER_ROOM cells, rounded up (and capped by the model's 512)


def test_measure_costs_leave_the_cache_as_it_was(ggufs):
    runner = LlamaCppRunner(ggufs[0], n_ctx=64, threads=1)
    runner.prefill(_ids(5, runner.vocab_size))
    costs = runner.measure_costs(range(1, 4), 2)
    assert sorted(costs) == [1, 2, 3] and all(ms > 0 for ms in costs.values())
    assert runner.length == runner.kv_length() == 5


def test_threads_can_be_set(ggufs):
    runner = LlamaCppRunner(ggufs[0], n_ctx=64, threads=1)
    runner.set_threads(2)
    assert runner.threads == 2 and llama_cpp.llama_n_threads(runner._ctx) == 2
    assert llamacpp_mod.physical_cores() >= 1


def test_an_8bit_kv_cache_falls_back_to_f16_where_heads_do_not_fit(ggufs, caplog):
    # The tiny model's heads are 16 wide; q8_0 blocks are 32: f16 is chosen without asking llama.cpp,
    # whose refusal was a WARNING line before a CLI error (found by the fuzz run).
    with caplog.at_level("WARNING", logger="engine.runners.llamacpp"):
        runner = LlamaCppRunner(ggufs[0], n_ctx=64, threads=1, kv_type="q8_0")
    assert runner.kv_type == "f16"
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    runner.prefill(_ids(4, runner.vocab_size))
    assert runner.kv_length() == 4


# --------------------------------------------------------------------------- the loop on llama.cpp

def test_engine_loads_from_gguf_without_conversion(engine, ggufs):
    info = engine.info
    assert (info.runtime, info.fast_path, info.device, info.dtype) == ("llamacpp", "llama.cpp", "cpu", "F32")
    assert info.threads == 1 and engine.target is None
    # Costs of every verify width the loop may use, for the cost model and auto mode.
    assert [w for w, _ in info.target_ms] == list(range(1, K_MAX + 2)) and info.draft_ms > 0
    assert {c.source for c in info.proposer_costs} == {"draft", "ngram"} and info.head_name is None
    # Measuring the verify widths left the target's cache as it was (each round rolls back what it fed).
    assert engine.target_runner.kv_length() == engine.target_runner.length == 0
    assert engine.tokenizer.eos_token_id in engine.eos_ids


def _request(mode: str, proposer: str = "draft", k: int = 4, prompt: str = "def add(a, b):", **sampling):
    return GenerationRequest(messages=(Message("user", prompt),), mode=mode, k=k, max_new_tokens=40,
                             proposer=proposer, sampling=Sampling(**sampling))


@pytest.mark.parametrize("proposer", ["draft", "ngram", "draft+ngram"])
def test_kv_length_equals_committed_length_after_every_step(engine, proposer):
    generation = engine.generate(_request("speculative", proposer))
    target, draft = engine.target_runner, engine.draft_runner
    for step in generation:
        # The target holds every committed token but the newest (fed by the next step).
        assert target.kv_length() == target.length == len(generation.prompt) + step.total_tokens - 1
        if proposer != "ngram":
            assert draft.kv_length() == draft.length <= len(generation.prompt) + step.total_tokens - 1
    assert generation.summary.new_tokens == len(generation.token_ids)


def test_greedy_speculative_equals_standard_on_llamacpp(engine):
    """Lossless on this runtime: identical counts over prompts and K (batched verify vs one token)."""
    prompts = ["def add(a, b):", "The quick brown fox", "快速排序是一种", "Hello world! How are", "for i in range(10):"]
    identical, compared = 0, 0
    for prompt in prompts:
        standard = engine.generate(_request("standard", prompt=prompt))
        list(standard)
        for k in (1, 3, 6):
            for proposer in ("draft", "ngram"):
                spec = engine.generate(_request("speculative", proposer, k=k, prompt=prompt))
                list(spec)
                compared += 1
                identical += spec.token_ids == standard.token_ids
    # llama.cpp's batched and single-token kernels agree to ~1e-3 of the logits' scale (see above),
    # far below the gaps between a tiny random model's top logits, so every output must be identical.
    assert identical == compared, f"{identical}/{compared} identical"


@pytest.mark.parametrize("costs", ["measured", "flat"])
def test_auto_mode_and_k_auto_equal_standard_on_llamacpp(engine, costs, monkeypatch):
    """The K controller on this runtime: K per step (0 = a standard step) and, in auto mode, the
    proposer per step; greedy output must stay the standard answer. "measured": the costs measured
    at load (a linear verify on two cores: mostly standard steps); "flat": a verify as cheap as one
    token, so the controller drafts and the speculative path is what is compared."""
    from dataclasses import replace

    from engine.decoding.control import TuningMemory

    if costs == "flat":
        flat = tuple((w, 1.0) for w in range(1, K_MAX + 2))
        monkeypatch.setattr(engine, "info", replace(engine.info, target_ms=flat))
    monkeypatch.setattr(engine, "tuning", TuningMemory())
    drafted = 0
    for prompt in ["def add(a, b):", "The quick brown fox", "快速排序是一种"]:
        standard = engine.generate(_request("standard", prompt=prompt))
        list(standard)
        for run in (engine.generate(_request("auto", "draft+ngram", k=K_AUTO, prompt=prompt)),
                    engine.generate(_request("speculative", "draft", k=K_AUTO, prompt=prompt))):
            steps = list(run)
            assert run.token_ids == standard.token_ids, (costs, prompt, run.request.mode)
            assert all(s.decision is not None and 0 <= s.decision.k <= K_MAX for s in steps)
            drafted += run.summary.drafted
    if costs == "flat":
        assert drafted > 0


def test_draft_head_is_refused_in_one_line_on_llamacpp(engine, ggufs):
    with pytest.raises(GenerationError, match="torch runtime") as err:
        engine.generate(_request("speculative", "head"))
    assert "\n" not in str(err.value)
    with pytest.raises(GenerationError, match="hidden states"):
        engine.target_runner.keep_hidden((1,))
    engine.target_runner.keep_hidden(())  # nothing asked: nothing refused
    # Asked for explicitly: refused before loading; under auto a head means torch, saying why.
    gguf = [resolve_source(str(ggufs[0]), "target")]
    with pytest.raises(ModelLoadError, match="hidden states"):
        assemble.choose_runtime(LoadSpec(runtime="llamacpp", device="cpu", needs_head=True), gguf)
    choice = assemble.choose_runtime(LoadSpec(runtime="auto", device="cpu", needs_head=True), gguf)
    assert choice.runtime == "torch" and "hidden states" in choice.note


def test_sampled_speculative_runs_and_is_seeded(engine):
    a = engine.generate(_request("speculative", temperature=0.8, top_p=0.9, seed=7))
    b = engine.generate(_request("speculative", temperature=0.8, top_p=0.9, seed=7))
    list(a), list(b)
    assert a.token_ids == b.token_ids and a.summary.drafted > 0


def test_verdict_names_a_linear_verify():
    from engine.measure.costmodel import CostModel

    # The llama.cpp figures on two cores: 1, 2, 4, 6 tokens cost 30, 60, 101, 150 ms.
    linear = CostModel(draft_ms=20.0, target_ms={1: 30.0, 2: 60.0, 4: 101.0, 6: 150.0})
    text = linear.verdict(0.8, 5)
    assert text.startswith("Speculative decoding will not pay here: a 2-token verify costs 2.0× a 1-token "
                           "forward (60 vs 30 ms) and the draft 67% of one; at 80% acceptance the best K=1")
    flat = CostModel(draft_ms=20.0, target_ms={1: 30.0, 6: 33.0})
    assert "verify" not in flat.verdict(0.1, 5)
    # n-gram drafts vary in length: 100 tokens in 80 steps that drafted 40 tokens in all (0.5 a step).
    ngram = CostModel(draft_ms=0.0, target_ms={1: 30.0, 2: 60.0, 4: 101.0, 6: 150.0})
    assert ngram.predicted_from_counts(100, 80, 40, 0) == pytest.approx(100 / 80 * 30 / 45)


# --------------------------------------------------------------------------- choosing the runtime

def test_auto_picks_llamacpp_for_gguf_on_cpu_and_torch_for_folders(ggufs):
    gguf = [resolve_source(str(ggufs[0]), "target")]
    folder = [resolve_source(str(ggufs[2]), "target")]
    assert assemble.choose_runtime(LoadSpec(runtime="auto", device="cpu"), gguf).runtime == "llamacpp"
    assert assemble.choose_runtime(LoadSpec(runtime="auto", device="cpu"), folder) == assemble.RuntimeChoice("torch")
    assert assemble.choose_runtime(LoadSpec(runtime="torch", device="cpu"), gguf).runtime == "torch"
    # A torch setting asked for explicitly means torch.
    assert assemble.choose_runtime(LoadSpec(runtime="auto", device="cpu", dtype="float32"), gguf).runtime == "torch"
    assert assemble.choose_runtime(LoadSpec(runtime="auto", device="cpu", fast_path="eager"), gguf).runtime == "torch"
    with pytest.raises(ModelLoadError, match="loads .gguf files"):
        assemble.choose_runtime(LoadSpec(runtime="llamacpp", device="cpu"), folder)
    with pytest.raises(ModelLoadError, match="runs on the CPU"):
        assemble.choose_runtime(LoadSpec(runtime="llamacpp", device="cuda"), gguf)


def test_missing_module_falls_back_to_torch_and_says_why(ggufs, monkeypatch):
    """Where llama_cpp cannot be imported, auto runs on torch with a one-line reason; asking for it fails."""
    import builtins
    import importlib

    real_import = importlib.import_module

    def no_llama(name, *args, **kwargs):
        if name == "llama_cpp":
            raise ImportError("No module named 'llama_cpp'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", no_llama)
    llamacpp_mod._import.cache_clear()
    try:
        reason = llamacpp_mod.unavailable_reason()
        assert reason == "ImportError: No module named 'llama_cpp'"
        gguf = [resolve_source(str(ggufs[0]), "target")]
        choice = assemble.choose_runtime(LoadSpec(runtime="auto", device="cpu"), gguf)
        assert choice.runtime == "torch" and "llama.cpp unavailable" in choice.note and "\n" not in choice.note
        with pytest.raises(llamacpp_mod.RuntimeUnavailable, match="pip install"):
            assemble.choose_runtime(LoadSpec(runtime="llamacpp", device="cpu"), gguf)
        engine = assemble.build_engine(LoadSpec(str(ggufs[0]), None, with_draft=False, device="cpu"))
        assert engine.info.runtime == "torch" and engine.info.runtime_note == choice.note
        from app.core.session import runtime_label

        assert "llama.cpp unavailable" in runtime_label(engine.info)
    finally:
        llamacpp_mod._import.cache_clear()
    assert builtins is not None


TEXTS = ["def add(a, b):\n    return a + b\n", "快速排序是一种分治算法。🙂🚀 and  spaces   and\ttabs\n\n\nnewlines",
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "Hello world! How are you? I'm fine. 3.14159"]


def test_llamacpp_tokenizer_matches_transformers(ggufs):
    """llama.cpp's own vocabulary encodes, decodes and templates as the Hugging Face tokenizer does."""
    from transformers import AutoTokenizer

    from engine.runners.llamacpp_tokenizer import LlamaCppTokenizer

    ours = LlamaCppTokenizer(LlamaCppRunner(ggufs[0], n_ctx=64, threads=1))
    reference = AutoTokenizer.from_pretrained(ggufs[2])
    for text in TEXTS:
        ids = reference(text, add_special_tokens=False)["input_ids"]
        assert ours(text)["input_ids"] == ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    # A character split across tokens decodes to U+FFFD until it is complete (the detokenizer relies on it).
    ids = reference("快速🙂", add_special_tokens=False)["input_ids"]
    assert [ours.decode(ids[:i]) for i in range(len(ids) + 1)] == [reference.decode(ids[:i]) for i in range(len(ids) + 1)]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "用Python写一个快速排序"}]
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert (ours.eos_token_id, ours.eos_token, len(ours)) == (reference.eos_token_id, reference.eos_token, len(reference))


def test_load_builds_no_tokenizer_and_converts_nothing(ggufs, tmp_path, monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a Hugging Face tokenizer or model was built")

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "fresh"))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    engine = assemble.build_engine(LoadSpec(str(ggufs[0]), str(ggufs[1]), runtime="llamacpp", threads=1))
    generation = engine.generate(_request("speculative"))
    assert "".join(step.text for step in generation) == generation.summary.text
    assert not (tmp_path / "fresh").exists() or not any((tmp_path / "fresh").rglob("*.safetensors"))


def test_cli_generate_and_bench_on_llamacpp(ggufs, tmp_path, capsys):
    from app.cli import main

    args = ["--target", str(ggufs[0]), "--draft", str(ggufs[1]), "--threads", "1", "--max-new-tokens", "12"]
    assert main(["generate", "--prompt", "def add(a, b):", "--json", "--runtime", "llamacpp", *args]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["runtime"] == "llamacpp" and out["config"]["fast_path"] == "llama.cpp"
    assert out["config"]["llama_cpp_python"] == llama_cpp.__version__
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": p}) for i, p in
                               enumerate(["def add(a, b):", "The quick brown fox"])), encoding="utf-8")
    result = tmp_path / "bench.json"
    modes = "standard,llamacpp-plain,speculative,speculative-ngram,torch-standard"
    assert main(["bench", "--prompts", str(prompts), "--modes", modes, "--json", str(result), "--warmup", "0",
                 *args]) == 0
    summary = json.loads(result.read_text())["summary"]
    for mode in modes.split(","):
        assert summary[mode]["new_tokens"] > 0
    # The plain llama-cpp-python loop decodes the same greedy tokens as the engine on llama.cpp.
    assert summary["fidelity"]["llamacpp-plain"]["identical"] == 2
    assert summary["fidelity"]["speculative"]["identical"] == 2
    assert summary["fidelity"]["speculative-ngram"]["identical"] == 2
    assert "torch-standard" in summary["vs_standard"]


def test_bad_gguf_is_one_line(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelLoadError) as err:
        LlamaCppRunner(Path(bad), threads=1)
    assert "llama.cpp could not load" in str(err.value) and "\n" not in str(err.value)


def test_amx_repacking_stays_off_where_amx_is_advertised(monkeypatch):
    """A runner made without a verdict (repack=None) keeps llama.cpp's repacked buffers off where AMX is
    advertised (its AMX matmuls died on this project's virtual Xeons) unless the variable asks for them."""
    monkeypatch.delenv(llamacpp_mod.AMX_ENV, raising=False)
    monkeypatch.setattr(llamacpp_mod, "amx_advertised", lambda: True)
    assert not llamacpp_mod.extra_buffers()
    monkeypatch.setenv(llamacpp_mod.AMX_ENV, "1")
    assert llamacpp_mod.extra_buffers()
    monkeypatch.delenv(llamacpp_mod.AMX_ENV)
    monkeypatch.setattr(llamacpp_mod, "amx_advertised", lambda: False)
    assert llamacpp_mod.extra_buffers()


def test_amx_kernels_are_tried_once_per_model_and_the_verdict_is_kept(ggufs, monkeypatch):
    """Where AMX is advertised, a child process tries llama.cpp's AMX kernels on the model: a death by a
    signal (SIGILL on this project's virtual Xeons) keeps them off for that file, a clean run keeps
    them on; the verdict is kept in the cache, and other failures are tried again next time."""
    from engine.runners import llamacpp_probe as probe

    monkeypatch.delenv(probe.AMX_ENV, raising=False)
    monkeypatch.setattr(probe, "amx_advertised", lambda: True)
    trials: list[Path] = []

    def child(status):
        def run(path):
            trials.append(path)
            return status
        return run

    said: list[str] = []
    assert probe.amx_runs(ggufs[0], said.append, child=child(-4)) is False
    assert probe.amx_runs(ggufs[0], said.append, child=child(0)) is False  # kept: not tried again
    assert trials == [ggufs[0]] and len(said) == 1 and "AMX" in said[0]
    assert probe.amx_runs(ggufs[1], child=child(0)) is True  # another file, its own trial
    assert probe.amx_runs(ggufs[1], child=child(-4)) is True
    assert len(trials) == 2
    kept = json.loads((Path(os.environ["SPECDEC_CACHE_DIR"]) / probe.VERDICTS).read_text())
    assert sorted(kept.values()) == [False, True]
    # A trial that failed for another reason (exit 1: memory, a broken file) is not kept.
    (Path(os.environ["SPECDEC_CACHE_DIR"]) / probe.VERDICTS).unlink()
    assert probe.amx_runs(ggufs[0], child=child(1)) is False
    assert probe.amx_runs(ggufs[0], child=child(0)) is True and len(trials) == 4
    # The variable decides without a trial; a CPU without AMX never tries.
    monkeypatch.setenv(probe.AMX_ENV, "0")
    assert probe.amx_runs(ggufs[1], child=child(0)) is False
    monkeypatch.setenv(probe.AMX_ENV, "1")
    assert probe.amx_runs(ggufs[1], child=child(-4)) is True
    monkeypatch.delenv(probe.AMX_ENV)
    monkeypatch.setattr(probe, "amx_advertised", lambda: False)
    assert probe.amx_runs(ggufs[1], child=child(-4)) is True
    assert len(trials) == 4


def test_the_amx_trial_child_loads_with_repacking_and_decodes(ggufs):
    from engine.runners import llamacpp_probe as probe

    assert probe.run_child(ggufs[0]) == 0  # the real child process, repacking on, on the tiny model


def test_a_load_follows_the_amx_verdict_and_says_so(ggufs, monkeypatch):
    from engine.runners import llamacpp_probe as probe

    monkeypatch.delenv(probe.AMX_ENV, raising=False)
    monkeypatch.setattr(probe, "amx_advertised", lambda: True)
    monkeypatch.setattr(probe, "run_child", lambda path: -4 if path == ggufs[0] else 0)
    engine = assemble.build_engine(LoadSpec(str(ggufs[0]), str(ggufs[1]), runtime="llamacpp", threads=1))
    assert (engine.target_runner.repack, engine.draft_runner.repack) == (False, True)
    assert engine.info.fast_path_note == ("llama.cpp's AMX kernels off for tiny-target: they did not run on this "
                                          "CPU in a trial")
    from app.core.session import device_line

    assert device_line(engine.info) == "cpu · F32 · llama.cpp · 1 thread"  # not "(eager)": no graphs here


def test_the_amx_trial_child_answers_bad_arguments_in_one_line(tmp_path, capsys):
    from engine.runners import llamacpp_trial as probe

    assert probe.main([]) == 2 and probe.main(["a", "b"]) == 2
    assert "usage:" in capsys.readouterr().err
    assert probe.main([str(tmp_path / "missing.gguf")]) == 1  # not a verdict: tried again next time
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("llamacpp_probe: llama.cpp could not load")
