"""Collecting reference cycles on purpose, through one hook the app can route (no torch, no Qt here).

The engine collects when freed weights must go now rather than at some later collection (a replaced
module before packing; a replaced pair before the next loads). The app routes the collection to its
GUI thread while its worker lives (app/ui/collector.py): a cycle can hold Qt objects, which must not
be destroyed on the worker's thread.
"""
from __future__ import annotations

import gc
from collections.abc import Callable

_collect: Callable[[], object] = gc.collect


def collect_garbage() -> None:
    """A full collection, wherever the hook runs it (by default here, with gc.collect)."""
    _collect()


def set_garbage_collector(collect: Callable[[], object] | None) -> Callable[[], object]:
    """Makes collect_garbage call `collect` (None: gc.collect again); returns the one before."""
    global _collect
    previous, _collect = _collect, collect or gc.collect
    return previous
