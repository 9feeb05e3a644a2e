"""Hostile input on the command line: one stderr line and exit code 2, found before any model loads."""
from __future__ import annotations

import csv
import os
import shutil
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import app.cli
import app.cli.common
from app.cli import main
from app.core.export import restore
from engine.limits import K_MAX

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def no_load(monkeypatch):
    """Fails the test if the CLI gets as far as loading models: these errors must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("models were loaded before the input was checked")

    monkeypatch.setattr(app.cli.common, "load_engine", refuse)


def _models(tiny_pair) -> list[str]:
    return ["--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--device", "cpu", "--dtype", "float32"]


def _one_line(code: int, err: str, *fragments: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("specdec-studio: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("args, fragment", [
    (["--temperature", "nan"], "finite"),
    (["--temperature", "inf"], "finite"),
    (["--temperature", "-1"], ">= 0"),
    (["--top-p", "nan"], "finite"),
    (["--top-p", "0"], "(0, 1]"),
    (["--top-p", "1.5"], "(0, 1]"),
    (["--top-k", "-1"], "--top-k"),
    (["--seed", "100000000000000000000000"], "--seed"),
    (["--seed", "-1"], "--seed"),
    (["--seed", "9" * 5000], "--seed"),  # longer than int() parses: still one short line
    (["--k", str(K_MAX + 1)], f"1 to {K_MAX}"),
    (["--mode", "standard", "--k", "40000"], f"1 to {K_MAX}"),
    (["--max-new-tokens", "10000000"], "--max-new-tokens"),
    (["--device", "cuda:x"], "--device"),
    (["--prompt", "   "], "empty"),
    (["--prompt", "caf\udce9"], "UTF-8"),  # what argv holds for the byte 0xE9 (surrogateescape)
])
def test_bad_options_fail_before_loading(args, fragment, no_load, capsys):
    argv = ["generate", "--prompt", "x", *args] if "--prompt" not in args else ["generate", *args]
    line = _one_line(main(argv), capsys.readouterr().err, fragment)
    assert len(line) < 200


def test_invalid_utf8_prompt_through_a_real_process(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECDEC_CACHE_DIR": str(tmp_path / "cache")}
    code = "import sys; from app.main import main; sys.exit(main())"
    proc = subprocess.run([sys.executable, "-c", code, "generate", "--prompt", b"caf\xe9"], env=env,
                          capture_output=True, timeout=120)
    _one_line(proc.returncode, proc.stderr.decode("utf-8", "replace"), "UTF-8")


@pytest.mark.parametrize("line", [
    '{"id": "a", "prompt": "bad \\udce9 text"}',
    '{"id": "\\ud800", "prompt": "x"}',
    '{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}',
    "[" * 100_000,
])
def test_bad_prompts_files_fail_before_loading(tmp_path, line, no_load, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text(line + "\n", encoding="utf-8")
    _one_line(main(["bench", "--prompts", str(path)]), capsys.readouterr().err, str(path))


def test_prompts_file_with_invalid_utf8_bytes(tmp_path, no_load, capsys):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"id": "a", "prompt": "caf\xe9"}\n')
    _one_line(main(["bench", "--prompts", str(path)]), capsys.readouterr().err, str(path))


@pytest.mark.parametrize("where", ["dir", "missing", "same"])
def test_unwritable_outputs_fail_before_loading(tmp_path, where, no_load, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hi"}\n')
    out = {"dir": tmp_path, "missing": tmp_path / "no" / "such" / "out.json", "same": tmp_path / "out.json"}[where]
    extra = ["--csv", str(out)] if where == "same" else []
    _one_line(main(["bench", "--prompts", str(prompts), "--json", str(out), *extra]), capsys.readouterr().err)


def test_output_on_a_read_only_filesystem_fails_before_loading(tmp_path, no_load, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hi"}\n')
    # /proc refuses new files even to root, where permission bits do not.
    _one_line(main(["bench", "--prompts", str(prompts), "--csv", "/proc/specdec-bench.csv"]),
              capsys.readouterr().err, "cannot write")


def test_folder_without_config_says_what_is_missing(tmp_path, tiny_pair, capsys):
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    line = _one_line(main(["generate", "--prompt", "x", "--target", str(empty), "--draft", str(tiny_pair[1]),
                           "--device", "cpu"]), capsys.readouterr().err, "config.json")
    assert line.rstrip().endswith("hub id.")


def test_standard_mode_does_not_reserve_room_for_drafts(tiny_pair, capsys):
    # The tiny target holds 512 positions: a prompt of ~500 tokens fits standard decoding whatever K says.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    words = "hello world " * 400
    ids = tok(words, add_special_tokens=False)["input_ids"][:508]
    prompt = tok.decode(ids)
    assert len(tok(prompt, add_special_tokens=False)["input_ids"]) > 512 - K_MAX - 1
    code = main(["generate", "--prompt", prompt, "--raw", "--mode", "standard", "--k", str(K_MAX),
                 "--max-new-tokens", "2", *_models(tiny_pair)])
    assert code == 0, capsys.readouterr().err


def test_no_future_warning_from_our_calls(tiny_pair):
    """transformers 5.2x renamed past_key_values; the old name prints a FutureWarning before every error."""
    import torch

    from engine.measure.baselines import run_hf
    from engine.types import GenerationRequest
    from tests.engine_fixtures import tiny_engine

    engine = tiny_engine(*tiny_pair)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        list(engine.generate(GenerationRequest(prompt="def add(a, b):", max_new_tokens=4, k=2)))
        for variant in ("hf", "hf-static"):
            run_hf(engine.target, engine.tokenizer, torch.tensor([1, 2, 3]), 3, variant)


def test_error_after_loading_is_one_stderr_line(tmp_path, tiny_pair):
    """A real process: nothing (warnings, progress bars) comes before the one error line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECDEC_CACHE_DIR": str(tmp_path / "cache"),
           "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "default"}
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 200  # more than the 512 positions
    proc = subprocess.run([sys.executable, "-m", "app.main", "generate", "--prompt", long_prompt, "--raw",
                           *_models(tiny_pair)], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    _one_line(proc.returncode, proc.stderr, "context")


def test_bench_csv_neutralises_formula_text(tiny_pair, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "=HYPERLINK(\\"http://evil.example\\")", "category": "@cmd", "prompt": "hi"}\n')
    out = tmp_path / "runs.csv"
    code = main(["bench", "--prompts", str(prompts), "--modes", "standard", "--max-new-tokens", "4",
                 "--warmup", "0", "--csv", str(out), *_models(tiny_pair)])
    assert code == 0, capsys.readouterr().err
    with open(out, newline="", encoding="utf-8") as f:
        row = next(csv.DictReader(f))
    assert row["prompt_id"].startswith("'=") and restore(row["prompt_id"]) == '=HYPERLINK("http://evil.example")'
    assert row["category"] == "'@cmd" and row["mode"] == "standard"
    assert int(row["new_tokens"]) > 0 and float(row["seconds"]) > 0


def _gguf(fields: bytes, n_fields: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, n_fields) + fields


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def _nested_arrays(depth: int) -> bytes:
    # key "x": an array of one array of one array ... of nothing.
    return _key("x") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 0, 0)


@pytest.mark.parametrize("name, blob, fragment", [
    ("nested", _gguf(_nested_arrays(100_000), 1), "nests arrays"),
    ("tokens-an-int", _gguf(_key("tokenizer.ggml.tokens") + struct.pack("<IQ", 10, 7), 1), "tokenizer metadata"),
    ("eos-a-string", _gguf(_key("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 1) + _key("a")
                           + _key("tokenizer.ggml.eos_token_id") + struct.pack("<I", 8) + _key("zz"), 2),
     "tokenizer metadata"),
], ids=["nested", "tokens-an-int", "eos-a-string"])
def test_crafted_gguf_is_one_line(tmp_path, name, blob, fragment, capsys):
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(blob)
    code = main(["generate", "--prompt", "x", "--target", str(path), "--mode", "standard", "--device", "cpu"])
    _one_line(code, capsys.readouterr().err, fragment)


def test_gguf_cut_inside_its_tensor_data_is_one_line(tmp_path, capsys):
    from tests.tiny import build_model, build_tokenizer
    from tests.tiny_gguf import write_tiny_gguf

    tok = build_tokenizer()
    whole = write_tiny_gguf(tmp_path / "whole.gguf", tok, build_model(len(tok), seed=1)).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) * 3 // 4])  # the header and table intact, the last tensors missing
    code = main(["generate", "--prompt", "x", "--target", str(cut), "--mode", "standard", "--device", "cpu"])
    _one_line(code, capsys.readouterr().err, "beyond the end of the file")


def test_converting_a_gguf_draws_no_progress_bar(tmp_path, tiny_pair, capsys):
    from tests.tiny import build_model, build_tokenizer
    from tests.tiny_gguf import write_tiny_gguf

    tok = build_tokenizer()
    gguf = write_tiny_gguf(tmp_path / "draft.gguf", tok, build_model(len(tok), seed=1))
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 200  # an error after loading and converting
    code = main(["generate", "--prompt", long_prompt, "--raw", "--target", str(tiny_pair[0]), "--draft", str(gguf),
                 "--device", "cpu"])
    _one_line(code, capsys.readouterr().err, "context")


@pytest.mark.parametrize("command", [["generate", "--prompt", "x", "--mode", "standard", "--device", "cpu"],
                                     ["cache", "clean"]])
def test_an_unusable_cache_folder_is_one_line(monkeypatch, command, capsys):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", "/proc/specdec-cache")  # not creatable, even for root
    _one_line(main(command), capsys.readouterr().err, "SPECDEC_CACHE_DIR")


@pytest.fixture
def nan_model(tmp_path, tiny_pair):
    """The tiny target with one row of its embedding NaN: what flipped bits in a weight file give."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_pair[0]))

    def save(rows: list[int]) -> str:
        import torch

        with torch.no_grad():
            model.get_input_embeddings().weight[rows] = float("nan")
        folder = tmp_path / f"nan{len(rows)}"
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        return str(folder)

    return tok, save


def test_weights_that_compute_nan_are_refused_at_load(nan_model, capsys):
    tok, save = nan_model
    folder = save(list(range(len(tok))))  # every row: the warm-up forward sees it
    capsys.readouterr()
    code = main(["generate", "--prompt", "hi", "--target", folder, "--mode", "standard", "--device", "cpu"])
    _one_line(code, capsys.readouterr().err, "not finite")


def test_nan_scores_while_sampling_are_one_line(nan_model, capsys):
    tok, save = nan_model
    ids = tok("hello world", add_special_tokens=False)["input_ids"]
    folder = save(ids)  # only the prompt's tokens: the load is fine, the first sampled step is not
    capsys.readouterr()
    code = main(["generate", "--prompt", "hello world", "--raw", "--target", folder, "--mode", "standard",
                 "--temperature", "1", "--device", "cpu", "--dtype", "float32"])
    _one_line(code, capsys.readouterr().err, "not finite")


def test_a_bug_is_still_one_line(tiny_pair, monkeypatch, capsys):
    import engine.decoding

    def bug(*args, **kwargs):
        raise ZeroDivisionError("a bug\nwith a second line")

    monkeypatch.setattr(engine.decoding.Engine, "generate", bug)
    code = main(["generate", "--prompt", "x", *_models(tiny_pair)])
    _one_line(code, capsys.readouterr().err, "internal error (ZeroDivisionError: a bug", "-v")


# --- the commands main added: sweep, distill, --k auto, --mode auto, --proposer head, --head -------------------

@pytest.fixture
def no_load_anywhere(no_load, monkeypatch):
    """no_load for sweep (it imported _load) and distill (it loads inside engine.heads.distill)."""
    import engine.heads.distill

    def refuse(*args, **kwargs):
        raise AssertionError("models were loaded before the input was checked")

    monkeypatch.setattr(app.cli.common, "load_engine", refuse)
    monkeypatch.setattr(engine.heads.distill, "distill", refuse)


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "a", "category": "code", "prompt": "def f():"}\n', encoding="utf-8")
    return path


@pytest.mark.parametrize("args, fragment", [
    (["--k", "0"], f"1 to {K_MAX}"),
    (["--k", f"1,{K_MAX + 1}"], f"1 to {K_MAX}"),
    (["--k", "auto,99999999999999999999999"], f"1 to {K_MAX}"),
    (["--k", "two"], "whole number"),
    (["--k", "3,3"], "listed twice"),
    (["--k", " , "], "at least one"),
    (["--temperature", "nan"], "finite"),
    (["--temperature", "0,inf"], "finite"),
    (["--temperature", "-0.5"], ">= 0"),
    (["--repeat", "0"], "--repeat"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--proposer", "draft,bogus"], "unknown proposer"),
    (["--head", "/no/such/head"], "does not exist"),
])
def test_bad_sweep_options_fail_before_loading(args, fragment, prompts_file, tmp_path, no_load_anywhere, capsys):
    argv = ["sweep", "--prompts", str(prompts_file), "--out", str(tmp_path / "out"), *args]
    line = _one_line(main(argv), capsys.readouterr().err, fragment)
    assert len(line) < 200


def test_sweep_output_folder_that_is_a_file_fails_before_loading(prompts_file, tmp_path, no_load_anywhere, capsys):
    (tmp_path / "taken").write_text("x")
    _one_line(main(["sweep", "--prompts", str(prompts_file), "--out", str(tmp_path / "taken")]),
              capsys.readouterr().err, "cannot create")


@pytest.mark.parametrize("args, fragment", [
    (["--minutes", "nan"], "finite"),
    (["--minutes", "inf"], "finite"),
    (["--minutes", "0"], "> 0"),
    (["--minutes", "-3"], "> 0"),
    (["--minutes", "1e12"], "at most"),
    (["--call-minutes", "nan"], "finite"),
    (["--seed", "-1"], "--seed"),
    (["--device", "gpu"], "--device"),
    (["--target", "caf\udce9"], "UTF-8"),
    (["--prompts", "/no/such/prompts.jsonl"], "cannot read prompts file"),
    (["--data", "/no/such/work"], "no such folder"),
])
def test_bad_distill_options_fail_before_loading(args, fragment, tmp_path, no_load_anywhere, capsys):
    line = _one_line(main(["distill", "--out", str(tmp_path / "head"), *args]), capsys.readouterr().err, fragment)
    assert len(line) < 200


def test_distill_data_that_is_no_earlier_run_fails_before_loading(tmp_path, no_load_anywhere, capsys):
    """--data must name an earlier run's work folder (or its data folder) with data rounds, not this run's own."""
    plain = tmp_path / "plain"
    plain.mkdir()
    out = ["--out", str(tmp_path / "head")]
    (tmp_path / "file").write_text("x")
    _one_line(main(["distill", *out, "--data", str(tmp_path / "file")]), capsys.readouterr().err, "not a work folder")
    _one_line(main(["distill", *out, "--data", str(plain)]), capsys.readouterr().err, "not a distillation's work folder")
    (plain / "state.json").write_text("{}")
    _one_line(main(["distill", *out, "--data", str(plain)]), capsys.readouterr().err, "has no data rounds")
    (plain / "data").mkdir()
    (plain / "data" / "round-copy.pt").write_bytes(b"x")  # not a name the data phase writes
    _one_line(main(["distill", *out, "--data", str(plain)]), capsys.readouterr().err, "has no data rounds")
    (plain / "data" / "round-00000.pt").write_bytes(b"x")
    own = tmp_path / "head" / "work"
    own.mkdir(parents=True)
    shutil.copy(plain / "state.json", own / "state.json")
    shutil.copytree(plain / "data", own / "data")
    _one_line(main(["distill", *out, "--data", str(own / "data")]), capsys.readouterr().err, "own work folder")
    _one_line(main(["distill", *out, "--data", str(plain), "--data", str(plain / "data")]),
              capsys.readouterr().err, "given twice")


def test_distill_output_that_is_a_file_fails_before_loading(tmp_path, no_load_anywhere, capsys):
    (tmp_path / "taken").write_text("x")
    _one_line(main(["distill", "--out", str(tmp_path / "taken")]), capsys.readouterr().err, "cannot create")


@pytest.mark.parametrize("args, fragment", [
    (["--k", "auto,"], "whole number"),  # one K, not a list, on generate
    (["--head", "/no/such/head", "--proposer", "head"], "does not exist"),
    (["--mode", "sometimes"], "--mode"),
    (["--proposer", "oracle"], "--proposer"),
])
def test_bad_new_generate_options_fail_before_loading(args, fragment, no_load, capsys):
    _one_line(main(["generate", "--prompt", "x", *args]), capsys.readouterr().err, fragment)


def test_new_generate_and_bench_options_parse(tmp_path):
    from app.cli.parser import build_parser
    from engine.limits import K_AUTO

    args = build_parser().parse_args(["generate", "--prompt", "x", "--k", "auto", "--mode", "auto",
                                      "--proposer", "head", "--head", "none"])
    assert (args.k, args.mode, args.proposer, args.head) == (K_AUTO, "auto", "head", "none")
    args = build_parser().parse_args(["distill", "--out", str(tmp_path), "--minutes", "0.5"])
    assert args.minutes == 0.5
    args = build_parser().parse_args(["sweep", "--prompts", "p", "--out", "o", "--k", "1,auto", "--temperature",
                                      "0,0.7"])
    assert (args.ks, args.temperatures) == ("1,auto", "0,0.7")


@pytest.mark.parametrize("repeat", ["0", "1000000"])
def test_bad_bench_repeat_fails_before_loading(repeat, prompts_file, no_load, capsys):
    _one_line(main(["bench", "--prompts", str(prompts_file), "--repeat", repeat]), capsys.readouterr().err, "--repeat")


def test_hf_static_caches_go_with_their_model(tiny_pair):
    """The fuzz run found a freed model's static cache handed to a later model that got its id()."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.measure import baselines

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_pair[0]))
    before = len(baselines._caches)
    baselines.run_hf(model, tok, torch.tensor([1, 2, 3]), 2, "hf-static")
    assert len(baselines._caches) == before + 1
    del model
    gc.collect()
    assert len(baselines._caches) == before
