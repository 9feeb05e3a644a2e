"""When is a configuration faster than standard decoding? Only when its gain exceeds the measured spread.

A speedup is a ratio of two timed runs, and two runs of the same work differ by a few percent (clocks,
heat, other programs); on a busy 2-core machine by more. So a configuration is "best" only when it
accepted some drafted tokens (otherwise it did standard decoding's work plus the drafting) and its
speedup is above 1 by more than the spread measured over its prompts and repeats. Chat, Race and Tune
word their verdicts from here (engine.measure.explain), so they never disagree.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

NOISE_FLOOR = 0.03  # the least spread assumed: two runs of the same work differ by about 3% (diagnostics.LOSES)


def speedup_spread(ratios: Sequence[float]) -> float:
    """How far a speedup can be off from noise alone: twice the standard error of the per-run ratios
    (configuration tok/s over standard tok/s, prompt by prompt, repeat by repeat), at least NOISE_FLOOR."""
    finite = [r for r in ratios if math.isfinite(r)]
    if len(finite) < 2:
        return NOISE_FLOOR
    return max(NOISE_FLOOR, 2 * statistics.stdev(finite) / math.sqrt(len(finite)))


def is_win(speedup: float, spread: float, accepted: float) -> bool:
    """Faster than standard beyond doubt: some drafted tokens accepted and a gain above the spread."""
    return accepted > 0 and math.isfinite(speedup) and speedup - 1 > max(spread, NOISE_FLOOR)
