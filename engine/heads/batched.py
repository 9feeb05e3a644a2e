"""The draft head of every served sequence at once: one cache row per slot, one forward per draft position.

The single-sequence HeadRunner (runner.py) drafts for one sequence: a catch-up over the rows the target
just verified, then K-1 chain steps. In a batch each sequence would run its own (engine/decoding/batch.py
drafted them one after another, each with its own host sync: on an H200 four sequences' drafting took about
as long as the batched verify). Here one catch-up takes every slot's new rows together, right-padded to the
widest, and each chain step drafts the next token of every slot: the head's weights stream once per draft
position whatever the number of sequences, and K replays draft for the whole batch.

A forward runs the first R slots (R: the smallest row bucket, 1, 2, 4, ... up to `slots`, that holds every slot
with new rows), as the batched target's static forward (runners/batched_graphs.py): a slot below R with fewer
new rows than the widest (or none: a sequence that drafts otherwise, a free row) writes its padding at its own
length and past, where attention masks it by position until a later catch-up overwrites it, and its drafts
are not read. The cache holds 2 * (K_max + 1) slots beyond the context so that padding and
chain steps past any row's length stay inside it. Its inputs and outputs are static buffers: CUDA graphs per
(rows, catch-up width, span) and per (rows, span) for the chain step, captured at load, replay it; elsewhere it
runs eagerly.
"""
from __future__ import annotations

import logging

import torch

from engine.heads.model import DraftHead, rope
from engine.runners.batched_graphs import row_buckets
from engine.runners.graphs import capture, kv_buckets
from engine.runners.lean import CACHE_ALIGN, PREFILL_CHUNK, math_attention

log = logging.getLogger(__name__)

MIN_BUCKET = 512  # smallest attention span, as the lone head runner's


class BatchedHeadRunner:
    """A DraftHead over `slots` cache rows: catch_up() for every slot's new rows, step() for every slot's next draft."""

    def __init__(self, head: DraftHead, slots: int, max_length: int, k_max: int, graphs: bool | None = None) -> None:
        """graphs: capture CUDA graphs at warmup() (default: on CUDA)."""
        assert head.lm_rows is not None, "bind() the head to its target before building a runner"
        c = self.config = head.config
        self.head = head
        self.slots = slots
        self.max_length = max_length
        self.widest = k_max + 1  # a fully accepted round's rows: the widest catch-up a round needs
        self.device, self.dtype = head.lm_rows.device, head.lm_rows.dtype
        cache_len = -(-(max_length + 2 * self.widest) // CACHE_ALIGN) * CACHE_ALIGN
        self.spans = kv_buckets(cache_len, MIN_BUCKET)
        self.use_graphs = self.device.type == "cuda" if graphs is None else graphs and self.device.type == "cuda"
        self.row_buckets = row_buckets(slots)
        self.graphs: dict[tuple[str, int, int, int], torch.cuda.CUDAGraph] = {}  # (kind, rows, width, span) -> graph
        self.lengths = [0] * slots  # positions each row's cache holds (its sequence's committed rows read)
        dev, dt = self.device, self.dtype
        with torch.inference_mode(False), torch.no_grad():
            self.k_cache = torch.zeros(slots, c.n_kv_heads, cache_len, c.head_dim, device=dev, dtype=dt)
            self.v_cache = torch.zeros_like(self.k_cache)
            # the K/V of each layer after the first (HeadConfig.layers), at the same positions
            self.more_kv = [(torch.zeros_like(self.k_cache), torch.zeros_like(self.k_cache)) for _ in head.more]
            self.key_pos = torch.arange(cache_len, device=dev)  # [L]
            self.cos, self.sin = head.rope_tables(cache_len, dev, dt)  # [L, D] each
            widths = range(1, self.widest + 1)
            self.feat_in = {w: torch.zeros(slots, w, c.features, device=dev, dtype=dt) for w in widths}
            self.ids_in = {w: torch.zeros(slots, w, dtype=torch.long, device=dev) for w in widths}
            self.starts = torch.zeros(slots, dtype=torch.long, device=dev)  # [S] each row's first catch-up position
            self.last = torch.zeros(slots, dtype=torch.long, device=dev)  # [S] index of its last new row
            self.state = torch.zeros(slots, c.hidden, device=dev, dtype=dt)  # [S, H] each row's last output
            self.token = torch.zeros(slots, dtype=torch.long, device=dev)  # [S] its last draft (target id)
            self.pos = torch.zeros(slots, dtype=torch.long, device=dev)  # [S] where its next chain step writes
            self.idx = torch.zeros((), dtype=torch.long, device=dev)  # the next column of `drafts`
            self.drafts = torch.zeros(slots, self.widest, dtype=torch.long, device=dev)  # [S, K_max+1] target ids
            self.shown = torch.zeros(slots, self.widest, device=dev)  # [S, K_max+1] softmax prob of each draft

    def buffer_bytes(self) -> int:
        """Its caches and static buffers (the graphs' pool is apart)."""
        tensors = [self.k_cache, self.v_cache, *(t for kv in self.more_kv for t in kv), *self.feat_in.values(),
                   *self.ids_in.values(), self.state,
                   self.drafts, self.shown]
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- the public steps ------------------------------------------------------------------------
    def reset(self, slot: int) -> None:
        self.lengths[slot] = 0

    def span(self, end: int) -> int:
        return next(s for s in self.spans if s >= end)

    def prefill(self, slot: int, features: torch.Tensor, ids: torch.Tensor) -> None:
        """One row's first rows [N, F] with the token after each [N] (a prompt), eagerly in chunks; no draft."""
        rows = torch.tensor([slot], device=self.device)
        for f, i in zip(features.split(PREFILL_CHUNK), ids.split(PREFILL_CHUNK)):
            start, width = self.lengths[slot], i.shape[0]
            positions = start + self.key_pos[None, :width]  # [1, W]
            self._layer(self.head.fuse(f.to(self.dtype))[None], self.head.embed_ids(i)[None], positions, rows,
                        self.span(start + width))
            self.lengths[slot] += width

    def catch_up(self, rows: dict[int, tuple[torch.Tensor, list[int]]], steps: int) -> None:
        """Every slot in `rows` reads its new rows [w, F] with the token after each (1 <= w <= widest); its last
        row drafts its first token into `drafts[slot, 0]`, then `steps` chain steps draft the next ones.
        Slots not in `rows` run on their padding and draft nothing anyone reads."""
        width = max(len(ids) for _, ids in rows.values())
        assert 1 <= width <= self.widest and 0 <= steps < self.widest, "a round's rows and drafts"
        r = next(b for b in self.row_buckets if b > max(rows))  # the slots that run
        ids = torch.zeros(r, width, dtype=torch.long)
        last = torch.zeros(r, dtype=torch.long)
        feats = self.feat_in[width]
        for slot, (features, tokens) in rows.items():
            feats[slot, : len(tokens)].copy_(features, non_blocking=True)
            ids[slot, : len(tokens)] = torch.tensor(tokens)
            last[slot] = len(tokens) - 1
        self.ids_in[width][:r].copy_(ids, non_blocking=True)
        self.last[:r].copy_(last, non_blocking=True)
        self.starts[:r].copy_(torch.tensor(self.lengths[:r]), non_blocking=True)
        # One span for the round: every row's catch-up and chain steps, padding included, attend within it.
        span = self.span(max(self.lengths[:r]) + width + steps)
        self._run(("catch", r, width, span), lambda: self._catch_up_body(r, width, span))
        for _ in range(steps):
            self._run(("step", r, 1, span), lambda: self._step_body(r, span))
        for slot, (_, tokens) in rows.items():
            self.lengths[slot] += len(tokens)

    def _run(self, key: tuple[str, int, int, int], body) -> None:
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
        else:
            body()

    # -- the bodies (captured as graphs on CUDA) --------------------------------------------------
    def _catch_up_body(self, r: int, width: int, span: int) -> None:
        """The first r slots read their new rows; each one's last drafts its first token."""
        head = self.head
        starts, last = self.starts[:r], self.last[:r]
        positions = starts[:, None] + self.key_pos[:width]  # [R, W]
        out = self._layer(head.fuse(self.feat_in[width][:r]), head.embed_ids(self.ids_in[width][:r]), positions,
                          None, span)
        self._tail(r, out[torch.arange(r, device=self.device), last])  # [R, H]: each row's last new row
        self.pos[:r].copy_(starts + last + 1)
        self.drafts[:r, 0].copy_(self.token[:r])
        self.shown[:r, 0].copy_(self._shown)
        self.idx.fill_(1)

    def _step_body(self, r: int, span: int) -> None:
        """The first r slots draft their next token."""
        state, token, pos = self.state[:r], self.token[:r], self.pos[:r]
        out = self._layer(state[:, None], self.head.embed_ids(token)[:, None], pos[:, None], None, span)
        self._tail(r, out[:, 0])
        column = self.idx.view(1)
        self.drafts[:r].index_copy_(1, column, self.token[:r, None])
        self.shown[:r].index_copy_(1, column, self._shown[:, None])
        pos.add_(1)
        self.idx.add_(1)

    def _tail(self, r: int, last: torch.Tensor) -> None:
        """Each row's greedy draft from its last state [R, H]: token, shown probability, the next step's state."""
        logits = self.head.logits(last).float()  # [R, Vd]
        best = logits.argmax(-1, keepdim=True)  # [R, 1]
        self._shown = torch.softmax(logits, -1).gather(1, best)[:, 0]  # [R]
        self.state[:r].copy_(last)
        self.token[:r].copy_(self.head.d2t[best[:, 0]])

    def _layer(self, h: torch.Tensor, emb: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None,
               span: int) -> torch.Tensor:
        """The decoder layers over rows [B, W] (the first B slots, or `rows`' slots) at `positions` [B, W]: states
        and embeddings [B, W, H] -> [B, W, H], their K/V written to those positions, each row causal over its own."""
        c, head = self.config, self.head
        b, w = positions.shape
        n = b * w
        cos = self.cos[positions].reshape(n, -1)  # [N, D]
        sin = self.sin[positions].reshape(n, -1)
        group = c.n_heads // c.n_kv_heads
        mask = self.key_pos[:span] <= positions[:, :, None]  # [B, W, span]
        mask = mask[:, None].expand(b, group, w, span).reshape(b, 1, group * w, span)
        bias = torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill_(~mask, float("-inf"))
        where = (torch.arange(b, device=self.device) if rows is None else rows)[:, None].expand(b, w)  # [B, W]
        h = h.reshape(n, -1)
        q, k, v = head.project(h, emb.reshape(n, -1).to(h.dtype))  # [N, Hq, D], [N, Hkv, D] x2
        attend = lambda q, k, v, k_cache, v_cache: self._attention(  # noqa: E731
            q, k, v, cos, sin, positions, where, rows, bias, span, k_cache, v_cache)
        h = head.finish(h, attend(q, k, v, self.k_cache, self.v_cache))
        for layer, (k_cache, v_cache) in zip(head.more, self.more_kv):
            h = layer.finish(h, attend(*layer.project(h), k_cache, v_cache))
        return h.view(b, w, -1)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor, where: torch.Tensor, rows: torch.Tensor | None, bias: torch.Tensor,
                   span: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """One layer's attention over rows [B, W]: q [N, Hq, D], k/v [N, Hkv, D] rotated, K/V written at `positions`
        of the slots `where` [B, W] in its cache, each row over its own slot's span -> [N, Hq * D]."""
        c = self.config
        b, w = positions.shape
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        k_cache[where, :, positions] = k.view(b, w, c.n_kv_heads, c.head_dim)
        v_cache[where, :, positions] = v.view(b, w, c.n_kv_heads, c.head_dim)
        if rows is None:
            k_rows, v_rows = k_cache[:b, :, :span], v_cache[:b, :, :span]
        else:
            k_rows = k_cache.index_select(0, rows)[:, :, :span]
            v_rows = v_cache.index_select(0, rows)[:, :, :span]
        group = c.n_heads // c.n_kv_heads
        # [B, W, Hq, D] -> [B, Hkv, G*W, D]: a KV head's G query heads as G*W query rows (as the lone runner)
        q = q.view(b, w, c.n_heads, c.head_dim).permute(0, 2, 1, 3).reshape(b, c.n_kv_heads, group * w, c.head_dim)
        o = math_attention(q, k_rows, v_rows, bias, c.head_dim**-0.5)  # [B, Hkv, G*W, D]
        return o.reshape(b, c.n_heads, w, c.head_dim).permute(0, 2, 1, 3).reshape(b * w, c.n_heads * c.head_dim)

    # -- CUDA graphs -------------------------------------------------------------------------------
    @torch.inference_mode()
    def warmup(self) -> int:
        """Captures the catch-up widths 1..widest and the chain step per rows and span (CUDA); returns how many.
        A failure leaves the eager forward (correct, slower) and says so in the log."""
        if not self.use_graphs:
            return 0
        stream = torch.cuda.Stream(self.device)
        pool = torch.cuda.graph_pool_handle()
        todo = [("catch", r, w, s) for r in self.row_buckets for s in self.spans for w in range(1, self.widest + 1)]
        todo += [("step", r, 1, s) for r in self.row_buckets for s in self.spans]
        saved = self.lengths
        self.lengths = [0] * self.slots
        try:
            for kind, r, width, span in todo:
                def body(kind=kind, r=r, width=width, span=span) -> None:
                    if kind == "catch":
                        self._catch_up_body(r, width, span)
                    else:
                        self._step_body(r, span)
                self.starts.zero_()
                self.last.zero_()
                self.idx.zero_()
                self.graphs[(kind, r, width, span)] = capture(body, stream, pool, self.device, self.idx.zero_)
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # graphs are an optimisation: eager stays correct
            log.warning("batched draft-head graph capture failed, it runs eagerly: %s", exc, exc_info=True)
            self.graphs.clear()
            torch.cuda.synchronize(self.device)
        self.lengths = saved
        self.idx.zero_()
        return len(self.graphs)
