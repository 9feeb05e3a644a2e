"""The draft check's counts per probe and the ranges it reports: how much its prediction depends on the text read."""
from __future__ import annotations

import csv
from dataclasses import replace

from engine.limits import K_MAX
from engine.measure.check_price import price_ngram
import numpy as np

from engine.measure.check_tally import MIN_PROBES, Stacked, Tally, merged, spread
from engine.measure.check_types import CandidateCheck, CheckReport
from engine.types import ModelInfo, Sampling

GREEDY = Sampling(temperature=0.0)
INFO = ModelInfo(target_name="t", draft_name=None, device="cpu", dtype="bf16", fast_path="eager", vocab_size=100,
                 target_ms=tuple((w, 10.0 + 0.5 * w) for w in range(1, K_MAX + 2)))


def _probe(hits: list[float]) -> Tally:
    """A probe whose drafter proposes one token at every row, accepted where hits says."""
    t = Tally.empty(K_MAX)
    t.add_offers([[h] for h in hits], [[h] for h in hits])
    t.top1_sum, t.rows = sum(hits), len(hits)
    return t


def _price(t: Tally) -> CandidateCheck:
    return price_ngram(INFO, t.summary(), GREEDY, "test")


def test_merged_probes_count_what_one_tally_of_everything_counts():
    a, b = [1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0]
    together = Tally.empty(K_MAX)
    for hits in (a, b):
        together.add_offers([[h] for h in hits], [[h] for h in hits])
    both = merged([_probe(a), _probe(b)], K_MAX)
    assert both.greedy == together.greedy and both.sampled == together.sampled
    assert both.rows == 7 and both.top1_sum == 4.0 and both.summary()["top1"] == 4 / 7
    trees = [replace(_probe(a), rejected=[1.0, 2.0], rescued=[0.0, 1.0], round_ms=9.0, rounds_timed=3),
             replace(_probe(b), rejected=[3.0], round_ms=2.0, rounds_timed=2)]
    assert merged(trees, K_MAX).rejected == [4.0, 2.0] and merged(trees, K_MAX).rescued == [0.0, 1.0]
    # A resample's tally comes from stacked counts: counting each probe once is merged(), twice doubles it.
    once, twice = Stacked(trees, K_MAX).tallies(np.array([[1.0, 1.0], [2.0, 0.0]]))
    assert once == merged(trees, K_MAX)
    assert twice.greedy == merged([trees[0], trees[0]], K_MAX).greedy and twice.rejected == [2.0, 4.0]
    # ... the head's rounds' wall time too, or a resample would price no host work beside the forwards
    assert (twice.round_ms, twice.rounds_timed) == (18.0, 6) and once.summary()["round_ms"] == 11.0 / 5
    assert Stacked([_probe(a)], K_MAX).tallies(np.ones((1, 1)))[0].rejected is None  # chains keep no rejections


def test_probes_that_agree_give_a_point_and_probes_that_differ_a_range_around_the_prediction():
    same = [_probe([1.0, 0.0] * 10) for _ in range(8)]
    checked = spread(_price(merged(same, K_MAX)), same, _price)
    first = checked.sampled_positions[0]
    assert checked.first_range == (first, first) and checked.speedup_range == (checked.speedup, checked.speedup)
    # n-gram lookup on text that repeats (every proposal accepted) beside text that does not (none accepted)
    mixed = [_probe([1.0] * 20) for _ in range(4)] + [_probe([0.0] * 20) for _ in range(4)]
    checked = spread(_price(merged(mixed, K_MAX)), mixed, _price)
    low, high = checked.first_range
    first = checked.sampled_positions[0]
    assert 0.0 < first < 1.0 and low < first - 0.1 and high > first + 0.1
    assert checked.speedup_range[0] < checked.speedup < checked.speedup_range[1]
    assert spread(_price(merged(mixed, K_MAX)), mixed, _price) == checked  # the same counts, the same ranges
    few = mixed[:MIN_PROBES - 1]
    assert spread(_price(merged(few, K_MAX)), few, _price).speedup_range is None  # too few probes to say


def _report(ranged: CandidateCheck) -> CheckReport:
    return CheckReport("t", "llamacpp", "cpu", 0.0, 1.0, 0, 20, 800, 110.0, (ranged,), "n-gram: 1.04× here (K=1)", 100.0)


def test_the_ranges_reach_the_table_the_csv_and_the_dialog(tmp_path, qtbot):
    from app.cli.check import format_report, write_csv
    from widgets.check_view import CheckView

    c = CandidateCheck("n-gram lookup", "ngram", "ok", greedy_positions=(0.31,), sampled_positions=(0.31,), best_k=1,
                       speedup=1.04, speedups=(1.04,), first_range=(0.22, 0.41), speedup_range=(0.95, 1.12),
                       positions_from="its own proposals")
    text = format_report(_report(c))
    assert "90% range" in text and " 1.04×  0.95-1.12" in text
    write_csv(tmp_path / "c.csv", _report(c))
    (row,) = csv.DictReader(open(tmp_path / "c.csv", encoding="utf-8"))
    assert row["speedup_range"] == "0.9500 1.1200" and row["first_range"] == "0.2200 0.4100"
    view = CheckView()
    qtbot.addWidget(view)
    view.set_report(_report(c))
    assert view.table.item(0, 7).text() == "1.04× (0.95–1.12)"
    assert "0.95–1.12×" in view.table.item(0, 7).toolTip() and "0.22–0.41" in view.table.item(0, 4).toolTip()
    assert view._ranges is not None  # a whisker over the bar
    view.set_report(_report(replace(c, speedup_range=None, first_range=None)))
    assert view.table.item(0, 7).text() == "1.04×" and view._ranges is None


def test_a_tree_walk_that_ends_on_a_childless_branch_counts_as_reached_not_accepted():
    """The product of the head's per-position rates is what a round keeps, trees' short branches included."""
    from types import SimpleNamespace

    import torch

    from engine.measure.check import HEAD_K, _head
    from engine.measure.costmodel import expected_tokens

    ms = dict(draft_ms=1.0, verify_ms=3.0, overhead_ms=0.5)
    rounds_ = [SimpleNamespace(total_tokens=2, new_tokens=2, proposed=(7,), accepted=1, tree_depth=8, extra=None, **ms),
               SimpleNamespace(total_tokens=5, new_tokens=3, proposed=(7, 8, 9), accepted=2, tree_depth=8, extra=None,
                               **ms),
               SimpleNamespace(total_tokens=6, new_tokens=1, proposed=(), accepted=0, tree_depth=0, extra=None,
                               draft_ms=0.0, verify_ms=2.0, overhead_ms=0.1)]
    tally = Tally.empty(HEAD_K)
    _head(rounds_, torch.zeros(12, 16), list(range(12)), GREEDY, tally)
    assert tally.summary()["round_ms"] == 4.5, "the drafting rounds' wall time, host work included"
    per_position = tally.greedy[HEAD_K].per_position
    assert per_position == (1.0, 0.5, 0.0)  # the first round's walk ended at its branch's end, after one token
    assert expected_tokens(per_position, HEAD_K) == (2 + 3) / 2  # tokens a drafting round kept, on average


def test_a_sampled_tree_position_is_priced_with_every_token_drafted_there():
    """Sampling through a tree keeps one of a node's children with the sum of their p (verify.tree_choices): the
    check prices a walked round's position with every token drafted under the path there, a chain's with its one."""
    from types import SimpleNamespace

    import torch

    from engine.measure.check import HEAD_K, _head

    rows = torch.full((4, 16), -30.0)
    rows[0, 7], rows[0, 5], rows[0, 3] = torch.tensor([0.5, 0.3, 0.2]).log()  # the law before the first token
    rows[1, 2] = 0.0  # certain

    def one_round(children: tuple) -> tuple[float, ...]:
        step = SimpleNamespace(total_tokens=3, new_tokens=3, proposed=(7, 2), accepted=2, tree_depth=8, extra=None,
                               tree_children=children, draft_ms=1.0, verify_ms=3.0, overhead_ms=0.5)
        tally = Tally.empty(HEAD_K)
        _head([step], rows, [7, 2, 9, 9], Sampling(temperature=1.0), tally)
        return tuple(round(x, 4) for x in tally.sampled[HEAD_K].per_position)

    assert one_round(((7, 5), (2, 11))) == (0.8, 1.0, 0.0)  # 7 or 5 kept: 0.5 + 0.3
    assert one_round(()) == (0.5, 1.0, 0.0)  # a chain: its own token only


def test_the_benchs_summary_counts_a_branchs_end_as_the_check_does():
    """Measured and predicted acceptance by position are the same quantity for dynamic trees: the summary of
    the rounds above gives the check's rates, not 1.0 at the position where a walk found no child."""
    from dataclasses import replace

    from types import SimpleNamespace

    from engine.measure.experiment import BenchPrompt, position_acceptance, record_run
    from engine.measure.stats import summarize
    from engine.types import Step, TokenView

    token = TokenView(token_id=1, text="x", status="accepted", step=0, draft_pos=0, q=1.0, p=1.0, accept_prob=1.0)

    def round_(index: int, proposed: int, accepted: int, depth: int) -> Step:
        return Step(index=index, mode="speculative", proposed=(7,) * proposed, proposed_q=(1.0,) * proposed,
                    proposed_p=(1.0,) * proposed, sources=("head",) * proposed, accepted=accepted, added=2,
                    added_status="corrected", tokens=(token,), text="x", new_tokens=accepted + 1, total_tokens=0,
                    draft_ms=1.0, verify_ms=1.0, elapsed_s=0.1, tree_width=16 if depth else 0, tree_depth=depth)

    steps = [round_(0, 1, 1, 8), round_(1, 3, 2, 8)]
    summary = summarize(steps, mode="speculative", k=3, prompt_tokens=3, seconds=1.0, stop_reason="eos")
    assert summary.per_position_acceptance[:3] == (1.0, 0.5, 0.0)
    # and the benchmark's record of the same rounds (what bench/check_honesty.py compares with the check)
    generation = SimpleNamespace(summary=summary, request=SimpleNamespace(sampling=SimpleNamespace(temperature=0.0)),
                                 tree_nodes=16)
    record = record_run(generation, steps, BenchPrompt("p", "code", "x"), "speculative")
    assert position_acceptance([record]) == (1.0, 0.5, 0.0)
    chains = [replace(s, tree_width=0, tree_depth=0) for s in steps]  # a chain shows every draft it made
    summary = summarize(chains, mode="speculative", k=3, prompt_tokens=3, seconds=1.0, stop_reason="eos")
    assert summary.per_position_acceptance[:3] == (1.0, 1.0, 0.0)
