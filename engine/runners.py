"""Model runners: one forward over new tokens against a KV cache, and the one place that rolls it back.

The decoding loop only talks to this interface, so the eager Hugging Face path (CPU, fallback) and
the static-cache / CUDA-graph path (engine/fast) are interchangeable.

Invariant kept by the loop: a runner's cache holds every committed token except the last one,
which is fed at the start of the next step (so every step's first position predicts a new token).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel


class Runner(Protocol):
    name: str  # "eager" or the fast path's name, reported to people
    vocab_size: int  # rows of the output head (may exceed the shared vocabulary)
    max_length: int  # most tokens the cache can hold
    length: int  # tokens currently in the cache

    def reset(self) -> None:
        """Empties the cache for a new generation."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Appends ids [W] (on the runner's device) to the cache; returns float32 logits [W, V]."""

    def prefill(self, ids: torch.Tensor) -> None:
        """Appends ids [W] to the cache without computing logits (the prompt needs none)."""

    def rollback(self, length: int) -> None:
        """Keeps the first `length` cached tokens and forgets the rest."""


class EagerRunner:
    """Hugging Face model with a DynamicCache; rollback is a crop."""

    name = "eager"

    def __init__(self, model: PreTrainedModel, max_length: int | None = None) -> None:
        self.model = model
        self.device = model.device
        self.vocab_size = model.get_output_embeddings().out_features
        self.max_length = max_length or int(getattr(model.config, "max_position_embeddings", 32768))
        self.cache = DynamicCache(config=model.config)
        self.length = 0

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.length = 0

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        width = ids.shape[-1]
        positions = torch.arange(self.length, self.length + width, device=self.device)
        out = self.model(
            input_ids=ids.view(1, width),  # [1, W]
            past_key_values=self.cache,
            cache_position=positions,
            use_cache=True,
        )
        self.length += width
        assert self.cache.get_seq_length() == self.length, "cache and runner disagree on length"
        return out.logits[0].float()  # [W, V]

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> None:
        width = ids.shape[-1]
        positions = torch.arange(self.length, self.length + width, device=self.device)
        # logits_to_keep=1: a long prompt's [W, V] float logits would otherwise be allocated for nothing.
        self.model(input_ids=ids.view(1, width), past_key_values=self.cache, cache_position=positions,
                   use_cache=True, logits_to_keep=1)
        self.length += width

    def measure_costs(self, widths: Iterable[int], iters: int = 3) -> dict[int, float]:
        return measure_forward_costs(self, widths, iters)

    def rollback(self, length: int) -> None:
        assert 0 <= length <= self.length, f"cannot roll back to {length} from {self.length}"
        if length < self.length:
            self.cache.crop(length - self.length)  # negative: tokens to remove
            self.length = length


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
    device = getattr(runner, "device", torch.device("cpu"))
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
            begin.record()
            for _ in range(iters):
                runner.forward(ids)
                runner.rollback(saved)
            end.record()
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
