"""Several sequences in one llama.cpp forward: a multi-sequence context on a runner's model (BatchedForward).

The batched step (engine/decoding/batch.py) on the llama.cpp runtime. The context holds `slots` sequences
(n_seq_max), sequence i under seq_id i with its own KV cells, so one llama_decode takes a llama_batch of
every sequence's new tokens, each row tagged with its seq_id and position, logits asked only for the rows
that are read. Rollback removes one sequence's cells past its committed length (llama_memory_seq_rm), as
the single-sequence runner does for its sequence 0.

The KV cache is unified (kv_unified): one pool of cells for every sequence. llama.cpp then cuts a batch
into ubatches by size alone (split_simple), so a K = 5 verify beside three standard steps runs as one graph,
one pass over the weights; a cache per sequence would cut it into ubatches of an equal count per sequence
(split_equal), a pass per distinct width. A ubatch finds free cells anywhere in the pool, so rollbacks
leave no unusable holes. The price: each row's attention spans the pool's used cells, masked to its own
sequence, small beside the weights at chat lengths.

The pool grows as the runner's context does: it starts at MIN_CELLS (at least a widest verify per row) and
is made again with twice as many cells when the sequences' tokens need more, up to slots × max_length,
feeding every row's cached tokens again, once per doubling; a new prompt reserves room for itself and an
answer. The context shares the runner's model (the weights are loaded once), threads, KV type and flash
attention, beside the runner's own single-sequence context, which stays as it was.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from engine.errors import GenerationError
from engine.runners.batched import Part
from engine.runners.lean import UnsupportedModelError
from engine.runners.llamacpp import (ANSWER_ROOM, DEFAULT_N_BATCH, MIN_CELLS, RESERVED_OUTPUTS, LlamaCppRunner,
                                     last_error, llama_cpp)

log = logging.getLogger(__name__)


class LlamaCppBatch:
    """forward(parts) -> float32 logits per part, views of llama.cpp's buffer valid until the next forward."""

    def __init__(self, runner: LlamaCppRunner, slots: int, max_length: int | None = None) -> None:
        """runner: the model's single-sequence runner (its model and settings); max_length: most tokens a row
        holds (None: the runner's)."""
        lib = self._lib = llama_cpp()
        self.runner = runner  # owns the model: kept alive as long as this context
        self.label = runner.label
        self.slots = slots
        self.max_length = min(max_length or runner.max_length, runner.max_length)
        self.vocab_size = runner.vocab_size
        self.device = runner.device
        self.outputs_max = slots * RESERVED_OUTPUTS  # a widest verify for every row, in one forward
        self.n_batch = max(DEFAULT_N_BATCH, self.outputs_max)  # tokens per llama_decode
        self.lengths = [0] * slots  # tokens cached per row
        self._tokens: list[list[int]] = [[] for _ in range(slots)]  # each row's cached ids, fed again on growth
        self._ctx = None
        self._batch = lib.llama_batch_init(self.n_batch, 0, 1)
        self.cells = 0  # KV cells of the pool
        try:
            self._make_context(max(MIN_CELLS, 1 << (self.outputs_max - 1).bit_length()))
        except GenerationError as e:
            self.close()
            raise UnsupportedModelError(f"{e} Serving one request at a time.") from None

    # -- BatchedForward -----------------------------------------------------------------------
    def reset(self, slot: int) -> None:
        self.rollback(slot, 0)

    def reserve(self, slot: int, length: int) -> None:
        """A new prompt of `length` tokens in an empty row: room for it and an answer, made now, so that
        feeding it in chunks never grows the pool (which feeds everything cached again) midway."""
        if self.lengths[slot] == 0:
            self._grow(sum(self.lengths) + min(length + ANSWER_ROOM, self.max_length))

    def rollback(self, slot: int, length: int) -> None:
        assert 0 <= length <= self.lengths[slot], f"cannot roll row {slot} back to {length}"
        if length < self.lengths[slot]:
            removed = self._lib.llama_memory_seq_rm(self._memory, slot, length, -1)
            assert removed, "llama.cpp refused to remove the cells past the committed length"
            self.lengths[slot] = length
            del self._tokens[slot][length:]

    def forward(self, parts: list[Part], logits: bool = True) -> list[torch.Tensor]:
        """Appends every part's ids to its row in one llama_decode (a prefill, logits=False: in chunks of
        n_batch); returns each part's logits [outputs or W, V], in order."""
        parts = [p.on_host() for p in parts]
        assert parts and all(p.ids for p in parts), "every part feeds at least one token"
        assert len({p.slot for p in parts}) == len(parts), "one part per sequence"
        for p in parts:
            if self.lengths[p.slot] + len(p.ids) > self.max_length:
                raise GenerationError(f"The context is full: {self.lengths[p.slot] + len(p.ids)} tokens do not fit "
                                      f"the {self.max_length} llama.cpp holds for {self.label}; start a new chat.")
        self._grow(sum(self.lengths) + sum(len(p.ids) for p in parts))
        rows = [(p.slot, t) for p in parts for t in p.ids]
        if not logits:
            for start in range(0, len(rows), self.n_batch):
                chunk = rows[start: start + self.n_batch]
                self._decode(chunk, [False] * len(chunk))
            return []
        counts = [len(p.ids) if p.outputs is None else min(p.outputs, len(p.ids)) for p in parts]
        assert len(rows) <= self.n_batch and sum(counts) <= self.outputs_max, "a forward with logits is one decode"
        wanted = [i >= len(p.ids) - n for p, n in zip(parts, counts) for i in range(len(p.ids))]
        self._decode(rows, wanted)
        out = self._lib.llama_get_logits(self._ctx)  # [sum(counts) * V] floats, in batch order
        flat = torch.from_numpy(np.ctypeslib.as_array(out, shape=(sum(counts), self.vocab_size)))
        return list(flat.split(counts))

    # -- llama.cpp specifics ------------------------------------------------------------------
    def kv_length(self, slot: int) -> int:
        """Tokens llama.cpp itself holds for a row (its largest position + 1)."""
        return int(self._lib.llama_memory_seq_pos_max(self._memory, slot)) + 1

    def close(self) -> None:
        """Frees the context and the batch (the model is the runner's)."""
        if self._batch is not None:
            self._lib.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            self._lib.llama_free(self._ctx)
            self._ctx = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may already be gone
            pass

    # -- internals ----------------------------------------------------------------------------
    def _decode(self, rows: list[tuple[int, int]], wanted: list[bool]) -> None:
        """One llama_decode of (slot, token) rows, each at its row's next position; logits where `wanted`."""
        threads = (self.runner.threads, self.runner.batch_threads)
        if threads != self._threads:  # the runner's were set since (set_threads): this context follows
            self._lib.llama_set_n_threads(self._ctx, *threads)
            self._threads = threads
        batch, at = self._batch, list(self.lengths)
        for i, ((slot, token), out) in enumerate(zip(rows, wanted)):
            batch.token[i] = token
            batch.pos[i] = at[slot]
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = slot
            batch.logits[i] = out
            at[slot] += 1
        batch.n_tokens = len(rows)
        status = self._lib.llama_decode(self._ctx, batch)
        if status != 0:  # 1: no KV slot; < 0: invalid batch or a failed compute
            raise GenerationError(f"llama.cpp could not decode a batch of {len(rows)} tokens of {self.label} "
                                  f"(status {status}: {last_error()}).")
        for slot, token in rows:
            self._tokens[slot].append(token)
        self.lengths = at

    def _grow(self, need: int) -> None:
        """A pool of at least `need` cells (the next power of two, within slots × max_length), every row's
        cached tokens fed again."""
        top = self.slots * self.max_length
        if need <= self.cells or self.cells >= top:
            return
        cached = [(slot, t) for slot, tokens in enumerate(self._tokens) for t in tokens]
        self._make_context(min(top, max(2 * self.cells, 1 << (need - 1).bit_length())))  # or the pool stays
        if cached:
            log.info("llama.cpp: %s's batch grew to %d cells; feeding %d cached tokens again", self.label,
                     self.cells, len(cached))
            for start in range(0, len(cached), self.n_batch):
                chunk = cached[start: start + self.n_batch]
                self._decode(chunk, [False] * len(chunk))

    def _make_context(self, cells: int) -> None:
        """A fresh pool of `cells` cells for `slots` sequences, its logits buffer reserved; every row empty.
        The new context is made before the old one is freed: where it cannot be (memory), GenerationError
        says so and the pool is as it was."""
        lib = self._lib
        cparams = self.runner.context_params()  # threads, KV type, flash attention
        cparams.n_ctx = cells
        cparams.n_seq_max = self.slots
        cparams.kv_unified = True
        cparams.n_batch = self.n_batch
        cparams.n_ubatch = min(max(cparams.n_ubatch, self.outputs_max), self.n_batch)
        cparams.n_outputs_max = self.outputs_max
        ctx = lib.llama_init_from_model(self.runner.model_handle, cparams)
        if not ctx:
            raise GenerationError(f"llama.cpp could not make a context of {self.slots} sequences and {cells} cells "
                                  f"for {self.label} ({last_error()}): lower --max-seqs or shorten the prompts.")
        if self._ctx:
            lib.llama_free(self._ctx)
        self._ctx = ctx
        self._threads = (cparams.n_threads, cparams.n_threads_batch)
        self._memory = lib.llama_get_memory(ctx)
        self.cells = int(lib.llama_n_ctx(ctx))
        self.lengths = [0] * self.slots
        self._tokens = [[] for _ in range(self.slots)]
        # One forward of a widest verify per row allocates the logits buffer now, not under a view.
        self.forward([Part(slot, (0,) * min(RESERVED_OUTPUTS, self.max_length)) for slot in range(self.slots)])
        lib.llama_memory_clear(self._memory, False)
        self.lengths = [0] * self.slots
        self._tokens = [[] for _ in range(self.slots)]
