"""The runner seam: one forward over new tokens against a KV cache, and the one place that rolls it back.

The decoding loop only talks to this interface, so the eager Hugging Face path (eager.py: CPU,
fallback) and the static-cache / CUDA-graph path (lean.py, graphs.py) are interchangeable.

Invariant kept by the loop: a runner's cache holds every committed token except the last one,
which is fed at the start of the next step (so every step's first position predicts a new token).
"""
from __future__ import annotations

import inspect
import statistics
import time
from collections.abc import Iterable
from typing import Protocol

import torch


class Runner(Protocol):
    name: str  # "eager" or the fast path's name, reported to people
    device: torch.device  # where ids go in and logits come out
    vocab_size: int  # rows of the output head (may exceed the shared vocabulary)
    max_length: int  # most tokens the cache can hold
    length: int  # tokens currently in the cache
    # Rows a draft head reads, [W, len(hidden_layers) * hidden]: the chosen layers' outputs for the
    # last forward or prefill (no extra target forward), or None. On the fast path they are a graph's
    # static buffer, valid until the next forward of the same width.
    hidden: torch.Tensor | None

    def reset(self) -> None:
        """Empties the cache for a new generation."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Appends ids [W] (on the runner's device) to the cache; returns float32 logits [W, V]."""

    def prefill(self, ids: torch.Tensor) -> None:
        """Appends ids [W] to the cache without computing logits (the prompt needs none)."""

    def reserve(self, length: int) -> None:
        """After reset(): room for a prompt of `length` tokens (and an answer), before it is fed in chunks.
        A cache allocated whole ignores it; one that grows (llama.cpp) grows once, not per chunk."""

    def rollback(self, length: int) -> None:
        """Keeps the first `length` cached tokens and forgets the rest."""

    def keep_hidden(self, layers: tuple[int, ...]) -> None:
        """From now on forward and prefill leave these layers' outputs in `hidden` (() stops it)."""

    def measure_costs(self, widths: Iterable[int], iters: int = ...) -> dict[int, float]:
        """Milliseconds per forward of each width, leaving the cache as it was."""


def ids_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """Token ids [n] on `device` without a host sync.

    torch.tensor(values, device="cuda") copies from pageable memory, which waits for every queued
    kernel; staged through pinned memory the copy is queued like a kernel, so the loop can launch
    a step's work without waiting for the previous one.
    """
    ids = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda" or not values:
        return ids.to(device)
    return ids.pin_memory().to(device, non_blocking=True)


def measure_forward_costs(runner: Runner, widths: Iterable[int], iters: int) -> dict[int, float]:
    """Milliseconds per forward for each width, measured the way the loop calls the runner.

    Writes past the current length and rolls back, so the cached content is left as it was.
    CUDA work is timed with events, as the mean of `iters` back-to-back forwards after a warm one.
    On a CPU each forward is timed alone and the median is kept (Engine.measure_costs interleaves
    single passes over the widths and the draft instead, so their ratio is measured side by side).
    """
    saved = runner.length
    device = runner.device
    costs: dict[int, float] = {}
    for width in widths:
        if saved + width > runner.max_length:
            continue
        ids = torch.randint(0, runner.vocab_size, (width,), device=device)
        if device.type == "cuda":
            runner.forward(ids)  # warm: allocator, kernel selection
            runner.rollback(saved)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            stream = torch.cuda.current_stream(device)  # the device's, not the current device's
            begin.record(stream)
            for _ in range(iters):
                runner.forward(ids)
                runner.rollback(saved)
            end.record(stream)
            end.synchronize()
            costs[width] = begin.elapsed_time(end) / iters
        else:
            times = []
            for _ in range(max(iters, 1)):
                t0 = time.perf_counter()
                runner.forward(ids)
                times.append((time.perf_counter() - t0) * 1000)
                runner.rollback(saved)
            costs[width] = statistics.median(times)
    return costs


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword a Hugging Face model's forward (and generate) takes its KV cache by.

    transformers 5.2x renamed `past_key_values` to `cache` and warns (FutureWarning) on the old
    name; older releases know only the old one. Asking the signature keeps stderr quiet on both.
    """
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
