"""The experiment core, the sweep (rows, prediction, CSV, CLI) and the Tune tab through the real worker."""
from __future__ import annotations

import csv
import json
import math
from dataclasses import replace

import pytest

from app.core.session import build_request
from engine.errors import InputError
from engine.limits import K_AUTO
from engine.measure import experiment as ex
from engine.measure import sweep as sw
from engine.types import GenerationRequest, ModelInfo, ProposerCost, Sampling, Step

# --------------------------------------------------------------------------- the experiment core


def test_schedule_warms_nothing_itself_and_rotates_the_order():
    prompts = [ex.BenchPrompt(f"p{i}", "c", "x") for i in range(3)]
    tasks = ex.schedule(prompts, ["a", "b", "c"], repeats=2)
    assert [(t.prompt.id, t.label) for t in tasks[:6]] == [
        ("p0", "a"), ("p0", "b"), ("p0", "c"), ("p1", "b"), ("p1", "c"), ("p1", "a")]
    assert [t.repeat for t in tasks] == [0] * 9 + [1] * 9
    firsts = [tasks[i].label for i in range(0, 18, 3)]
    assert set(firsts) == {"a", "b", "c"}  # every configuration runs first on some prompt


def test_run_tasks_warms_each_prompt_once_per_repeat():
    prompts = [ex.BenchPrompt("p0", "c", "x"), ex.BenchPrompt("p1", "c", "y")]
    warmed: list[str] = []

    def run(task: ex.Task) -> ex.RunRecord:
        return ex.RunRecord(task.prompt.id, "c", task.label, 1, 1.0, 1.0, 1, 0, 0, 0, "", (1,), repeat=task.repeat)

    records = ex.run_tasks(ex.schedule(prompts, ["a", "b"], 2), run, warm=lambda p: warmed.append(p.id))
    assert warmed == ["p0", "p1", "p0", "p1"] and len(records) == 8


def test_first_difference_and_prompts():
    assert ex.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert ex.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert ex.first_difference([1, 2], [1, 2, 3]) == 2
    assert math.isnan(ex.speedup(0.0, 5.0)) and ex.speedup(2.0, 5.0) == 2.5
    assert len(ex.packaged_prompts()) == 20
    with pytest.raises(InputError, match="src:2"):
        ex.parse_prompts(['{"prompt": "a"}', "not json"], "src")
    with pytest.raises(InputError, match="no prompts"):
        ex.parse_prompts(["", " "], "src")


def _step(i: int, drafted: int, accepted: int) -> Step:
    added = 100 + i
    return Step(i, "speculative" if drafted else "standard", tuple(range(drafted)), (0.5,) * drafted,
                (0.5,) * drafted, ("draft",) * drafted, accepted, added, "corrected", (), "", accepted + 1, 0,
                0.0, 0.0, 0.0)


def test_committed_ids_are_kept_drafts_then_the_targets_token():
    steps = [_step(0, 3, 2), _step(1, 0, 0)]
    assert ex.committed_ids(steps) == [0, 1, 100, 101]


def test_record_counts_the_draft_models_wide_first_forwards():
    """The first draft feeds the prompt as a prefill, then 1 token; after a fully accepted draft it
    feeds 2 (its last draft token and the bonus token); after two standard steps 1 + 2 (a catch-up)."""
    from engine.measure.stats import summarize

    class Done:
        summary = summarize([], mode="auto", k=0, prompt_tokens=1, seconds=1.0, stop_reason="eos")
        request = GenerationRequest(sampling=Sampling(temperature=0.7))

    steps = [_step(0, 3, 3), _step(1, 2, 1), _step(2, 0, 0), _step(3, 0, 0), _step(4, 2, 0)]
    record = ex.record_run(Done(), steps, ex.BenchPrompt("a", "c", "x"), "auto")
    assert record.temperature == 0.7  # which measured costs price it: a sampled round's
    widths = record.catch_up_widths
    assert widths[2] == 1 and widths[3] == 1 and sum(widths) == 2
    assert record.drafted_steps[:4] == (2, 0, 2, 1) and record.drafted_by == (("draft", 3, 7),)
    # Standard steps before the first draft: their tokens go into the draft's prompt prefill, not a catch-up.
    late = [_step(0, 0, 0), _step(1, 0, 0), _step(2, 0, 0), _step(3, 2, 1)]
    assert ex.record_run(Done(), late, ex.BenchPrompt("a", "c", "x"), "auto").catch_up_widths == ()


# --------------------------------------------------------------------------- the sweep's arithmetic

COSTS = ModelInfo("t", "d", "cpu", "float32", "eager", 100, draft_ms=2.0,
                  target_ms=tuple((w, 10.0 + (w - 1)) for w in range(1, 14)),
                  proposer_costs=(ProposerCost("draft", 2.0, 0.0), ProposerCost("ngram", 0.0, 0.1)))


def run(label: str, prompt: str, tokens: int, seconds: float, *, drafted: int = 0, accepted: int = 0,
        steps: int | None = None, ids: tuple[int, ...] | None = None, overhead_s: float = 0.0) -> ex.RunRecord:
    steps = steps if steps is not None else tokens
    lengths = [0] * 13
    lengths[drafted] = steps
    reached = [steps if i < drafted else 0 for i in range(12)]
    hits = [steps if i < accepted else 0 for i in range(12)]
    return ex.RunRecord(prompt, "code", label, tokens, seconds, tokens / seconds, steps, drafted * steps,
                        drafted * steps, accepted * steps, "", ids or tuple(range(tokens)), overhead_s=overhead_s,
                        position_reached=tuple(reached), position_accepted=tuple(hits), drafted_steps=tuple(lengths),
                        drafted_by=(("draft", steps, drafted * steps),) if drafted else ())


def test_rows_speedup_identity_and_a_prediction_that_matches_exact_costs():
    configs = sw.plan(["draft"], [2], [0.0])
    std, k2 = (c.label for c in configs)
    # Standard: 30 steps of 10 ms. K=2, both drafts always accepted: 10 steps of 2*2 + 12 ms for 30 tokens.
    records = [run(std, "a", 30, 0.30), run(k2, "a", 30, 0.16, drafted=2, accepted=2, steps=10),
               run(std, "b", 30, 0.30), run(k2, "b", 30, 0.16, drafted=2, accepted=2, steps=10, ids=(9,) * 30)]
    rows = sw.rows(records, configs, COSTS)
    assert [r.label for r in rows] == ["standard", "draft K=2"]
    r = rows[1]
    assert r.speedup == pytest.approx(0.30 / 0.16)
    assert r.predicted_speedup == pytest.approx(r.speedup)  # the costs are exactly the measured ones
    assert (r.identical, r.compared) == (1, 2) and r.acceptance == 1.0 and r.tokens_per_target_forward == 3.0
    assert sw.best(rows) is r
    # A measured overhead per step enters both sides of the prediction.
    slow = [run(std, "a", 30, 0.33, overhead_s=0.03), run(k2, "a", 30, 0.17, drafted=2, accepted=2, steps=10,
                                                           overhead_s=0.01)]
    assert sw.rows(slow, configs, COSTS)[1].predicted_speedup == pytest.approx(0.33 / 0.17)


def test_sampled_runs_are_priced_with_the_sampled_costs_measured_at_load():
    """A head's sampled drafts cost more than its greedy ones (host work between CUDA graphs): the
    H200's head at T = 0.7 drafted at 0.31 ms a token against 0.20 greedy. A run at T > 0 is priced
    with ModelInfo.sampled_costs / sampled_target_ms, each figure not measured so falls back to greedy,
    and greedy runs keep the greedy costs."""
    target = tuple((w, 3.0 if w == 1 else 3.6) for w in range(1, 14))
    info = ModelInfo("t", None, "cuda:0", "bfloat16", "cuda-graphs", 100, target_ms=target,
                     proposer_costs=(ProposerCost("head", 0.2, 0.0),),
                     sampled_costs=(ProposerCost("head", 0.3, 0.05),),
                     sampled_target_ms=((1, 3.1), (6, 3.8)))
    k = 5
    steps, tokens = 10, 30  # 3 tokens a step: the first two drafts accepted, the third rejected
    lengths = [0] * 13
    lengths[k] = steps
    reached = (steps, steps, steps) + (0,) * 9
    hits = (steps, steps) + (0,) * 10

    def head_run(temperature: float) -> ex.RunRecord:
        return ex.RunRecord("a", "code", "head K=5", tokens, 1.0, tokens, steps, k * steps, k * steps, 2 * steps,
                            "", tuple(range(tokens)), position_reached=reached, position_accepted=hits,
                            drafted_steps=tuple(lengths), drafted_by=(("head", steps, k * steps),),
                            temperature=temperature)

    def std_run(temperature: float) -> ex.RunRecord:
        return ex.RunRecord("a", "code", "standard", tokens, 1.0, tokens, tokens, 0, 0, 0, "", tuple(range(tokens)),
                            drafted_steps=(tokens,) + (0,) * 12, temperature=temperature)

    greedy = ex.predicted_speedup(info, [head_run(0.0)], [std_run(0.0)])
    assert greedy == pytest.approx((30 / (steps * (k * 0.2 + 3.6))) / (30 / (tokens * 3.0)))
    sampled = ex.predicted_speedup(info, [head_run(0.7)], [std_run(0.7)])
    assert sampled == pytest.approx((30 / (steps * (0.05 + k * 0.3 + 3.8))) / (30 / (tokens * 3.1)))
    assert sampled < greedy
    # The cost model the verdicts and the controller read prices the same way.
    from engine.measure.costmodel import CostModel, costs_at

    assert CostModel.from_info(info, "head").step_ms(k) == pytest.approx(k * 0.2 + 3.6)
    assert CostModel.from_info(info, "head", sampled=True).step_ms(k) == pytest.approx(0.05 + k * 0.3 + 3.8)
    widths, costs = costs_at(info, sampled=True)
    assert widths[2] == 3.6 and widths[6] == 3.8  # not measured sampled: the greedy width
    assert costs_at(replace(info, sampled_costs=()), sampled=True)[1]["head"].per_token_ms == 0.2


def test_tree_runs_are_priced_with_the_tree_verify_and_the_alternatives_tokens():
    """A head's greedy tree (runners/tree.py): each K-draft step is priced at the tree round measured
    at load (ModelInfo.tree_ms), and gains one token wherever the target picked an alternative at the
    first rejection, at the rate measured per position in the runs."""
    target = tuple((w, 3.0 if w == 1 else 3.6) for w in range(1, 14))
    info = ModelInfo("t", None, "cuda:0", "bfloat16", "cuda-graphs", 100, target_ms=target,
                     proposer_costs=(ProposerCost("head", 0.2, 0.0),), tree_ms=((5, 3.9),), tree_alternatives=2)
    k, steps = 5, 10
    lengths = [0] * 13
    lengths[k] = steps
    reached = (steps, steps, steps) + (0,) * 9  # every step: 2 drafts accepted, the third rejected
    hits = (steps, steps) + (0,) * 10
    rescued = (0, 0, 4) + (0,) * 9  # at 4 of those 10 rejections an alternative was kept: 3 + 1 tokens

    def head_run(tree: int) -> ex.RunRecord:
        tokens = 34 if tree else 30
        return ex.RunRecord("a", "code", "head K=5", tokens, 1.0, tokens, steps, k * steps, k * steps, 2 * steps,
                            "", tuple(range(tokens)), position_reached=reached, position_accepted=hits,
                            drafted_steps=tuple(lengths), drafted_by=(("head", steps, k * steps),),
                            position_alternative=rescued if tree else (), tree=tree)

    std = ex.RunRecord("a", "code", "standard", 30, 1.0, 30, 30, 0, 0, 0, "", tuple(range(30)),
                       drafted_steps=(30,) + (0,) * 12)
    per_position = ex.position_acceptance([head_run(2)])
    assert ex.alternative_rates([head_run(2)])[:3] == (0.0, 0.0, 0.4)
    assert ex.alternative_tokens(per_position, ex.alternative_rates([head_run(2)]), k) == pytest.approx(0.4)
    chain = ex.predicted_speedup(info, [head_run(0)], [std])
    assert chain == pytest.approx((30 / (steps * (k * 0.2 + 3.6))) / (1 / 3.0))
    tree = ex.predicted_speedup(info, [head_run(2)], [std])
    assert tree == pytest.approx((34 / (steps * (k * 0.2 + 3.9))) / (1 / 3.0))
    # A tree of another width than the one measured at load is not priced as one.
    assert ex.predicted_speedup(info, [head_run(3)], [std]) == pytest.approx(
        (30 / (steps * (k * 0.2 + 3.6))) / (1 / 3.0))
    assert ex.alternative_rates([head_run(0)]) == ()
    # Sampling verifies the head's best tokens as a tree too: the tree round measured greedy plus what
    # sampling adds to a chain's verify of the same width (here 0.3 ms at width K + 1).
    sampled = replace(info, sampled_target_ms=((k + 1, 3.9),))
    hot = replace(head_run(2), temperature=0.7)
    assert ex.predicted_speedup(sampled, [hot], [replace(std, temperature=0.7)]) == pytest.approx(
        (34 / (steps * (k * 0.2 + 3.9 + 0.3))) / (1 / 3.0))


def test_prediction_costs_the_drafts_two_token_first_forward_and_its_measured_prefill():
    """llama.cpp's CPU kernels: a 2-token forward costs 1.8x a 1-token one, for the draft as for the target.

    K=1, every draft accepted: each proposal after the first starts with a 2-token draft forward
    (its accepted token and the bonus token). The draft's prompt prefill, deferred to its first
    proposal, is in the run's measured prefill_s, which enters the prediction as measured.
    """
    costs = ModelInfo("t", "d", "cpu", "Q4_K_M", "llama.cpp", 100, draft_ms=20.0,
                      target_ms=tuple((w, 33.0 * (1.0 if w == 1 else 0.9 * w)) for w in range(1, 14)),
                      proposer_costs=(ProposerCost("draft", 20.0, 0.5),))
    configs = sw.plan(["draft"], [1], [0.0])
    std, k1 = (c.label for c in configs)
    target = dict(costs.target_ms)
    steps = 32  # 64 tokens, 2 per step
    draft_s = (steps * 0.5 + 20.0 + (steps - 1) * 20.0 * target[2] / target[1]) / 1000
    verify_s = steps * target[2] / 1000
    prefill_std, prefill_k1 = 0.6, 0.6 + 0.25  # the draft's prompt prefill: 0.25 s, measured in the run
    std_run = ex.RunRecord("a", "code", std, 64, prefill_std + 64 * 0.033, 0.0, 64, 0, 0, 0, "", tuple(range(64)),
                           prefill_s=prefill_std, verify_s=64 * 0.033, drafted_steps=(64,) + (0,) * 12)
    k1_run = ex.RunRecord("a", "code", k1, 64, prefill_k1 + draft_s + verify_s, 0.0, steps, steps, steps, steps, "",
                          tuple(range(64)), prefill_s=prefill_k1, draft_s=draft_s, verify_s=verify_s,
                          position_reached=(steps,) + (0,) * 11, position_accepted=(steps,) + (0,) * 11,
                          drafted_steps=(0, steps) + (0,) * 11, drafted_by=(("draft", steps, steps),),
                          catch_up_widths=(0, 0, steps - 1))
    std_run = replace(std_run, tokens_per_s=64 / std_run.seconds)
    k1_run = replace(k1_run, tokens_per_s=64 / k1_run.seconds)
    row = sw.rows([std_run, k1_run], configs, costs)[1]
    assert row.predicted_speedup == pytest.approx(row.speedup)
    # Costing the 2-token forwards as 1-token ones (the old model) predicts 15% too much here.
    old = ex.predicted_speedup(costs, [replace(k1_run, catch_up_widths=())], [std_run])
    assert old / row.speedup - 1 > 0.10


def test_sampled_rows_claim_no_identity_and_partial_sweeps_give_partial_rows():
    configs = sw.plan(["draft", "ngram"], [1, 3], [0.7], auto=True)
    assert [c.label for c in configs] == ["standard T=0.7", "draft K=1 T=0.7", "draft K=3 T=0.7", "auto draft T=0.7",
                                          "ngram K=1 T=0.7", "ngram K=3 T=0.7", "auto ngram T=0.7"]
    records = [run(configs[0].label, "a", 10, 1.0), run(configs[1].label, "a", 10, 0.8, drafted=1, accepted=1,
                                                        steps=5)]
    rows = sw.rows(records, configs, COSTS)
    assert len(rows) == 2 and rows[1].identical is None and rows[1].compared == 0


def test_csv_and_parsing(tmp_path):
    configs = sw.plan(["draft"], [2, K_AUTO], [0.0])
    records = [run(c.label, "a", 10, 1.0 if c.mode == "standard" else 0.5, drafted=0 if c.mode == "standard" else 2,
                   accepted=1, steps=10 if c.mode == "standard" else 5) for c in configs]
    path = tmp_path / "sweep.csv"
    sw.write_csv(path, sw.rows(records, configs, COSTS))
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == sw.CSV_COLUMNS
    assert [(r["proposer"], r["k"]) for r in rows] == [("standard", "0"), ("draft", "2"), ("draft", "auto")]
    assert float(rows[1]["speedup"]) == pytest.approx(2.0) and rows[1]["prediction_error"] != ""
    assert sw.parse_list("1, 2,auto", sw.parse_k, "k") == [1, 2, K_AUTO]
    for bad in ("1,1", "0", "13", "x", ""):
        with pytest.raises(InputError):
            sw.parse_list(bad, sw.parse_k, "k")
    with pytest.raises(InputError, match="unknown proposer"):
        sw.plan(["medusa"], [1], [0.0])


def test_sweep_csv_neutralises_formula_text_and_keeps_numbers(tmp_path):
    """sweep.csv goes through the same OWASP rule as the session CSV: text never runs as a formula."""
    from dataclasses import replace

    from app.core.export import restore

    configs = sw.plan(["draft"], [2], [0.0])
    records = [run(c.label, "a", 10, 1.0 if c.mode == "standard" else 0.5, drafted=0 if c.mode == "standard" else 2,
                   accepted=1, steps=10 if c.mode == "standard" else 5) for c in configs]
    rows = sw.rows(records, configs, COSTS)
    hostile = ['=HYPERLINK("http://evil.example","x")', "@SUM(A1)", "+1", "-x", "\tx"]
    rows = [replace(r, proposer=hostile[i], mode=hostile[-1 - i], predicted_speedup=-0.5) for i, r in enumerate(rows)]
    path = tmp_path / "sweep.csv"
    sw.write_csv(path, rows)
    with open(path, newline="", encoding="utf-8") as f:
        read = list(csv.DictReader(f))
    for row in read:
        for column, value in row.items():
            try:
                float(value)
                continue  # numbers stay numbers, negative ones too
            except ValueError:
                assert not value.startswith(("=", "+", "-", "@", "\t", "\r")), (column, value)
    assert [restore(r["proposer"]) for r in read] == hostile[:2]
    assert [restore(r["mode"]) for r in read] == [hostile[-1], hostile[-2]]
    assert all(float(r["predicted_speedup"]) == -0.5 for r in read)


# --------------------------------------------------------------------------- the CLI on tiny models

def test_sweep_command_writes_csv_json_and_png(tiny_pair, tmp_path, capsys, monkeypatch):
    from app.cli import main

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "category": "code", "prompt": "def add(a, b):"}\n'
                       '{"id": "b", "category": "chat", "prompt": "Hello world!"}\n')
    out = tmp_path / "sweep"
    code = main(["sweep", "--prompts", str(prompts), "--k", "1,3", "--temperature", "0,0.8", "--proposer",
                 "draft,ngram", "--auto", "--max-new-tokens", "10", "--out", str(out), "--target", str(tiny_pair[0]),
                 "--draft", str(tiny_pair[1]), "--device", "cpu", "--dtype", "float32"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    with open(out / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * (1 + 2 * 3)  # per temperature: standard, and per proposer K=1, K=3, auto
    for r in rows:
        assert float(r["tokens_per_s"]) > 0 and r["runs"] == "2"
        if r["temperature"] == "0.0":  # float32 greedy: every configuration gives the target's own output
            assert r["identical"] == "2" and r["compared"] == "2", r
        else:
            assert r["identical"] == ""
        if r["mode"] != "standard":
            assert r["predicted_speedup"] != ""
    assert (out / "sweep.png").stat().st_size > 10_000
    saved = json.loads((out / "sweep.json").read_text())
    assert len(saved["runs"]) == len(rows) * 2 and saved["config"]["target_ms"]
    assert "<- best" in captured.out and "wrote" in captured.out


def test_the_sweep_measures_costs_again_beside_each_prompt(tiny_pair):
    """A CPU's speed drifts over a sweep: one more pass of the cost measurement per prompt (and repeat),
    pooled with the passes at load, so the predictions use costs from the minutes of the runs."""
    from engine.settings import GenerationSettings
    from tests.engine_fixtures import tiny_engine

    engine = tiny_engine(*tiny_pair)
    engine.measure_costs(rounds=1)
    configs = sw.plan(["draft"], [1], [0.0])
    prompts = [ex.BenchPrompt("a", "c", "def add(a, b):"), ex.BenchPrompt("b", "c", "hello world")]

    def make_request(prompt, config, max_new):
        settings = GenerationSettings(mode=config.mode, proposer=config.proposer or "draft", k=config.k,
                                      temperature=config.temperature, max_new_tokens=max_new)
        return build_request(settings, (), prompt=prompt)

    records = sw.run_sweep(engine, prompts, configs, make_request=make_request, max_new_tokens=6, repeat=2)
    assert len(records) == 8 and len(engine.cost_passes) == 1 + 2 * 2
    assert sw.rows(records, configs, engine.info)[1].predicted_speedup is not None


# --------------------------------------------------------------------------- the Tune tab through the real worker

@pytest.fixture
def tuned_window(qtbot, tmp_path, tiny_pair):
    from app.ui.settings import AppSettings
    from app.ui.window import MainWindow
    from app.ui.worker import running_threads
    from tests.engine_fixtures import tiny_engine

    engine = tiny_engine(*tiny_pair)
    w = MainWindow(engine_factory=lambda _req, _progress: engine, settings=AppSettings(tmp_path / "s.ini"))
    qtbot.addWidget(w)
    with qtbot.waitSignal(w.models_loaded, timeout=30000):
        from engine.settings import ModelSelection

        w.load_models(ModelSelection())
    yield w
    w.close()
    assert not running_threads()


def test_tune_tab_sweeps_live_highlights_the_best_and_applies_it(qtbot, tuned_window):
    from widgets.tune.view import TunePlan

    w = tuned_window
    view, tune = w.tune_view, w.tune
    plan = TunePlan(ks=(1, 2), temperatures=(0.0,), proposers=("draft",), auto=True, prompts=2, max_new_tokens=8,
                    repeat=1)
    progress: list[int] = []
    w.worker.sweep_progress.connect(lambda done, _total, _record: progress.append(done))
    with qtbot.waitSignal(tune.sweep_done, timeout=60000) as done:
        assert tune.start(plan)
        assert not w.prompt.button.isEnabled() or not w._can_chat()  # the chat waits for the sweep
    rows = done.args[0]
    assert [r.label for r in rows] == ["standard", "draft K=1", "draft K=2", "auto draft"]
    assert view.table.rowCount() == 4 and view.progress.value() == view.progress.maximum() == 8
    assert all(r.identical == r.compared == 2 for r in rows)  # float32 greedy
    best = view.best_row_index()
    assert best is not None and view.table.item(best, 0).font().bold()
    assert set(view.plots.series()) == {"draft T=0"}
    # Apply: the best configuration goes into the chat settings.
    view.apply_button.click()
    chosen, top = w.panel.values(), rows[best]
    assert (chosen.mode, chosen.temperature) == (top.mode, top.temperature)
    assert w._can_chat()


def test_tune_tab_stops_between_runs_and_keeps_what_ran(qtbot, tuned_window, tmp_path):
    from widgets.tune.view import TunePlan

    w = tuned_window
    tune = w.tune
    plan = TunePlan(ks=(1, 2, 3, 5), temperatures=(0.0, 0.7), proposers=("draft", "ngram"), auto=True, prompts=4,
                    max_new_tokens=16, repeat=2)
    w.worker.sweep_progress.connect(lambda done, _total, _record: tune.stop() if done == 2 else None)
    with qtbot.waitSignal(tune.sweep_done, timeout=60000):
        tune.start(plan)
    assert 2 <= len(tune.records) < 10 and "Stopped" in w.tune_view.status.text()
    assert not tune.running and w._can_chat()
    # The session CSV has a row for every run that ran, with its configuration and the prompt it asked.
    import csv

    from app.core.export import ENCODING

    path = tmp_path / "session.csv"
    assert w.export_session(str(path))  # no chat answer yet: the sweep alone is worth exporting
    with open(path, encoding=ENCODING, newline="") as f:
        rows = list(csv.DictReader(f))
    questions = {p.id: p.prompt for p in tune.prompts}
    assert len(rows) == len(tune.records) and {r["kind"] for r in rows} == {"sweep"}
    for row, record in zip(rows, tune.records):
        assert row["prompt_id"] == record.prompt_id and row["question"] == questions[record.prompt_id]
        assert row["new_tokens"] == str(record.new_tokens) and row["target_model"] == w.info.target_name
        assert row["request_mode"] in ("standard", "speculative", "auto")


def test_diagnoses_show_in_the_tune_tab_and_apply(qtbot, tuned_window):
    from engine.types import SweepRow

    w = tuned_window
    rows = tuple(SweepRow("speculative", "draft", k, 0.0, 10, s, 0.7, 2.0, (0.8, 0.8), 0.3, None, None, 0, 4, k)
                 for k, s in ((1, 1.05), (3, 1.3), (5, 1.1)))
    from engine.settings import GenerationSettings

    w.panel.set_values(GenerationSettings(mode="speculative", proposer="draft", k=5))
    w.tune.update_evidence(sweep=rows)
    texts = w.tune_view.diagnosis_texts()
    assert any("K=3 measured 1.30x" in t for t in texts), texts
    index = next(i for i, d in enumerate(w.tune.diagnoses) if d.kind == "best_k")
    w.tune_view.action_requested.emit(index)
    assert w.panel.values().k == 3


def test_best_needs_a_gain_beyond_the_measured_spread_and_some_accepted_drafts():
    """Tune's "Best: auto draft … 1.14×" with 0% accepted was noise: now standard decoding is the best there."""
    from engine.measure.verdict import NOISE_FLOOR, is_win, speedup_spread

    configs = sw.plan(["draft"], [2], [0.0], auto=True)
    std, k2, auto = (c.label for c in configs)
    # auto accepted nothing (it decoded standard steps) but ran 14% faster on one prompt, 2% on another: noise.
    noisy = [run(std, "a", 30, 0.30), run(auto, "a", 30, 0.30 / 1.14),
             run(std, "b", 30, 0.30), run(auto, "b", 30, 0.30 / 1.02),
             run(std, "c", 30, 0.30), run(k2, "c", 30, 0.30 / 1.02, drafted=2, accepted=1, steps=15)]
    rows = sw.rows(noisy, configs, COSTS)
    by = {r.label: r for r in rows}
    assert by["auto draft"].speedup > 1.05 and by["auto draft"].acceptance == 0
    assert by["auto draft"].spread > NOISE_FLOOR  # two prompts that disagree: a measured spread
    assert by["draft K=2"].speedup == pytest.approx(1.02) and by["draft K=2"].spread == NOISE_FLOOR
    top = sw.best(rows)
    assert top is not None and top.mode == "standard"  # neither gain is beyond its spread
    assert "<- best" in [line for line in sw.format_rows(rows).splitlines() if line.startswith("standard")][0]
    # A clear gain with drafts accepted on every prompt wins.
    clear = [run(std, p, 30, 0.30) for p in "ab"] + [run(k2, p, 30, 0.16, drafted=2, accepted=2, steps=10)
                                                     for p in "ab"]
    rows = sw.rows(clear, configs, COSTS)
    assert sw.best(rows).label == "draft K=2"
    # The rule itself: gain beyond spread, and something accepted.
    assert not is_win(1.14, 0.2, 0.5) and not is_win(1.5, 0.03, 0.0) and is_win(1.2, 0.05, 0.4)
    assert speedup_spread([1.0]) == NOISE_FLOOR and speedup_spread([1.0, 1.4]) == pytest.approx(0.4)


def test_the_bench_verdict_names_what_drafted_not_what_was_asked():
    """Auto routes a loaded head beside the draft model: the verdict weighs the head's cost when the head
    drafted most tokens, and says so."""
    from types import SimpleNamespace

    from engine.measure.bench import cost_model_summary, main_drafter

    target = tuple((w, 3.0 if w == 1 else 3.3) for w in range(1, 14))
    info = ModelInfo("t", "d", "cuda:0", "bfloat16", "cuda-graphs", 100, target_ms=target, draft_ms=1.9,
                     proposer_costs=(ProposerCost("draft", 1.9, 0.0), ProposerCost("head", 0.2, 0.0)))

    def run(mode, drafted_by):
        return replace(ex.RunRecord("a", "code", mode, 40, 1.0, 40.0, 20, 0, 30, 20, "", tuple(range(40))),
                       drafted_by=drafted_by, position_reached=(20, 15) + (0,) * 10,
                       position_accepted=(15, 10) + (0,) * 10)

    runs = [run("standard", ()), run("auto", (("head", 8, 40), ("draft", 2, 6)))]
    assert main_drafter(runs) == "head" and main_drafter(runs[:1]) is None
    summary = {"auto": {"k_mean": 5.0}, "standard": {}}
    cost = cost_model_summary(SimpleNamespace(info=info), runs, summary, proposer="draft")
    assert cost["drafter"] == "head" and cost["draft_ms"] == pytest.approx(0.2)
    assert "the draft head costs 7% of a target forward" in cost["verdict"]


def test_round_split_gives_each_phase_per_step_and_what_lies_outside_the_steps():
    # 10 rounds of 4 drafts: 20 ms drafting, 50 ms verifying, 5 ms between steps; 0.1 s of prompt, 0.08 s
    # in all after it: 5 ms outside every step (the answer's start and end).
    spec = replace(run("head K=4", "a", 30, 0.18, drafted=4, accepted=2, steps=10), prefill_s=0.1, draft_s=0.02,
                   verify_s=0.05, overhead_s=0.005)
    split = ex.round_split([spec])
    assert split == pytest.approx({"draft": 2.0, "verify": 5.0, "host": 0.5, "outside": 0.5, "all": 8.0})
    std = replace(run("standard", "a", 30, 0.09), verify_s=0.09)  # 30 standard steps of 3 ms
    assert ex.round_split([std]) == pytest.approx({"draft": 0.0, "verify": 3.0, "host": 0.0, "outside": 0.0,
                                                   "all": 3.0})
