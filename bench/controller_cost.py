"""What one K decision costs on the host: AdaptiveK.choose + observe per step, in microseconds. Prints the figures.

    .venv/bin/python bench/controller_cost.py

No models: synthetic costs (an H200-like pair), a simulated draft accepting 70% per position.
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.decoding.control import AdaptiveK, StepCosts  # noqa: E402
from engine.decoding.proposers import Offer  # noqa: E402
from engine.limits import K_MAX  # noqa: E402
from engine.types import ProposerCost  # noqa: E402


def main() -> int:
    target = (0.0, *(2.8 + 0.05 * (w - 1) for w in range(1, K_MAX + 2)))
    costs = StepCosts(target, {"draft": ProposerCost("draft", 1.6, 0.05), "ngram": ProposerCost("ngram", 0.0, 0.02)})
    rng = random.Random(0)
    for name, offers in (("draft", (Offer("draft", K_MAX),)),
                         ("draft + n-gram", (Offer("ngram", 6, key="ngram:3"), Offer("draft", K_MAX)))):
        controller = AdaptiveK(costs)
        n, started = 20000, time.perf_counter()
        for _ in range(n):
            d = controller.choose(offers, 1000)
            accepted = 0
            while accepted < d.k and rng.random() < 0.7:
                accepted += 1
            controller.observe(d, d.k, accepted, 1.6 * d.k, target[d.k + 1], 1.6 * d.k + target[d.k + 1] + 0.1)
        per_step = (time.perf_counter() - started) / n * 1e6
        print(f"{name}: {per_step:.1f} us per step (choose + observe, {n} steps, simulated outcome included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
