"""What a draft head is: its shapes, the target layers it reads, and the target it was trained on."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields

import torch
from torch import nn

from engine.errors import IncompatibleModelsError

FORMAT = 1  # bump when the shard layout or the maths change: older heads are then refused
PROBE = 64  # leading values of the target's final-norm weight kept to tell fine-tunes apart
PROBE_TOLERANCE = 2e-2  # relative: bf16 rounding passes, another fine-tune of the same shape does not


@dataclass(frozen=True)
class HeadConfig:
    hidden: int  # residual width (the target's hidden size)
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (GQA, as the target)
    head_dim: int  # width of one attention head
    intermediate: int  # MLP width (smaller than the target's: the head ships in the repo)
    eps: float  # RMSNorm epsilon
    feature_layers: tuple[int, ...]  # target layers whose outputs are fused (EAGLE-3: low, mid, high)
    draft_vocab: int  # rows of the head's output: the most frequent target ids (FR-Spec / EAGLE-3)
    layers: int = 1  # decoder layers: the first reads [embedding, state], each later one the state alone

    @property
    def features(self) -> int:
        """Width of the fused input: one hidden state per feature layer."""
        return len(self.feature_layers) * self.hidden

    def to_json(self) -> dict:
        return {**asdict(self), "feature_layers": list(self.feature_layers)}

    @classmethod
    def from_json(cls, data: dict) -> HeadConfig:
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        return cls(**{**values, "feature_layers": tuple(int(x) for x in values["feature_layers"])})


def feature_layers(n_layers: int) -> tuple[int, ...]:
    """Low, middle and high target layers (0-based outputs), as EAGLE-3 picks them.

    All below the last layer, whose output the model only exposes after its final norm.
    For the 28-layer 1.5B target: (1, 13, 24). Tiny test models get fewer distinct layers.
    """
    assert n_layers >= 2, "a draft head needs a target with at least two layers"
    return tuple(sorted({min(1, n_layers - 2), max(0, n_layers // 2 - 1), max(0, n_layers - 4)}))


@dataclass(frozen=True)
class TargetFingerprint:
    """Enough of a target to refuse a head trained on another model."""

    model_type: str  # e.g. "qwen2"
    hidden: int  # hidden size
    layers: int  # decoder layers
    vocab: int  # rows of the output head
    config_sha256: str  # hash of the architecture fields (not of incidental ones like dtype)
    norm_probe: tuple[float, ...]  # leading values of the final norm weight (fine-tunes differ here)

    def to_json(self) -> dict:
        return {**asdict(self), "norm_probe": list(self.norm_probe)}

    @classmethod
    def from_json(cls, data: dict) -> TargetFingerprint:
        return cls(**{**data, "norm_probe": tuple(float(x) for x in data["norm_probe"])})


def _architecture(config) -> dict:
    """The config fields that decide the network's shape and maths, in a stable form.

    Written by different transformers versions (rope_theta moved into rope_parameters in 5.x)
    and read back from GGUF (eps as 9.99999997e-07): values are normalised before hashing.
    """
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None)) if isinstance(rope, dict) else None
    n_heads = config.num_attention_heads
    return {
        "model_type": config.model_type,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or n_heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // n_heads,
        "vocab_size": config.vocab_size,
        "rope_theta": float(f"{float(theta):.6g}") if theta is not None else None,
        "rms_norm_eps": float(f"{float(getattr(config, 'rms_norm_eps', 1e-6)):.4g}"),
        "hidden_act": getattr(config, "hidden_act", None),
    }


def fingerprint(model: nn.Module) -> TargetFingerprint:
    """The fingerprint of a loaded Hugging Face causal LM (before any CPU packing: reads weights)."""
    config = model.config
    arch = _architecture(config)
    digest = hashlib.sha256(json.dumps(arch, sort_keys=True).encode()).hexdigest()
    norm = model.model.norm.weight.detach().float().cpu()[:PROBE]
    rows = int(model.get_input_embeddings().weight.shape[0])
    return TargetFingerprint(
        model_type=str(config.model_type),
        hidden=int(config.hidden_size),
        layers=int(config.num_hidden_layers),
        vocab=rows,
        config_sha256=digest,
        norm_probe=tuple(round(float(x), 6) for x in norm),
    )


def check_matches(trained_on: TargetFingerprint, loaded: TargetFingerprint, head_name: str) -> None:
    """Raises IncompatibleModelsError naming the first difference between the two targets."""
    pairs = [
        ("model type", trained_on.model_type, loaded.model_type),
        ("hidden size", trained_on.hidden, loaded.hidden),
        ("layer count", trained_on.layers, loaded.layers),
        ("vocabulary", trained_on.vocab, loaded.vocab),
    ]
    for label, want, got in pairs:
        if want != got:
            raise IncompatibleModelsError(
                f"The draft head {head_name} was trained for a target with {label} {want}; the loaded "
                f"target has {got}. Train a head for this target: specdec-studio distill --target ... --out DIR."
            )
    if trained_on.config_sha256 != loaded.config_sha256:
        raise IncompatibleModelsError(
            f"The draft head {head_name} was trained for a target with another configuration (config hash "
            f"{trained_on.config_sha256[:12]} vs {loaded.config_sha256[:12]}). Train a head for this target: "
            "specdec-studio distill --target ... --out DIR."
        )
    a = torch.tensor(trained_on.norm_probe)
    b = torch.tensor(loaded.norm_probe)
    if a.shape != b.shape or float((a - b).abs().max()) > PROBE_TOLERANCE * max(float(a.abs().max()), 1e-6):
        raise IncompatibleModelsError(
            f"The draft head {head_name} was trained on another model of the same shape (its final-norm "
            "weights differ: another fine-tune?). Train a head for this target: specdec-studio distill."
        )
