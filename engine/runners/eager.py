"""The eager runner: a Hugging Face model with a DynamicCache (CPU, and any model the fast path cannot take)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from engine.runners.base import cache_keyword, measure_forward_costs

if TYPE_CHECKING:  # importing the modeling base costs ~120 MB; the llama.cpp runtime never needs it
    from transformers import PreTrainedModel


class EagerRunner:
    """Hugging Face model with a DynamicCache; rollback is a crop."""

    name = "eager"

    def __init__(self, model: PreTrainedModel, max_length: int | None = None) -> None:
        self.model = model
        self.device = model.device
        self.vocab_size = model.get_output_embeddings().out_features
        self.max_length = max_length or int(getattr(model.config, "max_position_embeddings", 32768))
        self.cache = type(self)._new_cache(model)
        self.length = 0
        self._cache_kw = cache_keyword(model)
        self.hidden_layers: tuple[int, ...] = ()  # layers whose outputs a draft head reads
        self.hidden: torch.Tensor | None = None  # [W, n * hidden] rows of the last forward or prefill

    def keep_hidden(self, layers: tuple[int, ...]) -> None:
        """From now on forwards also leave these layers' outputs in `hidden`."""
        self.hidden_layers = tuple(layers)
        self.hidden = None

    def _keep(self, out) -> None:
        if self.hidden_layers:
            # hidden_states[0] is the embedding output: layer i's output is entry i + 1.
            self.hidden = torch.cat([out.hidden_states[i + 1][0] for i in self.hidden_layers], dim=-1)

    @staticmethod
    def _new_cache(model: PreTrainedModel):
        from transformers import DynamicCache  # ~150 MB to import: only once a torch model runs eagerly

        return DynamicCache(config=model.config)

    def reset(self) -> None:
        self.cache = self._new_cache(self.model)
        self.length = 0

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        width = ids.shape[-1]
        positions = torch.arange(self.length, self.length + width, device=self.device)
        out = self.model(
            input_ids=ids.view(1, width),  # [1, W]
            **{self._cache_kw: self.cache},
            cache_position=positions,
            use_cache=True,
            output_hidden_states=bool(self.hidden_layers),
        )
        self._keep(out)
        self.length += width
        assert self.cache.get_seq_length() == self.length, "cache and runner disagree on length"
        return out.logits[0].float()  # [W, V]

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> None:
        width = ids.shape[-1]
        positions = torch.arange(self.length, self.length + width, device=self.device)
        # logits_to_keep=1: a long prompt's [W, V] float logits would otherwise be allocated for nothing.
        out = self.model(input_ids=ids.view(1, width), **{self._cache_kw: self.cache}, cache_position=positions,
                         use_cache=True, logits_to_keep=1, output_hidden_states=bool(self.hidden_layers))
        self._keep(out)
        self.length += width

    def reserve(self, length: int) -> None:
        """A DynamicCache grows by appending: nothing to reserve."""

    def measure_costs(self, widths: Iterable[int], iters: int = 3) -> dict[int, float]:
        return measure_forward_costs(self, widths, iters)

    def rollback(self, length: int) -> None:
        assert 0 <= length <= self.length, f"cannot roll back to {length} from {self.length}"
        if length < self.length:
            self.cache.crop(length - self.length)  # negative: tokens to remove
            self.length = length
