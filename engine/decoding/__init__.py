"""Decoding: the one loop (loop.py), sampling and the acceptance rule, proposers, detokenizer."""
from engine.decoding.loop import Engine, Generation

__all__ = ["Engine", "Generation"]
