"""The fast path's runner: lean forward, static KV cache, CUDA graphs; build_runners sets up a pair.

On CUDA the widths the loop uses every step (1 for draft steps and standard decoding, 2 for the
draft catch-up, K+1 for the verify) are captured once as CUDA graphs in `warmup()`, one per
(width, attention span); a forward then costs a copy of the ids, a scalar fill and one graph
launch instead of hundreds of kernel launches from Python. Other widths (the prompt) run the same
lean forward eagerly. On CPU everything runs eagerly; that is what the unit tests exercise.

Rollback moves the write position only: stale cache slots are masked by position and overwritten.

A model split over GPUs is captured as one graph per stage (device) and width; a forward replays
them in order, copying the hidden state across. Layers that cannot be captured (bitsandbytes'
LLM.int8(), see engine.models.quant.CAPTURABLE) keep the static cache and run eagerly.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from engine.errors import GenerationError
from engine.limits import DEFAULT_MAX_LENGTH, K_MAX
from engine.runners.base import measure_forward_costs
from engine.runners.lean import CACHE_ALIGN, PREFILL_CHUNK, LeanDecoder
from engine.runners.tree import Tree
from engine.models.quant import CAPTURABLE, layer_kind
from engine.loadspec import LoadProgress
from engine.runners.tree import chain_tree

log = logging.getLogger(__name__)

Progress = Callable[[float, str], None]  # (fraction done 0..1, what is happening)
WARMUP_ITERS = 3  # eager runs on a side stream before each capture, as PyTorch asks
MIN_BUCKET = 512  # smallest attention span; spans double up to the whole cache


def capture(body: Callable[[], None], stream: torch.cuda.Stream, pool, device: torch.device,
            reset: Callable[[], None] | None = None) -> torch.cuda.CUDAGraph:
    """body() as a CUDA graph in `pool`: warmed WARMUP_ITERS times on the side `stream` (reset() after each, so
    every run starts from the state a replay will), then captured on it. Every runner of this project captures
    through here; replaying once to check, and putting counters back after, are the caller's."""
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_ITERS):
            body()
            if reset is not None:
                reset()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        body()
    return graph


def capture_problem(model: nn.Module) -> str | None:
    """Why this model's forward cannot be captured in a CUDA graph, or None when it can."""
    for module in model.modules():
        kind = layer_kind(module)
        if kind is not None and not CAPTURABLE.get(kind, True):
            return (f"{kind} layers (bitsandbytes) cannot be captured in a CUDA graph: "
                    f"static cache, eager kernel launches")
    return None


def captured_graphs(runner: object) -> bool:
    """Whether a runner replays CUDA graphs (a StaticGraphRunner whose capture succeeded): what the batch and
    the scheduler follow, so serving takes the fast path exactly where the engine's own loop does."""
    return bool(getattr(runner, "graphs", None))


def kv_buckets(cache_len: int, smallest: int) -> tuple[int, ...]:
    """Attention spans (multiples of CACHE_ALIGN) doubling from `smallest` up to the whole cache.

    Attention over the static cache reads every slot of its span; a span per context size keeps
    short generations from paying for a long cache. One graph per (width, span).
    """
    spans, span = [], max(CACHE_ALIGN, smallest // CACHE_ALIGN * CACHE_ALIGN)
    while span < cache_len:
        spans.append(span)
        span *= 2
    return (*spans, cache_len)


class StaticGraphRunner:
    """Runner over a LeanDecoder; raises UnsupportedModelError (from the constructor) to signal fallback.

    The tensor `forward` returns for a captured width is that graph's static output: it is
    overwritten by the next forward of the same width, so consume (or clone) it before then.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_length: int,
        graph_widths: Iterable[int],
        use_graphs: bool | None = None,
        share_weights: bool = True,
        attention: str = "sdpa",
        min_bucket: int = MIN_BUCKET,
        compile_widths: Iterable[int] = (),
        compile_spans: int = 2,
        stage_breaks: tuple[int, ...] = (),
        hidden_layers: tuple[int, ...] = (),
    ) -> None:
        self.decoder = LeanDecoder(model, max_length, share_weights=share_weights, attention=attention,
                                   stage_breaks=stage_breaks)
        self._forward = self.decoder.forward
        self._run_stage = self.decoder.run_stage
        # Opt-in: inductor fuses the elementwise ops (norms, RoPE, SiLU) before capture, which cuts
        # kernel count per forward. It compiles once per (width, span), ~20 s each on an H200, so
        # only the widths the loop uses every step and the smallest spans are compiled.
        self.compile_widths = frozenset(int(w) for w in compile_widths)
        self.compile_spans = compile_spans
        self._compiled = (
            torch.compile(self.decoder.run_stage, dynamic=False, fullgraph=True) if self.compile_widths else None
        )
        self.device = self.decoder.device  # where logits come out (the last stage's device)
        self.vocab_size = self.decoder.config.vocab_size
        self.max_length = max_length
        self.length = 0
        cuda = self.device.type == "cuda"
        self.use_graphs = cuda if use_graphs is None else (use_graphs and cuda)
        if use_graphs and not cuda:
            log.info("CUDA graphs asked for on %s; running the static forward eagerly", self.device)
        self.fallback_reason: str | None = None  # why graphs are off although CUDA is there
        self.capture_failed = False  # capture was tried and failed (another attention kernel may succeed)
        problem = capture_problem(model)
        if self.use_graphs and problem:
            self.use_graphs, self.fallback_reason = False, problem
        self.graph_widths = tuple(sorted({int(w) for w in graph_widths if 0 < int(w) <= max_length}))
        self.buckets = kv_buckets(self.decoder.config.cache_len, min_bucket)
        self.graphs: dict[tuple[int, int], list[torch.cuda.CUDAGraph]] = {}  # (width, bucket) -> one per stage
        # Tree forwards (engine/runners/tree.py) of the widths in tree_widths: their own graphs, reading
        # the tree's depth and ancestors from static buffers (any tree of that width replays them).
        self.tree_widths: tuple[int, ...] = ()
        self.tree_graphs: dict[tuple[int, int], list[torch.cuda.CUDAGraph]] = {}
        self.static_tree: dict[int, Tree] = {}  # width -> its static depth / ancestors buffers
        self.last_start = 0  # where the last forward began writing (keep_path moves slots after it)
        self.static_ids: dict[int, torch.Tensor] = {}  # width -> [W] long input buffer (input device)
        self.static_out: dict[int, torch.Tensor] = {}  # width -> [W, V] float32 output (output device)
        self.stage_out: dict[tuple[int, int], torch.Tensor] = {}  # (stage, width) -> [W, hidden] it writes
        self.stage_in: dict[tuple[int, int], torch.Tensor] = {}  # (stage, width) -> [W, hidden] it reads
        # Hidden rows for a draft head (Runner.keep_hidden): captured inside the graphs too.
        self.hidden_layers: tuple[int, ...] = tuple(hidden_layers)
        self.static_hidden: dict[int, torch.Tensor] = {}  # width -> [W, n * hidden] (output device)
        self.hidden: torch.Tensor | None = None  # rows of the last forward or prefill
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # one side stream per device for captures
        with torch.inference_mode(False):
            # Graphs read the write position from here (stage 0; later stages have their own copy).
            self.start = torch.zeros((), dtype=torch.long, device=self.decoder.input_device)
        self.name = "static-eager"

    # -- Runner -----------------------------------------------------------------------------

    def reset(self) -> None:
        self.length = 0  # stale slots are masked by position; nothing to clear

    def rollback(self, length: int) -> None:
        assert 0 <= length <= self.length, f"cannot roll back to {length} from {self.length}"
        self.length = length  # the device scalar is set from it by the next forward

    def keep_hidden(self, layers: tuple[int, ...]) -> None:
        """From now on forwards also leave these layers' outputs in `hidden` (recaptures the graphs)."""
        layers = tuple(layers)
        if layers == self.hidden_layers:
            return
        self.hidden_layers = layers
        self.hidden = None
        if self.graphs:
            self._drop_graphs()
            self.warmup()
            if self.tree_widths:
                self.capture_trees(self.tree_widths)

    def _drop_graphs(self) -> None:
        self.graphs.clear()
        self.tree_graphs.clear()
        self.static_ids.clear()
        self.static_out.clear()
        self.stage_out.clear()
        self.stage_in.clear()
        self.static_hidden.clear()

    def forward(self, ids: torch.Tensor, tree: Tree | None = None) -> torch.Tensor:
        """Appends ids [W] to the cache; returns float32 logits [W, V] (see the class note on reuse).

        tree: the W tokens form this tree of drafts (engine/runners/tree.py); keep_path then
        moves the kept branch into place."""
        width = ids.shape[-1]
        if self.length + width > self.max_length:
            raise GenerationError(
                f"The context is full: {self.length} cached tokens + {width} new exceed the "
                f"{self.max_length}-token cache of this runner. Shorten the prompt or max_new_tokens."
            )
        self.last_start = self.length
        bucket = self._bucket(self.length + width)
        if tree is not None:
            assert tree.width == width <= PREFILL_CHUNK, "a tree forward is one chunk of its own width"
            graphs = self.tree_graphs.get((width, bucket))
            if graphs is None:
                return self._eager(ids.view(width), True, tree)
            static = self.static_tree[width]
            static.depth.copy_(tree.depth, non_blocking=True)
            static.ancestors.copy_(tree.ancestors, non_blocking=True)
        else:
            graphs = self.graphs.get((width, bucket))
        if graphs is None:  # eagerly, in chunks; _eager advances the length per chunk
            outs = self._chunks(ids.view(width), logits=True)
            return outs[0] if len(outs) == 1 else torch.cat(outs)
        self.static_ids[width].copy_(ids.view(width), non_blocking=True)
        self._set_start(self.length)
        for s, graph in enumerate(graphs):
            if s:  # the hidden state crosses to the next GPU (ordered against both devices' streams)
                self.stage_in[(s, width)].copy_(self.stage_out[(s - 1, width)], non_blocking=True)
            graph.replay()
        self.length += width
        self.hidden = self.static_hidden.get(width)
        return self.static_out[width]

    def keep_path(self, nodes: list[int]) -> None:
        """After a tree forward: the rows `nodes` (in order, from row 0) become the cached sequence.

        Moves the K/V of each kept row whose slot differs to its place after the one before, and
        the same rows of `hidden`, so a draft head reads the kept branch. The caller rolls back
        to the committed length afterwards, as after any verify.
        """
        moved = [(i, node) for i, node in enumerate(nodes) if node != i]
        if not moved:
            return
        dst = torch.tensor([i for i, _ in moved], dtype=torch.long)
        src = torch.tensor([node for _, node in moved], dtype=torch.long)
        device = self.decoder.input_device
        if device.type == "cuda":
            dst, src = dst.pin_memory(), src.pin_memory()
        dst, src = dst.to(device, non_blocking=True), src.to(device, non_blocking=True)
        self.decoder.move_slots(src + self.last_start, dst + self.last_start)
        if self.hidden is not None:
            dst, src = dst.to(self.hidden.device), src.to(self.hidden.device)
            self.hidden.index_copy_(0, dst, self.hidden.index_select(0, src))

    def prefill(self, ids: torch.Tensor) -> None:
        """Appends ids [W] to the cache, eagerly and in chunks, computing no logits."""
        width = ids.shape[-1]
        if self.length + width > self.max_length:
            raise GenerationError(
                f"The prompt needs {self.length + width} cache positions; this runner holds {self.max_length}."
            )
        self._chunks(ids.view(width), logits=False)

    def reserve(self, length: int) -> None:
        """The static cache holds max_length from the start: nothing to reserve."""

    # -- fast path ----------------------------------------------------------------------------

    def _bucket(self, end: int) -> int:
        """The smallest attention span holding `end` positions."""
        return next(b for b in self.buckets if b >= end)

    def _set_start(self, length: int) -> None:
        self.start.fill_(length)
        for stage in self.decoder.stages[1:]:
            stage.start.fill_(length)

    def _chunks(self, ids: torch.Tensor, logits: bool) -> list[torch.Tensor | None]:
        """The eager forward over ids [W] in PREFILL_CHUNK pieces; `hidden` gets all W rows."""
        outs, rows = [], []
        for chunk in ids.split(PREFILL_CHUNK):
            outs.append(self._eager(chunk, logits))
            if self.hidden_layers:
                rows.append(self.hidden)
        if rows:
            self.hidden = rows[0] if len(rows) == 1 else torch.cat(rows)
        return outs

    def _eager(self, ids: torch.Tensor, logits: bool = True, tree: Tree | None = None) -> torch.Tensor | None:
        self._set_start(self.length)
        hidden = None
        if self.hidden_layers:
            buf = torch.empty(ids.shape[0], len(self.hidden_layers) * self.decoder.config.hidden,
                              dtype=self.decoder.dtype, device=self.device)
            hidden = (buf, self.hidden_layers)
            self.hidden = buf
        out = self._forward(ids, self.start, self._bucket(self.length + ids.shape[0]), logits, hidden, tree)
        self.length += ids.shape[0]
        return out

    def warmup(self, progress: Progress | None = None) -> None:
        """Captures one CUDA graph per width (a few seconds); eager warm-up runs on CPU.

        If capture fails the runner stays correct and eager; `name` and `fallback_reason` say so.
        """
        report = progress or (lambda fraction, message: None)
        saved = self.length
        widths = self.graph_widths
        if not self.use_graphs:
            # Touch each width once so first-call costs (allocations, kernels) are not in timings.
            for i, width in enumerate(widths):
                report(i / max(len(widths), 1), f"warming up width {width}")
                self.length = 0
                self._eager(torch.zeros(width, dtype=torch.long, device=self.device))
            self.length = saved
            report(1.0, "ready (eager static cache)")
            return
        try:
            with torch.inference_mode(False), torch.no_grad():
                # Graphs of one runner never run concurrently, so they share one pool per device.
                pools = {}
                for stage in self.decoder.stages:
                    with torch.cuda.device(stage.device):
                        pools[stage.device] = torch.cuda.graph_pool_handle()
                todo = [(w, b) for w in widths for b in self.buckets if w <= b]
                for i, (width, bucket) in enumerate(todo):
                    report(i / len(todo), f"capturing CUDA graph {i + 1}/{len(todo)} (width {width}, span {bucket})")
                    self._capture(width, bucket, pools)
            self.name = "cuda-graphs+compile" if self._compiled is not None else "cuda-graphs"
            log.info("captured %d CUDA graphs: widths %s x spans %s x %d stage(s)", len(todo), list(widths),
                     list(self.buckets), len(self.decoder.stages))
        except Exception as exc:  # capture is an optimisation: never let it break decoding
            log.warning("CUDA graph capture failed, using the static cache eagerly: %s", exc, exc_info=True)
            self._drop_graphs()
            self.fallback_reason = f"CUDA graph capture failed: {exc}"
            self.capture_failed = True
            self.name = "static-eager"
            for stage in self.decoder.stages:
                torch.cuda.synchronize(stage.device)
        self.length = saved
        report(1.0, f"ready ({self.name})")

    def _buffers(self, width: int) -> None:
        """One set of input/output buffers per width, shared by that width's graphs (one per span)."""
        if width in self.static_ids:
            return
        stages, c = self.decoder.stages, self.decoder.config
        self.static_ids[width] = torch.zeros(width, dtype=torch.long, device=self.decoder.input_device)
        self.static_out[width] = torch.zeros(width, self.vocab_size, dtype=torch.float32, device=self.device)
        if self.hidden_layers:
            self.static_hidden[width] = torch.zeros(width, len(self.hidden_layers) * c.hidden,
                                                    dtype=self.decoder.dtype, device=self.device)
        for s in range(len(stages) - 1):
            self.stage_out[(s, width)] = torch.zeros(width, c.hidden, dtype=self.decoder.dtype,
                                                     device=stages[s].device)
            self.stage_in[(s + 1, width)] = torch.zeros(width, c.hidden, dtype=self.decoder.dtype,
                                                        device=stages[s + 1].device)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        # One side stream per device for every warm-up and capture: blocks the caching allocator
        # keeps for a stream are reused by the next capture instead of piling up per new stream.
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _capture(self, width: int, bucket: int, pools: dict, tree: bool = False) -> None:
        self._buffers(width)
        hidden = (self.static_hidden[width], self.hidden_layers) if self.hidden_layers else None
        stages = self.decoder.stages
        run = self._run_stage
        if self._compiled is not None and width in self.compile_widths and bucket in self.buckets[: self.compile_spans]:
            run = self._compiled
        static_tree = None
        if tree:
            if width not in self.static_tree:
                self.static_tree[width] = chain_tree(width, self.decoder.input_device)  # any valid tree
            static_tree = self.static_tree[width]
        self._set_start(0)
        graphs = []
        for s, stage in enumerate(stages):
            last = s == len(stages) - 1
            inp = self.static_ids[width] if s == 0 else self.stage_in[(s, width)]
            out = self.static_out[width] if last else self.stage_out[(s, width)]
            start = self.start if s == 0 else stage.start

            stage_tree = None if static_tree is None else static_tree.to(stage.device)

            def step(s=s, inp=inp, out=out, start=start, stage_tree=stage_tree) -> None:
                # [W, V] from the last stage, [W, hidden] before; kept layers' rows into `hidden`
                out.copy_(run(s, inp, start, bucket, True, hidden, stage_tree))

            with torch.cuda.device(stage.device):
                graphs.append(capture(step, self._stream(stage.device), pools[stage.device], stage.device))
        for s, graph in enumerate(graphs):  # one replay so a broken capture fails here, not in a generation
            if s:
                self.stage_in[(s, width)].copy_(self.stage_out[(s - 1, width)])
            graph.replay()
        for stage in stages:
            torch.cuda.synchronize(stage.device)
        (self.tree_graphs if tree else self.graphs)[(width, bucket)] = graphs

    def capture_trees(self, widths: Iterable[int], progress: Progress | None = None, compile: Iterable[int] = ()
                      ) -> None:
        """Graphs for tree forwards of these widths (CUDA; eager elsewhere). A failed capture leaves
        those widths eager (correct, slower) and says so in the log. compile: on the compiled fast
        path these widths are compiled too (a dynamic tree's rounds all verify its widest)."""
        self.tree_widths = tuple(sorted({int(w) for w in widths if 0 < int(w) <= PREFILL_CHUNK}))
        if self._compiled is not None:
            self.compile_widths = self.compile_widths | set(compile)
        if not self.use_graphs or not self.graphs:
            return
        if len(self.decoder.stages) > 1:
            return  # a split model's stages would need the tree on every device: eager is correct
        report = progress or (lambda fraction, message: None)
        saved = self.length
        try:
            with torch.inference_mode(False), torch.no_grad():
                stage = self.decoder.stages[0]
                with torch.cuda.device(stage.device):
                    pools = {stage.device: torch.cuda.graph_pool_handle()}
                todo = [(w, b) for w in self.tree_widths for b in self.buckets if w <= b
                        and (w, b) not in self.tree_graphs]
                for i, (width, bucket) in enumerate(todo):
                    report(i / max(len(todo), 1), f"capturing tree graph {i + 1}/{len(todo)}")
                    self._capture(width, bucket, pools, tree=True)
        except Exception as exc:  # an optimisation: eager tree forwards stay correct
            log.warning("tree graph capture failed; tree forwards run eagerly: %s", exc, exc_info=True)
            self.tree_graphs.clear()
            torch.cuda.synchronize(self.device)
        self.length = saved

    def measure_costs(self, widths: Iterable[int], iters: int = 20) -> dict[int, float]:
        return measure_forward_costs(self, widths, iters)


def build_runners(
    target: nn.Module,
    draft: nn.Module | None,
    *,
    max_length: int | None = None,
    k_max: int = K_MAX,
    attention: str = "sdpa",
    progress: Callable[[Any], None] | None = None,
    compile_k: int | None = None,
    hidden_layers: tuple[int, ...] = (),
    compile_tree: int | None = None,
) -> tuple[StaticGraphRunner, StaticGraphRunner | None, str]:
    """Fast runners for a pair, warmed up (graphs captured on CUDA); (target, draft, fast-path name).

    Raises UnsupportedModelError (or anything else) when the fast path cannot take a model; the
    caller then falls back to eager runners. `progress` receives engine.models.store.LoadProgress.
    hidden_layers: the target's layers a draft head reads (its graphs then keep those rows too).
    compile_tree: with compile_k, also compile this tree width (a head's verify, engine/runners/tree.py).
    """
    limit = int(getattr(target.config, "max_position_embeddings", DEFAULT_MAX_LENGTH))
    length = min(max_length or DEFAULT_MAX_LENGTH, limit)
    # Width 1: standard decoding; 2..k_max+1: the verify (K drafts + the pending token).
    target_widths = range(1, k_max + 2)
    # compile_k: also compile (inductor) the widths a K = compile_k loop uses every step.
    compiled_target = (1, compile_k + 1, *((compile_tree,) if compile_tree else ())) if compile_k else ()
    target_runner = StaticGraphRunner(target, max_length=length, graph_widths=target_widths, attention=attention,
                                      compile_widths=compiled_target, hidden_layers=hidden_layers)
    # Width 1: a draft step; 2: the catch-up after a fully accepted draft (pending + bonus).
    draft_runner = (
        StaticGraphRunner(draft, max_length=length, graph_widths=(1, 2), attention=attention,
                          compile_widths=(1, 2) if compile_k else ())
        if draft is not None
        else None
    )
    if compile_k:
        import torch._dynamo

        # One compiled code object serves both models, several widths and spans: allow the variants.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)

    def stage(lo: float, hi: float) -> Callable[[float, str], None] | None:
        if progress is None:
            return None
        return lambda fraction, message: progress(LoadProgress("warmup", lo + (hi - lo) * fraction, message))

    share = 0.8 if draft_runner is not None else 1.0
    target_runner.warmup(stage(0.0, share))
    if target_runner.capture_failed and attention == "sdpa":
        # The fused attention kernel is the likeliest part to refuse capture; plain matmuls rarely do.
        log.warning("retrying graph capture with matmul attention: %s", target_runner.fallback_reason)
        return build_runners(target, draft, max_length=max_length, k_max=k_max, attention="math", progress=progress,
                             compile_k=compile_k, hidden_layers=hidden_layers, compile_tree=compile_tree)
    if draft_runner is not None:
        draft_runner.warmup(stage(share, 1.0))
    name = target_runner.name
    if target_runner.fallback_reason:
        log.warning("fast path: %s", target_runner.fallback_reason)
    return target_runner, draft_runner, name
