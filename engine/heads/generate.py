"""The distillation's data writer: many prompts continued at once by continuous batching on the lean decoder.

Hugging Face's batched generate runs every row until the longest is done and grows its cache by copying
it each step, so a round of answers of very different lengths spends most of its steps on rows that have
ended. Here a fixed number of rows (`rows`) decode together on the lean decoder's static cache
(BatchedDecoder.forward_rows: one vectorised attention over every row's own cache). Every step gives each
row one token; every CHECK_EVERY steps one host sync reads the new tokens, rows that wrote EOS or
reached their limit hand back their answer, and the free rows take the next prompts (right-padded,
batched prefills of at most PREFILL_TOKENS tokens). Attention reads only the cache span the longest live
row needs (BatchedDecoder.span), so short answers read little. Logits that are not finite anywhere in
a run raise NonFiniteLogits at the next sync (the caller falls back to another writer); until then they
are drawn from as zeros, so a sampling draw never faults the device.

The step of every row at once is a forward of ~20 kernels a layer: launched one by one, the host's
launches, not the device, set the pace (an H100's kernels ran about 3.3 s of a profiled 14.6-s run of
512 rows, `bench/distill_writers.py --profile`). On CUDA it is replayed as a CUDA graph per attention span
(RowSteps), captured the first time a span is needed; the tail of a run, its rows packed into fewer,
and every prefill run eagerly.

Greedy continuations equal the model's own greedy decoding, prompt by prompt (float32 tests). Sampled
rows draw from softmax(logits / T), cut to the top-p nucleus, with one generator for the whole run:
reproducible for a fixed seed, rows and prompts, not across other row counts.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from engine.errors import GenerationError
from engine.runners.batched import BatchedDecoder
from engine.runners.graphs import capture
from engine.runners.lean import PREFILL_CHUNK

log = logging.getLogger(__name__)

CHECK_EVERY = 8  # decode steps between host syncs (a row may decode this many tokens past its EOS, discarded)
PREFILL_TOKENS = 8192  # padded prompt tokens a prefill forward takes at most (its activations stay small)


class NonFiniteLogits(GenerationError):
    """The model gave NaN or infinite logits in a batched run (its answers are not trustworthy)."""


@dataclass
class _Row:
    index: int  # which prompt
    length: int  # tokens in its cache row
    budget: int  # new tokens it may still write
    written: list[int] = field(default_factory=list)


class RowSteps:
    """One decode step of all the decoder's rows (a token each at its own start) from static inputs: a CUDA graph
    per attention span, captured at its first use (`graphs`), else the same forward eagerly from the same
    buffers. A capture that fails leaves every later step eager (correct, slower) and says so in the log."""

    def __init__(self, decoder: BatchedDecoder, graphs: bool) -> None:
        self.d = decoder
        self.ids = torch.zeros(decoder.slots, 1, dtype=torch.long, device=decoder.lean.input_device)
        self.starts = torch.zeros(decoder.slots, dtype=torch.long, device=decoder.device)
        self.graphs_on = graphs and decoder.device.type == "cuda"
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # span -> graph, its static logits
        self.pool = self.stream = None

    def __call__(self, nxt: torch.Tensor, starts: list[int], span: int) -> torch.Tensor:
        """Float32 logits [rows, V] of every row's next token nxt [rows] written at starts[row]; read them before
        the next call (a graph's output is overwritten by its next replay)."""
        self.ids.copy_(nxt[:, None])
        self.starts.copy_(torch.tensor(starts), non_blocking=True)
        if not self.graphs_on:
            return self._body(span)
        entry = self.graphs.get(span)
        if entry is None:
            try:
                entry = self.graphs[span] = self._capture(span)
            except Exception as exc:  # graphs are an optimisation: eager stays correct
                log.warning("the data writer's step graph failed to capture, it runs eagerly: %s", exc, exc_info=True)
                self.graphs_on = False
                self.graphs.clear()
                torch.cuda.synchronize(self.d.device)
                return self._body(span)
        graph, out = entry
        graph.replay()
        return out

    def _body(self, span: int) -> torch.Tensor:
        return self.d.forward_rows(self.ids, self.starts, kv_len=span)

    def _capture(self, span: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm-ups write each row's K/V for the step being taken (the same values the replay writes again)."""
        if self.pool is None:
            self.pool, self.stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(self.d.device)
        held: list[torch.Tensor] = []
        graph = capture(lambda: held.append(self._body(span)), self.stream, self.pool, self.d.device, held.clear)
        return graph, held[-1]


class ContinuousSampler:
    """Continues prompts `rows` at a time on one model; rows that end take the next prompt at once."""

    def __init__(self, model, *, rows: int, max_length: int, eos: list[int],
                 decoder: BatchedDecoder | None = None, graphs: bool = True) -> None:
        """max_length: prompt + answer tokens of the longest continuation; graphs: replay the step of every row
        as CUDA graphs (on CUDA). Raises UnsupportedModelError (engine.runners.lean) for a model the lean
        decoder cannot run."""
        self.decoder = decoder or BatchedDecoder(model, max_length, rows)
        self.steps = RowSteps(self.decoder, graphs)
        self.rows = self.decoder.slots
        self.max_length = self.decoder.max_length
        self.device = self.decoder.device
        self.eos_set = set(eos)
        self.bad = torch.zeros((), dtype=torch.bool, device=self.device)  # a run's logits were not all finite

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], *, max_new: int, temperature: float, top_p: float, seed: int,
            max_time: float | None = None) -> list[tuple[list[int], bool]]:
        """(new ids, ended with EOS) per prompt, in order; new ids stop after the first EOS (kept).

        A prompt that leaves no room for an answer gets ([], False). max_time (seconds) stops every row
        where it is (answers cut short, not ended).
        """
        deadline = None if max_time is None else time.perf_counter() + max_time
        gen = torch.Generator(device=self.device).manual_seed(seed)
        results: list[tuple[list[int], bool]] = [([], False)] * len(prompts)
        queue = deque(i for i, p in enumerate(prompts) if p and len(p) < self.max_length and max_new > 0)
        live: dict[int, _Row] = {}  # slot -> row
        free = list(range(self.rows))
        nxt = torch.zeros(self.rows, dtype=torch.long, device=self.device)  # each row's next input token
        self.bad.zero_()
        width = self.rows  # rows decoded each step: all, or the first few once the queue is empty
        while queue or live:
            if queue and free and (len(free) * 8 >= self.rows or not live):
                self._admit(prompts, queue, free, live, results, nxt, max_new, temperature, top_p, gen)
                if not live:
                    continue
            if deadline is not None and time.perf_counter() > deadline:
                break
            if not queue and len(live) * 2 <= width and width > 8:
                # The last rows of a run: packed into the first rows, so each step decodes only theirs.
                width = max(8, -(-len(live) // 8) * 8)
                nxt, live = self._pack(live, nxt)
            slots = sorted(live)
            steps = min(CHECK_EVERY, min(r.budget for r in live.values()))
            history = []
            for _ in range(steps):
                starts = [live[s].length if s in live else 0 for s in range(width)]
                span = self.decoder.span(max(starts) + 1)
                if width == self.rows:
                    logits = self.steps(nxt, starts, span)
                else:
                    logits = self.decoder.forward_rows(nxt[:width, None], starts, kv_len=span)
                picked = self._draw(logits, temperature, top_p, gen)
                nxt = picked if width == self.rows else torch.cat([picked, nxt[width:]])
                history.append(picked)
                for s in slots:
                    live[s].length += 1
            drawn = torch.stack(history, dim=1)[torch.tensor(slots)].tolist()  # the one host sync of `steps` steps
            self._check_finite()
            for s, new in zip(slots, drawn):
                if self._extend(live[s], new, results):
                    del live[s]
                    free.append(s)
        self._check_finite()
        for row in live.values():  # cut short by max_time
            results[row.index] = (row.written, False)
        return results

    def _pack(self, live: dict[int, _Row], nxt: torch.Tensor) -> tuple[torch.Tensor, dict[int, _Row]]:
        """Moves the live rows' caches and next tokens to rows 0 .. n-1 (in slot order)."""
        src = sorted(live)
        dst = list(range(len(src)))
        self.decoder.move_rows(src, dst)
        moved = nxt.clone()
        moved[torch.tensor(dst, device=self.device)] = nxt[torch.tensor(src, device=self.device)]
        return moved, {d: live[s] for s, d in zip(src, dst)}

    def _extend(self, row: _Row, new: list[int], results: list) -> bool:
        """Appends a row's new tokens up to its first EOS or its budget; True (and its result set) when it ended."""
        ended = False
        for t in new:
            row.written.append(t)
            row.budget -= 1
            if t in self.eos_set:
                ended = True
                break
            if row.budget <= 0:
                break
        if ended or row.budget <= 0:
            results[row.index] = (row.written, ended)
            return True
        return False

    def _admit(self, prompts, queue, free, live, results, nxt, max_new, temperature, top_p, gen) -> None:
        """Prefills the next prompts into free rows and draws each one's first token: groups of prompts of
        similar length, right-padded, at most PREFILL_TOKENS padded tokens a group, in chunks of PREFILL_CHUNK."""
        taken = []
        while queue and free:
            taken.append((free.pop(), queue.popleft()))
        taken.sort(key=lambda t: len(prompts[t[1]]))
        group: list[tuple[int, int]] = []
        for item in taken:
            width = len(prompts[item[1]])  # the longest so far (sorted)
            if group and (len(group) + 1) * min(width, PREFILL_CHUNK) > PREFILL_TOKENS:
                self._prefill(prompts, group, free, live, results, nxt, max_new, temperature, top_p, gen)
                group = []
            group.append(item)
        self._prefill(prompts, group, free, live, results, nxt, max_new, temperature, top_p, gen)

    def _prefill(self, prompts, taken, free, live, results, nxt, max_new, temperature, top_p, gen) -> None:
        width = max(len(prompts[i]) for _, i in taken)
        ids = torch.zeros(len(taken), width, dtype=torch.long)
        for row, (_, i) in enumerate(taken):
            ids[row, : len(prompts[i])] = torch.tensor(prompts[i])
        lengths = torch.tensor([len(prompts[i]) for _, i in taken])
        slots = [s for s, _ in taken]
        last = None
        for begin in range(0, width, PREFILL_CHUNK):
            end = min(begin + PREFILL_CHUNK, width)
            take = (lengths - 1 - begin).clamp(0, end - begin - 1)
            logits = self.decoder.forward_rows(ids[:, begin:end].to(self.device), [begin] * len(taken), slots,
                                               take=take, kv_len=self.decoder.span(end))
            here = ((lengths - 1 >= begin) & (lengths - 1 < end)).to(self.device)[:, None]
            last = logits if last is None else torch.where(here, logits, last)
        first = self._draw(last, temperature, top_p, gen)
        nxt[torch.tensor(slots, device=self.device)] = first
        for (s, i), t in zip(taken, first.tolist()):
            row = _Row(index=i, length=len(prompts[i]), budget=min(max_new, self.max_length - len(prompts[i])))
            if self._extend(row, [t], results):
                free.append(s)
            else:
                live[s] = row


    def _check_finite(self) -> None:
        if bool(self.bad):
            raise NonFiniteLogits("The batched forward gave logits that are not finite.")

    def _draw(self, logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
        """_pick, after noting (without a sync) whether any logit is not finite and drawing from those as zeros."""
        self.bad |= ~torch.isfinite(logits).all()
        return _pick(logits.nan_to_num(0.0, 0.0, 0.0), temperature, top_p, gen)


def _pick(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """One token per row of float32 logits [B, V]: the argmax at T = 0, else a draw from the top-p nucleus
    of softmax(logits / T) (the smallest set of most likely tokens whose mass reaches top_p)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the more likely tokens
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)
