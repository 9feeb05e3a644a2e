"""The benchmark scripts answer bad input in one line (exit 2), before any model is loaded where they can."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, says", [
    (["--bench-prompts", "no-such-prompts.jsonl"], "cannot read prompts file"),
    (["--target", "no/such/model", "--draft", "none"], "Model path not found"),
    (["--skip", "draft,heads"], "--skip takes draft, head and ngram, not heads"),
    (["--answer-tokens", "5"], "--answer-tokens is --max-new-tokens here"),
])
def test_check_honesty_answers_bad_input_in_one_line(tmp_path, capsys, argv, says):
    code = _script("check_honesty").main([*argv, "--json", str(tmp_path / "out.json")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("check_honesty: ") and says in err and "\n" not in err
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("name, argv, says", [
    ("cpu_memory_peaks", ["--target", "no/such/model"], "Model path not found"),
    ("head_acceptance_gap", ["--target", "no/such/model"], "Model path not found"),
    ("head_acceptance_gap", ["--prompt-file", "no-such-prompts.jsonl"], "No such file"),
    ("distill_data_speed", ["--target", "no/such/model", "--device", "cpu"], "cannot load no/such/model"),
])
def test_a_model_or_file_that_cannot_load_is_one_line(monkeypatch, capsys, name, argv, says):
    monkeypatch.setattr("sys.argv", [f"{name}.py", *argv])
    assert _script(name).main() == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{name}: ") and says in err and "\n" not in err


def test_check_honesty_refuses_a_results_file_it_could_not_write_before_loading(tmp_path, capsys):
    for out, says in ((tmp_path, "is a folder"), (tmp_path / "no" / "x.json", "does not exist")):
        assert _script("check_honesty").main(["--target", "no/such/model", "--json", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("check_honesty: ") and says in err and "\n" not in err


def test_tree_sweep_refuses_a_results_file_it_could_not_write_before_loading(tmp_path, capsys):
    assert _script("tree_sweep").main(["--trees", "d16", "--json", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tree_sweep: ") and "is a folder" in err and "\n" not in err


def test_tree_sweep_refuses_a_walk_it_does_not_know_before_loading(tmp_path, capsys):
    assert _script("tree_sweep").main(["--trees", "d16:cols", "--json", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tree_sweep: ") and "'rows'" in err and "\n" not in err
    sweep = _script("tree_sweep")
    assert sweep.parse_config("d48@8:rows", 4) == ("d48@8:rows", "d48", 8, True)
    assert sweep.parse_config("2", 4) == ("2", "2", 4, False)
    assert sweep.parse_config("auto", 4) == ("auto", "auto", 4, False)


@pytest.mark.parametrize("argv, says", [
    (["--temperatures", "0,0.7", "--json", "x.json"], "names each file with {t}"),
    (["--temperatures", "0,-1", "--json", "x_{t}.json"], "temperature must be >= 0"),
    (["--temperatures", "0,0", "--json", "x_{t}.json"], "listed twice"),
    (["--trees", "auto@5", "--json", "x.json"], "auto chooses K and its tree itself"),
    (["--trees", "d8,d8", "--json", "x.json"], "lists a configuration twice"),
])
def test_tree_sweep_checks_its_temperatures_before_loading(tmp_path, capsys, argv, says, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _script("tree_sweep").main(["--trees", "d16", *argv]) == 2  # a later --trees overrides the first
    err = capsys.readouterr().err.strip()
    assert err.startswith("tree_sweep: ") and says in err and "\n" not in err
    assert _script("tree_sweep").result_paths(Path("r_{t}.json"), [0.0, 0.7, 1.0]) == [
        Path("r_greedy.json"), Path("r_t07.json"), Path("r_t1.json")]
    assert _script("tree_sweep").result_paths(Path("r.json"), [0.7]) == [Path("r.json")]
    assert _script("tree_sweep").result_paths(Path("r_{t}.json"), [0.7]) == [Path("r_t07.json")]


def test_head_curve_keeps_a_continued_runs_start_on_its_own_held_out_answers(tmp_path, capsys):
    lines = [{"kind": "data", "answer_tokens": 100},
             {"kind": "eval", "step": 0, "acceptance": [0.0]},  # a fresh run's random head: not a point
             {"kind": "train", "tokens": 400}, {"kind": "eval", "step": 5, "acceptance": [0.5]},
             {"kind": "continue", "from": "h"}, {"kind": "data", "answer_tokens": 300},
             {"kind": "eval", "step": 0, "acceptance": [0.4]},  # the head so far on the new held-out answers
             {"kind": "train", "tokens": 600}, {"kind": "eval", "step": 9, "acceptance": [0.6]}]
    log = tmp_path / "train_log.jsonl"
    log.write_text("\n".join(json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    assert _script("head_curve").main([str(log), "--json", str(tmp_path / "c.json")]) == 0
    points = json.loads((tmp_path / "c.json").read_text(encoding="utf-8"))["points"]
    assert [(p["answer_tokens"], p["trained_tokens"], p["step"], p["acceptance"], p.get("start", False))
            for p in points] == [(100, 400, 5, [0.5], False), (400, 400, 0, [0.4], True), (400, 1000, 9, [0.6], False)]
    assert "the head it continues" in capsys.readouterr().out
    again = lines[4:]  # a third run that writes the second one's data again: no fresh tokens, its points marked
    log.write_text("\n".join(json.dumps(x) for x in lines + again) + "\n", encoding="utf-8")
    assert _script("head_curve").main([str(log), "--json", str(tmp_path / "c.json")]) == 0
    points = json.loads((tmp_path / "c.json").read_text(encoding="utf-8"))["points"]
    assert [(p["answer_tokens"], p["trained_tokens"], p.get("repeat", False)) for p in points[3:]] == [
        (400, 1000, True), (400, 1600, True)]
    assert "data of an earlier run again" in capsys.readouterr().out
    both = [lines[4], lines[5], {"kind": "data", "answer_tokens": 50, "round": 2}, *lines[6:]]  # fresh beside old
    log.write_text("\n".join(json.dumps(x) for x in lines + both) + "\n", encoding="utf-8")
    assert _script("head_curve").main([str(log), "--json", str(tmp_path / "c.json")]) == 0
    points = json.loads((tmp_path / "c.json").read_text(encoding="utf-8"))["points"]
    assert [(p["answer_tokens"], p.get("repeat", False)) for p in points[3:]] == [(450, "with"), (450, "with")]
    assert "with data of an earlier run again" in capsys.readouterr().out
    for text in ("not json\n", '{"kind": "continue"}\n{"kind": "eval"}\n', '{"kind": "eval", "step": "x"}\n'):
        log.write_text(text, encoding="utf-8")
        assert _script("head_curve").main([str(log)]) == 2
        assert capsys.readouterr().err.startswith("head_curve: cannot read")


def test_distill_writers_profiles_the_continuous_writer(tiny_head, tmp_path, capsys):
    """--no-generate --eager --profile on a CPU: the writer is timed eagerly and as it runs by default (the same
    answers), then profiled; the costliest operations are printed with their shares of all the operators'
    time, which the record closes with beside how busy the processor was."""
    out = tmp_path / "w.json"
    argv = ["--target", str(tiny_head.target), "--device", "cpu", "--dtype", "float32", "--questions", "6",
            "--answer-tokens", "6", "--rows", "4,", "--no-generate", "--eager", "--profile", "--json", str(out)]
    assert _script("distill_writers").main(argv) == 0
    printed = capsys.readouterr().out
    assert "continuous 4 eager" in printed and "CPU busy" in printed
    record = json.loads(out.read_text(encoding="utf-8"))
    *rows, total = record["summary"]["profile"]
    assert rows and all(0 <= r["share"] <= 1 and r["calls"] >= 1 for r in rows)
    assert sum(r["share"] for r in rows) <= 1.0001 and total["op"] == "(all operators)" and 0 < total["busy"]
    writers = record["summary"]["writers"]
    assert [w["writer"] for w in writers] == ["continuous 4 eager", "continuous 4"]
    assert writers[1]["same_as_first"] == writers[1]["answers"] == 6  # the same answers as the eager step's


def test_head_variants_prices_a_wider_vocabulary_and_a_second_layer(tiny_head, tmp_path, capsys):
    """On the tiny head: the answers' tokens outside its rows, its draft cost with more rows and with a second
    layer, and per variant the acceptance rise it needs; each figure in the record and on the screen."""
    out = tmp_path / "v.json"
    argv = ["--target", str(tiny_head.target), "--head", str(tiny_head.head), "--prompts", "3",
            "--max-new-tokens", "12", "--iters", "3", "--json", str(out)]
    assert _script("head_variants").main(argv) == 0
    printed = capsys.readouterr().out
    s = json.loads(out.read_text(encoding="utf-8"))["summary"]
    assert 3 <= s["answer_tokens"] <= 36 and 0 <= s["outside_vocab"] <= s["answer_tokens"]  # an answer may end early
    assert s["vocab_ceiling"] == pytest.approx(s["outside_vocab"] / s["answer_tokens"])
    names = [v["variant"] for v in s["variants"]]
    assert names == [f"{s['target_vocab']:,} output rows", "two decoder layers"]  # the tiny head has 256 of 320
    assert list(s["draft_ms"]) == ["today", *names] and all(ms > 0 for ms in s["draft_ms"].values())
    for v in s["variants"]:
        assert v["needed_rise"] is None or 0 <= v["needed_rise"] <= 1
    assert "vocabulary ceiling" in printed and "two decoder layers" in printed


def test_head_variants_chain_pricing():
    hv = _script("head_variants")
    acceptance, target = [0.8] * 5, {w: 10.0 + w for w in range(1, 10)}
    now, k = hv.chain_speedup(acceptance, target, 0.5)
    assert k >= 1 and now > 1.0
    assert hv.needed_rise(acceptance, target, 0.5, now) == pytest.approx(0.0, abs=1e-6)
    dearer = hv.needed_rise(acceptance, target, 1.5, now)
    assert 0 < dearer < 0.2 and hv.chain_speedup([min(a + dearer, 1) for a in acceptance], target, 1.5)[0] >= now - 1e-9
    assert hv.needed_rise(acceptance, target, 100.0, now) is None  # costs more than every draft could win


@pytest.mark.parametrize("argv, says", [
    (["--prompts", "-1"], "0 or more"),
    (["--passes", "0"], "1 or more"),
    (["--max-new-tokens", "0"], "1 or more"),
    (["--prompt-file", "no-such-prompts.jsonl"], "cannot read prompts"),
])
def test_head_variants_answers_bad_input_in_one_line_before_loading(argv, says, tmp_path, capsys):
    assert _script("head_variants").main([*argv, "--target", "no/such/model"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("head_variants: ") and says in err and "\n" not in err
    assert _script("head_variants").main(["--json", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_tree_sweep_says_a_rows_walks_price_is_the_host_walks_on_a_cpu(tiny_head, tmp_path, capsys, monkeypatch):
    """On a CPU the engine prices its trees for the host's walk at load; a `:rows` configuration is timed
    walking every row, and its priced column says whose price it shows."""
    from engine.decoding import sampling, verify

    # the script switches the walk through these module settings: put back after the test, for the tests after it
    monkeypatch.setattr(verify, "WALK_ON_HOST", verify.WALK_ON_HOST)
    monkeypatch.setattr(sampling, "HOST_SAMPLING", sampling.HOST_SAMPLING)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"q{i}", "category": "chat", "prompt": p})
                                 for i, p in enumerate(["hello world", "def add"])) + "\n", encoding="utf-8")
    out = tmp_path / "s.json"
    argv = ["--trees", "d8@3,d8@3:rows", "--json", str(out), "--target", str(tiny_head.target), "--head",
            str(tiny_head.head), "--runtime", "torch", "--device", "cpu", "--dtype", "float32",
            "--max-new-tokens", "6", "--prompts", str(prompts)]
    assert _script("tree_sweep").main(argv) == 0
    printed = capsys.readouterr().out
    rows = {r["config"]: r for r in json.loads(out.read_text(encoding="utf-8"))["configs"]}
    assert rows["d8@3"]["priced_ms"]["walk"] == rows["d8@3:rows"]["priced_ms"]["walk"] == "host"
    lines = [line for line in printed.splitlines() if line.startswith("d8@3")]
    assert any("(for the host's walk)" in line for line in lines if line.startswith("d8@3:rows"))
    assert not any("(for the host's walk)" in line for line in lines if line.split()[0] == "d8@3")


def test_tree_sweep_runs_auto_beside_a_tree_at_two_temperatures_after_one_load(tiny_head, tmp_path, capsys,
                                                                                 monkeypatch):
    """One load, a file a temperature: each with standard, the fixed tree and auto, each row's ratio by category."""
    from engine.decoding import sampling, verify

    monkeypatch.setattr(verify, "WALK_ON_HOST", verify.WALK_ON_HOST)
    monkeypatch.setattr(sampling, "HOST_SAMPLING", sampling.HOST_SAMPLING)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"q{i}", "category": c, "prompt": p})
                                 for i, (c, p) in enumerate([("chat", "hello world"), ("code", "def add")])) + "\n",
                       encoding="utf-8")
    sweep = _script("tree_sweep")
    loads = []
    real_load = sweep.load_engine
    monkeypatch.setattr(sweep, "load_engine", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    modes = []
    real_request = sweep.request_for
    monkeypatch.setattr(sweep, "request_for", lambda a, p, mode, n: modes.append(mode) or real_request(a, p, mode, n))
    argv = ["--trees", "d8@3,auto", "--temperatures", "0,0.7", "--json", str(tmp_path / "s_{t}.json"),
            "--target", str(tiny_head.target), "--head", str(tiny_head.head), "--runtime", "torch", "--device", "cpu",
            "--dtype", "float32", "--max-new-tokens", "6", "--prompts", str(prompts)]
    assert sweep.main(argv) == 0
    assert loads == [1] and set(modes) == {"standard", "speculative", "auto"}
    for name, temperature in (("s_greedy.json", 0.0), ("s_t07.json", 0.7)):
        record = json.loads((tmp_path / name).read_text(encoding="utf-8"))
        assert record["temperature"] == temperature
        assert [r["config"] for r in record["configs"]] == ["d8@3", "auto"]
        assert {r["mode"] for r in record["runs"]} == {"standard", "d8@3", "auto"}
        for row in record["configs"]:
            assert set(row["by_category"]) == {"chat", "code"} and all(v > 0 for v in row["by_category"].values())
    greedy = json.loads((tmp_path / "s_greedy.json").read_text(encoding="utf-8"))
    assert all(r["identical"] == r["compared"] == 2 for r in greedy["configs"])  # float32: lossless, auto too
    printed = capsys.readouterr().out
    assert "x standard by category: chat, code" in printed
    greedy_part, sampled_part = printed.split("temperature 0.7")
    assert "2/2" in next(line for line in greedy_part.splitlines() if line.startswith("d8@3"))
    # Sampled outputs differ from standard's by chance: no count of identical outputs that reads like a fault.
    assert "sampled" in next(line for line in sampled_part.splitlines() if line.startswith("d8@3"))
