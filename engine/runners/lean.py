"""A lean Qwen2/Llama/Mistral decoder forward on a Hugging Face model's own weights, static KV cache.

gpt-fast style: one preallocated cache per layer, RoPE tables computed once, K/V written with
`index_copy_` at `start + arange(W)`, attention over the whole static cache with the mask
`key_pos <= query_pos`. Slots past the write position are masked, so rolling back is just moving
`start` back (stale entries are overwritten later). Attention reads a fixed span of the cache
(the runner picks the smallest of a few doubling spans that holds the context), so every shape is
fixed for a given (width, span) and the forward can be captured as a CUDA graph (engine/fast/runner.py).

Weights: q/k/v and gate/up are concatenated once so each is one matmul. With share_weights (the
default) the HF model's own parameters are re-pointed at slices of those fused tensors, so nothing
is held twice and the HF model keeps working (it is what the eager runner and the HF baselines
use). Consequences: the model's q/k/v (and gate/up) weights now share storage, so save it before
building a LeanDecoder, not after; and do not move or cast the model afterwards (`.to()` would
leave the decoder on the old tensors). share_weights=False keeps the originals and costs one extra
copy of the attention and MLP input weights (about 1.7 GB for the 1.5B target in bf16).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import EngineError

log = logging.getLogger(__name__)

SUPPORTED_TYPES = ("qwen2", "llama", "mistral")
# RoPE variants whose cos/sin depend only on the position (not on the current sequence length).
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
CACHE_ALIGN = 64  # cache slots rounded up so attention masks meet SDPA kernels' alignment rules
PREFILL_CHUNK = 256  # longer prompts are fed in chunks so attention scores stay small
ATTENTION = ("sdpa", "math")  # fused scaled_dot_product_attention, or two matmuls and a softmax


class UnsupportedModelError(EngineError):
    """The fast path cannot run this model; the caller falls back to the eager runner."""


@dataclass(frozen=True)
class LeanConfig:
    n_layers: int  # decoder layers
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (GQA: n_heads is a multiple of it)
    head_dim: int  # width of one head
    hidden: int  # residual stream width
    eps: float  # RMSNorm epsilon
    scaling: float  # attention score scale (head_dim ** -0.5 for these models)
    vocab_size: int  # rows of the output head
    max_length: int  # positions a generation may use
    cache_len: int  # allocated cache slots (max_length rounded up to CACHE_ALIGN)

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads


def _plain_linear(module: nn.Module, what: str) -> nn.Linear:
    if type(module) is not nn.Linear or not module.weight.is_floating_point():
        raise UnsupportedModelError(
            f"The fast path needs plain floating-point linear layers, but {what} is "
            f"{type(module).__name__} (quantized or wrapped); using the eager path."
        )
    return module


def check_supported(model: nn.Module, max_length: int) -> None:
    """Raises UnsupportedModelError when the lean forward would not reproduce this model."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_TYPES:
        raise UnsupportedModelError(
            f"The fast path supports {', '.join(SUPPORTED_TYPES)} models, not {model_type!r}; using the eager path."
        )
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    uses_window = "sliding_attention" in layer_types or (model_type == "mistral" and window is not None)
    if uses_window and window is not None and window < max_length:
        raise UnsupportedModelError(
            f"This model uses sliding-window attention ({window} tokens) and the context is {max_length}; "
            "the fast path only does full attention, so the eager path is used."
        )
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"The fast path expects a SiLU MLP, this model uses {act!r}; using the eager path.")
    rope_type = getattr(getattr(model.model, "rotary_emb", None), "rope_type", "default")
    if rope_type not in STATIC_ROPE:
        raise UnsupportedModelError(f"RoPE type {rope_type!r} depends on the sequence length; using the eager path.")
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1 or next(iter(devices)).type == "meta":
        raise UnsupportedModelError(
            f"The fast path needs the whole model on one device; its weights are on {sorted(map(str, devices))}."
        )
    if getattr(model, "hf_device_map", None) and len(set(model.hf_device_map.values())) > 1:
        raise UnsupportedModelError("The model is split across devices (device_map); using the eager path.")


def _fuse(modules: list[nn.Linear], share: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several linears reading the same input: one matmul instead of several.

    With `share`, the original parameters are re-pointed at slices of the fused tensor, so the
    Hugging Face model keeps working and no weight is held twice.
    """
    weight = torch.cat([m.weight.detach() for m in modules], dim=0)  # [sum(out), in]
    has_bias = [m.bias is not None for m in modules]
    bias = None
    if any(has_bias):
        bias = torch.cat(
            [m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in modules]
        )
    if share:
        row = 0
        for m in modules:
            n = m.out_features
            m.weight.data = weight[row : row + n]
            if m.bias is not None:
                m.bias.data = bias[row : row + n]
            row += n
    return weight, bias


@dataclass
class _Layer:
    ln1: torch.Tensor  # [hidden] input RMSNorm weight
    wqkv: torch.Tensor  # [(Hq + 2 Hkv) * D, hidden]
    bqkv: torch.Tensor | None  # [(Hq + 2 Hkv) * D] (Qwen2 has q/k/v bias; Llama does not)
    wo: torch.Tensor  # [hidden, Hq * D]
    bo: torch.Tensor | None
    ln2: torch.Tensor  # [hidden] post-attention RMSNorm weight
    w13: torch.Tensor  # [2 * inter, hidden] gate and up
    b13: torch.Tensor | None
    w2: torch.Tensor  # [hidden, inter] down
    b2: torch.Tensor | None
    k_cache: torch.Tensor  # [1, Hkv, cache_len, D]
    v_cache: torch.Tensor  # [1, Hkv, cache_len, D]


def _linear_residual(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x + h @ weight.T (+ bias): the residual add rides in the GEMM epilogue (one kernel, not two)."""
    if bias is not None:
        return x + F.linear(h, weight, bias)
    return torch.addmm(x, h, weight.t())


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's Qwen2RMSNorm/LlamaRMSNorm: normalise in float32, cast back, then scale. F.rms_norm is one
    # fused kernel on recent CUDA builds instead of five elementwise ones.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class LeanDecoder:
    """forward(ids [W], start) -> float32 logits [W, V], appending W tokens at positions start.. start+W-1."""

    def __init__(
        self, model: nn.Module, max_length: int, *, share_weights: bool = True, attention: str = "sdpa"
    ) -> None:
        check_supported(model, max_length)
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, not {attention!r}")
        self.attention = attention
        config = model.config
        base = model.model
        attn0 = base.layers[0].self_attn
        n_heads = config.num_attention_heads
        n_kv = getattr(config, "num_key_value_heads", None) or n_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
        lm_head = _plain_linear(model.get_output_embeddings(), "the output head")
        cache_len = -(-max_length // CACHE_ALIGN) * CACHE_ALIGN
        self.config = LeanConfig(
            n_layers=len(base.layers),
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            hidden=config.hidden_size,
            eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            scaling=float(getattr(attn0, "scaling", head_dim**-0.5)),
            vocab_size=lm_head.weight.shape[0],
            max_length=max_length,
            cache_len=cache_len,
        )
        assert n_heads % n_kv == 0, f"{n_heads} query heads do not group over {n_kv} key/value heads"
        weight = base.embed_tokens.weight
        self.device = weight.device
        self.dtype = weight.dtype
        self.model = model  # keeps the weights alive; nothing else is used from it after this
        self.share_weights = share_weights
        with torch.no_grad(), torch.inference_mode(False):
            self.embed = weight.detach()  # [V_in, hidden]
            self.lm_head = lm_head.weight.detach()  # [V, hidden]; the same storage when tied
            self.lm_bias = None if lm_head.bias is None else lm_head.bias.detach()
            self.norm = base.norm.weight.detach()
            self.layers = [self._build_layer(layer) for layer in base.layers]
            positions = torch.arange(cache_len, device=self.device)
            self.key_pos = positions  # [cache_len]
            # HF's own rotary module, so every static RoPE variant (llama3, yarn, ...) matches it.
            dummy = torch.zeros(1, device=self.device, dtype=self.dtype)
            cos, sin = base.rotary_emb(dummy, positions[None])  # [1, cache_len, D] in dtype
            self.cos = cos[0].contiguous()  # [cache_len, D]
            # rotate_half(x) * sin == roll(x, D/2) * [-sin_first_half, sin_second_half]
            half = head_dim // 2
            self.sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1).contiguous()
        log.info(
            "lean decoder: %d layers, %d/%d heads x %d, cache %d slots, %.1f MiB of KV cache",
            self.config.n_layers, n_heads, n_kv, head_dim, cache_len, self.cache_bytes() / 2**20,
        )

    def _build_layer(self, layer: nn.Module) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v, o = (_plain_linear(getattr(attn, n), n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        gate, up, down = (_plain_linear(getattr(mlp, n), n) for n in ("gate_proj", "up_proj", "down_proj"))
        wqkv, bqkv = _fuse([q, k, v], self.share_weights)
        w13, b13 = _fuse([gate, up], self.share_weights)
        c = self.config
        shape = (1, c.n_kv_heads, c.cache_len, c.head_dim)
        return _Layer(
            ln1=layer.input_layernorm.weight.detach(),
            wqkv=wqkv,
            bqkv=bqkv,
            wo=o.weight.detach(),
            bo=None if o.bias is None else o.bias.detach(),
            ln2=layer.post_attention_layernorm.weight.detach(),
            w13=w13,
            b13=b13,
            w2=down.weight.detach(),
            b2=None if down.bias is None else down.bias.detach(),
            k_cache=torch.zeros(shape, device=self.device, dtype=self.dtype),
            v_cache=torch.zeros(shape, device=self.device, dtype=self.dtype),
        )

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.k_cache, layer.v_cache))

    def fused_bytes(self) -> int:
        """Memory taken by the fused q/k/v and gate/up weights (0 extra when shared with the HF model)."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.wqkv, layer.w13))

    @torch.no_grad()
    def forward(
        self, ids: torch.Tensor, start: torch.Tensor, kv_len: int | None = None, logits: bool = True,
        hidden: tuple[torch.Tensor, tuple[int, ...]] | None = None,
    ) -> torch.Tensor | None:
        """ids [W] long, start: long scalar tensor on the device -> float32 logits [W, V].

        logits=False only fills the cache (the prompt): no output head, no [W, V] allocation.
        hidden=(out [W, n * hidden], layers): the outputs of those n layers are copied into `out`
        side by side (a draft head reads them; inside a graph, `out` is a static buffer).

        Attention reads the first `kv_len` cache slots (default: all); the caller guarantees
        start + W <= kv_len, and picks kv_len from a few buckets so short contexts read little.
        No host syncs and no data-dependent shapes: capturable as a CUDA graph for fixed W, kv_len.
        """
        c = self.config
        width = ids.shape[0]
        kv_len = kv_len or c.cache_len
        pos = start + self.key_pos[:width]  # [W] absolute positions
        cos = self.cos.index_select(0, pos)  # [W, D]
        sin = self.sin.index_select(0, pos)  # [W, D]
        # Causal over the static cache: slots beyond a query's position (the future, or stale tokens
        # left by a rollback) are masked. Rows repeat per query head of a KV group (see below).
        mask = self.key_pos[None, :kv_len] <= pos[:, None]  # [W, L]
        mask = mask.repeat(c.group, 1)  # [G*W, L]
        # Additive form built once per forward, not converted from bool inside every layer.
        bias = torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill_(~mask, float("-inf"))
        cos = cos[:, None, :]  # [W, 1, D] broadcasts over heads
        sin = sin[:, None, :]
        x = F.embedding(ids, self.embed)  # [W, hidden]
        q_size, kv_size = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        n_qk = c.n_heads + c.n_kv_heads
        keep = {} if hidden is None else {layer: slot for slot, layer in enumerate(hidden[1])}
        for index, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.ln1, c.eps)
            qkv = F.linear(h, layer.wqkv, layer.bqkv)  # [W, (Hq + 2 Hkv) * D]
            # RoPE on the query and key heads at once: rotate_half(x) = roll(x, D/2) * (-1 | +1).
            qk = qkv[:, : q_size + kv_size].view(width, n_qk, c.head_dim)  # [W, Hq + Hkv, D]
            qk = qk * cos + torch.roll(qk, c.head_dim // 2, dims=-1) * sin  # [W, Hq + Hkv, D]
            v = qkv[:, q_size + kv_size :].view(width, c.n_kv_heads, c.head_dim)  # [W, Hkv, D]
            k = qk[:, c.n_heads :].transpose(0, 1).unsqueeze(0)  # [1, Hkv, W, D]
            layer.k_cache.index_copy_(2, pos, k)  # [1, Hkv, L, D]
            layer.v_cache.index_copy_(2, pos, v.transpose(0, 1).unsqueeze(0))
            # GQA without copying the cache: the G query heads sharing one KV head (HF orders them
            # consecutively) become G*W query rows against that head.
            q = qk[:, : c.n_heads].transpose(0, 1).reshape(1, c.n_kv_heads, c.group * width, c.head_dim)
            o = self._attend(q, layer.k_cache[:, :, :kv_len], layer.v_cache[:, :, :kv_len], bias)  # [1, Hkv, G*W, D]
            o = o.view(c.n_heads, width, c.head_dim).transpose(0, 1).reshape(width, q_size)  # [W, Hq*D]
            x = _linear_residual(x, o, layer.wo, layer.bo)
            h = _rms_norm(x, layer.ln2, c.eps)
            gate, up = F.linear(h, layer.w13, layer.b13).chunk(2, dim=-1)  # [W, inter] each
            x = _linear_residual(x, F.silu(gate) * up, layer.w2, layer.b2)
            if index in keep:
                slot = keep[index]
                hidden[0][:, slot * c.hidden : (slot + 1) * c.hidden].copy_(x)
        if not logits:
            return None
        x = _rms_norm(x, self.norm, c.eps)
        return F.linear(x, self.lm_head, self.lm_bias).float()  # [W, V]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """q [1, Hkv, G*W, D], k/v [1, Hkv, L, D], additive mask bias [G*W, L] -> [1, Hkv, G*W, D]."""
        if self.attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.config.scaling)
        # "math": two batched matmuls. With a handful of query rows, fused attention kernels
        # parallelise over query blocks and heads only (a few thread blocks for a long cache),
        # while cuBLAS splits the long key dimension; which wins is measured by bench/gpu_check.py.
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.config.scaling  # [1, Hkv, G*W, L]
        probs = torch.softmax(scores + bias, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)
