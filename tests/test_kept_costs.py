"""Forward costs kept between starts (engine/decoding/kept_costs.py) and believed only when they hold
(engine/decoding/cost_check.py): keyed per machine, pair, runtime and threads; damaged files ignored;
a start with kept costs measures nothing before Ready; disturbed measurements are repeated."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import replace

import pytest

from engine.decoding import cost_check, costs
from engine.decoding.kept_costs import COSTS_FORMAT, KeptCosts, cost_key, costs_path, forget, keep, key_digest, read_kept
from engine.errors import CostsInterrupted
from engine.limits import K_MAX
from engine.types import ProposerCost

WIDTHS = range(1, K_MAX + 2)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))


def figures(forward: float = 40.0, draft: float = 24.0) -> KeptCosts:
    return KeptCosts(tuple((w, forward * (1 + 0.8 * (w - 1))) for w in WIDTHS),
                     (ProposerCost("draft", draft, 1.0), ProposerCost("ngram", 0.02, 0.01)),
                     (ProposerCost("draft", draft * 1.1, 1.0), ProposerCost("ngram", 0.03, 0.01)), (), 1.7e9)


KEY = {"format": COSTS_FORMAT, "machine": {"cpu": "test CPU", "cores": 2}, "runtime": "llamacpp", "threads": 2,
       "target": "111:aa", "draft": "222:bb", "dtype": "Q4_K_M"}


# --------------------------------------------------------------------------- the file

def test_kept_costs_round_trip_and_another_pair_runtime_or_thread_count_misses():
    assert keep(KEY, figures())
    assert read_kept(KEY) == figures()
    for change in ({"threads": 1}, {"runtime": "torch"}, {"target": "111:ab"}, {"machine": {"cpu": "other", "cores": 2}}):
        assert read_kept({**KEY, **change}) is None, change
    other = {**KEY, "threads": 1}
    keep(other, figures(50.0))  # both kept side by side
    assert read_kept(KEY) == figures() and read_kept(other) == figures(50.0)
    forget(KEY)
    assert read_kept(KEY) is None and read_kept(other) == figures(50.0)


def test_the_key_names_the_machine_the_models_by_content_the_runtime_and_threads(tiny_pair, tmp_path):
    from tests.engine_fixtures import tiny_engine
    from tests.tiny import save_pair

    engine = tiny_engine(*tiny_pair)
    key = cost_key(engine)
    assert key["machine"]["cpu"] and key["runtime"] == "torch" and key["threads"] >= 1
    assert key == cost_key(engine)  # stable
    engine.info = replace(engine.info, threads=7)
    assert cost_key(engine)["threads"] == 7
    other = tiny_engine(*save_pair(tmp_path / "other", noise=0.02, seed=5))
    assert cost_key(other)["target"] != key["target"] and cost_key(other)["draft"] != key["draft"]
    copy = tmp_path / "copy"  # the same files elsewhere: the same content, the same key
    copy.mkdir()
    for f in tiny_pair[0].iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert cost_key(tiny_engine(copy, tiny_pair[1]))["target"] == key["target"]


@pytest.mark.parametrize("content", [
    b"\x00\xff not json", b"[1, 2, 3]", b'{"format": 99, "entries": {}}', b'{"format": 1, "entries": []}',
    b"{" * 100000,  # deep nesting
])
def test_a_damaged_or_foreign_costs_file_is_ignored_with_one_line_and_rewritten(content, caplog):
    path = costs_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING):
        assert read_kept(KEY) is None
    assert len([r for r in caplog.records if "costs" in r.getMessage()]) == 1
    assert keep(KEY, figures()) and read_kept(KEY) == figures()  # measured again and kept


@pytest.mark.parametrize("harm", [
    lambda c: c["target_ms"].pop("3"),  # a width missing
    lambda c: c["target_ms"].update({"1": -4.0}),  # a negative time
    lambda c: c["target_ms"].update({"2": float("nan")}),  # NaN (json writes it, json reads it)
    lambda c: c["target_ms"].update({"99": 1.0}),  # a width the loop never uses
    lambda c: c["proposers"].update({"evil": [1.0, 0.0]}),  # a proposer that does not exist
    lambda c: c["proposers"].update({"draft": "fast"}),
    lambda c: c.update({"target_ms": "40"}),
])
def test_a_damaged_entry_is_ignored(harm, caplog):
    keep(KEY, figures())
    data = json.loads(costs_path().read_text())
    harm(data["entries"][key_digest(KEY)]["costs"])
    costs_path().write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING):
        assert read_kept(KEY) is None
    assert len(caplog.records) == 1


def test_an_entry_filed_under_another_key_is_not_believed():
    keep(KEY, figures())
    data = json.loads(costs_path().read_text())
    entry = data["entries"][key_digest(KEY)]
    other = {**KEY, "threads": 1}
    data["entries"][key_digest(other)] = entry  # copied under the other key's name: its key says otherwise
    costs_path().write_text(json.dumps(data))
    assert read_kept(other) is None


def test_a_link_or_a_huge_file_is_not_read(tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"format": 1, "entries": {}}))
    costs_path().parent.mkdir(parents=True)
    os.symlink(secret, costs_path())
    assert read_kept(KEY) is None
    assert keep(KEY, figures())  # replaces the link itself, never what it points at
    assert not costs_path().is_symlink() and secret.read_text() == json.dumps({"format": 1, "entries": {}})
    costs_path().write_bytes(b" " * (2 << 20))
    assert read_kept(KEY) is None


def test_cache_clean_removes_the_kept_costs_and_nothing_else(tmp_path):
    from engine.models import cache_space

    keep(KEY, figures())
    root = costs_path().parent
    assert cache_space.foreign(root) == []  # ours, even in a cache from before the tag
    cache_space.claim(root)
    mine = root / "notes.txt"
    mine.write_text("mine")
    dead = root / f".{costs_path().name}.999999999.part"
    dead.write_text("{")
    os.utime(dead, (1, 1))
    kinds = {i.path.name: i.kind for i in cache_space.cache_items()}
    assert kinds[costs_path().name] == "costs" and kinds[dead.name] == "leftover" and mine.name not in kinds
    cache_space.clean()
    assert not costs_path().exists() and not dead.exists() and mine.read_text() == "mine"


# --------------------------------------------------------------------------- at load and after Ready

def _count_measurements(monkeypatch) -> dict[str, int]:
    calls = {"rounds": 0, "proposer": 0}
    rounds, proposer = costs.measure_rounds, costs.measure_proposer

    def counted_rounds(*args, **kwargs):
        calls["rounds"] += 1
        return rounds(*args, **kwargs)

    def counted_proposer(*args, **kwargs):
        calls["proposer"] += 1
        return proposer(*args, **kwargs)

    monkeypatch.setattr(costs, "measure_rounds", counted_rounds)
    monkeypatch.setattr(costs, "measure_proposer", counted_proposer)
    return calls


def test_a_second_start_with_kept_costs_measures_nothing_before_ready(tiny_pair, monkeypatch):
    from engine.assemble import build_engine
    from engine.loadspec import LoadSpec

    # Tiny models take ~1 ms a forward and the draft is the target's size: judge nothing here.
    monkeypatch.setattr(cost_check, "SPREAD", 1e9)
    monkeypatch.setattr(cost_check, "DRAFT_PLAUSIBLE", 1e9)
    monkeypatch.setattr(cost_check, "FAR", 1e9)
    calls = _count_measurements(monkeypatch)
    spec = LoadSpec(target=str(tiny_pair[0]), draft=str(tiny_pair[1]), runtime="torch", device="cpu",
                    dtype="float32", head=None, keep_costs=True)
    first = build_engine(spec)
    assert calls["rounds"] > 0 and calls["proposer"] > 0 and first.info.costs_state == "measuring"
    assert not costs_path().exists()  # one pass before Ready: the other two follow, then all three are kept
    first.refresh_costs()
    assert first.info.costs_state == "measuring"
    assert first.refresh_costs() and first.info.costs_state == "measured" and first.cost_check.done
    assert len(first.cost_passes) == 1 and costs_path().is_file()
    calls.update(rounds=0, proposer=0)
    second = build_engine(spec)
    assert calls == {"rounds": 0, "proposer": 0}  # Ready without one timed round
    assert second.info.costs_state == "kept"
    assert second.info.target_ms == first.info.target_ms
    assert second.info.proposer_costs == first.info.proposer_costs
    assert second.cost_check is not None and not second.cost_check.done  # checked again after Ready
    for _ in range(cost_check.ROUNDS):
        second.refresh_costs()
    assert calls["rounds"] > 0 and second.cost_check.done and second.info.costs_state == "measured"
    # Without keep_costs (the CLI, benchmarks) every start measures.
    calls.update(rounds=0, proposer=0)
    third = build_engine(replace(spec, keep_costs=False))
    assert calls["rounds"] > 0 and third.info.costs_state == "measured" and len(third.cost_passes) == 3


def test_on_llama_cpp_the_gguf_files_and_the_thread_count_are_the_key(tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp")
    from engine.assemble import build_engine
    from engine.loadspec import LoadSpec
    from tests.tiny_gguf import save_gguf_pair

    monkeypatch.setattr(cost_check, "SPREAD", 1e9)
    monkeypatch.setattr(cost_check, "DRAFT_PLAUSIBLE", 1e9)
    target, draft, _, _ = save_gguf_pair(tmp_path / "gguf", noise=0.02, seed=0)
    calls = _count_measurements(monkeypatch)
    spec = LoadSpec(str(target), str(draft), runtime="llamacpp", threads=1, keep_costs=True)
    first = build_engine(spec)
    while not first.cost_check.done:
        first.refresh_costs()
    assert calls["rounds"] > 0 and first.info.costs_state == "measured"
    assert cost_key(first)["target"].startswith(f"{target.stat().st_size}:")
    calls.update(rounds=0, proposer=0)
    assert build_engine(spec).info.costs_state == "kept" and calls == {"rounds": 0, "proposer": 0}
    two = build_engine(replace(spec, threads=2))  # another thread count: measured again
    assert calls["rounds"] > 0 and two.info.costs_state == "measuring"


def _scripted(monkeypatch, passes: list[tuple[float, float]]):
    """measure_pass returns (1-token forward ms, draft ms per token) from the list, in order."""
    queue = list(passes)

    def measure_pass(engine, interrupted=None):
        forward, draft = queue.pop(0)
        f = figures(forward, draft)
        return dict(f.target_ms), {c.source: c for c in f.proposer_costs}, {c.source: c for c in f.sampled_costs}

    monkeypatch.setattr(costs, "measure_pass", measure_pass)
    monkeypatch.setattr(cost_check, "measure_pass", measure_pass)
    return queue


@pytest.fixture
def engine(tiny_pair):
    from tests.engine_fixtures import tiny_engine

    return tiny_engine(*tiny_pair)


def test_a_disturbed_measurement_at_load_gives_no_verdict_and_is_measured_again(engine, monkeypatch):
    from app.core.session import cost_verdict

    # One pass under a neighbour's burst: the passes disagree.
    queue = _scripted(monkeypatch, [(40, 24), (95, 60), (41, 24), (40, 24), (41, 25), (40, 24)])
    engine.settle_costs(keep_costs=True)  # one pass before Ready
    assert engine.info.costs_state == "measuring" and cost_verdict(engine.info, None)[0] == "draft cost: measuring"
    engine.refresh_costs()
    engine.refresh_costs()
    assert engine.info.costs_state == "disturbed" and "spread" in engine.info.costs_note
    assert read_kept(cost_key(engine)) is None  # not kept
    short, full = cost_verdict(engine.info, None)
    assert short == "draft cost: measuring again" and "no verdict" in full
    while queue:
        engine.refresh_costs()
    assert engine.info.costs_state == "measured" and engine.cost_check.done
    assert engine.info.draft_ms == 24 and dict(engine.info.target_ms)[1] == 40
    assert read_kept(cost_key(engine)).target_ms == figures(40, 24).target_ms
    assert "of a forward" in cost_verdict(engine.info, None)[0]  # a verdict again, e.g. "The draft costs 60% of a forward"


def test_a_draft_dearer_than_the_target_is_measured_again_before_it_is_believed(engine, monkeypatch):
    # 259% of a target forward (measured beside a competing process), consistent in its passes.
    queue = _scripted(monkeypatch, [(40, 104), (41, 106), (40, 104), (40, 24), (40, 24), (41, 24)])
    engine.settle_costs(keep_costs=False)  # all three passes before Ready, as the CLI measures
    assert engine.info.costs_state == "disturbed" and "260%" in engine.info.costs_note
    engine.cost_check.key = cost_key(engine)  # kept once settled
    while queue:
        engine.refresh_costs()
    assert engine.info.costs_state == "measured" and engine.info.draft_ms == 24


def test_a_draft_that_stays_dear_is_believed_once_a_second_measurement_confirms_it(engine, monkeypatch):
    queue = _scripted(monkeypatch, [(40, 60), (40, 60), (40, 61)] * 2)
    engine.settle_costs(keep_costs=True)
    engine.refresh_costs()
    engine.refresh_costs()
    assert engine.info.costs_state == "disturbed"
    while queue:
        engine.refresh_costs()
    assert engine.info.costs_state == "measured" and engine.info.draft_ms == 60


def test_kept_costs_are_replaced_only_by_consistent_figures_near_them(engine, monkeypatch):
    key = cost_key(engine)
    keep(key, figures(40, 24))
    # After Ready: a noisy measurement, then one far from the kept figures: both repeated, not believed.
    queue = _scripted(monkeypatch, [(40, 24), (80, 24), (41, 24), (80, 48), (81, 48), (80, 49)])
    engine.settle_costs(keep_costs=True)
    assert engine.info.costs_state == "kept"
    while queue:
        assert not engine.refresh_costs()
    assert dict(engine.info.target_ms)[1] == 40 and read_kept(key).target_ms == figures(40, 24).target_ms
    assert not engine.cost_check.done
    # A second far measurement that agrees with the first: the machine changed, the new figures stay.
    _scripted(monkeypatch, [(80, 48), (80, 48), (81, 48)])
    for _ in range(cost_check.ROUNDS):
        engine.refresh_costs()
    assert engine.info.costs_state == "measured" and dict(engine.info.target_ms)[1] == 80
    assert dict(read_kept(key).target_ms)[1] == 80


def test_figures_that_never_settle_are_left_unsteady(engine, monkeypatch):
    from app.core.session import cost_verdict

    noisy = [(40, 24), (90, 24), (40, 24)]
    queue = _scripted(monkeypatch, noisy * cost_check.ATTEMPTS)
    engine.settle_costs(keep_costs=True)
    while queue:
        engine.refresh_costs()
    assert engine.cost_check.done and engine.info.costs_state == "unsteady"
    assert not engine.refresh_costs()
    assert cost_verdict(engine.info, None)[0] == "draft cost: unsteady"
    # The median of every pass is kept as unsteady: the next start is Ready at once, with no verdict,
    # and a consistent measurement after Ready replaces them.
    kept = read_kept(cost_key(engine))
    assert kept is not None and not kept.steady and dict(kept.target_ms)[1] == 40
    queue = _scripted(monkeypatch, [(50, 30), (50, 30), (51, 30)])
    engine.settle_costs(keep_costs=True)
    assert engine.info.costs_state == "disturbed" and "never held together" in engine.info.costs_note
    assert cost_verdict(engine.info, None)[0] == "draft cost: measuring again" and len(queue) == 3  # none measured
    while queue:
        engine.refresh_costs()
    assert engine.info.costs_state == "measured" and read_kept(cost_key(engine)).steady
    assert dict(read_kept(cost_key(engine)).target_ms)[1] == 50


def test_an_interrupted_pass_is_dropped_and_leaves_the_caches_as_they_were(engine):
    from engine.types import GenerationRequest, Message

    request = GenerationRequest(messages=(Message("user", "Hello there"),), mode="standard", max_new_tokens=12)
    before = list(engine.generate(request))
    engine.settle_costs(keep_costs=False)
    engine.cost_check = cost_check.CostCheck(None, costs.pooled(engine.cost_passes), kept=False)
    asked = iter([False, False, False, True])
    length = engine.target_runner.length
    with pytest.raises(CostsInterrupted):
        engine.refresh_costs(lambda: next(asked, True))
    assert engine.cost_check.passes == [] and engine.target_runner.length == length
    after = list(engine.generate(request))
    assert [s.text for s in after] == [s.text for s in before]  # greedy output unchanged
