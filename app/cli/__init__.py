"""The headless command line: one module per command (generate, bench, sweep, distill, cache, plan, check,
serve), the options they share (arguments, options), what they share at run time (common) and the entry
point (run)."""
from app.cli.run import main

__all__ = ["main"]
