"""Decoding: the Engine (engine.py), its one loop (loop.py) in phases (verify, outcome, describe), sampling
and the acceptance rule, proposers and their factory, the K controller, the detokenizer."""
from engine.decoding.engine import Engine
from engine.decoding.loop import Generation

__all__ = ["Engine", "Generation"]
