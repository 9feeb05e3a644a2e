"""Every cache row in one forward of a fixed shape: the batched forward's CUDA graphs.

BatchedDecoder.forward (batched.py) attends part by part: on a GPU that is hundreds of kernel launches a
forward, each part's attention a few more per layer, where the lone runner replays one graph. Here a forward
takes the first R rows at once (R: the smallest of the row buckets, 1, 2, 4, ... up to `slots`, that holds
every part's row; the batch gives a new sequence the lowest free row, so R follows the requests in flight),
each right-padded to the nearest of BATCH_WIDTHS, through forward_rows (one attention call a layer over every
row's own cache), its inputs and outputs in static buffers: one CUDA graph per (rows, padded width, attention
span), captured at load, replays it.

Rows below R that take no part in a forward (free rows, a sequence that drafts with n-gram while others feed
the draft model) still run: they write their padding at their own length, past what they hold, where attention
masks it by position until a later forward overwrites it (rollback's rule), and their outputs are not read.
Rows from R on do not run. The attention span covers every running row's positions. A prompt's chunk (no logits)
goes into its one row, right-padded to the nearest of PREFILL_WIDTHS, from a graph per (padded width, span): eagerly,
the per-part forward of one chunk costs about 20 ms of launches on a GPU whose forward takes 2.5 (every sequence
in the batch waits for it; bench/results/h100_batched_forward_cost.json). A forward this cannot take (wider than
the widest width; a row too near the end of its cache; other layers kept; several prompts at once) goes to the
per-part forward, the same maths.

On a CPU the same static forward runs eagerly (tests compare it with the per-part one); on a GPU it pays because
the matmuls cost about the same for a few more rows (the rows are where the weights stream once).
"""
from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING

import torch

from engine.limits import BATCH_WIDTHS, PREFILL_WIDTHS
from engine.runners.graphs import MIN_BUCKET, capture, kv_buckets

if TYPE_CHECKING:
    from engine.runners.batched import BatchedDecoder, Part

log = logging.getLogger(__name__)


class AllRows:
    """BatchedDecoder.forward over every row at once, from static buffers; CUDA graphs where `graphs` is on."""

    def __init__(self, decoder: BatchedDecoder, keep: tuple[int, ...] = (), graphs: bool = False,
                 widths: tuple[int, ...] = BATCH_WIDTHS) -> None:
        """keep: the layers every forward keeps (a draft head's); graphs: capture (CUDA only)."""
        self.d = decoder
        c = decoder.config
        self.keep = tuple(keep)
        self.widths = tuple(w for w in widths if w <= decoder.max_length)
        self.spans = kv_buckets(c.cache_len, MIN_BUCKET)
        self.row_buckets = row_buckets(decoder.slots)
        self.graphs_on = graphs and decoder.device.type == "cuda"
        slots, dev = decoder.slots, decoder.device
        self.ids = {w: torch.zeros(slots, w, dtype=torch.long, device=decoder.lean.input_device) for w in self.widths}
        self.starts = torch.zeros(slots, dtype=torch.long, device=dev)
        self.out = {w: torch.zeros(slots, w, c.vocab_size, dtype=torch.float32, device=dev) for w in self.widths}
        self.kept = {w: torch.zeros(slots, w, len(self.keep) * c.hidden, dtype=decoder.lean.dtype, device=dev)
                     for w in self.widths} if self.keep else {}
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}  # (rows, width, span) -> graph
        # A prompt's chunk, right-padded to one of PREFILL_WIDTHS, into one row (`row`, from `start`) without logits:
        # one graph per (width, span) where the per-part forward launches hundreds of kernels.
        self.prefill_widths = tuple(w for w in PREFILL_WIDTHS if w <= decoder.max_length)
        self.pre_ids = {w: torch.zeros(1, w, dtype=torch.long, device=decoder.lean.input_device)
                        for w in self.prefill_widths}
        self.row = torch.zeros(1, dtype=torch.long, device=dev)
        self.start = torch.zeros(1, dtype=torch.long, device=dev)
        self.pre_kept = {w: torch.zeros(1, w, len(self.keep) * c.hidden, dtype=decoder.lean.dtype, device=dev)
                         for w in self.prefill_widths} if self.keep else {}
        self.prefill_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (width, span) -> graph
        self.forwards = 0  # forwards taken here (the rest went part by part): what a bench reports
        self.prefills = 0  # prompt chunks taken here
        # The last forward's (rows, width) when it was taken here (None: it went part by part): its logits are
        # out[width][:rows] and its tokens ids[width][:rows], every row at once (the batch's greedy verify reads them).
        self.last: tuple[int, int] | None = None

    def buffer_bytes(self) -> int:
        """The static inputs and outputs (the graphs' own pool is apart)."""
        tensors = [*self.ids.values(), self.starts, *self.out.values(), *self.kept.values(), *self.pre_ids.values(),
                   *self.pre_kept.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- one forward -------------------------------------------------------------------------------
    def _step(self, rows: int, width: int, span: int) -> None:
        """The forward a graph holds: the first `rows` rows' static ids and starts in, their static logits (and
        kept rows) out."""
        logits = self.d.forward_rows(self.ids[width][:rows], self.starts[:rows], kv_len=span, every=True,
                                     keep=self.keep)
        self.out[width][:rows].copy_(logits)
        if self.keep:
            self.kept[width][:rows].copy_(self.d.kept_rows)

    def _prefill_step(self, width: int, span: int) -> None:
        """The forward a prefill graph holds: the static chunk into row `row` from `start`, its kept rows out."""
        self.d.forward_rows(self.pre_ids[width], self.start, slots=self.row, kv_len=span, keep=self.keep)
        if self.keep:
            self.pre_kept[width].copy_(self.d.kept_rows)

    def prefill(self, part: Part) -> bool:
        """A prompt's chunk into its row, no logits (the graph of its padded width, eagerly off CUDA); False where
        no prefill shape takes it. The padding's slots lie past the row's length, masked until overwritten."""
        d, n = self.d, len(part.ids)
        start = d.lengths[part.slot]
        width = next((w for w in self.prefill_widths if w >= n), None)
        if part.tail is not None or width is None or start + width > d.config.cache_len:
            return False
        span = next(s for s in self.spans if s >= start + width)
        graph = self.prefill_graphs.get((width, span))
        if graph is None and self.graphs_on:
            return False  # a shape not captured: the per-part forward (the same maths) is no slower eagerly
        ids = torch.zeros(1, width, dtype=torch.long)
        ids[0, :n] = torch.tensor(part.ids)
        self.pre_ids[width].copy_(ids, non_blocking=True)
        self.row.fill_(part.slot)
        self.start.fill_(start)
        if graph is not None:
            graph.replay()
        else:
            self._prefill_step(width, span)
        d.lengths[part.slot] += n
        self.prefills += 1
        if self.keep:
            d.kept = [self.pre_kept[width][0, :n].clone()]  # the next chunk's replay overwrites the buffer
        return True

    def forward(self, parts: list[Part], logits: bool, keep: tuple[int, ...]) -> list[torch.Tensor] | None:
        """What BatchedDecoder.forward returns, or None where this shape cannot take the forward."""
        self.last = None
        if keep and keep != self.keep:
            return None
        if not logits:
            return [] if len(parts) == 1 and self.prefill(parts[0]) else None
        d = self.d
        widths = [p.width for p in parts]
        width = next((w for w in self.widths if w >= max(widths)), None)
        if width is None:
            return None
        rows = next(r for r in self.row_buckets if r > max(p.slot for p in parts))
        lengths = d.lengths
        if any(n + width > d.config.cache_len for n in lengths[:rows]):
            return None  # padding would run past a row's cache: the per-part forward writes what it feeds only
        # Every running row's queries see their own keys (a row masked whole would softmax to NaN and leave NaN
        # keys behind in its cache, which a -inf bias does not mask).
        span = next(s for s in self.spans if s >= max(lengths[:rows]) + width)
        ids = torch.zeros(rows, width, dtype=torch.long)
        for p in parts:
            ids[p.slot, : len(p.ids)] = torch.tensor(p.ids)
        self.ids[width][:rows].copy_(ids, non_blocking=True)
        for p in parts:  # drafts still on the device go in after the host's tokens, on the device
            if p.tail is not None:
                self.ids[width][p.slot, len(p.ids): p.width].copy_(p.tail)
        self.starts[:rows].copy_(torch.tensor(lengths[:rows]), non_blocking=True)
        graph = self.graphs.get((rows, width, span))
        if graph is not None:
            graph.replay()
        else:
            self._step(rows, width, span)
        self.forwards += 1
        self.last = (rows, width)
        for p, w in zip(parts, widths):
            lengths[p.slot] += w
        out = self.out[width]
        if self.keep:
            d.kept = [self.kept[width][p.slot, :w] for p, w in zip(parts, widths)]
        counts = [w if p.outputs is None else min(p.outputs, w) for p, w in zip(parts, widths)]
        return [out[p.slot, w - k: w] for p, w, k in zip(parts, widths, counts)]

    # -- capture -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> int:
        """One graph per (rows, width, span), and per (width, span) of a prefill; returns how many. A failure
        leaves the eager static forward (correct, slower) and says so in the log. The rows' lengths are untouched
        (forward_rows never sets them)."""
        if not self.graphs_on:
            return 0
        d = self.d
        self.starts.zero_()
        stream = torch.cuda.Stream(d.device)
        pool = torch.cuda.graph_pool_handle()
        try:
            for rows, width, span in itertools.product(self.row_buckets, self.widths, self.spans):
                if width > span:
                    continue
                self.ids[width].zero_()
                self.graphs[(rows, width, span)] = self._capture(lambda: self._step(rows, width, span), stream, pool)
            self.row.zero_()
            for width, span in itertools.product(self.prefill_widths, self.spans):
                if width <= span:
                    self.prefill_graphs[(width, span)] = self._capture(lambda: self._prefill_step(width, span),
                                                                       stream, pool)
            torch.cuda.synchronize(d.device)
        except Exception as exc:  # graphs are an optimisation: never let them break serving
            log.warning("batched CUDA graph capture failed, the batch runs its static forward eagerly: %s", exc,
                        exc_info=True)
            self.graphs.clear()
            self.prefill_graphs.clear()
            torch.cuda.synchronize(d.device)
        return len(self.graphs) + len(self.prefill_graphs)

    def _capture(self, body, stream: torch.cuda.Stream, pool) -> torch.cuda.CUDAGraph:
        """body() captured into the shared pool (runners/graphs.py capture), then replayed once."""
        graph = capture(body, stream, pool, self.d.device)
        graph.replay()
        return graph


def row_buckets(slots: int) -> tuple[int, ...]:
    """Rows a static forward runs: powers of two below `slots`, then `slots` (1, 2, 4, 8 for 8; 1, 2, 3 for 3)."""
    return (*(1 << i for i in range(slots.bit_length()) if 1 << i < slots), slots)
