"""The draft head's weights and maths: fuse target features, decoder layers, the target's output rows.

Position j of the head reads the target's hidden states at j (the outputs of a low, a middle and
a high layer, fused by `fc`: EAGLE-3) and the embedding of token j+1, and predicts token j+2.
Chained drafting feeds the head's own output back in place of the fused features (EAGLE's
feature-level autoregression). The layer is the target's architecture (RMSNorm, RoPE, GQA,
SiLU MLP) with a narrower MLP, and q/k/v read the concatenation [norm(embedding), norm(hidden)]
with the hidden state as the residual. A head of more layers (`HeadConfig.layers`) runs each later one
as a plain decoder layer over the state (`ExtraLayer`, its own K/V cache); a later layer's output
projections start at zero, so a layer added to a trained head starts as the identity. The last
layer's output goes through a final norm and the target's own output rows for a reduced draft
vocabulary (`d2t`: draft row -> target id), so a draft step reads 32k rows instead of 152k and
nothing of the target is stored twice on disk.

Both the training loop (engine/heads/train.py, batched with its own attention pattern) and the
decoding runner (engine/heads/runner.py, static KV cache) call the pieces below, so the maths
they train and the maths they run are the same code.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from engine.heads.config import HeadConfig
from engine.models import fastquant
from engine.models.fastquant import rms_norm

INIT_STD = 0.02  # as Hugging Face initialises Qwen2/Llama linears
LAYER_WEIGHTS = ("fc", "wqkv", "wo", "w13", "w2")  # the matrices quantize() can turn 8-bit




def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., W, heads, D] rotated at the positions of cos/sin [W, D] (HF's rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[..., :, None, :] + rotated * sin[..., :, None, :]


class LayerMaths(nn.Module):
    """What every decoder layer of the head shares: its linears (8-bit once quantized), the split of q/k/v
    and the attention output's residual, norm and MLP. Subclasses own wqkv, wo, post_norm, w13 and w2."""

    config: HeadConfig
    quantized: nn.ModuleDict

    def _linear(self, name: str, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W_name.T (+ residual): the 8-bit kernel (the add fused) once quantized, else F.linear."""
        if name in self.quantized:
            return self.quantized[name](x, residual=residual)
        out = F.linear(x, getattr(self, name).to(x.dtype))
        return out if residual is None else residual + out

    def _quantize(self, names: tuple[str, ...], kind: str) -> int:
        """These matrices as QuantLinear (their float weights released); how many this layer has quantized."""
        for name in names:
            weight = getattr(self, name)
            if weight is None:
                continue
            with torch.no_grad():
                q, scale = fastquant.quantize(weight.detach(), kind)
            self.quantized[name] = fastquant.QuantLinear(q, scale, None, kind)
            setattr(self, name, None)
        return len(self.quantized)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's input [..., W, In] -> q [..., W, Hq, D], k, v [..., W, Hkv, D]."""
        c = self.config
        qkv = self._linear("wqkv", x)
        q_size, kv_size = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        q = qkv[..., :q_size].unflatten(-1, (c.n_heads, c.head_dim))
        k = qkv[..., q_size : q_size + kv_size].unflatten(-1, (c.n_kv_heads, c.head_dim))
        v = qkv[..., q_size + kv_size :].unflatten(-1, (c.n_kv_heads, c.head_dim))
        return q, k, v

    def finish(self, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Residual state h [..., W, H] and attention output [..., W, Hq * D] -> the new state [..., W, H]."""
        c = self.config
        dtype = h.dtype
        h = self._linear("wo", attended, residual=h)
        gate, up = self._linear("w13", rms_norm(h, self.post_norm.to(dtype), c.eps)).chunk(2, dim=-1)
        return self._linear("w2", F.silu(gate) * up, residual=h)


class ExtraLayer(LayerMaths):
    """A decoder layer after the first: q/k/v from the normed state alone, the target's architecture."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        c = self.config = config
        self.in_norm = nn.Parameter(torch.ones(c.hidden))
        self.wqkv = nn.Parameter(torch.empty((c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.hidden))
        self.wo = nn.Parameter(torch.zeros(c.hidden, c.n_heads * c.head_dim))  # zero: starts as the identity
        self.post_norm = nn.Parameter(torch.ones(c.hidden))
        self.w13 = nn.Parameter(torch.empty(2 * c.intermediate, c.hidden))
        self.w2 = nn.Parameter(torch.zeros(c.hidden, c.intermediate))  # zero: starts as the identity
        for w in (self.wqkv, self.w13):
            nn.init.normal_(w, std=INIT_STD)
        self.quantized = nn.ModuleDict()

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """State h [..., W, H] -> q [..., W, Hq, D], k, v [..., W, Hkv, D]."""
        return self._split(rms_norm(h, self.in_norm.to(h.dtype), self.config.eps))


class DraftHead(LayerMaths):
    """The trained weights; the target's embeddings and output rows are bound, not owned."""

    def __init__(self, config: HeadConfig, d2t: torch.Tensor) -> None:
        super().__init__()
        c = config
        assert c.layers >= 1, "a draft head has at least one decoder layer"
        self.config = c
        n_feat = len(c.feature_layers)
        qkv_rows = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
        self.feat_norm = nn.Parameter(torch.ones(n_feat, c.hidden))  # one norm per fused layer
        self.fc = nn.Parameter(torch.empty(c.hidden, c.features))  # [H, n_feat * H]
        self.emb_norm = nn.Parameter(torch.ones(c.hidden))
        self.hid_norm = nn.Parameter(torch.ones(c.hidden))
        self.wqkv = nn.Parameter(torch.empty(qkv_rows, 2 * c.hidden))  # [(Hq + 2 Hkv) * D, 2H]
        self.wo = nn.Parameter(torch.empty(c.hidden, c.n_heads * c.head_dim))
        self.post_norm = nn.Parameter(torch.ones(c.hidden))
        self.w13 = nn.Parameter(torch.empty(2 * c.intermediate, c.hidden))  # gate and up
        self.w2 = nn.Parameter(torch.empty(c.hidden, c.intermediate))  # down
        self.final_norm = nn.Parameter(torch.ones(c.hidden))
        assert d2t.ndim == 1 and d2t.numel() == c.draft_vocab, "d2t must list one target id per draft row"
        self.register_buffer("d2t", d2t.long().clone())  # [Vd] draft row -> target token id
        for w in (self.fc, self.wqkv, self.wo, self.w13, self.w2):
            nn.init.normal_(w, std=INIT_STD)
        self.quantized = nn.ModuleDict()  # name -> QuantLinear, once quantize() ran (decoding only)
        self.more = nn.ModuleList(ExtraLayer(c) for _ in range(c.layers - 1))  # layers 2.. (HeadConfig.layers)
        # Bound by bind(): the target's tensors, never saved with the head.
        self.embed: torch.Tensor | None = None  # [V, H] target input embeddings
        self.lm_rows: torch.Tensor | None = None  # [Vd, H] target output rows of the draft vocabulary
        self.lm_bias: torch.Tensor | None = None  # [Vd] or None
        self.rotary = None  # the target's rotary module (cos/sin per position)

    # -- binding to a target -----------------------------------------------------------------

    def bind(self, target: nn.Module, dtype: torch.dtype | None = None) -> DraftHead:
        """Points the head at the target's embeddings, output rows and RoPE (call before CPU packing).

        The output rows are gathered once ([Vd, H], contiguous): a draft step then reads only them.
        dtype: the rows' dtype when the output head is still in its file's (load_pair leaves linear
        weights mapped, uncast, for the packer).
        """
        with torch.no_grad(), torch.inference_mode(False):
            # an 8-bit target head (fastquant) gives its rows dequantized: the draft sees the logits the target will
            out = target.get_output_embeddings()
            if dtype is None and isinstance(out, fastquant.QuantLinear):
                dtype = target.get_input_embeddings().weight.dtype
            self.lm_rows, self.lm_bias = fastquant.head_rows(out, self.d2t, dtype)
        return self.bind_inputs(target)

    def bind_inputs(self, target: nn.Module) -> DraftHead:
        """Only the embeddings and RoPE (the output rows, once gathered, need no target)."""
        self.embed = target.get_input_embeddings().weight.detach()
        self.rotary = target.model.rotary_emb
        return self

    def rope_tables(self, length: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [length, D] for positions 0..length-1, from the target's own rotary module."""
        assert self.rotary is not None, "bind() the head to its target first"
        positions = torch.arange(length, device=device)[None]
        dummy = torch.zeros(1, device=device, dtype=dtype)
        cos, sin = self.rotary(dummy, positions)  # [1, length, D]
        return cos[0].to(dtype), sin[0].to(dtype)

    def quantize(self, kind: str) -> int:
        """The layers' matrices (fc, q/k/v, o, gate/up, down) to int8-wo or fp8, for decoding; returns how many.

        The float weights are released; the norms and the target's bound rows stay as they are (the
        output rows are the target's own head, which stays in float as the target's does).
        """
        return self._quantize(LAYER_WEIGHTS, kind) + sum(
            layer._quantize(LAYER_WEIGHTS[1:], kind) for layer in self.more)

    @property
    def kind(self) -> str | None:
        """'int8-wo' / 'fp8' once quantize() ran, else None (the layer is in float)."""
        return next((m.kind for m in self.quantized.values()), None)

    # -- the maths, shared by training and decoding --------------------------------------------

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target hidden states [..., n_feat * H] -> the head's input state [..., H].

        Each layer's state is normalised first: the residual streams of different depths differ
        in scale by orders of magnitude (and carry a few huge outlier dimensions).
        """
        c = self.config
        parts = features.unflatten(-1, (len(c.feature_layers), c.hidden))  # [..., n_feat, H]
        normed = rms_norm(parts, self.feat_norm.to(parts.dtype), c.eps).flatten(-2)  # [..., n_feat * H]
        return self._linear("fc", normed)

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.embed is not None, "bind() the head to its target first"
        return F.embedding(ids, self.embed)

    def project(self, h: torch.Tensor, emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first layer's q/k/v: state h [..., W, H] and token embedding [..., W, H] -> q [..., W, Hq, D],
        k, v [..., W, Hkv, D]."""
        c = self.config
        dtype = h.dtype
        x = torch.cat([rms_norm(emb.to(dtype), self.emb_norm.to(dtype), c.eps),
                       rms_norm(h, self.hid_norm.to(dtype), c.eps)], dim=-1)  # [..., W, 2H]
        return self._split(x)

    def grown(self, layers: int) -> DraftHead:
        """This head with `layers` decoder layers: its own weights, then new layers that start as the
        identity (zero output projections), so the grown head drafts exactly what this one does. Unbound."""
        assert layers >= self.config.layers and not self.quantized, "only a float head grows, never shrinks"
        head = DraftHead(replace(self.config, layers=layers), self.d2t.cpu())
        head.load_state_dict(self.state_dict(), strict=False)
        return head.to(device=self.fc.device, dtype=self.fc.dtype)

    def normed(self, h: torch.Tensor) -> torch.Tensor:
        """What the output rows read: the final norm of the state (regressed onto the target's)."""
        return rms_norm(h, self.final_norm.to(h.dtype), self.config.eps)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """State [..., H] -> draft-vocabulary logits [..., Vd] (in the state's dtype)."""
        assert self.lm_rows is not None, "bind() the head to its target first"
        normed = self.normed(h)
        return F.linear(normed, self.lm_rows.to(normed.dtype), None if self.lm_bias is None else self.lm_bias)

    def num_trained(self) -> int:
        return sum(p.numel() for p in self.parameters())
