"""A lean Qwen2/Qwen3/Llama/Mistral decoder forward on a Hugging Face model's own weights, static KV cache.

gpt-fast style: one preallocated cache per layer, RoPE tables computed once, K/V written with
`index_copy_` at `start + arange(W)`, attention over the whole static cache with the mask
`key_pos <= query_pos`. Slots past the write position are masked, so rolling back is just moving
`start` back (stale entries are overwritten later). Attention reads a fixed span of the cache
(the runner picks the smallest of a few doubling spans that holds the context), so every shape is
fixed for a given (width, span) and the forward can be captured as a CUDA graph (engine/runners/graphs.py).

Weights: q/k/v and gate/up are concatenated once so each is one matmul. With share_weights (the
default) the HF model's own parameters are re-pointed at slices of those fused tensors, so nothing
is held twice and the HF model keeps working (it is what the eager runner and the HF baselines
use). Consequences: the model's q/k/v (and gate/up) weights now share storage, so save it before
building a LeanDecoder, not after; and do not move or cast the model afterwards (`.to()` would
leave the decoder on the old tensors). share_weights=False keeps the originals and costs one extra
copy of the attention and MLP input weights (about 1.7 GB for the 1.5B target in bf16).

Quantized linears (bitsandbytes int8 / nf4, or any module that is not a plain nn.Linear) are
called through their own forward, one per projection, instead of being fused. A model split
across GPUs by a device_map runs as stages, one per device (a contiguous run of layers); each
stage has its own RoPE tables and write position, and the hidden state crosses between them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import EngineError
from engine.models import fastquant
from engine.models.fastquant import rms_norm as _rms_norm
from engine.models.fastquant_kernel import MAX_ROWS as MAX_8BIT_ROWS
from engine.runners import rope_kernel
from engine.runners.cpu import PackedLinear
from engine.runners.tree import Tree

log = logging.getLogger(__name__)

SUPPORTED_TYPES = ("qwen2", "qwen3", "llama", "mistral")
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


def _is_plain(module: nn.Module) -> bool:
    return type(module) is nn.Linear and module.weight.is_floating_point()


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
    if any(d.type == "meta" for d in devices) or (len(devices) > 1 and any(d.type != "cuda" for d in devices)):
        raise UnsupportedModelError(
            f"The fast path needs every weight on the GPU; this model's are on {sorted(map(str, devices))}."
        )
    order = [_layer_device(layer) for layer in model.model.layers]
    runs = [d for i, d in enumerate(order) if i == 0 or d != order[i - 1]]
    if len(runs) != len(set(runs)):
        raise UnsupportedModelError("The model's layers go back and forth between devices; using the eager path.")
    out = model.get_output_embeddings()
    norm = model.model.norm.weight.device
    head = out.weight.device if hasattr(out, "weight") else norm  # a packed head (runners/cpu.py) is a CPU's
    if model.model.embed_tokens.weight.device != order[0] or head != order[-1] or norm != head:
        raise UnsupportedModelError(
            "The split model's embedding or output head is not beside its first or last layer; using the eager path."
        )


def _layer_device(layer: nn.Module) -> torch.device:
    return layer.input_layernorm.weight.device


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


class _Proj:
    """Linear modules reading one input: one fused matmul when all are plain, else each module's forward."""

    def __init__(self, modules: list[nn.Module], share: bool) -> None:
        self.modules: tuple[nn.Module, ...] = ()
        self.weight: torch.Tensor | None = None  # [sum(out), in]
        self.bias: torch.Tensor | None = None
        if all(_is_plain(m) for m in modules):
            if len(modules) == 1:
                m = modules[0]
                self.weight, self.bias = m.weight.detach(), None if m.bias is None else m.bias.detach()
            else:
                self.weight, self.bias = _fuse(modules, share)
        elif fastquant.fusable(modules):  # int8-wo / fp8: fused too, the 8-bit kernel in the module
            self.modules = (fastquant.fuse(modules),)
        else:
            self.modules = tuple(modules)  # quantized: the kernels live in the modules

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h [W, in] -> [W, sum(out)]."""
        if self.weight is not None:
            return F.linear(h, self.weight, self.bias)
        outs = [m(h) for m in self.modules]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def residual(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """x + self(h), the add fused into the matmul when the weight is plain or int8-wo/fp8."""
        if self.weight is not None:
            return _linear_residual(x, h, self.weight, self.bias)
        if len(self.modules) == 1 and isinstance(self.modules[0], fastquant.QuantLinear):
            return self.modules[0](h, residual=x)  # the 8-bit kernel adds it in its epilogue
        return x + self(h)


@dataclass
class _Layer:
    ln1: torch.Tensor  # [hidden] input RMSNorm weight
    qkv: _Proj  # -> [W, (Hq + 2 Hkv) * D] (Qwen2 has q/k/v bias; Llama does not)
    qk_norm: torch.Tensor | None  # [Hq + Hkv, D] Qwen3's per-head RMSNorm weights for q then k; None elsewhere
    o: _Proj  # [W, Hq * D] -> [W, hidden]
    ln2: torch.Tensor  # [hidden] post-attention RMSNorm weight
    gate_up: _Proj  # -> [W, 2 * inter]
    down: _Proj  # [W, inter] -> [W, hidden]
    k_cache: torch.Tensor  # [1, Hkv, cache_len, D], a view of its stage's `kv`
    v_cache: torch.Tensor  # [1, Hkv, cache_len, D]

    def heads(self, x: torch.Tensor, c: LeanConfig, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's input: residual rows x [N, hidden] (N = prod(shape)) -> qk [*shape, Hq + Hkv, D],
        query heads then key heads, before RoPE (Qwen3's per-head norm applied), and v [*shape, Hkv, D].
        Every forward (lean, batched parts, batched rows) starts a layer here."""
        q_size, kv_size = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        qkv = self.qkv(_rms_norm(x, self.ln1, c.eps))  # [N, (Hq + 2 Hkv) * D]
        qk = qkv[:, : q_size + kv_size].view(*shape, c.n_heads + c.n_kv_heads, c.head_dim)
        if self.qk_norm is not None:
            qk = _rms_norm(qk, self.qk_norm, c.eps)  # per head, [Hq + Hkv, D] weights broadcast over the rows
        return qk, qkv[:, q_size + kv_size :].view(*shape, c.n_kv_heads, c.head_dim)

    def finish(self, x: torch.Tensor, o: torch.Tensor, c: LeanConfig) -> torch.Tensor:
        """The layer after attention: x [N, hidden] + o's projection, then the MLP with its residual."""
        x = self.o.residual(x, o)
        gate_up = self.gate_up(_rms_norm(x, self.ln2, c.eps))  # [N, 2 * inter]: gate, then up
        return self.down.residual(x, fastquant.silu_mul(gate_up))


def rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, c: LeanConfig) -> torch.Tensor:
    """RoPE on query and key heads at once: rotate_half(x) = roll(x, D/2) * (-1 | +1), the sign folded into sin."""
    return qk * cos + torch.roll(qk, c.head_dim // 2, dims=-1) * sin


@dataclass
class _Stage:
    """A run of consecutive layers on one device, with that device's copy of the position tables."""

    device: torch.device
    first: int  # index of its first layer in the model
    layers: list[_Layer]
    key_pos: torch.Tensor  # [cache_len] positions 0..cache_len-1
    cos: torch.Tensor  # [cache_len, D]
    sin: torch.Tensor  # [cache_len, D], sign folded in for the roll form of rotate_half
    start: torch.Tensor  # long scalar: write position (stage 0 uses the caller's)
    kv: torch.Tensor | None = None  # [layers, 2, Hkv, cache_len, D]: its layers' caches are views of it


def _linear_residual(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x + h @ weight.T (+ bias): the residual add rides in the GEMM epilogue (one kernel, not two)."""
    if bias is not None:
        return x + F.linear(h, weight, bias)
    return torch.addmm(x, h, weight.t())


class LeanDecoder:
    """forward(ids [W], start) -> float32 logits [W, V], appending W tokens at positions start.. start+W-1."""

    def __init__(
        self, model: nn.Module, max_length: int, *, share_weights: bool = True, attention: str = "sdpa",
        stage_breaks: tuple[int, ...] = (),
    ) -> None:
        """stage_breaks: layer indices that start a new stage although the device does not change
        (tests run the split-model path on one CPU this way)."""
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
        lm_head = model.get_output_embeddings()
        # called as it is: the CPU fast path's oneDNN head, or an 8-bit head (fastquant.quantize_model)
        packed_head = isinstance(lm_head, (PackedLinear, fastquant.QuantLinear))
        if not _is_plain(lm_head) and not packed_head:
            raise UnsupportedModelError(
                f"The fast path needs a plain output head, not {type(lm_head).__name__}; using the eager path.")
        cache_len = -(-max_length // CACHE_ALIGN) * CACHE_ALIGN
        self.config = LeanConfig(
            n_layers=len(base.layers),
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            hidden=config.hidden_size,
            eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            scaling=float(getattr(attn0, "scaling", head_dim**-0.5)),
            vocab_size=lm_head.out_features,
            max_length=max_length,
            cache_len=cache_len,
        )
        assert n_heads % n_kv == 0, f"{n_heads} query heads do not group over {n_kv} key/value heads"
        weight = base.embed_tokens.weight
        self.input_device = weight.device  # where ids go in
        self.device = base.norm.weight.device  # where logits come out (the same unless split)
        # A CompactEmbedding (runners/cpu.py) keeps bfloat16 rows of a float32 model: its lookups are cast.
        self.dtype = getattr(base.embed_tokens, "out_dtype", weight.dtype)
        self.model = model  # keeps the weights alive; nothing else is used from it after this
        self.share_weights = share_weights
        with torch.no_grad(), torch.inference_mode(False):
            self.embed = weight.detach()  # [V_in, hidden]
            self.lm_module = lm_head if packed_head else None
            # an 8-bit head takes at most the kernel's rows a call: wider verifies run in passes, never
            # dequantizing the whole head (1.5 GB for a 14B target) for cuBLAS
            self.lm_rows_per_call = MAX_8BIT_ROWS if isinstance(lm_head, fastquant.QuantLinear) else 0
            self.lm_head = None if packed_head else lm_head.weight.detach()  # [V, hidden]; the same storage when tied
            self.lm_bias = None if packed_head or lm_head.bias is None else lm_head.bias.detach()
            self.norm = base.norm.weight.detach()
            self.layers = [self._build_layer(layer) for layer in base.layers]
            self.stages: list[_Stage] = []
            for i, (layer, built) in enumerate(zip(base.layers, self.layers)):
                device = _layer_device(layer)
                if not self.stages or self.stages[-1].device != device or i in stage_breaks:
                    self.stages.append(self._stage(base, device, i))
                self.stages[-1].layers.append(built)
            c = self.config
            for stage in self.stages:  # one tensor per stage, so moving a slot is one copy (move_slots)
                stage.kv = torch.zeros(len(stage.layers), 2, c.n_kv_heads, c.cache_len, c.head_dim,
                                       device=stage.device, dtype=self.dtype)
                for i, layer in enumerate(stage.layers):
                    layer.k_cache, layer.v_cache = stage.kv[i, 0].unsqueeze(0), stage.kv[i, 1].unsqueeze(0)
        projections = [p for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        self.quantized = any(p.modules for p in projections)
        log.info(
            "lean decoder: %d layers on %s, %d/%d heads x %d, cache %d slots, %.1f MiB of KV cache%s",
            self.config.n_layers, ", ".join(str(st.device) for st in self.stages), n_heads, n_kv, head_dim,
            cache_len, self.cache_bytes() / 2**20, ", quantized linears" if self.quantized else "",
        )

    def _stage(self, base: nn.Module, device: torch.device, first: int) -> _Stage:
        positions = torch.arange(self.config.cache_len, device=device)
        # HF's own rotary module, so every static RoPE variant (llama3, yarn, ...) matches it.
        dummy = torch.zeros(1, device=device, dtype=self.dtype)
        cos, sin = (t.to(device) for t in base.rotary_emb(dummy, positions[None]))  # [1, cache_len, D] in dtype
        # rotate_half(x) * sin == roll(x, D/2) * [-sin_first_half, sin_second_half]
        half = self.config.head_dim // 2
        return _Stage(
            device=device, first=first, layers=[], key_pos=positions, cos=cos[0].contiguous(),
            sin=torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1).contiguous(),
            start=torch.zeros((), dtype=torch.long, device=device),
        )

    def _build_layer(self, layer: nn.Module) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        c = self.config
        qk_norm = None
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head of q and k, before RoPE
            qk_norm = torch.cat([attn.q_norm.weight.detach().expand(c.n_heads, c.head_dim),
                                 attn.k_norm.weight.detach().expand(c.n_kv_heads, c.head_dim)])
        return _Layer(
            ln1=layer.input_layernorm.weight.detach(),
            qkv=_Proj([attn.q_proj, attn.k_proj, attn.v_proj], self.share_weights),
            qk_norm=qk_norm,
            o=_Proj([attn.o_proj], self.share_weights),
            ln2=layer.post_attention_layernorm.weight.detach(),
            gate_up=_Proj([mlp.gate_proj, mlp.up_proj], self.share_weights),
            down=_Proj([mlp.down_proj], self.share_weights),
            k_cache=torch.empty(0), v_cache=torch.empty(0),  # views of its stage's `kv`, set after the stages
        )

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.k_cache, layer.v_cache))

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copies the K/V of cache slots src [n] to slots dst [n] in every layer (a tree's kept branch)."""
        for stage in self.stages:
            kv = stage.kv
            kv.index_copy_(3, dst.to(stage.device), kv.index_select(3, src.to(stage.device)))

    def fused_bytes(self) -> int:
        """Memory taken by the fused q/k/v and gate/up weights (0 extra when shared with the HF model)."""
        return sum(p.weight.numel() * p.weight.element_size() for layer in self.layers
                   for p in (layer.qkv, layer.gate_up) if p.weight is not None)

    @torch.no_grad()
    def forward(
        self, ids: torch.Tensor, start: torch.Tensor, kv_len: int | None = None, logits: bool = True,
        hidden: tuple[torch.Tensor, tuple[int, ...]] | None = None, tree: Tree | None = None,
    ) -> torch.Tensor | None:
        """ids [W] long, start: long scalar tensor on the input device -> float32 logits [W, V].

        logits=False only fills the cache (the prompt): no output head, no [W, V] allocation.
        hidden=(out [W, n * hidden], layers): the outputs of those n layers are copied into `out`
        side by side (a draft head reads them; inside a graph, `out` is a static buffer).

        Attention reads the first `kv_len` cache slots (default: all); the caller guarantees
        start + W <= kv_len, and picks kv_len from a few buckets so short contexts read little.
        No host syncs and no data-dependent shapes: each stage is capturable as a CUDA graph for
        fixed W, kv_len (on one device, the whole forward is one stage).

        tree=(depth [W] long, ancestors [W, W] bool): the W tokens are a tree of drafts rather than
        a sequence (see Tree); row i still writes cache slot start + i.
        """
        x = ids if ids.device == self.input_device else ids.to(self.input_device)
        for s, stage in enumerate(self.stages):
            if s:
                x = x.to(stage.device)
                stage.start.copy_(start)
            x = self.run_stage(s, x, start if s == 0 else stage.start, kv_len, logits, hidden,
                               None if tree is None else tree.to(stage.device))
        return x

    def run_stage(
        self, s: int, x: torch.Tensor, start: torch.Tensor, kv_len: int | None = None, logits: bool = True,
        hidden: tuple[torch.Tensor, tuple[int, ...]] | None = None, tree: Tree | None = None,
    ) -> torch.Tensor | None:
        """Stage s: ids [W] (stage 0) or hidden [W, hidden] in; hidden out, or logits [W, V] from the last.

        Kept layers (`hidden`) of this stage are copied into that buffer, which lives on the output
        device: for a split model the copy crosses GPUs and cannot be captured, so such a runner
        falls back to the static cache without graphs (reported).
        """
        c = self.config
        stage = self.stages[s]
        kv_len = kv_len or c.cache_len
        if s == 0:
            x = F.embedding(x, self.embed).to(self.dtype)  # [W, hidden]
        width = x.shape[0]
        slots = start + stage.key_pos[:width]  # [W] cache slots written
        if tree is None:
            pos = slots  # [W] absolute positions
            # Causal over the static cache: slots beyond a query's position (the future, or stale tokens
            # left by a rollback) are masked.
            mask = stage.key_pos[None, :kv_len] <= pos[:, None]  # [W, L]
        else:
            pos, mask = tree.positions_and_mask(start, stage.key_pos[:kv_len])
        fused = rope_kernel.runs(x)  # RoPE, the cache writes and the query layout in one launch a layer
        if not fused:
            cos = stage.cos.index_select(0, pos)[:, None, :]  # [W, 1, D] broadcasts over heads
            sin = stage.sin.index_select(0, pos)[:, None, :]
        mask = mask.repeat(c.group, 1)  # [G*W, L]: rows repeat per query head of a KV group (see below)
        # Additive form built once per forward, not converted from bool inside every layer.
        bias = torch.zeros(mask.shape, dtype=self.dtype, device=stage.device).masked_fill_(~mask, float("-inf"))
        q_size = c.n_heads * c.head_dim
        keep = {} if hidden is None else {layer: slot for slot, layer in enumerate(hidden[1])}
        for index, layer in enumerate(stage.layers, stage.first):
            qk, v = layer.heads(x, c, (width,))  # [W, Hq + Hkv, D], [W, Hkv, D]
            # GQA without copying the cache: the G query heads sharing one KV head (HF orders them
            # consecutively) become G*W query rows against that head.
            if fused:  # the same values, bit for bit, as the torch ops below (engine/runners/rope_kernel.py)
                q = rope_kernel.rope_and_write(qk, v, stage.cos, stage.sin, pos, slots, layer.k_cache,
                                               layer.v_cache, c.n_heads)  # [1, Hkv, G*W, D]
            else:
                qk = rope(qk, cos, sin, c)  # [W, Hq + Hkv, D]
                k = qk[:, c.n_heads :].transpose(0, 1).unsqueeze(0)  # [1, Hkv, W, D]
                layer.k_cache.index_copy_(2, slots, k)  # [1, Hkv, L, D]
                layer.v_cache.index_copy_(2, slots, v.transpose(0, 1).unsqueeze(0))
                q = qk[:, : c.n_heads].transpose(0, 1).reshape(1, c.n_kv_heads, c.group * width, c.head_dim)
            o = self._attend(q, layer.k_cache[:, :, :kv_len], layer.v_cache[:, :, :kv_len], bias)  # [1, Hkv, G*W, D]
            o = o.reshape(c.n_heads, width, c.head_dim).transpose(0, 1).reshape(width, q_size)  # [W, Hq*D]
            x = layer.finish(x, o, c)
            if index in keep:
                slot = keep[index]
                hidden[0][:, slot * c.hidden : (slot + 1) * c.hidden].copy_(x)
        if s < len(self.stages) - 1:
            return x  # [W, hidden]
        if not logits:
            return None
        x = _rms_norm(x, self.norm, c.eps)
        return self.logits_of(x)

    def logits_of(self, x: torch.Tensor) -> torch.Tensor:
        """Normed rows [W, hidden] -> float32 logits [W, V] through the output head (a packed one as it is)."""
        if self.lm_module is not None:
            step = self.lm_rows_per_call
            if not step or x.shape[0] <= step:
                return self.lm_module(x).float()
            out = x.new_empty(x.shape[0], self.config.vocab_size, dtype=torch.float32)
            for i in range(0, x.shape[0], step):
                out[i:i + step] = self.lm_module(x[i:i + step])
            return out
        return F.linear(x, self.lm_head, self.lm_bias).float()

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """q [1, Hkv, G*W, D], k/v [1, Hkv, L, D], additive mask bias [G*W, L] -> [1, Hkv, G*W, D]."""
        if self.attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.config.scaling)
        # "math": two batched matmuls. With a handful of query rows, fused attention kernels
        # parallelise over query blocks and heads only (a few thread blocks for a long cache),
        # while cuBLAS splits the long key dimension; which wins is measured by bench/fast_path_vs_hf.py.
        return math_attention(q, k, v, bias, self.config.scaling)


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                   scaling: float) -> torch.Tensor:
    """Attention as two batched matmuls and a float32 softmax: q [B, Hkv, R, D], k/v [B, Hkv, L, D], additive
    bias broadcasting to [B, Hkv, R, L] -> [B, Hkv, R, D]."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling  # [B, Hkv, R, L]
    probs = torch.softmax(scores + bias, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
