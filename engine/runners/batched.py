"""Several sequences in one forward: the batched-forward seam, and its torch implementation over the lean
decoder's weights.

BatchedForward is all the batched step (engine/decoding/batch.py) asks of a model; llamacpp_batch.py is its
other implementation, on llama.cpp's own multi-sequence batches. Here, each sequence owns a row (`slot`) of
one KV cache and its own length. One forward takes every sequence's new tokens at once — a standard step's
one token, a speculative step's pending token and K drafts, a catch-up's few — flattened into [N] rows: the
linear layers (where the weights stream) run once over all N rows, attention runs per sequence against its
own row with the causal mask over its positions. Rollback is moving a row's length back (stale slots are
masked and overwritten later), as lean.py. On a GPU every row goes through one static forward instead,
replayed from CUDA graphs (batched_graphs.py).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.runners import rope_kernel
from engine.runners.batched_graphs import AllRows
from engine.runners.lean import LeanDecoder, UnsupportedModelError, _rms_norm, math_attention, rope

SPAN = 256  # forward_rows reads the cache in spans of this many slots (short contexts read little)
# How forward_rows attends, every row against its own cache: "math", two batched matmuls and a float32 softmax
# (the same ops on every device: SDPA picks a fused kernel by shape and mask, and a 4-D mask over many rows is a
# case the single-row forwards never run); "bmm", the same in three kernels (the scaling and the mask ride in the
# first matmul's epilogue, a softmax in the activation dtype); "sdpa", torch's fused attention with the mask.
ROW_ATTENTION = ("math", "bmm", "sdpa")


@dataclass(frozen=True)
class Part:
    """One sequence's share of a batched forward."""

    slot: int  # its cache row
    ids: tuple[int, ...]  # tokens appended at positions length .. length + len(ids) - 1
    outputs: int | None = None  # logits for its last `outputs` positions only (a draft step reads one); None: all
    # Tokens after `ids` still on the device ([n] long: drafts the host has not read). The static forward
    # (batched_graphs.py) copies them in place; any other route reads them to the host first.
    tail: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return len(self.ids) + (0 if self.tail is None else self.tail.shape[0])

    def on_host(self) -> Part:
        """The same part with its tail read into `ids` (a host sync)."""
        if self.tail is None:
            return self
        return Part(self.slot, (*self.ids, *self.tail.tolist()), self.outputs)


class BatchedForward(Protocol):
    """One forward over several sequences' new tokens, each sequence in its own cache row (slot)."""

    max_length: int  # most tokens one row holds
    slots: int  # rows: sequences decoded at once

    def reset(self, slot: int) -> None:
        """Empties a row for a new sequence."""

    def reserve(self, slot: int, length: int) -> None:
        """After reset(): room in the row for a prompt of `length` tokens and an answer (as Runner.reserve)."""

    def rollback(self, slot: int, length: int) -> None:
        """Keeps the row's first `length` tokens and forgets the rest."""

    def forward(self, parts: list[Part], logits: bool = True) -> list[torch.Tensor]:
        """Appends every part's ids to its row; each part's float32 logits [outputs or W, V], in order, valid
        until the next forward (logits=False, a prefill: none)."""


class RowCosts:
    """ms of a batched forward by its rows (every sequence's tokens together), as its caller measured them.

    A row count measured costs its decayed mean; another one the nearest measured count's, scaled by
    the shape of `lone_ms` (a lone forward's ms by width, index 0 unused: the costs measured at load),
    extended past its widest width along its last slope; before any measurement, `lone_ms` itself.
    """

    def __init__(self, rate: float) -> None:
        self.rate = rate  # weight of the newest forward in a row count's mean
        self.measured: dict[int, float] = {}  # rows -> decayed mean ms of the forwards of that many rows

    def observe(self, rows: int, ms: float) -> None:
        old = self.measured.get(rows)
        self.measured[rows] = ms if old is None else old + self.rate * (ms - old)

    def ms(self, lone_ms: tuple[float, ...], rows: int) -> float:
        def shape(n: int) -> float:
            top = len(lone_ms) - 1
            slope = max((lone_ms[top] - lone_ms[1]) / (top - 1), 0.0)
            return lone_ms[n] if n <= top else lone_ms[top] + slope * (n - top)

        if rows in self.measured or not self.measured:
            return self.measured.get(rows) or shape(rows)
        near = min(self.measured, key=lambda n: (abs(n - rows), n))
        return self.measured[near] * shape(rows) / shape(near)


class BatchedDecoder:
    """forward(parts) -> float32 logits [len(ids), V] per part; each part appends to its own cache row."""

    def __init__(self, model: nn.Module, max_length: int, slots: int, decoder: LeanDecoder | None = None) -> None:
        """decoder: a lean decoder already built on `model` (its fused weights are reused, not fused again).
        On a CPU whose fast path packed the linears for oneDNN (runners/cpu.py) the lean forward calls them
        as they are, the output head included."""
        self.lean = decoder or LeanDecoder(model, max_length)
        if len(self.lean.stages) != 1:
            raise UnsupportedModelError("Batched decoding needs the model on one device; serving one at a time.")
        c = self.config = self.lean.config
        self.max_length = min(max_length, c.max_length)
        self.device = self.lean.device
        self.vocab_size = c.vocab_size
        self.slots = slots
        # [layers, 2, slots, Hkv, cache_len, D]: row b holds sequence b's keys and values.
        self.kv = torch.zeros(c.n_layers, 2, slots, c.n_kv_heads, c.cache_len, c.head_dim, device=self.device,
                              dtype=self.lean.dtype)
        self.lengths = [0] * slots  # tokens cached per row
        self.kept: list[torch.Tensor] = []  # the last forward's kept layers per part (forward's `keep`)
        self.kept_rows: torch.Tensor | None = None  # forward_rows' kept layers [B, W, len(keep) * hidden]
        # True: several parts go through one forward_rows call, right-padded to the widest (one attention
        # call a layer instead of one per part, where a GPU's matmuls cost the same for a few more rows);
        # False: each part attends alone (on a CPU every padded row would cost its share of the matmuls).
        # Both give each sequence its single-sequence greedy answer (tests run both); a CPU serves with False.
        self.vectorised = False
        # Every row in one static forward, CUDA graphs on a GPU (batched_graphs.py; use_all_rows sets it up).
        self.all_rows: AllRows | None = None
        # forward_rows' attention (ROW_ATTENTION): "bmm", the fastest of the three in CUDA graphs at every rows x width
        # measured (bench/batched_forward_cost.py; bench/results/h100_batched_forward_cost.json)
        self.attention = "bmm"

    def reset(self, slot: int) -> None:
        self.lengths[slot] = 0

    def reserve(self, slot: int, length: int) -> None:
        """The cache is allocated whole: nothing to do."""

    def rollback(self, slot: int, length: int) -> None:
        assert 0 <= length <= self.lengths[slot], f"cannot roll row {slot} back to {length}"
        self.lengths[slot] = length

    @torch.no_grad()
    def forward(self, parts: list[Part], logits: bool = True, keep: tuple[int, ...] = ()) -> list[torch.Tensor]:
        """Appends every part's ids to its row; returns each part's logits [W_b, V] (float32), in order.
        logits=False (prefill): nothing is returned and no output head runs. keep: layers whose outputs are
        kept, side by side, as `kept` (each part's [W_b, len(keep) * hidden], in order: a draft head's rows)."""
        assert parts and all(p.ids for p in parts), "every part feeds at least one token"
        assert len({p.slot for p in parts}) == len(parts), "one part per cache row"
        if self.all_rows is not None:
            out = self.all_rows.forward(parts, logits, keep)
            if out is not None:
                return out
        parts = [p.on_host() for p in parts]
        if self.vectorised and len(parts) > 1:
            width = max(len(p.ids) for p in parts)
            if all(self.lengths[p.slot] + width <= self.max_length for p in parts):
                return self._forward_padded(parts, width, logits, keep)
        c, lean = self.config, self.lean
        stage = lean.stages[0]
        widths = [len(p.ids) for p in parts]
        starts = [self.lengths[p.slot] for p in parts]
        assert all(s + w <= self.max_length for s, w in zip(starts, widths)), "a row would overflow its cache"
        ids = torch.tensor([t for p in parts for t in p.ids], device=lean.input_device)  # [N]
        pos = torch.cat([torch.arange(s, s + w) for s, w in zip(starts, widths)]).to(self.device)  # [N]
        cos = stage.cos.index_select(0, pos)[:, None, :]  # [N, 1, D]
        sin = stage.sin.index_select(0, pos)[:, None, :]
        # Per part: its rows in the flat batch, its causal mask over its own cache span.
        spans = []
        offset = 0
        for s, w in zip(starts, widths):
            keys = stage.key_pos[: s + w]
            mask = keys[None, :] <= (s + stage.key_pos[:w])[:, None]  # [W, S + W]
            bias = torch.zeros(mask.shape, dtype=lean.dtype, device=self.device).masked_fill_(~mask, float("-inf"))
            spans.append((offset, w, s, bias.repeat(c.group, 1)))  # [G*W, S + W]
            offset += w
        q_size = c.n_heads * c.head_dim
        n = ids.shape[0]
        x = F.embedding(ids, lean.embed).to(lean.dtype)  # [N, hidden]
        kept: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(lean.layers):
            qk, v = layer.heads(x, c, (n,))  # [N, Hq + Hkv, D], [N, Hkv, D]
            qk = rope(qk, cos, sin, c)
            out = torch.empty(n, q_size, device=self.device, dtype=x.dtype)
            for part, (o0, w, s, bias) in zip(parts, spans):
                k_row = self.kv[index, 0, part.slot]  # [Hkv, L, D]
                v_row = self.kv[index, 1, part.slot]
                k_row[:, s: s + w] = qk[o0: o0 + w, c.n_heads:].transpose(0, 1)
                v_row[:, s: s + w] = v[o0: o0 + w].transpose(0, 1)
                q = qk[o0: o0 + w, : c.n_heads].transpose(0, 1).reshape(1, c.n_kv_heads, c.group * w, c.head_dim)
                o = lean._attend(q, k_row[None, :, : s + w], v_row[None, :, : s + w], bias)  # [1, Hkv, G*W, D]
                out[o0: o0 + w] = o.reshape(c.n_heads, w, c.head_dim).transpose(0, 1).reshape(w, q_size)
            x = layer.finish(x, out, c)
            if index in keep:
                kept[index] = x
        if keep:
            rows = torch.cat([kept[i] for i in keep], dim=1)  # [N, len(keep) * hidden], as LeanDecoder keeps them
            self.kept = list(rows.split(widths))
        for part, w in zip(parts, widths):
            self.lengths[part.slot] += w
        if not logits:
            return []
        counts = [w if p.outputs is None else min(p.outputs, w) for p, w in zip(parts, widths)]
        if counts != widths:  # only the rows someone reads go through the output head
            ends = itertools.accumulate(widths)  # each part's last row + 1 in the flat batch
            keep = torch.cat([torch.arange(e - k, e) for e, k in zip(ends, counts)]).to(self.device)
            x = x.index_select(0, keep)  # [sum(counts), hidden]
        x = _rms_norm(x, lean.norm, c.eps)
        out_logits = lean.logits_of(x)  # [sum(counts), V]
        return list(out_logits.split(counts))

    @torch.no_grad()
    def forward_rows(self, ids: torch.Tensor, starts: list[int] | torch.Tensor,
                     slots: list[int] | torch.Tensor | None = None,
                     take: torch.Tensor | None = None, kv_len: int | None = None, every: bool = False,
                     keep: tuple[int, ...] = ()) -> torch.Tensor | None:
        """Every row at once, all of one width: ids [B, W] appended to rows `slots` (default: the first B rows,
        in order; a list, or a [B] long tensor on the device, which a CUDA graph reads) at positions starts[b] ..
        starts[b] + W - 1 (a list, or such a tensor); float32 logits [B, V] of each row's token `take[b]`
        (default: its last), or with `every` all W tokens' logits [B, W, V].

        What `forward` does per part, vectorised: one attention call for all B rows against their own
        cache rows (the first `kv_len` slots, default all; the caller keeps every start + W within it),
        each row's causal mask over its own positions. No host sync and no data-dependent shapes beyond
        B, W and kv_len. Lengths are the caller's to set afterwards (a right-padded prefill writes past
        its prompt; those slots are masked until overwritten). A row whose start would overflow the
        cache is the caller's error. keep: layers whose outputs are kept side by side as `kept_rows`
        [B, W, len(keep) * hidden] (forward's `keep`).
        """
        c, lean = self.config, self.lean
        stage = lean.stages[0]
        b, w = ids.shape
        kv_len = kv_len or c.cache_len
        if not isinstance(starts, torch.Tensor):
            assert max(starts) + w <= min(kv_len, c.cache_len), "a row would overflow its cache"
            starts = torch.tensor(starts, device=self.device)
        rows = slots if slots is None or isinstance(slots, torch.Tensor) else torch.tensor(slots, device=self.device)
        pos = starts[:, None] + stage.key_pos[:w]  # [B, W]
        x = F.embedding(ids.reshape(-1).to(lean.input_device), lean.embed).to(lean.dtype)  # [B*W, hidden]
        fused = rope_kernel.runs(x)  # RoPE, the cache writes and the query layout in one launch a layer (CUDA)
        if not fused:
            cos = stage.cos[pos][:, :, None, :]  # [B, W, 1, D]
            sin = stage.sin[pos][:, :, None, :]
            where = (torch.arange(b, device=self.device) if rows is None else rows)[:, None].expand(b, w)  # [B, W]
        mask = stage.key_pos[:kv_len] <= pos[:, :, None]  # [B, W, L]
        mask = mask[:, None].expand(b, c.group, w, kv_len).reshape(b, 1, c.group * w, kv_len)
        bias = torch.zeros(mask.shape, dtype=lean.dtype, device=self.device).masked_fill_(~mask, float("-inf"))
        if self.attention == "bmm":  # the bias as the 3-D batch baddbmm adds to, built once a forward
            bias = bias.expand(b, c.n_kv_heads, c.group * w, kv_len).reshape(b * c.n_kv_heads, c.group * w, kv_len)
        q_size = c.n_heads * c.head_dim
        kept: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(lean.layers):
            qk, v = layer.heads(x, c, (b, w))  # [B, W, Hq + Hkv, D], [B, W, Hkv, D]
            k_all, v_all = self.kv[index, 0], self.kv[index, 1]  # [slots, Hkv, L, D]
            if fused:  # the same values, bit for bit, as the torch ops below
                q = rope_kernel.rope_and_write_rows(qk, v, stage.cos, stage.sin, pos, k_all, v_all, rows, c.n_heads)
            else:
                qk = rope(qk, cos, sin, c)
                k_all[where, :, pos] = qk[:, :, c.n_heads:]  # [B, W, Hkv, D] into each row's slots
                v_all[where, :, pos] = v
                # [B, W, Hq, D] -> [B, Hkv, G*W, D]: the G query heads of a KV head as G*W query rows (as lean.py)
                q = qk[:, :, : c.n_heads].permute(0, 2, 1, 3).reshape(b, c.n_kv_heads, c.group * w, c.head_dim)
            k_rows = k_all[:b, :, :kv_len] if rows is None else k_all[:, :, :kv_len].index_select(0, rows)
            v_rows = v_all[:b, :, :kv_len] if rows is None else v_all[:, :, :kv_len].index_select(0, rows)
            o = self._attend(q, k_rows, v_rows, bias)  # [B, Hkv, G*W, D]
            o = o.reshape(b, c.n_heads, w, c.head_dim).permute(0, 2, 1, 3).reshape(b * w, q_size)
            x = layer.finish(x, o, c)
            if index in keep:
                kept[index] = x.view(b, w, -1)
        if keep:
            self.kept_rows = torch.cat([kept[i] for i in keep], dim=-1)  # [B, W, len(keep) * hidden]
        if every:
            return lean.logits_of(_rms_norm(x, lean.norm, c.eps)).view(b, w, -1)
        pick = torch.full((b,), w - 1, device=self.device) if take is None else take.to(self.device)
        x = x.view(b, w, -1)[torch.arange(b, device=self.device), pick]  # [B, hidden]
        return lean.logits_of(_rms_norm(x, lean.norm, c.eps))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """q [B, Hkv, G*W, D] against each row's cache k/v [B, Hkv, L, D], the additive mask bias [B, 1, G*W, L]
        ("bmm": [B*Hkv, G*W, L]) -> [B, Hkv, G*W, D], by `attention` (ROW_ATTENTION)."""
        c = self.config
        if self.attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=c.scaling)
        if self.attention == "bmm":  # three kernels: scaled scores with the mask added in one, softmax, values
            b, h, r, d = q.shape
            scores = torch.baddbmm(bias, q.reshape(b * h, r, d), k.flatten(0, 1).transpose(1, 2), alpha=c.scaling)
            return torch.bmm(torch.softmax(scores, dim=-1), v.flatten(0, 1)).view(b, h, r, d)
        return math_attention(q, k, v, bias, c.scaling)

    def _forward_padded(self, parts: list[Part], width: int, logits: bool, keep: tuple[int, ...]) -> list[torch.Tensor]:
        """forward() through forward_rows: parts right-padded to `width` (the padding's cache slots lie past
        each row's length, masked until overwritten)."""
        ids = torch.zeros(len(parts), width, dtype=torch.long)
        for row, p in enumerate(parts):
            ids[row, : len(p.ids)] = torch.tensor(p.ids)
        starts = [self.lengths[p.slot] for p in parts]
        widths = [len(p.ids) for p in parts]
        out = self.forward_rows(ids.to(self.lean.input_device), starts, [p.slot for p in parts],
                                kv_len=self.span(max(starts) + width),
                                every=logits, keep=keep)
        if keep:
            self.kept = [self.kept_rows[row, :w] for row, w in enumerate(widths)]
        for p, w in zip(parts, widths):
            self.lengths[p.slot] += w
        if not logits:
            return []
        counts = [w if p.outputs is None else min(p.outputs, w) for p, w in zip(parts, widths)]
        return [out[row, w - k: w] for row, (w, k) in enumerate(zip(widths, counts))]

    def use_all_rows(self, keep: tuple[int, ...] = (), graphs: bool = False) -> int:
        """Forwards of every row at once from static buffers, keeping `keep`'s layers; with `graphs` (CUDA)
        captured per (width, span) now. Returns the graphs captured."""
        self.all_rows = AllRows(self, keep, graphs)
        return self.all_rows.capture()

    def span(self, positions: int) -> int:
        """Cache slots attention reads for rows of up to `positions` tokens: a multiple of SPAN, at most all."""
        return min(-(-positions // SPAN) * SPAN, self.config.cache_len)

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        """Copies rows src's caches and lengths to rows dst (packing live sequences into the first rows)."""
        if src:
            self.kv.index_copy_(2, torch.tensor(dst, device=self.device),
                                self.kv.index_select(2, torch.tensor(src, device=self.device)))
            lengths = [self.lengths[s] for s in src]
            for d, n in zip(dst, lengths):
                self.lengths[d] = n
