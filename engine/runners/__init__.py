"""Runners: the seam between the decoding loop and a model (one forward, a KV cache, rollback).

base.py is the protocol; eager.py the Hugging Face model as shipped; lean.py + graphs.py the
static-cache fast path with CUDA graphs; cpu.py packs weights for oneDNN on the CPU; llamacpp.py
runs GGUF models through llama.cpp (with llamacpp_tokenizer.py, its vocabulary as the tokenizer).
batched.py is the seam of several sequences in one forward (the server's batched step), on torch, and
llamacpp_batch.py on llama.cpp's multi-sequence batches.
"""
from engine.runners.base import Runner, ids_tensor, measure_forward_costs
from engine.runners.eager import EagerRunner

__all__ = ["EagerRunner", "Runner", "ids_tensor", "measure_forward_costs"]
