"""`specdec-studio cache info|clean|verify`: shows, checks and frees the converted-model cache (no torch needed)."""
from __future__ import annotations

import argparse

from app.cli.common import PROG, CliError


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def cmd_cache(args: argparse.Namespace) -> int:
    from engine.models import cache_space as cache

    root = cache.cache_dir()
    if args.action == "clean":
        print(f"freed {_size(cache.clean(models=args.all))} in {root}")
        return 0
    if args.action == "verify":
        results = cache.verify_all()
        for r in results:
            print(f"{'ok' if r.problem is None else 'DAMAGED':<8} {r.name}" + (f": {r.problem}" if r.problem else ""))
        damaged = [r for r in results if r.problem is not None]
        if damaged:
            raise CliError(f"{len(damaged)} of {len(results)} converted models were damaged and have been removed; "
                           f"they are converted again on next use")
        print(f"{len(results)} converted models in {root}, every file matches its SHA-256")
        return 0
    items = cache.cache_items()
    print(f"cache: {root}")
    for item in items:
        print(f"  {_size(item.size):>9}  {item.kind:<8}  {item.name}  ({item.path.name})")
    total = sum(i.size for i in items)
    spare = sum(i.size for i in items if i.kind in ("leftover", "gguf", "costs"))
    models = sum(i.size for i in items if i.kind == "model")
    print(f"total {_size(total)}: `{PROG} cache clean` frees {_size(spare)}, `clean --all` {_size(spare + models)}")
    return 0
