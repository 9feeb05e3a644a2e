"""The llama.cpp runner: a GGUF model through llama-cpp-python's low-level API, behind the Runner seam.

One llama_context per model with one sequence (id 0). forward() feeds a llama_batch that asks for
logits at every position and hands back llama.cpp's own logits buffer as a torch tensor without a
copy; rollback removes the KV cells at positions >= the committed length (llama_memory_seq_rm).
The server's batched step makes a second context of several sequences on the same model
(llamacpp_batch.py).
llama.cpp's calls release the GIL (ctypes), so the UI thread keeps running while a model decodes.
"""
from __future__ import annotations

import collections
import ctypes
import importlib
import logging
import threading
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from engine.cpu_threads import physical_cores  # noqa: F401  (named here too: the runtime's default)
from engine.errors import GenerationError, ModelLoadError
from engine.limits import K_MAX
from engine.runners.llamacpp_probe import AMX_ENV, amx_advertised, forced  # noqa: F401  (AMX_ENV: named here too)
from engine.runners.base import measure_forward_costs

log = logging.getLogger(__name__)

NAME = "llama.cpp"
# Memory, measured with the default pair on two cores (the weights are 1,534 MiB; the process with
# torch and the engine imported is ~220 MiB before any model):
DEFAULT_N_CTX = 32768  # most KV cells a context may grow to (and at most the model's training context)
MIN_CELLS = 1024  # a context's first size; it doubles when a prompt or an answer needs more
ANSWER_ROOM = 512  # cells a new prompt reserves beyond itself: an answer of the app's default length
KV_TYPE = "q8_0"  # 8-bit KV cache: 21 KiB a token for both models (f16: 40 KiB) ("f16" or "q8_0")
_KV_TYPES = {"f16": 1, "q8_0": 8}  # ggml type ids (ggml.h)
DEFAULT_N_BATCH = 512  # prompt tokens per llama_decode call; larger prompts are fed in chunks
# Tokens per graph evaluation. The compute buffers grow with it (512: 108 MiB for both models,
# 128: ~25 MiB); chat prompts are shorter than 128 tokens, so only long prompts pay a little.
DEFAULT_N_UBATCH = 128
FLASH_ATTN = True  # needed for the 8-bit V cache
# Read the weights into memory instead of mapping the file: repacked tensors (Q4_K for AVX2/AVX-512)
# otherwise stay resident twice (2,543 vs 1,920 MiB for the pair), and mapped pages are the first
# the kernel drops under memory pressure, which makes every forward wait on the disk.
USE_MMAP = False
# Rows reserved in llama.cpp's logits buffer at load: the widest verify the loop sends, so the
# buffer is never reallocated under a tensor handed out by forward().
RESERVED_OUTPUTS = K_MAX + 1

_backend_lock = threading.Lock()
_backend_ready = False
_recent_log: collections.deque[tuple[int, str]] = collections.deque(maxlen=20)  # (level, line), for errors
_log_callback = None  # kept alive: llama.cpp holds a raw pointer to it


class RuntimeUnavailable(ModelLoadError):
    """llama-cpp-python cannot be imported here; the message says why and how to install it."""


# One line for a draft head asked of this runtime (its proposer reads the target's hidden states).
HEAD_REFUSED = ("A draft head reads the target's hidden states, which the llama.cpp runtime does not give: "
                "load the models on the torch runtime (--runtime torch) to use one.")

INSTALL_HINT = ".venv/bin/pip install llama-cpp-python==0.3.36 (it builds from source: cmake and a C++ compiler)"


@lru_cache(maxsize=1)
def _import() -> ModuleType | str:
    try:
        return importlib.import_module("llama_cpp")
    except Exception as e:  # ImportError, or OSError from a shared library that does not load
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"{type(e).__name__}: {text}"[:200]


def unavailable_reason() -> str | None:
    """None when llama-cpp-python imports; otherwise one line saying why it does not."""
    found = _import()
    return found if isinstance(found, str) else None


def llama_cpp() -> ModuleType:
    """The llama_cpp module with its backend initialised and its log routed to `logging`."""
    global _backend_ready, _log_callback
    found = _import()
    if isinstance(found, str):
        raise RuntimeUnavailable(f"llama.cpp is not available ({found}); install it with: {INSTALL_HINT}")
    with _backend_lock:
        if not _backend_ready:
            _log_callback = found.llama_log_callback(_on_log)
            found.llama_log_set(_log_callback, ctypes.c_void_p(0))
            found.llama_backend_init()
            _backend_ready = True
    return found


# ggml's log levels (ggml.h): 1 debug, 2 info, 3 warn, 4 error, 5 continues the previous line.
# Its warnings are load chatter (e.g. a GGUF's token types) and stay at info; errors are warnings.
_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.INFO, 4: logging.WARNING}
_last_level = logging.DEBUG


def _on_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    global _last_level
    _last_level = _LEVELS.get(level, _last_level)
    line = text.decode("utf-8", errors="replace").rstrip()
    if line:
        _recent_log.append((_last_level, line))
        log.log(_last_level, "llama.cpp: %s", line)


def last_error() -> str:
    """The last thing llama.cpp said, for an error message (it reports reasons only in its log)."""
    for level, line in reversed(_recent_log):
        if level >= logging.WARNING:
            return line.split(": ", 1)[-1][:200]
    return "see the log (-v) for llama.cpp's reason"


def extra_buffers() -> bool:
    """Whether llama.cpp may repack weights into its extra buffer types here, without trying: off where
    AMX is advertised (its kernels died on this project's virtual Xeons), unless AMX_ENV is 1. The
    app's loads try them once per model instead (llamacpp_probe.amx_runs)."""
    decided = forced()
    return not amx_advertised() if decided is None else decided


def file_type_name(code: int) -> str:
    """'Q4_K_M' for llama.cpp's file type 15 (the GGUF's general.file_type)."""
    import gguf

    try:
        return gguf.LlamaFileType(code).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return f"type {code}"


class LlamaCppRunner:
    """One GGUF model in its own llama.cpp context; the KV cache holds one sequence.

    The cache grows with use, like the torch runtime's dynamic cache: llama.cpp allocates (and
    clears) every cell of a context up front, so a context starts at 1,024 cells and is made again
    with twice as many when a prompt or an answer needs more (up to max_length); what was cached is
    fed again then, once per doubling. A new prompt reserves room for itself and a long answer.

    forward() returns a view of llama.cpp's logits buffer: valid until the next call on this
    runner (the loop reads it before it calls again). The buffer is reserved for
    RESERVED_OUTPUTS rows when a context is made, so it is never moved while a view exists.
    """

    name = NAME
    device = torch.device("cpu")
    hidden: torch.Tensor | None = None  # llama.cpp hands out logits and embeddings, not a layer's outputs
    max_rows = RESERVED_OUTPUTS  # rows of logits one forward may ask for (torch runners have no such bound)

    def __init__(self, path: Path, *, n_ctx: int = DEFAULT_N_CTX, threads: int | None = None,
                 batch_threads: int | None = None, n_batch: int = DEFAULT_N_BATCH,
                 n_ubatch: int = DEFAULT_N_UBATCH, kv_type: str = KV_TYPE,
                 flash_attn: bool = FLASH_ATTN, use_mmap: bool = USE_MMAP, min_cells: int = MIN_CELLS,
                 label: str | None = None, repack: bool | None = None) -> None:
        """threads: for one-row forwards (None: the physical cores); batch_threads: for wider ones, the prompt
        and verifies (None: as threads). repack: let llama.cpp repack weights into its extra buffer types for
        this CPU (AMX, AVX-512 layouts); None: as extra_buffers() says."""
        lib = llama_cpp()
        self._lib = lib
        self.path = path
        self.flash_attn, self.use_mmap = flash_attn, use_mmap
        self.label = label or path.stem
        self._model = self._ctx = None
        self._batch = None
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = 0  # this runner is the CPU runtime; GPUs run the torch path
        mparams.load_mode = lib.LLAMA_LOAD_MODE_MMAP if use_mmap else lib.LLAMA_LOAD_MODE_NONE
        self.repack = extra_buffers() if repack is None else repack
        mparams.use_extra_bufts = self.repack
        model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise ModelLoadError(f"llama.cpp could not load {path}: {last_error()}.")
        self._model = model
        vocab = lib.llama_model_get_vocab(model)
        self.model_handle, self.vocab_handle = model, vocab  # for the tokenizer (llamacpp_tokenizer.py)
        self.vocab_size = int(lib.llama_vocab_n_tokens(vocab))  # one logits row per token id
        self.max_length = max(8, min(n_ctx, int(lib.llama_model_n_ctx_train(model)) or n_ctx))
        self.threads = threads or physical_cores()
        self.batch_threads = batch_threads or self.threads
        self.file_type = file_type_name(int(lib.llama_model_ftype(model)))
        self.file_bytes = int(lib.llama_model_size(model))
        # End-of-generation ids as llama.cpp sees them (eos, eot, <|endoftext|>, ...).
        self.eog_ids = frozenset(i for i in range(self.vocab_size) if lib.llama_vocab_is_eog(vocab, i))
        self._batch, self._batch_size = lib.llama_batch_init(n_batch, 0, 1), n_batch
        for i in range(n_batch):  # one sequence: these never change
            self._batch.n_seq_id[i] = 1
            self._batch.seq_id[i][0] = 0
        cparams = lib.llama_context_default_params()
        cparams.n_batch = n_batch
        cparams.n_ubatch = min(n_ubatch, n_batch)
        cparams.n_outputs_max = RESERVED_OUTPUTS  # no forward asks for more rows of logits
        cparams.n_seq_max = 1
        cparams.n_threads, cparams.n_threads_batch = self.threads, self.batch_threads
        cparams.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.no_perf = True
        self._cparams = cparams
        self.kv_type, self.kv_type_id = kv_type, _KV_TYPES[kv_type]
        self.cells = 0  # KV cells of the current context
        self.length = 0
        self._tokens: list[int] = []  # the cached ids, fed again when the context grows
        self.min_cells = min_cells
        self._make_context(min(min_cells, self.max_length))

    # -- the Runner protocol ------------------------------------------------------------------
    def reset(self) -> None:
        self._lib.llama_memory_clear(self._memory, False)  # cells only; their data is overwritten
        self.length = 0
        self._tokens.clear()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Appends ids [W] and returns float32 logits [W, V], one row per fed position.

        Wider than RESERVED_OUTPUTS (a draft model catching up on the tokens of several standard
        steps in auto mode, which reads only the last row): the leading tokens are fed as a prefill
        and the rows of the last RESERVED_OUTPUTS positions come back, so the buffer never moves.
        """
        tokens = ids.tolist()
        width = len(tokens)
        assert width > 0, "a forward takes at least one token"
        if width > RESERVED_OUTPUTS:
            self.prefill(ids[:width - RESERVED_OUTPUTS])
            tokens, width = tokens[width - RESERVED_OUTPUTS:], RESERVED_OUTPUTS
        self._decode(tokens, outputs=True)
        rows = self._lib.llama_get_logits(self._ctx)  # [W * V] floats, in batch order
        return torch.from_numpy(np.ctypeslib.as_array(rows, shape=(width, self.vocab_size)))

    def reserve(self, length: int) -> None:
        """A new prompt of `length` tokens: room for it and a long answer, made now, so that feeding it
        in chunks never grows the context (which feeds everything cached again) midway."""
        if self.length == 0:
            self._grow(length + ANSWER_ROOM)

    def prefill(self, ids: torch.Tensor) -> None:
        """Appends ids [W] in chunks of n_batch, asking for no logits (the prompt needs none)."""
        tokens = ids.tolist()
        if self.length == 0:
            self.reserve(len(tokens))
        for start in range(0, len(tokens), self.n_batch):
            self._decode(tokens[start:start + self.n_batch], outputs=False)

    def rollback(self, length: int) -> None:
        assert 0 <= length <= self.length, f"cannot roll back to {length} from {self.length}"
        if length < self.length:
            removed = self._lib.llama_memory_seq_rm(self._memory, 0, length, -1)
            assert removed, "llama.cpp refused to remove the cells past the committed length"
            self.length = length
            del self._tokens[length:]

    def keep_hidden(self, layers: tuple[int, ...]) -> None:
        """A draft head needs chosen layers' outputs, which llama.cpp's API does not give: refused."""
        if layers:
            raise GenerationError(HEAD_REFUSED)

    def measure_costs(self, widths: Iterable[int], iters: int = 3) -> dict[int, float]:
        return measure_forward_costs(self, widths, iters)

    # -- llama.cpp specifics ------------------------------------------------------------------
    def set_threads(self, threads: int, batch: int | None = None) -> None:
        """Threads for every later decode: `threads` for one-row forwards, `batch` (default: the same) wider."""
        self.threads = self._cparams.n_threads = max(1, int(threads))
        self.batch_threads = self._cparams.n_threads_batch = max(1, int(batch or threads))
        self._lib.llama_set_n_threads(self._ctx, self.threads, self.batch_threads)

    def context_params(self) -> ctypes.Structure:
        """A copy of this runner's llama_context_params (threads, KV type, flash attention, batch sizes): a
        context of several sequences on the same model starts from them (llamacpp_batch.py)."""
        return type(self._cparams).from_buffer_copy(self._cparams)

    def kv_length(self) -> int:
        """Tokens llama.cpp itself holds for the sequence (its largest position + 1)."""
        return int(self._lib.llama_memory_seq_pos_max(self._memory, 0)) + 1

    def close(self) -> None:
        """Frees the context, the model and the batch; the runner cannot be used afterwards."""
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        if self._batch is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            lib.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            lib.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may already be gone
            pass

    # -- internals ----------------------------------------------------------------------------
    def _decode(self, tokens: list[int], *, outputs: bool) -> None:
        batch, n = self._batch, len(tokens)
        if self.length + n > self.max_length:
            raise GenerationError(
                f"The context is full: {self.length + n} tokens do not fit the {self.max_length} "
                f"llama.cpp holds for {self.label}; start a new chat.")
        self._grow(self.length + n)
        flag = 1 if outputs else 0
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = self.length + i
            batch.logits[i] = flag
        batch.n_tokens = n
        status = self._lib.llama_decode(self._ctx, batch)
        if status != 0:
            # 1: no KV slot; < 0: invalid batch or a failed compute. The cache is as before the call.
            raise GenerationError(f"llama.cpp could not decode {n} tokens of {self.label} "
                                  f"(status {status}: {last_error()}).")
        self.length += n
        self._tokens.extend(tokens)

    def _grow(self, length: int) -> None:
        """A context of at least `length` cells (the next power of two, within max_length)."""
        if length <= self.cells or self.cells >= self.max_length:
            return
        cached = self._tokens[:]
        self._make_context(min(self.max_length, max(self.min_cells, 1 << (length - 1).bit_length())))
        if cached:  # the cache does not survive a new context: feed it again, once per doubling
            log.info("llama.cpp: %s grew to %d cells; feeding %d cached tokens again", self.label, self.cells,
                     len(cached))
            self.prefill(torch.tensor(cached))

    def _make_context(self, cells: int) -> None:
        """A fresh context of `cells` KV cells, its logits buffer reserved; the cache starts empty."""
        lib, cparams = self._lib, self._cparams
        if self._ctx:
            lib.llama_free(self._ctx)
            self._ctx = None
        cparams.n_ctx = cells
        cparams.n_batch = min(self._batch_size, cells)
        cparams.n_ubatch = min(cparams.n_ubatch, cparams.n_batch)
        ctx = None
        kinds = (self.kv_type, "f16")
        heads = lib.llama_model_n_head(self._model)
        if self.kv_type != "f16" and heads and (lib.llama_model_n_embd(self._model) // heads) % 32:
            # q8_0 blocks of 32 must divide the head size: asking would only print llama.cpp's refusal.
            kinds = ("f16",)
        for kv in dict.fromkeys(kinds):
            cparams.type_k = cparams.type_v = _KV_TYPES[kv]
            ctx = lib.llama_init_from_model(self._model, cparams)
            if ctx:
                self.kv_type, self.kv_type_id = kv, _KV_TYPES[kv]
                break
            log.info("llama.cpp: no %s KV cache for %s (%s)", kv, self.label, last_error())
        if not ctx:
            self.close()
            raise ModelLoadError(f"llama.cpp could not create a context for {self.path} "
                                 f"({cells} tokens): {last_error()}.")
        self._ctx = ctx
        self._memory = lib.llama_get_memory(ctx)
        self.cells = int(lib.llama_n_ctx(ctx))
        self.n_batch, self.n_ubatch = int(cparams.n_batch), int(cparams.n_ubatch)
        self.length = 0
        self._tokens = []
        # One forward of the widest verify allocates the logits buffer now, not under a view.
        self.forward(torch.zeros(min(RESERVED_OUTPUTS, self.cells, self.n_batch), dtype=torch.long))
        self.reset()

