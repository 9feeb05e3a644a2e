"""The fast path: a lean static-cache decoder forward over HF weights, replayed as CUDA graphs."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from engine.fast.lean import LeanDecoder, UnsupportedModelError, check_supported
from engine.fast.runner import StaticGraphRunner, kv_buckets

__all__ = ["LeanDecoder", "StaticGraphRunner", "UnsupportedModelError", "build_runners", "check_supported", "kv_buckets"]

log = logging.getLogger(__name__)

DEFAULT_MAX_LENGTH = 8192  # cache positions when the caller does not say (capped by the model's own limit)
DEFAULT_K_MAX = 12  # verify widths 2..K_MAX+1 get graphs; larger K still works, eagerly


def build_runners(
    target: nn.Module,
    draft: nn.Module | None,
    *,
    max_length: int | None = None,
    k_max: int = DEFAULT_K_MAX,
    attention: str = "sdpa",
    progress: Callable[[Any], None] | None = None,
    compile_k: int | None = None,
) -> tuple[StaticGraphRunner, StaticGraphRunner | None, str]:
    """Fast runners for a pair, warmed up (graphs captured on CUDA); (target, draft, fast-path name).

    Raises UnsupportedModelError (or anything else) when the fast path cannot take a model; the
    caller then falls back to eager runners. `progress` receives engine.store.LoadProgress.
    """
    limit = int(getattr(target.config, "max_position_embeddings", DEFAULT_MAX_LENGTH))
    length = min(max_length or DEFAULT_MAX_LENGTH, limit)
    # Width 1: standard decoding; 2..k_max+1: the verify (K drafts + the pending token).
    target_widths = range(1, k_max + 2)
    # compile_k: also compile (inductor) the widths a K = compile_k loop uses every step.
    compiled_target = (1, compile_k + 1) if compile_k else ()
    target_runner = StaticGraphRunner(target, max_length=length, graph_widths=target_widths, attention=attention,
                                      compile_widths=compiled_target)
    # Width 1: a draft step; 2: the catch-up after a fully accepted draft (pending + bonus).
    draft_runner = (
        StaticGraphRunner(draft, max_length=length, graph_widths=(1, 2), attention=attention,
                          compile_widths=(1, 2) if compile_k else ())
        if draft is not None
        else None
    )
    if compile_k:
        import torch._dynamo

        # One compiled code object serves both models, several widths and spans: allow the variants.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)

    def stage(lo: float, hi: float) -> Callable[[float, str], None] | None:
        if progress is None:
            return None
        from engine.store import LoadProgress

        return lambda fraction, message: progress(LoadProgress("warmup", lo + (hi - lo) * fraction, message))

    share = 0.8 if draft_runner is not None else 1.0
    target_runner.warmup(stage(0.0, share))
    if target_runner.fallback_reason and attention == "sdpa":
        # The fused attention kernel is the likeliest part to refuse capture; plain matmuls rarely do.
        log.warning("retrying graph capture with matmul attention: %s", target_runner.fallback_reason)
        return build_runners(target, draft, max_length=max_length, k_max=k_max, attention="math", progress=progress,
                             compile_k=compile_k)
    if draft_runner is not None:
        draft_runner.warmup(stage(share, 1.0))
    name = target_runner.name
    if target_runner.fallback_reason:
        log.warning("fast path: %s", target_runner.fallback_reason)
    return target_runner, draft_runner, name
