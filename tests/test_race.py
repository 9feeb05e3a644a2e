"""Race tests: the pure comparison logic, the RaceView, and whole races through the real EngineWorker."""
from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.ui.race import RaceController
from app.core.race_logic import (
    RACE_COLUMNS,
    BenchPrompt,
    committed_tokens,
    describe_divergence,
    first_divergence,
    load_bench_prompts,
    prompt_meta,
    race_result,
    race_rows,
    read_race_csv,
    run_order,
    speedup_stats,
    summarize_race,
    write_race_csv,
)
from app.ui.worker import WorkerHost, running_threads
from engine.limits import K_AUTO
from engine.loadspec import LoadSpec
from engine.measure.stats import summarize
from engine.settings import GenerationSettings
from engine.types import (
    GenerationRequest,
    Message,
    ModelInfo,
    Step,
    Summary,
    TokenView,
)
from widgets.race.view import RaceView, replay_scale

INFO = ModelInfo(target_name="fake-target", draft_name="fake-draft", device="cpu", dtype="bfloat16",
                 fast_path="eager", vocab_size=1000)

# Twelve committed tokens; "" + "你好" is a character split over two byte-level tokens (3 and 4).
TEXTS = ["def", " f", "():", "", "你好", " return", " 1", " +", " 2", "\n", "print", "(f())"]
STD_IDS = list(range(100, 112))
STD_P = [0.9, 0.8, 0.95, 0.6, 0.6, 0.7, 0.5, 0.41, 0.8, 0.9, 0.7, 0.6]
DIVERGE_AT = 7


def standard_steps(ids=STD_IDS, texts=TEXTS, ps=STD_P, seconds: float = 2.0) -> list[Step]:
    """One target token per step, evenly spread over `seconds` on the engine's clock."""
    steps = []
    n = len(ids)
    for i, (tok, text, p) in enumerate(zip(ids, texts, ps)):
        view = TokenView(tok, text, "target", i, None, None, p, None, None)
        steps.append(Step(index=i, mode="standard", proposed=(), proposed_q=(), proposed_p=(), sources=(),
                          accepted=0, added=tok, added_status="target", tokens=(view,), text=text, new_tokens=1,
                          total_tokens=i + 1, draft_ms=0.0, verify_ms=seconds / n * 1e3,
                          elapsed_s=seconds * (i + 1) / n, stop_reason="eos" if i == n - 1 else None))
    return steps


def speculative_steps(ids, texts=TEXTS, ps=STD_P, *, chunk: int = 3, seconds: float = 1.0) -> list[Step]:
    """Steps of `chunk` committed tokens: chunk-1 accepted drafts, one rejected ghost, one correction."""
    steps: list[Step] = []
    starts = list(range(0, len(ids), chunk))
    total = 0
    for s_i, start in enumerate(starts):
        part = list(range(start, min(start + chunk, len(ids))))
        drafted, added = part[:-1], part[-1]
        views = [TokenView(ids[j], texts[j], "accepted", s_i, d, 0.8, ps[j], 1.0, "draft")
                 for d, j in enumerate(drafted)]
        views.append(TokenView(999, "✗", "rejected", s_i, len(drafted), 0.5, 0.1, 0.2, "draft"))
        views.append(TokenView(ids[added], texts[added], "corrected", s_i, None, None, ps[added], None, None))
        total += len(part)
        k = len(drafted) + 1
        steps.append(Step(index=s_i, mode="speculative", proposed=tuple(ids[j] for j in drafted) + (999,),
                          proposed_q=(0.8,) * k, proposed_p=(0.9,) * k, sources=("draft",) * k,
                          accepted=len(drafted), added=ids[added], added_status="corrected", tokens=tuple(views),
                          text="".join(texts[j] for j in part), new_tokens=len(part), total_tokens=total,
                          draft_ms=1.0, verify_ms=2.0, elapsed_s=seconds * (s_i + 1) / len(starts),
                          stop_reason="eos" if s_i == len(starts) - 1 else None))
    return steps


def summary_of(steps: list[Step], mode: str, seconds: float, k: int = 5) -> Summary:
    return summarize(steps, mode=mode, k=k, prompt_tokens=9, seconds=seconds, stop_reason="eos")


SPEC_IDS = STD_IDS[:DIVERGE_AT] + [555] + STD_IDS[DIVERGE_AT + 1:]
SPEC_P = STD_P[:DIVERGE_AT] + [0.40] + STD_P[DIVERGE_AT + 1:]


# --------------------------------------------------------------------------- a scripted engine

class ScriptedGeneration(Iterator[Step]):
    def __init__(self, steps: list[Step], request: GenerationRequest, seconds: float, cancel: threading.Event,
                 delay_s: float) -> None:
        self.summary: Summary | None = None
        self._it = self._run(steps, request, seconds, cancel, delay_s)

    def __next__(self) -> Step:
        return next(self._it)

    def _run(self, steps, request, seconds, cancel, delay_s) -> Iterator[Step]:
        out = []
        stop = "eos"
        for step in steps:
            if cancel.wait(delay_s) if delay_s else cancel.is_set():
                stop = "cancelled"
                break
            out.append(step)
            yield step
        # The Summary's seconds are scripted: the race must use them, not its own wall clock.
        self.summary = summarize(out, mode=request.mode, k=request.k, prompt_tokens=9, seconds=seconds,
                                 stop_reason=stop)


class RaceEngine:
    """Standard requests get `standard`, speculative ones `speculative`; seconds scripted per call."""

    def __init__(self, standard: list[Step], speculative: list[Step], *, standard_seconds=(2.0,),
                 speculative_seconds=(1.0,), delay_s: float = 0.0) -> None:
        self.info = INFO
        self.scripts = {"standard": standard, "speculative": speculative}
        self.seconds = {"standard": list(standard_seconds), "speculative": list(speculative_seconds)}
        self.calls = {"standard": 0, "speculative": 0}
        self.delay_s = delay_s
        self.requests: list[GenerationRequest] = []

    def generate(self, request: GenerationRequest, cancel: threading.Event, progress=None) -> ScriptedGeneration:
        self.requests.append(request)
        mode = "standard" if request.mode == "standard" else "speculative"  # the chat's auto mode drafts too
        seconds = self.seconds[mode][self.calls[mode] % len(self.seconds[mode])]
        self.calls[mode] += 1
        return ScriptedGeneration(self.scripts[mode], request, seconds, cancel, self.delay_s)


@pytest.fixture
def race_setup(qtbot):
    """(make(engine) -> (controller, view)); the worker thread is joined and checked afterwards."""
    hosts: list[WorkerHost] = []

    def make(engine: RaceEngine, settings: GenerationSettings | None = None):
        host = WorkerHost(lambda _req, _progress: engine)
        hosts.append(host)
        host.worker.load_requested.emit(LoadSpec())
        # Not waitSignal on a worker signal: its blocker would run (and stop its timer) on the worker thread.
        qtbot.waitUntil(lambda: host.worker.engine is not None, timeout=5000)
        view = RaceView()
        qtbot.addWidget(view)
        view.resize(1300, 850)
        view.show()
        ids = iter(range(1, 10_000))
        chosen = settings or GenerationSettings(mode="speculative", system_prompt="Be brief.", k=4, temperature=0.0,
                                                seed=7, max_new_tokens=64)
        controller = RaceController(host.worker, view, next_request_id=lambda: next(ids),
                                    current_settings=lambda: chosen)
        return controller, view

    yield make
    for host in hosts:
        assert host.shutdown(5.0)
    assert not running_threads(), f"dangling worker threads: {running_threads()}"


def run_race(qtbot, controller: RaceController, view: RaceView, prompt: str, repeats: int = 1):
    view.set_prompt_text(prompt)
    view.set_repeats(repeats)
    with qtbot.waitSignal(controller.race_finished, timeout=10000) as blocker:
        view.race_button.click()
    return blocker.args[0]


# --------------------------------------------------------------------------- pure logic

def test_speedup_is_the_ratio_of_each_modes_own_tokens_per_second():
    std, spec = standard_steps(seconds=2.0), speculative_steps(STD_IDS, seconds=0.8)
    std_sum, spec_sum = summary_of(std, "standard", 2.4), summary_of(spec, "speculative", 0.8)
    r = race_result(race_id=1, repeat=0, prompt=BenchPrompt("p00", "code", "x"), k=5, temperature=0.0, seed=0,
                    standard=(std, std_sum), speculative=(spec, spec_sum))
    assert r.speedup == pytest.approx(spec_sum.tokens_per_s / std_sum.tokens_per_s)
    assert r.speedup == pytest.approx((12 / 0.8) / (12 / 2.4))  # 3.0: prefill-inclusive Summary seconds
    assert r.identical is True and r.divergence is None and r.reason is None


def test_divergence_reasons_near_tie_numerics_and_length():
    std = standard_steps()
    spec = speculative_steps(SPEC_IDS, ps=SPEC_P)
    d = first_divergence(std, spec)
    assert d is not None and d.index == DIVERGE_AT and d.kind == "near_tie"
    assert (d.standard_token, d.speculative_token) == (STD_IDS[7], 555)
    assert describe_divergence(d) == "near-tie: target p=0.41 vs 0.40 — batched verification in bf16 can flip argmax"

    far = speculative_steps(SPEC_IDS, ps=STD_P[:7] + [0.12] + STD_P[8:])
    d = first_divergence(std, far)
    assert d.kind == "numerics" and "verify forward's numerics differ" in describe_divergence(d)

    short = speculative_steps(STD_IDS[:9], TEXTS[:9], STD_P[:9])
    d = first_divergence(std, short)
    assert d.index == 9 and d.kind == "length" and d.speculative_token is None
    assert "speculative output ended" in describe_divergence(d)

    # Rejected drafts never count as output.
    assert [t for t, _ in committed_tokens(speculative_steps(STD_IDS))] == STD_IDS


def test_sampled_races_do_not_claim_identity():
    std, spec = standard_steps(), speculative_steps(SPEC_IDS)
    r = race_result(race_id=1, repeat=0, prompt=BenchPrompt("p00", "code", "x"), k=5, temperature=0.7, seed=3,
                    standard=(std, summary_of(std, "standard", 2)), speculative=(spec, summary_of(spec, "speculative", 1)))
    assert r.identical is None and r.divergence is None


def test_speedup_median_and_spread():
    s = speedup_stats([2.0, 2.5, 1.6, 2.0, 4.0])
    assert (s.n, s.median, s.minimum, s.maximum) == (5, 2.0, 1.6, 4.0)
    assert (s.q1, s.q3) == pytest.approx((2.0, 2.5)) and s.iqr == pytest.approx(0.5)
    one = speedup_stats([1.7])
    assert (one.median, one.minimum, one.maximum, one.iqr) == (1.7, 1.7, 1.7, 0.0)
    assert speedup_stats([math.nan, 2.0]).n == 1


def test_run_order_alternates_and_replay_scale_is_watchable():
    assert [run_order(r) for r in range(3)] == [("standard", "speculative"), ("speculative", "standard"),
                                                ("standard", "speculative")]
    assert replay_scale(0.05) == pytest.approx(80.0)  # a 50 ms CPU race replays over 4 s
    assert replay_scale(10.0) == 1.0
    assert replay_scale(60.0) == pytest.approx(1 / 3)


def test_bench_prompts_are_packaged_with_the_app():
    prompts = load_bench_prompts()
    assert len(prompts) == 20 and prompts[0].id == "p00"
    assert {p.category for p in prompts} == {"code", "longform_zh", "longform_en", "chat", "math", "short", "summarize"}
    packaged = Path(__file__).resolve().parents[1] / "assets" / "bench_prompts.jsonl"
    assert packaged.is_file()
    assert prompt_meta("  " + prompts[5].prompt + "\n", prompts) == prompts[5]
    assert prompt_meta("my own prompt", prompts).id == "custom"


# --------------------------------------------------------------------------- races through the real worker

def test_race_reports_speedup_from_each_modes_own_timing_and_marks_divergence(race_setup, qtbot):
    engine = RaceEngine(standard_steps(), speculative_steps(SPEC_IDS, ps=SPEC_P),
                        standard_seconds=(2.5,), speculative_seconds=(1.25,))
    controller, view = race_setup(engine)
    assert view.select_prompt("p03")  # a Chinese code prompt
    summary = run_race(qtbot, controller, view, view.prompt_text())

    # Same prompt, seed, sampling and K for both; standard first; the system prompt kept.
    std_req, spec_req = engine.requests
    assert (std_req.mode, spec_req.mode) == ("standard", "speculative")
    assert std_req.messages == spec_req.messages == (Message("system", "Be brief."),
                                                     Message("user", load_bench_prompts()[3].prompt))
    assert std_req.sampling == spec_req.sampling and std_req.k == spec_req.k == 4
    assert std_req.request_id != spec_req.request_id

    [result] = controller.results
    assert result.prompt_id == "p03" and result.category == "code"
    expected = result.speculative.tokens_per_s / result.standard.tokens_per_s
    assert result.standard.seconds == 2.5 and result.speculative.seconds == 1.25
    assert result.speedup == pytest.approx(expected) == pytest.approx(2.0)
    assert "Speedup 2.00×" in view.result_label.text()
    assert summary.speedup.median == pytest.approx(2.0)
    row = view.table_rows()[0]
    assert row[:3] == ["Code", "p03", "1"] and row[5] == "2.00×" and row[9] == "no"
    assert row[3] == f"{12 / 2.5:.1f}" and row[4] == f"{12 / 1.25:.1f}"

    # The shared chart: tokens against each mode's own clock, from the origin.
    x, y = view.chart.series("standard")
    assert (x[0], y[0]) == (0.0, 0.0) and (x[-1], y[-1]) == pytest.approx((2.0, 12.0)) and len(x) == 13
    x, y = view.chart.series("speculative")
    assert (x[-1], y[-1]) == pytest.approx((1.0, 12.0)) and len(x) == 5

    # Each pane shows its own mode's tok/s and time.
    assert "4.8 tok/s" in view.panes["standard"].stats.text() and "2.50 s" in view.panes["standard"].stats.text()
    assert "9.6 tok/s" in view.panes["speculative"].stats.text()

    # Greedy and different at token 7: the reason, and token 7 marked in both panes.
    assert result.identical is False and result.divergence_index == DIVERGE_AT
    assert "near-tie: target p=0.41 vs 0.40" in result.reason and "token 7" in view.result_label.text()
    std_view, spec_view = view.panes["standard"].view, view.panes["speculative"].view
    start, end = std_view.highlighted_span()
    assert start == len("".join(TEXTS[:DIVERGE_AT])) and std_view.toPlainText()[start:end] == TEXTS[DIVERGE_AT]
    s_start, s_end = spec_view.highlighted_span()
    assert spec_view.toPlainText()[s_start:s_end] == TEXTS[DIVERGE_AT]
    token = spec_view.token_at(s_start)
    assert token.token_id == 555 and token.status != "rejected"
    assert spec_view.extraSelections()[0].cursor.selectionStart() == s_start
    assert "first divergence: near-tie" in spec_view.tooltip_at(s_start)
    # The mark survives a display toggle (ghosts hidden shifts every later position).
    spec_view.set_show_rejected(False)
    s_start, s_end = spec_view.highlighted_span()
    assert spec_view.toPlainText()[s_start:s_end] == TEXTS[DIVERGE_AT]
    assert spec_view.extraSelections()[0].cursor.selectionStart() == s_start

    # Replay: a shared timeline; half-way through (1.25 s) the speculative run is done and standard is not.
    assert view.replay_button.isEnabled()
    view.replay()
    assert view.is_replaying() and std_view.highlighted_span() is None
    view._replay_timer.stop()  # drive the timeline by hand
    view.replay_to(1.25)
    assert spec_view.committed_text() == "".join(TEXTS)
    assert std_view.committed_text() == "".join(TEXTS[:7])  # its Steps: 2 s over 12 tokens
    with qtbot.waitSignal(view.replay_finished, timeout=1000):
        view.replay_to(10.0)
    assert std_view.committed_text() == "".join(TEXTS) and std_view.highlighted_span() == (start, end)


def test_repeats_alternate_order_and_give_median_and_spread(race_setup, qtbot):
    # Speculative seconds chosen so the speedups are 2, 2.5, 1.6, 2, 4 (12 tokens each).
    engine = RaceEngine(standard_steps(), speculative_steps(STD_IDS), standard_seconds=(2.0,),
                        speculative_seconds=(1.0, 0.8, 1.25, 1.0, 0.5))
    controller, view = race_setup(engine)
    summary = run_race(qtbot, controller, view, "Count to twelve.", repeats=5)

    assert [r.mode for r in engine.requests] == ["standard", "speculative", "speculative", "standard",
                                                 "standard", "speculative", "speculative", "standard",
                                                 "standard", "speculative"]
    assert [r.speedup for r in controller.results] == pytest.approx([2.0, 2.5, 1.6, 2.0, 4.0])
    assert all(r.identical for r in controller.results)
    s = summary.speedup
    assert (s.n, s.median, s.minimum, s.maximum, s.iqr) == pytest.approx((5, 2.0, 1.6, 4.0, 0.5))
    assert summary.prompt_id == "custom"
    text = view.repeats_label.text()
    assert "median speedup 2.00×" in text and "1.60×–4.00×" in text and "IQR 0.50×" in text
    row = view.table_rows()[0]
    assert row[2] == "5" and row[5] == "2.00×" and row[6] == "1.60–4.00× · IQR 0.50" and row[9] == "yes"
    assert "outputs identical" in view.result_label.text()
    assert not controller.running and view.race_button.isEnabled()


def test_table_groups_races_by_category(race_setup, qtbot):
    engine = RaceEngine(standard_steps(), speculative_steps(STD_IDS))
    controller, view = race_setup(engine)
    for pid in ("p16", "p00", "p12", "p01"):  # short, code, chat, code
        view.select_prompt(pid)
        run_race(qtbot, controller, view, view.prompt_text())
    assert [r[:2] for r in view.table_rows()] == [["Code", "p00"], ["Code", "p01"], ["Chat", "p12"],
                                                  ["Short answers", "p16"]]


def test_export_round_trips_and_an_unwritable_path_keeps_results(race_setup, qtbot, tmp_path):
    engine = RaceEngine(standard_steps(), speculative_steps(SPEC_IDS, ps=SPEC_P),
                        speculative_seconds=(1.0, 0.9))
    controller, view = race_setup(engine)
    view.select_prompt("p05")
    run_race(qtbot, controller, view, view.prompt_text(), repeats=2)
    results = list(controller.results)
    assert len(results) == 2

    bad = tmp_path / "missing-folder" / "race.csv"
    assert not controller.export_csv(str(bad))
    assert view.error_label.isVisibleTo(view) and "Could not write" in view.error_label.text()
    assert controller.results == results and not bad.exists()

    path = tmp_path / "race.csv"
    assert controller.export_csv(str(path))
    rows = read_race_csv(path)
    assert rows == race_rows(results)
    assert len(rows) == 4
    header = path.read_text(encoding="utf-8-sig").splitlines()[0].split(",")
    assert tuple(header) == RACE_COLUMNS
    first = rows[0]
    assert (first.race_id, first.repeat, first.prompt_id, first.category, first.mode) == (1, 0, "p05", "longform_zh",
                                                                                          "standard")
    assert first.identical is False and first.first_divergence == DIVERGE_AT
    assert first.k == 4 and first.temperature == 0.0 and first.seed == 7
    spec = next(r for r in rows if r.mode == "speculative" and r.repeat == 1)
    assert spec.seconds == 0.9 and spec.tokens_per_s == 12 / 0.9
    assert spec.speedup == results[1].speedup and spec.acceptance_rate == results[1].speculative.acceptance_rate
    assert (spec.target_forwards, spec.draft_forwards, spec.new_tokens) == (4, 12, 12)


def test_csv_writes_empty_cells_for_sampled_races(tmp_path):
    std, spec = standard_steps(), speculative_steps(STD_IDS)
    r = race_result(race_id=3, repeat=0, prompt=BenchPrompt("p12", "chat", "x"), k=5, temperature=0.8, seed=1,
                    standard=(std, summary_of(std, "standard", 2)), speculative=(spec, summary_of(spec, "speculative", 1)))
    path = tmp_path / "sampled.csv"
    assert write_race_csv(path, [r]) == 2
    rows = read_race_csv(path)
    assert rows == race_rows([r]) and rows[0].identical is None and rows[0].first_divergence is None
    assert summarize_race([r]).identical is None


def test_csv_neutralises_formula_text_and_reads_it_back(tmp_path):
    std, spec = standard_steps(), speculative_steps(STD_IDS)
    r = race_result(race_id=4, repeat=0, prompt=BenchPrompt("=1+1", "@cmd", "x"), k=5, temperature=0.0, seed=1,
                    standard=(std, summary_of(std, "standard", 2)), speculative=(spec, summary_of(spec, "speculative", 1)))
    path = tmp_path / "hostile.csv"
    write_race_csv(path, [r])
    raw = path.read_text(encoding="utf-8-sig")
    assert ",=1+1," not in raw and ",@cmd," not in raw and ",'=1+1,'@cmd," in raw
    rows = read_race_csv(path)
    assert rows == race_rows([r]) and rows[0].prompt_id == "=1+1" and rows[0].category == "@cmd"


def test_stop_ends_the_race_and_keeps_finished_repeats(race_setup, qtbot):
    engine = RaceEngine(standard_steps(), speculative_steps(STD_IDS), delay_s=0.02)
    controller, view = race_setup(engine)
    view.set_prompt_text("Stop me.")
    view.set_repeats(3)
    with qtbot.waitSignal(controller.result_ready, timeout=10000):
        view.race_button.click()
    assert controller.running and view.stop_button.isEnabled() and not view.race_button.isEnabled()
    with qtbot.waitSignal(controller.race_finished, timeout=10000) as blocker:
        view.stop_button.click()
    summary = blocker.args[0]
    assert summary is not None and summary.speedup.n == 1  # the finished repeat counts; the stopped one not
    assert len(controller.results) == 1 and not controller.running
    assert view.race_button.isEnabled() and not view.stop_button.isEnabled()
    assert "Stopped" in view.status_label.text()


def test_a_failed_run_is_reported_and_ends_the_race(race_setup, qtbot):
    class Failing(RaceEngine):
        def generate(self, request, cancel, progress=None):
            if request.mode == "speculative":
                from engine.errors import GenerationError
                raise GenerationError("Speculative decoding with a draft model needs a draft; load one first.")
            return super().generate(request, cancel)

    controller, view = race_setup(Failing(standard_steps(), speculative_steps(STD_IDS)))
    summary = run_race(qtbot, controller, view, "Hello")
    assert summary is None and not controller.results
    assert "speculative run failed" in view.error_label.text() and "needs a draft" in view.error_label.text()
    assert view.race_button.isEnabled()


def test_the_controller_ignores_request_ids_it_did_not_issue(race_setup, qtbot):
    engine = RaceEngine(standard_steps(), speculative_steps(STD_IDS))
    controller, view = race_setup(engine)
    # Someone else's (the chat's) signals on the same worker must not touch the race view.
    controller.worker.steps.emit(9999, tuple(standard_steps()[:3]))
    controller.worker.generation_finished.emit(9999, summary_of(standard_steps(), "standard", 1.0))
    qtbot.wait(50)
    assert view.panes["standard"].view.committed_text() == "" and not controller.results


def test_picker_groups_prompts_by_category(qtbot):
    view = RaceView(load_bench_prompts())
    qtbot.addWidget(view)
    labels = [view.picker.itemText(i) for i in range(view.picker.count())]
    assert labels[0].startswith("Custom")
    assert labels[1] == "Code" and labels[2].strip().startswith("p00 ·")
    assert labels.index("Long-form Chinese") < labels.index("Long-form English") < labels.index("Chat")
    header = view.picker.model().item(1)
    assert not header.isEnabled() and not header.isSelectable()
    assert view.select_prompt("p18") and view.prompt_text() == "一年有多少个小时？"
    view.set_prompt_text(view.prompt_text() + " 请解释。")  # edited: a custom prompt now
    assert view.picker.currentIndex() == 0
    view.race_requested.connect(lambda *_: pytest.fail("an empty prompt must not race"))
    view.set_prompt_text("   ")
    view.race_button.click()
    assert "Type a prompt" in view.error_label.text()
    view.set_race_enabled(False, "Models are loading")
    assert not view.race_button.isEnabled() and view.race_button.toolTip() == "Models are loading"
    view.set_race_enabled(True)
    assert view.race_button.isEnabled()


@pytest.fixture
def raced_window(qtbot, tmp_path):
    """The real main window with models loaded from a scripted race engine; no thread left after."""
    from app.ui.settings import AppSettings
    from app.ui.window import MainWindow
    from engine.settings import ModelSelection

    engine = RaceEngine(standard_steps(), speculative_steps(SPEC_IDS, ps=SPEC_P))
    w = MainWindow(engine_factory=lambda _req, _progress: engine, settings=AppSettings(tmp_path / "s.ini"))
    qtbot.addWidget(w)
    with qtbot.waitSignal(w.models_loaded, timeout=5000):
        w.load_models(ModelSelection())
    yield w, engine
    w.close()
    assert not running_threads()


def test_a_race_in_auto_mode_chooses_k_per_step(race_setup, qtbot):
    controller, view = race_setup(RaceEngine(standard_steps(), speculative_steps(STD_IDS)), GenerationSettings())
    run_race(qtbot, controller, view, "Race me")
    engine_requests = controller.worker.engine.requests
    assert [(r.mode, r.k) for r in engine_requests] == [("standard", K_AUTO), ("speculative", K_AUTO)]


def test_race_and_chat_share_the_main_windows_worker(qtbot, raced_window):
    """Ids from the window's counter, settings from its panel; each side ignores the other's ids."""
    w, engine = raced_window
    run_race(qtbot, w.race, w.race_view, "Race me")
    assert len(w.race.results) == 1 and w.race.results[0].divergence_index == DIVERGE_AT
    assert not w.records and w.active_request is None  # the chat ignored the race's ids
    assert engine.requests[0].max_new_tokens == w.panel.values().max_new_tokens
    assert engine.requests[0].messages[0] == Message("system", w.panel.values().system_prompt)

    with qtbot.waitSignal(w.answer_finished, timeout=5000):
        w.send("And now a chat")
    assert len(w.records) == 1 and len(w.race.results) == 1  # and the race ignored the chat's
    assert w.records[0].request.request_id not in {r.request_id for r in engine.requests[:2]}


def test_the_session_csv_has_the_question_and_a_row_per_race_run(qtbot, raced_window, tmp_path):
    import csv

    from app.core.export import ENCODING

    w, _engine = raced_window
    run_race(qtbot, w.race, w.race_view, "=Race me")  # a formula-looking prompt stays text in the CSV
    with qtbot.waitSignal(w.answer_finished, timeout=5000):
        w.send("And now a chat")
    path = tmp_path / "session.csv"
    assert w.export_session(str(path))
    with open(path, encoding=ENCODING, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["kind"] for r in rows] == ["chat", "race standard", "race speculative"]
    assert rows[0]["question"] == "And now a chat"
    assert [r["question"] for r in rows[1:]] == ["'=Race me"] * 2 and rows[1]["prompt_id"] == "custom"
    result = w.race.results[0]
    for row, summary in zip(rows[1:], (result.standard, result.speculative)):
        assert row["target_model"] == w.info.target_name and row["new_tokens"] == str(summary.new_tokens)
        assert float(row["tokens_per_s"]) == summary.tokens_per_s and row["timestamp"]


def test_the_main_windows_race_tab_blocks_chat_while_racing(qtbot, raced_window):
    w, _engine = raced_window
    assert w.tabs.tabText(1).startswith("Race")
    w.show_tab(w.race_view)
    w.race_view.set_prompt_text("Race me")
    with qtbot.waitSignal(w.race.race_finished, timeout=10000):
        w.race_view.race_button.click()
        assert w.send("chat while racing") is None  # one generation at a time on the worker
    assert len(w.race.results) == 1 and not w.records
