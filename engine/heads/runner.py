"""The draft head while decoding: its static KV cache, the catch-up and chain steps, CUDA graphs.

One round of drafting is a catch-up over the rows the target just verified (their hidden states
and the committed tokens after them; the last row yields draft token 1), then K-1 chain steps,
each feeding the head's own output state and its last draft token. Everything a step needs
and produces lives in static device buffers: the step writes its token into `drafts[idx]`,
moves `pos` and `idx` on and leaves its state for the next step, so K steps are K graph
replays with no host work in between, and nothing waits for the device.

The cache holds one entry per committed position: `length` always equals the target runner's
length after a catch-up. Chain steps write past it; those slots are masked by position and
overwritten by the next catch-up (gpt-fast style rollback, nothing to crop).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.errors import GenerationError
from engine.heads.model import DraftHead, rope
from engine.limits import TREE_ALTERNATIVES_MAX
from engine.runners.graphs import capture, kv_buckets
from engine.runners.lean import CACHE_ALIGN, PREFILL_CHUNK

log = logging.getLogger(__name__)

ALTERNATIVES = TREE_ALTERNATIVES_MAX  # next-best draft tokens kept beside each draft (a tree proposal reads up to these)
MIN_BUCKET = 512  # smallest attention span (as the target runner): one graph per (width, span)
COMPILE_SPANS = 2  # compile_step: spans whose chain step is compiled (short and medium contexts)
# Most captured replays one catch-up is split into; wider ones (a prompt's rows) run as one eager
# forward. On an H200 catch-ups of a few replays cost 1.1-1.2 ms more than a round's own one
# (bench/results/h200_auto_trace_t07_head.json, catch_up_ms): about 0.3 ms a replay.
MAX_REPLAYS = 4


class HeadRunner:
    """Runs a bound DraftHead against its own static cache; graphs on CUDA, eager elsewhere."""

    def __init__(
        self,
        head: DraftHead,
        *,
        max_length: int,
        k_max: int,
        use_graphs: bool | None = None,
        min_bucket: int = MIN_BUCKET,
        compile_step: bool = False,
    ) -> None:
        """compile_step: capture the chain step (the smallest COMPILE_SPANS spans) from an
        inductor-compiled body, which fuses its elementwise kernels (CUDA; ~20 s of warm-up each)."""
        assert head.lm_rows is not None, "bind() the head to its target before building a runner"
        c = head.config
        self.head = head
        self.config = c
        self.device = head.lm_rows.device
        self.dtype = head.lm_rows.dtype
        self.max_length = max_length
        self.k_max = k_max
        cache_len = -(-max_length // CACHE_ALIGN) * CACHE_ALIGN
        self.buckets = kv_buckets(cache_len, min_bucket)
        cuda = self.device.type == "cuda"
        self.use_graphs = cuda if use_graphs is None else (use_graphs and cuda)
        self.length = 0  # committed positions in the cache
        self.graphs: dict[tuple[str, int, int], torch.cuda.CUDAGraph] = {}  # (kind, width, span) -> graph
        self._side_stream: torch.cuda.Stream | None = None  # warm-ups and captures (CUDA)
        self.pool: object | None = None  # the graphs' memory pool (CUDA), shared by later captures (trees)
        with torch.inference_mode(False), torch.no_grad():
            dev, dt = self.device, self.dtype
            shape = (1, c.n_kv_heads, cache_len, c.head_dim)
            self.k_cache = torch.zeros(shape, device=dev, dtype=dt)
            self.v_cache = torch.zeros(shape, device=dev, dtype=dt)
            # the K/V of each layer after the first (HeadConfig.layers), at the same slots
            self.more_kv = [(torch.zeros(shape, device=dev, dtype=dt), torch.zeros(shape, device=dev, dtype=dt))
                            for _ in head.more]
            self.key_pos = torch.arange(cache_len, device=dev)  # [L]
            self.cos, self.sin = head.rope_tables(cache_len, dev, dt)  # [L, D] each
            self.start = torch.zeros((), dtype=torch.long, device=dev)  # catch-up write position
            self.pos = torch.zeros((), dtype=torch.long, device=dev)  # chain step write position
            self.idx = torch.zeros((), dtype=torch.long, device=dev)  # next slot of `drafts`
            self.state = torch.zeros(1, c.hidden, device=dev, dtype=dt)  # [1, H] the head's last output
            self.token = torch.zeros(1, dtype=torch.long, device=dev)  # [1] its last draft (target id)
            self.drafts = torch.zeros(k_max + 1, dtype=torch.long, device=dev)  # [K_max+1] target ids
            self.shown = torch.zeros(k_max + 1, dtype=torch.float32, device=dev)  # softmax prob of each draft
            self.alts = torch.zeros(k_max + 1, ALTERNATIVES, dtype=torch.long, device=dev)  # next-best target ids
            self.last_logits = torch.zeros(c.draft_vocab, dtype=torch.float32, device=dev)  # [Vd] last step's
            self.feat_in: dict[int, torch.Tensor] = {}  # width -> [W, F] catch-up features
            self.ids_in: dict[int, torch.Tensor] = {}  # width -> [W] catch-up tokens
        self.name = "head-eager"
        self._compiled_step = (torch.compile(self._step_body, dynamic=False, fullgraph=True)
                               if compile_step and self.use_graphs else None)

    # -- the public steps ----------------------------------------------------------------------

    def reset(self) -> None:
        self.length = 0

    @property
    def widest_catch_up(self) -> int:
        """The widest captured catch-up: a fully accepted round's K_max + 1 rows."""
        return self.k_max + 1

    def span(self, end: int) -> int:
        """The smallest attention span holding `end` positions."""
        if end > self.buckets[-1]:
            raise GenerationError(f"The draft head's cache holds {self.max_length} positions; {end} were needed.")
        return next(b for b in self.buckets if b >= end)

    def catch_up(self, features: torch.Tensor, ids: torch.Tensor, span: int) -> None:
        """Appends rows [W, F] with the tokens after them [W]; its last row drafts token 1.

        Leaves the state for chain steps in the static buffers; `drafts[0]` is the greedy draft.
        """
        width = ids.shape[0]
        if self.length + width > self.max_length:
            raise GenerationError("The draft head's cache is full; shorten the prompt or max_new_tokens.")
        # Wider than one captured catch-up (rows of a stretch it did not draft: standard steps, another
        # proposer's rounds): a few replays of captured widths, the last one drafting. Run eagerly, such
        # catch-ups made the head's rounds in auto draft in 1.65 ms on an H200 against 0.9 for their
        # tokens (bench/results/h200_auto_trace_t07_head.json); a prompt's hundreds of rows stay one
        # eager forward.
        widest = self.widest_catch_up
        sizes = [width % widest or widest] + [widest] * ((width - 1) // widest)
        graphs = [self.graphs.get(("catch", w, span)) for w in sizes] if len(sizes) <= MAX_REPLAYS else [None]
        if width and all(graph is not None for graph in graphs):
            done = 0
            for w, graph in zip(sizes, graphs):
                self.feat_in[w].copy_(features[done : done + w], non_blocking=True)
                self.ids_in[w].copy_(ids[done : done + w], non_blocking=True)
                self.start.fill_(self.length)
                graph.replay()
                self.length += w
                done += w
            return
        for f, i in zip(features.split(PREFILL_CHUNK), ids.split(PREFILL_CHUNK)):
            self.start.fill_(self.length)
            self._catch_up_body(f, i, max(span, self.span(self.length + i.shape[0])))
            self.length += i.shape[0]

    def step(self, span: int) -> None:
        """One chain step at `pos`: feeds `state` and `token`, writes the next draft at `drafts[idx]`."""
        graph = self.graphs.get(("step", 1, span))
        if graph is not None:
            graph.replay()
        else:
            self._step_body(span)

    # -- the bodies (captured as graphs on CUDA) ------------------------------------------------

    def _catch_up_body(self, features: torch.Tensor, ids: torch.Tensor, span: int) -> None:
        head = self.head
        h = head.fuse(features.to(self.dtype))  # [W, H]
        out = self._layer(h, head.embed_ids(ids), self.start, span)  # [W, H]
        self._tail(out[-1:])
        self.pos.copy_(self.start + ids.shape[0])
        self.drafts[:1].copy_(self.token)
        self.shown[:1].copy_(self._shown)
        self.alts[:1].copy_(self._alts)
        self.idx.fill_(1)

    def _step_body(self, span: int) -> None:
        out = self._layer(self.state, self.head.embed_ids(self.token), self.pos.view(1), span)  # [1, H]
        self._tail(out)
        self.drafts.index_copy_(0, self.idx.view(1), self.token)
        self.shown.index_copy_(0, self.idx.view(1), self._shown)
        self.alts.index_copy_(0, self.idx.view(1), self._alts)
        self.pos.add_(1)
        self.idx.add_(1)

    def _tail(self, last: torch.Tensor) -> None:
        """Greedy draft of the last row [1, H]: its token, shown probability, logits, state and the
        next-best tokens (for a tree of drafts)."""
        logits = self.head.logits(last)[0].float()  # [Vd]
        top = logits.topk(1 + ALTERNATIVES).indices  # [1 + A], best first
        best = top[:1]  # [1]
        self._alts = self.head.d2t.index_select(0, top[1:]).view(1, -1)  # [1, A] target ids
        self._shown = torch.softmax(logits, -1).gather(0, best)  # [1]
        self.last_logits.copy_(logits)
        self.state.copy_(last)
        self.token.copy_(self.head.d2t.index_select(0, best))

    def _layer(self, h: torch.Tensor, emb: torch.Tensor, start: torch.Tensor, span: int) -> torch.Tensor:
        """The decoder layers over W rows at positions start.. (writing their K/V): [W, H] -> [W, H]."""
        width = h.shape[0]
        pos = start.view(-1)[:1] + self.key_pos[:width]  # [W]
        return self.attend(h, emb, pos, pos, self.key_pos[None, :span] <= pos[:, None], span)

    def attend(self, h: torch.Tensor, emb: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               visible: torch.Tensor, span: int) -> torch.Tensor:
        """The decoder layers over W rows: states h [W, H] and token embeddings [W, H] at RoPE positions [W],
        their K/V written to cache slots [W], each row attending to the slots `visible` [W, span] says.

        A chain's rows sit at their own slots and see every slot up to theirs; a tree's rows (engine/heads/
        tree.py) share positions between siblings, so their slots and what they see are given apart. Every
        layer after the first reads the state the one before left, at the same slots in its own cache.
        """
        c, head = self.config, self.head
        cos, sin = self.cos.index_select(0, positions), self.sin.index_select(0, positions)  # [W, D]
        mask = visible.repeat(c.n_heads // c.n_kv_heads, 1)  # [G*W, span]
        bias = torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill_(~mask, float("-inf"))
        q, k, v = head.project(h, emb)  # [W, Hq, D], [W, Hkv, D], [W, Hkv, D]
        h = head.finish(h, self._attention(q, k, v, cos, sin, slots, bias, span, self.k_cache, self.v_cache))
        for layer, (k_cache, v_cache) in zip(head.more, self.more_kv):
            q, k, v = layer.project(h)
            h = layer.finish(h, self._attention(q, k, v, cos, sin, slots, bias, span, k_cache, v_cache))
        return h

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   slots: torch.Tensor, bias: torch.Tensor, span: int, k_cache: torch.Tensor,
                   v_cache: torch.Tensor) -> torch.Tensor:
        """One layer's attention: q [W, Hq, D], k/v [W, Hkv, D] rotated, K/V written to `slots` of its cache,
        each row over the span as `bias` [G*W, span] allows -> [W, Hq * D]."""
        c = self.config
        width = q.shape[0]
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        k_cache.index_copy_(2, slots, k.transpose(0, 1).unsqueeze(0))  # [1, Hkv, L, D]
        v_cache.index_copy_(2, slots, v.transpose(0, 1).unsqueeze(0))
        group = c.n_heads // c.n_kv_heads
        # GQA without copying the cache: a KV head's G query heads become G*W query rows.
        q = q.transpose(0, 1).reshape(1, c.n_kv_heads, group * width, c.head_dim)
        k_span, v_span = k_cache[:, :, :span], v_cache[:, :, :span]
        if self.device.type == "cuda":
            o = F.scaled_dot_product_attention(q, k_span, v_span, attn_mask=bias, scale=c.head_dim**-0.5)
        else:  # a handful of query rows: two matmuls beat the CPU flash kernel (8 ms vs 0.1 at span 1024)
            scores = torch.matmul(q, k_span.transpose(-1, -2)) * c.head_dim**-0.5 + bias  # [1, Hkv, G*W, span]
            o = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v_span)  # [1, Hkv, G*W, D]
        return o.reshape(c.n_heads, width, c.head_dim).transpose(0, 1).reshape(width, c.n_heads * c.head_dim)

    # -- CUDA graphs ----------------------------------------------------------------------------

    def warmup(self, progress: Callable[[float, str], None] | None = None) -> None:
        """Captures the catch-up widths 1..k_max+1 and the chain step, per span (about a second)."""
        report = progress or (lambda fraction, message: None)
        saved = self.length
        todo = [("catch", w, s) for s in self.buckets for w in range(1, self.widest_catch_up + 1) if w <= s]
        todo += [("step", 1, s) for s in self.buckets]
        if not self.use_graphs:
            feats = torch.zeros(2, self.config.features, device=self.device, dtype=self.dtype)
            self.length = 0
            self.catch_up(feats, torch.zeros(2, dtype=torch.long, device=self.device), self.buckets[0])
            self.step(self.buckets[0])
            self.length = saved
            report(1.0, "draft head ready (eager)")
            return
        try:
            with torch.cuda.device(self.device), torch.inference_mode(False), torch.no_grad():
                pool = self.pool = torch.cuda.graph_pool_handle()
                for i, (kind, width, span) in enumerate(todo):
                    if i % 16 == 0:
                        report(i / len(todo), f"capturing draft-head graphs ({i}/{len(todo)})")
                    self._capture(kind, width, span, pool)
            self.name = "head-cuda-graphs+compile" if self._compiled_step is not None else "head-cuda-graphs"
            log.info("draft head: captured %d CUDA graphs", len(todo))
        except Exception as exc:  # graphs are an optimisation: eager stays correct
            log.warning("draft-head graph capture failed, running it eagerly: %s", exc, exc_info=True)
            self.graphs.clear()
            self.name = "head-eager"
            torch.cuda.synchronize(self.device)
        self.length = saved
        report(1.0, f"draft head ready ({self.name})")

    def _capture(self, kind: str, width: int, span: int, pool: object) -> None:
        if kind == "catch" and width not in self.feat_in:
            self.feat_in[width] = torch.zeros(width, self.config.features, device=self.device, dtype=self.dtype)
            self.ids_in[width] = torch.zeros(width, dtype=torch.long, device=self.device)

        step = self._step_body
        if self._compiled_step is not None and span in self.buckets[:COMPILE_SPANS]:
            step = self._compiled_step

        def body() -> None:
            if kind == "catch":
                self._catch_up_body(self.feat_in[width], self.ids_in[width], span)
            else:
                step(span)

        def reset() -> None:
            self.pos.fill_(0)
            self.idx.fill_(0)

        self.start.fill_(0)
        self.capture_graph((kind, width, span), body, reset, pool)

    def capture_graph(self, key: tuple, body: Callable[[], None], reset: Callable[[], None], pool: object) -> None:
        """Captures `body` as the graph `key` (warm-ups first); `reset` puts its device counters back
        before each warm-up run and after the capture, so they run from the same state as a replay."""
        reset()
        # One side stream for every warm-up and capture of this runner, as the target's runner does: the
        # caching allocator keeps blocks per stream, so a new stream per capture keeps each capture's
        # blocks apart and memory grows with the number of graphs (bench/head_memory.py measures it).
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        graph = capture(body, self._side_stream, pool, self.device, reset)
        reset()
        graph.replay()
        torch.cuda.synchronize(self.device)
        self.graphs[key] = graph

    def measure_ms(self, k: int = 5, iters: int = 20) -> float:
        """Milliseconds per draft token as the proposer spends them: a catch-up of width 2, k-1 steps.

        Writes past the committed length only (as drafting does), so the cache is left as it was.
        """
        saved = self.length
        k = max(1, min(k, self.k_max))
        feats = torch.zeros(2, self.config.features, device=self.device, dtype=self.dtype)
        ids = torch.zeros(2, dtype=torch.long, device=self.device)
        span = self.span(saved + 2 + k)

        def round_() -> None:
            self.length = saved
            self.catch_up(feats, ids, span)
            for _ in range(k - 1):
                self.step(span)

        total = self.time_ms(round_, iters)
        self.length = saved
        return total / (iters * k)

    def time_ms(self, round_: Callable[[], None], iters: int) -> float:
        """Milliseconds `iters` calls of `round_` take after one untimed call: CUDA events on a GPU (the
        device's time, not the launches'), the wall clock elsewhere."""
        round_()
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            for _ in range(iters):
                round_()
            return (time.perf_counter() - t0) * 1000
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(self.device)
        begin.record()
        for _ in range(iters):
            round_()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end)
