"""Draft heads: decoder layers fed the target's own hidden states (EAGLE-style; one by default), and their training.

config.py: what a head is (shapes, fused target layers, the target it belongs to);
model.py: its weights and maths; runner.py: its static KV cache and CUDA graphs for decoding;
shards.py: safetensors shards with SHA-256, the manifest, finding the shipped head;
data.py / train.py / distill.py: self-distillation from the target (`specdec-studio distill`).
"""
