"""Measurement: step statistics, the cost model, Hugging Face baselines and benchmarks."""
