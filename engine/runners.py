"""Model runners: one forward over new tokens against a KV cache, and the one place that rolls it back.

The decoding loop only talks to this interface, so the eager Hugging Face path (CPU, fallback) and
the static-cache / CUDA-graph path (engine/fast) are interchangeable.

Invariant kept by the loop: a runner's cache holds every committed token except the last one,
which is fed at the start of the next step (so every step's first position predicts a new token).
"""
from __future__ import annotations

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

    def rollback(self, length: int) -> None:
        """Keeps the first `length` cached tokens and forgets the rest."""


class EagerRunner:
    """Hugging Face model with a DynamicCache; rollback is a crop."""

    name = "eager"

    def __init__(self, model: PreTrainedModel, max_length: int | None = None) -> None:
        self.model = model
        self.device = model.device
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
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

    def rollback(self, length: int) -> None:
        assert 0 <= length <= self.length, f"cannot roll back to {length} from {self.length}"
        if length < self.length:
            self.cache.crop(length - self.length)  # negative: tokens to remove
            self.length = length
