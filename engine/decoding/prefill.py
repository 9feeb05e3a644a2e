"""The prompt read in chunks of about CHUNK_S of work each: progress between chunks, and Stop acts there.

A 4k-token prompt takes minutes on two CPU cores; fed in one call it could neither be watched nor
stopped. Each chunk is sized from the speed measured on the chunks before it (kept per engine and
model across requests); before any, from the cost of the widest verify measured at load. On a GPU
the measured speed soon says the whole prompt takes under CHUNK_S, and it is then fed at once.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
import torch

from engine.types import PrefillPart, PrefillProgress

CHUNK_S = 0.5  # seconds of work per chunk: how late a Stop can act, how often progress moves
FIRST_CHUNK = 32  # tokens of the first chunk when nothing has been measured for this model
# The smallest chunk: smaller batches read slower per token, which the next chunk's size would then follow
# down (llama.cpp, 1.5B on 2 busy cores: 6 tokens/s in batches of 8, 17-19 in batches of 32 to 512).
MIN_CHUNK = 16

# work(start, end): feed prompt positions [start, end) of this part's input into its cache.
Work = Callable[[int, int], None]
ProgressCallback = Callable[[PrefillProgress], None]
# feed(part, total, work) -> False when cancelled before all of it went in: Feed.feed, or feed_all.
FeedFn = Callable[[PrefillPart, int, Work], bool]


class Feed:
    """Feeds a part's prompt in measured chunks; `feed` says whether all of it went in (False: cancelled).

    rates: tokens per second per part, learned here and kept by the engine for its next requests;
    `estimate` gives a first rate from the costs measured at load when none was learned yet.
    """

    def __init__(self, rates: dict[str, float], device: torch.device, *, cancel: threading.Event | None = None,
                 progress: ProgressCallback | None = None,
                 estimate: Callable[[PrefillPart], float | None] | None = None) -> None:
        self.rates = rates
        self.device = device
        self.cancel = cancel or threading.Event()
        self.progress = progress
        self.estimate = estimate

    def chunk(self, part: PrefillPart, left: int) -> int:
        """Tokens of the next chunk: about CHUNK_S of work at the measured speed; all that is left if it
        would take under 1.5 chunks (no short tail chunk)."""
        rate = self.rates.get(part) or (self.estimate(part) if self.estimate is not None else None)
        if not rate:
            return min(left, FIRST_CHUNK)
        size = max(MIN_CHUNK, int(rate * CHUNK_S))
        return left if left <= 1.5 * size else size

    def feed(self, part: PrefillPart, total: int, work: Work) -> bool:
        """Runs work over [0, total) chunk by chunk, checking the cancel event before each chunk."""
        done = 0
        self._report(part, done, total)
        while done < total:
            if self.cancel.is_set():
                return False
            n = self.chunk(part, total - done)
            t0 = time.perf_counter()
            work(done, done + n)
            if self.device.type == "cuda":  # the clock (and Stop) must see the chunk done, not queued
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - t0
            if n >= MIN_CHUNK and seconds > 0:
                # The latest chunk's speed: attention over a longer context slows later chunks down.
                self.rates[part] = n / seconds
            done += n
            self._report(part, done, total)
        return True

    def _report(self, part: PrefillPart, done: int, total: int) -> None:
        if self.progress is not None and total > 0:
            self.progress(PrefillProgress(part, done, total))


def feed_all(part: PrefillPart, total: int, work: Work) -> bool:
    """A feed without chunks, progress or cancel: all of it at once (cost measurements, tests)."""
    if total > 0:
        work(0, total)
    return True
