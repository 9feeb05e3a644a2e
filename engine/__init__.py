"""The engine: speculative decoding headless (no Qt), for the app, the CLI and the benchmarks."""
from engine.cpu_threads import prepare_openmp

# Before anything imports torch (whose libgomp llama.cpp shares): idle OpenMP threads sleep instead of
# spinning, so another busy program does not stall every forward (engine/cpu_threads.py).
prepare_openmp()
