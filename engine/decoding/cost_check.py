"""Forward costs believed only when they hold: kept ones used at once and checked again after Ready,
disturbed ones measured again instead of turned into a verdict.

At load (settle_costs): figures kept for this machine, pair, runtime, precision and threads
(kept_costs.py) are used as they are, so Ready comes right after the weights load; otherwise the
passes are measured as before (costs.measure_costs). A measurement looks disturbed when its passes
disagree (a neighbour's burst in one of them), when a draft model costs more than a target forward
(measured 259% under load on 2 shared cores, about 60% quiet), or, after Ready, when it is far from
the kept figures. Disturbed figures are still used by auto (they are all there is) but no verdict is
given on them (ModelInfo.costs_state "disturbed": the app says "measuring again"). A start without
kept costs is Ready after one pass (about a third of the measurement); the other two follow after Ready
("measuring": no verdict yet either), and the three are judged and kept together.

After Ready (CostCheck.step, one pass at a time, only while nothing else wants the engine) the
figures are measured again: kept figures are replaced only by a consistent measurement that agrees
with them, or by two consistent measurements that agree with each other (the machine changed).
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from engine.decoding.costs import (
    CostPass,
    Interrupted,
    gpu_pass,
    measure_costs,
    measure_pass,
    measure_trees,
    pooled,
    publish,
)
from engine.decoding.kept_costs import KeptCosts, cost_key, keep, read_kept
from engine.limits import K_MAX
from engine.loadspec import LoadProgress

if TYPE_CHECKING:  # annotations only
    from engine.decoding.engine import Engine

log = logging.getLogger(__name__)

SPREAD = 0.25  # passes of one measurement may differ by this share of the figure (of a target forward, proposers)
FAR = 0.25  # a measurement this far from the kept figures is measured again before it replaces them
DRAFT_PLAUSIBLE = 1.0  # a draft model costing more than this many target forwards looks disturbed
ROUNDS = 3  # passes per measurement on a CPU (one on a GPU: its figures are medians of 20 rounds already)
ATTEMPTS = 3  # measurements after Ready before the figures are called unsteady and left alone


def _figures(p: CostPass) -> dict[str, float]:
    """The figures a verdict rests on: the 1-token and widest verify, each proposer's per-token cost."""
    target, costs, _ = p
    figures = {"target 1": target[1], f"target {K_MAX + 1}": target[max(target)]}
    figures.update((f"{s} per token", c.per_token_ms) for s, c in costs.items())
    return figures


def _scale(name: str, value: float, forward: float) -> float:
    # Proposers are weighed against a target forward: that ratio is what a verdict reads, and a nearly
    # free proposer (n-gram lookup, 0.02 ms) may double without changing anything.
    return forward if name.endswith("per token") else value


def spread(passes: list[CostPass]) -> str | None:
    """Why the passes of one measurement disagree (SPREAD), or None when they hold together."""
    all_figures = [_figures(p) for p in passes]
    if len(all_figures) < 2:
        return None
    forward = statistics.median(f["target 1"] for f in all_figures)
    for name in all_figures[0]:
        values = [f[name] for f in all_figures if name in f]
        scale = _scale(name, statistics.median(values), forward)
        if scale > 0 and (max(values) - min(values)) / scale > SPREAD:
            return f"{name} spread {min(values):.1f}-{max(values):.1f} ms between passes"
    return None


def implausible(p: CostPass) -> str | None:
    """Why pooled figures cannot be right as they stand (a draft model dearer than the target), or None."""
    target, costs, _ = p
    draft = costs.get("draft")
    if draft is not None and target[1] > 0 and draft.per_token_ms / target[1] > DRAFT_PLAUSIBLE:
        return f"the draft measured {draft.per_token_ms / target[1]:.0%} of a target forward"
    return None


def disturbance(passes: list[CostPass]) -> str | None:
    """Why these passes of one measurement look disturbed, or None when they hold together."""
    return (spread(passes) or implausible(pooled(passes))) if passes else None


def distance(new: CostPass, old: CostPass) -> str | None:
    """Why `new` is far from `old` (FAR), or None when they agree."""
    a, b = _figures(new), _figures(old)
    forward = b["target 1"]
    for name in b:
        if name in a:
            scale = _scale(name, b[name], forward)
            if scale > 0 and abs(a[name] - b[name]) / scale > FAR:
                return f"{name} {a[name]:.1f} ms against {b[name]:.1f} ms before"
    return None


def as_pass(kept: KeptCosts) -> CostPass:
    return (dict(kept.target_ms), {c.source: c for c in kept.proposer_costs},
            {c.source: c for c in kept.sampled_costs})


def _kept(p: CostPass, sampled_target: dict[int, float], steady: bool = True) -> KeptCosts:
    target, costs, sampled = p
    return KeptCosts(tuple(sorted(target.items())), tuple(costs.values()), tuple(sampled.values()),
                     tuple(sorted(sampled_target.items())), time.time(), steady)


def _covers(kept: KeptCosts, engine: Engine) -> bool:
    # The head's greedy cost is measured as it attaches; every other proposer must have kept figures.
    needed = {s for s in engine.proposer_sources() if s != "head"}
    return needed <= {c.source for c in kept.proposer_costs}


def _set_state(engine: Engine, state: str, note: str = "") -> None:
    engine.info = replace(engine.info, costs_state=state, costs_note=note)


def settle_costs(engine: Engine, progress=None, keep_costs: bool = False) -> None:
    """The costs at load: kept ones when `keep_costs` finds them (nothing measured before Ready; checked
    again after it: Engine.cost_check), else measured now, kept when they hold, measured again when not."""
    key = None
    if keep_costs:
        try:
            key = cost_key(engine)
        except Exception as exc:  # no key, no keeping: measuring still works
            log.warning("forward costs will not be kept: %s", exc)
    kept = read_kept(key) if key is not None else None
    if kept is not None and _covers(kept, engine):
        if progress is not None:
            progress(LoadProgress("warmup", 0.95, "Using the forward costs measured on this machine before"))
        target, costs, sampled = as_pass(kept)
        publish(engine, target, dict(costs), 0.0, sampled, dict(kept.sampled_target_ms))
        measure_trees(engine)
        engine.cost_passes = [as_pass(kept)]  # a sweep's passes pool with them (costs.measure_again)
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(kept.saved_at)) if kept.saved_at else "before"
        if kept.steady:
            _set_state(engine, "kept", f"measured {when}")
        else:  # the best there was, so Ready comes at once; still no verdict on them
            _set_state(engine, "disturbed", f"they never held together when measured ({when})")
        engine.cost_check = CostCheck(key, as_pass(kept), kept=kept.steady)
        return
    # The app (a key) is Ready after one pass on a CPU; the others follow while it is idle, and the
    # three are judged and kept together (CostCheck). A GPU measures everything in about a second.
    on_cpu = engine.device.type != "cuda"
    measure_costs(engine, progress, 1 if key is not None and on_cpu else ROUNDS)
    if not engine.info.target_ms:
        return  # could not measure: nothing to judge or keep
    measured = engine.cost_passes or [_info_pass(engine)]
    if on_cpu and len(measured) < ROUNDS:
        _set_state(engine, "measuring", f"{len(measured)} of {ROUNDS} passes before Ready")
        engine.cost_check = CostCheck(key, pooled(measured), kept=False, passes=measured)
        return
    reason = disturbance(measured)
    if reason is None:
        _set_state(engine, "measured")
        if key is not None:
            keep(key, _kept(pooled(measured), dict(engine.info.sampled_target_ms)))
        return
    # Not a warning: the status bar says "measuring again", and a command-line run prints one line or none.
    log.info("the forward costs measured at load look disturbed (%s): measuring them again after Ready", reason)
    _set_state(engine, "disturbed", reason)
    # Passes that held together but look implausible are a measurement a later one may confirm.
    engine.cost_check = CostCheck(key, pooled(measured), kept=False,
                                  last=None if spread(measured) else pooled(measured))


def _info_pass(engine: Engine) -> CostPass:
    info = engine.info
    return (dict(info.target_ms), {c.source: c for c in info.proposer_costs if c.source != "head"},
            {c.source: c for c in info.sampled_costs})


class CostCheck:
    """The forward costs measured again after Ready, one pass per step() (see the module's docstring).

    key: where to keep what holds (None: not kept); reference: the figures in use; kept: they came from
    the file; last: the previous measurement that did not settle, which a new one may confirm.
    step() measures only when the caller says the engine is free; it leaves the caches as they were.
    """

    def __init__(self, key: dict | None, reference: CostPass, *, kept: bool, last: CostPass | None = None,
                 passes: list[CostPass] | None = None) -> None:
        """passes: those of the measurement in progress (the one measured before Ready)."""
        self.key = key
        self.reference = reference
        self.kept = kept
        self.last = last
        self.passes: list[CostPass] = list(passes or ())
        self.history: list[CostPass] = []  # every pass of the measurements that did not settle
        self.sampled_target: dict[int, float] = {}
        self.attempts = 0  # measurements finished
        self.done = False

    def step(self, engine: Engine, interrupted: Interrupted | None = None) -> bool:
        """Measures one more pass (CostsInterrupted drops it); True when engine.info changed."""
        if self.done:
            return False
        if engine.device.type == "cuda":
            one, self.sampled_target = gpu_pass(engine, interrupted)
            rounds = 1
        else:
            one, rounds = measure_pass(engine, interrupted), ROUNDS
        self.passes.append(one)
        if len(self.passes) < rounds:
            return False
        passes, self.passes = self.passes, []
        self.attempts += 1
        new = pooled(passes)
        noisy = spread(passes)
        reason = noisy or implausible(new) or (distance(new, self.reference) if self.kept else None)
        if reason is None or (noisy is None and self.last is not None and distance(new, self.last) is None):
            return self._settle(engine, new)  # consistent, or confirmed by the previous consistent measurement
        log.info("forward costs measured again still look disturbed (%s)", reason)
        self.history += passes
        if noisy is None:
            self.last = new
        if self.attempts >= ATTEMPTS:
            self.done = True
        if self.kept:
            return False  # the kept figures stay in use as they were
        if self.done:
            self._keep_unsteady(engine, reason)
        else:
            _set_state(engine, "disturbed", reason)
        return True

    def _keep_unsteady(self, engine: Engine, reason: str) -> None:
        # Never steady on this machine: the median of every pass is in use from now on and kept as
        # unsteady, so the next start is Ready at once (with no verdict) and measures again after it.
        best = pooled(self.history)
        target, costs, sampled = best
        sampled_target = self.sampled_target or dict(engine.info.sampled_target_ms)
        publish(engine, dict(target), dict(costs), engine.info.measure_s, dict(sampled), sampled_target)
        engine.cost_passes = [best]
        _set_state(engine, "unsteady", reason)
        if self.key is not None:
            keep(self.key, _kept(best, sampled_target, steady=False))

    def _settle(self, engine: Engine, new: CostPass) -> bool:
        self.done = True
        target, costs, sampled = new
        sampled_target = self.sampled_target or dict(engine.info.sampled_target_ms)
        publish(engine, dict(target), dict(costs), engine.info.measure_s, dict(sampled), sampled_target)
        engine.cost_passes = [new]
        _set_state(engine, "measured")
        if self.key is not None:
            keep(self.key, _kept(new, sampled_target))
        log.info("forward costs measured again after Ready and kept")
        return True


