"""Hugging Face generate() baselines for `bench`, run in the same process on the same loaded models.

Variants: "hf" (dynamic cache, eager), "hf-static" (a reused StaticCache; on CUDA generate()
compiles its decode step itself, mode="reduce-overhead", i.e. CUDA graphs), "hf-assisted" (HF
assisted generation with the draft as assistant_model).
"""
from __future__ import annotations

import time
import weakref
from typing import Any, Literal

import torch
from torch import nn
from transformers import StaticCache

from engine.errors import GenerationError
from engine.runners.base import cache_keyword
from engine.types import Sampling

Variant = Literal["hf", "hf-static", "hf-assisted"]
VARIANTS: tuple[Variant, ...] = ("hf", "hf-static", "hf-assisted")

# model -> {slots: its reused static cache}; weak, so a freed model's caches go with it (an id() key
# outlived its model: a later model given the same id got a cache of another dtype and shape).
_caches: weakref.WeakKeyDictionary[torch.nn.Module, dict[int, StaticCache]] = weakref.WeakKeyDictionary()
_warm: weakref.WeakKeyDictionary[torch.nn.Module, set[int]] = weakref.WeakKeyDictionary()  # slots run once on CUDA


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sampling_kwargs(sampling: Sampling | None) -> dict[str, Any]:
    if sampling is None or sampling.greedy:
        return {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    return {
        "do_sample": True,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k or None,
        "top_p": sampling.top_p,
    }


def run_hf(
    target: nn.Module,
    tokenizer: Any,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    variant: Variant = "hf",
    draft: nn.Module | None = None,
    sampling: Sampling | None = None,
) -> dict[str, Any]:
    """One timed generate(); returns {"new_tokens", "seconds", "token_ids"} (token_ids: the new ids).

    input_ids: [1, P] or [P]. `eos` is disabled (min_new_tokens = max_new_tokens) so every variant
    generates the same number of tokens and tokens/s compare fairly.
    hf-static on CUDA runs one untimed generate first with the compiled forward (compilation
    and graph capture take a while and would swamp the timing).
    """
    if variant not in VARIANTS:
        raise GenerationError(f"Unknown baseline {variant!r}; choose one of {', '.join(VARIANTS)}.")
    if variant == "hf-assisted" and draft is None:
        raise GenerationError("The hf-assisted baseline needs a draft model.")
    device = next(target.parameters()).device
    ids = input_ids.view(1, -1).to(device)  # [1, P]
    kwargs: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        pad_token_id=getattr(tokenizer, "pad_token_id", None) or getattr(tokenizer, "eos_token_id", None),
        attention_mask=torch.ones_like(ids),
        **_sampling_kwargs(sampling),
    )
    if variant == "hf-assisted":
        kwargs["assistant_model"] = draft
    compiled = False
    if variant == "hf-static":
        # One StaticCache per model, sized in 512-slot steps and reused (reset) across prompts:
        # generate() then compiles its decode step once (its own automatic torch.compile with
        # CUDA graphs on CUDA) instead of once per prompt length.
        slots = -(-(ids.shape[1] + max_new_tokens + 1) // 512) * 512
        caches = _caches.setdefault(target, {})
        if slots not in caches:
            caches[slots] = StaticCache(config=target.config, max_cache_len=slots)
        kwargs[cache_keyword(target)] = caches[slots]
        compiled = device.type == "cuda"
    seed = sampling.seed if sampling is not None else 0
    with torch.inference_mode():
        if variant == "hf-static":
            caches[slots].reset()  # its tensors are inference tensors: reset in here
        warm = _warm.setdefault(target, set())
        if compiled and slots not in warm:
            torch.manual_seed(seed)
            target.generate(ids, **kwargs)  # compiles and captures: untimed
            warm.add(slots)
            caches[slots].reset()
        torch.manual_seed(seed)
        _sync(device)
        t0 = time.perf_counter()
        out = target.generate(ids, **kwargs)  # [1, P + N]
        _sync(device)
        seconds = time.perf_counter() - t0
    new = out[0, ids.shape[1] :].tolist()
    return {"new_tokens": len(new), "seconds": seconds, "token_ids": new}
