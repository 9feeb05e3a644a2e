"""The Engine: a loaded target (and optional draft or head) kept resident, that decodes requests."""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import replace

import torch

from engine.decoding.cost_check import CostCheck, settle_costs
from engine.decoding.control import AdaptiveK, FixedK, KController, StepCosts, TuningMemory
from engine.decoding.costs import measure_again, measure_costs, measure_trees
from engine.decoding.factory import make_proposer, make_proposers
from engine.decoding.loop import Generation, widest
from engine.decoding.prefill import ProgressCallback
from engine.decoding.proposers import Proposer, ProposerSet
from engine.errors import GenerationError
from engine.heads.model import DraftHead
from engine.heads.runner import ALTERNATIVES, HeadRunner
from engine.heads.tree import TreeDrafter
from engine.limits import (DEFAULT_K, K_AUTO, K_MAX, TREE_COST_LIMIT, TREE_FRONTIER, TREE_K_MAX,
                           TREE_MIN_COST_LIMIT, TREE_NODES, TREE_NODES_MAX, TREE_NODES_MIN)
from engine.loadspec import LoadProgress
from engine.models.device import output_device
from engine.measure.costmodel import costs_at, tree_costs_at
from engine.runners import Runner
from engine.runners.eager import EagerRunner
from engine.runners.tree import Tree, sibling_rows, sibling_tree
from engine.types import DraftSource, GenerationRequest, ModelInfo, Sampling

log = logging.getLogger(__name__)


class Engine:
    """A loaded target (and optional draft) that decodes requests; holds the models resident."""

    def __init__(
        self,
        target: torch.nn.Module | None,
        tokenizer,
        info: ModelInfo,
        *,
        draft: torch.nn.Module | None = None,
        vocab: int | None = None,
        target_runner: Runner | None = None,
        draft_runner: Runner | None = None,
        max_length: int | None = None,
        eos_ids: Iterable[int] = (),
    ) -> None:
        """target/draft: torch models, or None where a runner brings its own (llama.cpp);
        eos_ids: end-of-generation ids beyond the tokenizer's and the model config's."""
        assert target is not None or target_runner is not None, "a target model or a target runner"
        self.tokenizer = tokenizer
        self.info = info
        self.cost_passes: list = []  # CPU: every pass of the cost measurement so far (costs.measure_pass)
        self.cost_check: CostCheck | None = None  # the costs to measure again after Ready (cost_check.py)
        self.target = target
        self.draft = draft
        if target_runner is None or (draft is not None and draft_runner is None):
            target_runner = target_runner or EagerRunner(target, max_length)
            draft_runner = draft_runner or (EagerRunner(draft, max_length) if draft is not None else None)
        self.target_runner = target_runner
        self.draft_runner = draft_runner
        # Where logits come out: a target split over GPUs ends on its last one, where the draft lives.
        self.device = output_device(target) if target is not None else self.target_runner.device
        # Compare on the shared vocabulary: Qwen2.5 0.5B has 151936 rows, 7B 152064.
        heads = [self.target_runner.vocab_size] + ([self.draft_runner.vocab_size] if self.draft_runner else [])
        self.vocab = vocab or min(heads)
        self.eos_ids = _eos_ids(tokenizer, target) | {int(i) for i in eos_ids}
        self.head_runner: HeadRunner | None = None  # a draft head for this target (attach_head)
        self._lock = threading.Lock()  # one generation at a time: the caches are shared
        # Queue rounds ahead of the host (see Generation._loop). None: on CUDA only, where it keeps
        # the device busy while the host describes steps; on a CPU the work runs inside the launch,
        # so it would only delay each step's tokens. Tests force it on to check it changes no output.
        self.lookahead: bool | None = None
        self.tuning = TuningMemory()  # what adaptive K learned in this process; each answer starts from it
        # Next-best head tokens verified beside each head draft as a tree (runners/tree.py); None: the
        # device's default (set_tree): a dynamic tree fitted to the verify costs measured here (wide on a GPU,
        # whose verify costs nearly the same for many more rows; small on a CPU, where cost grows with width),
        # chains on runners without tree forwards.
        self.tree_alternatives: int | None = None
        self._trees: dict[tuple[int, int], Tree] = {}  # (K, S) -> its sibling tree on the device
        # A dynamic tree instead (engine/heads/tree.py, set_dynamic_tree): the head grows one per round.
        self.tree_drafter: TreeDrafter | None = None
        self._drafters: dict[tuple[int, int], TreeDrafter] = {}  # (nodes, frontier) -> drafter, graphs kept
        # ModelInfo's tree fields per tree measured since the last full measurement (costs.measure_trees).
        self.tree_costs: dict[tuple[int, int, int], dict] = {}
        self._fit_tree = False  # the tree is the default one, fitted to the measured costs (fit_tree)
        # Prompt tokens per second each part read at last (target, draft, head): the next prompt's
        # chunks are sized from it (engine/decoding/prefill.py).
        self.prefill_rates: dict[str, float] = {}


    def attach_head(self, head: DraftHead, name: str, progress=None, compile_step: bool = False) -> None:
        """Uses a draft head (bound to this target, or to a copy of it) from the next request on.

        The target runner starts keeping the head's layers (on CUDA: its graphs are recaptured),
        the head gets its own cache and graphs, and its cost per draft token is measured.
        compile_step: its chain step is inductor-compiled before capture (the "compiled" fast path).
        """
        if self.target is None:  # a runner with its own model (llama.cpp) keeps no hidden states
            self.target_runner.keep_hidden(head.config.feature_layers)  # refuses in one line
            raise GenerationError("This runtime cannot run a draft head; load the models with --runtime torch.")
        if progress is not None:
            progress(LoadProgress("warmup", 0.9, f"Preparing the draft head {name}"))
        with self._lock:
            head.bind_inputs(self.target)  # one copy of the embeddings: the engine's own
            self.target_runner.keep_hidden(head.config.feature_layers)
            runner = HeadRunner(head, max_length=self.target_runner.max_length, k_max=K_MAX,
                                compile_step=compile_step)
            runner.warmup()
            try:
                ms = runner.measure_ms(iters=20 if self.device.type == "cuda" else 3)
            except Exception as exc:  # advice only, as the other costs
                log.warning("could not measure the draft head's cost: %s", exc)
                ms = 0.0
            self.head_runner = runner
            self.info = replace(self.info, head_name=name, head_ms=ms)
            drafter, self.tree_drafter = self.tree_drafter, None  # it drafted with the head replaced
            for old in self._drafters.values():
                old.drop()
            self._drafters.clear()
        if drafter is not None:
            self.set_dynamic_tree(drafter.nodes, drafter.frontier)
        self.set_tree(self.tree_alternatives)  # the tree's graphs, where one pays

    def alternatives(self) -> int:
        """Next-best tokens a head proposal carries beside each draft (0: chains, or dynamic trees)."""
        if self.head_runner is None or not hasattr(self.target_runner, "keep_path") or self.tree_drafter is not None:
            return 0
        return self.tree_alternatives or 0

    def set_tree(self, alternatives: int | None) -> None:
        """Chooses the tree: alternatives beside each head draft token (0: chains), or None: the default for
        this device, a dynamic tree fitted to the measured costs (fit_tree) where the runner verifies trees
        (TREE_NODES on a GPU, TREE_NODES_MIN on a CPU), chains elsewhere. Captures its graphs on CUDA."""
        if alternatives is not None and not 0 <= alternatives <= ALTERNATIVES:
            raise GenerationError(f"A tree keeps 0..{ALTERNATIVES} alternatives per draft token, not {alternatives}.")
        self.tree_alternatives = alternatives
        if alternatives is None and self.head_runner is not None and hasattr(self.target_runner, "capture_trees"):
            # A GPU verifies wide trees for little more than a chain; a CPU's wider forwards cost more, so its
            # fit starts at the smallest tree (and falls back to chains when even that costs too much).
            self.set_dynamic_tree(TREE_NODES if self.device.type == "cuda" else TREE_NODES_MIN, fit=True)
            return
        if self.tree_drafter is not None:
            self.set_dynamic_tree(0)
        s = self.alternatives()
        capture = getattr(self.target_runner, "capture_trees", None)
        if s and capture is not None:
            with self._lock:
                capture(sibling_rows(k, s) for k in range(1, TREE_K_MAX + 1))
        if self.info.target_ms and (s, self.tree_nodes) != (self.info.tree_alternatives, self.info.tree_nodes):
            with self._lock:  # costs measured already: this tree's too
                measure_trees(self, reuse=True)

    @property
    def tree_nodes(self) -> int:
        """Nodes of the dynamic tree a head round verifies (0: none)."""
        return self.tree_drafter.nodes if self.tree_drafter is not None else 0

    def fit_tree(self) -> None:
        """The default dynamic tree, fitted to the costs measured here: halved while its verify at the default K
        costs more than TREE_COST_LIMIT times a chain's (a device whose wide forwards cost more), chains when the
        smallest tree's costs more than TREE_MIN_COST_LIMIT times. A tree a person chose is left as it is, and
        so is one whose costs are not measured."""
        if not self._fit_tree or self.tree_drafter is None:
            return
        tree, chain = dict(self.info.tree_ms).get(DEFAULT_K), dict(self.info.target_ms).get(DEFAULT_K + 1)
        limit = TREE_COST_LIMIT if self.tree_nodes > TREE_NODES_MIN else TREE_MIN_COST_LIMIT
        if self.info.tree_nodes != self.tree_nodes or not tree or not chain or tree <= limit * chain:
            return
        nodes = self.tree_nodes // 2
        log.info("a %d-node tree verifies in %.2f ms, %.2fx a chain's: %s", self.tree_nodes, tree, tree / chain,
                 f"trying {nodes} nodes" if nodes >= TREE_NODES_MIN else "chains instead")
        if nodes < TREE_NODES_MIN:
            self.set_tree(0)
        else:
            self.set_dynamic_tree(nodes, self.tree_drafter.frontier, fit=True)  # measured, and fitted again

    def set_dynamic_tree(self, nodes: int, frontier: int = TREE_FRONTIER, fit: bool = False) -> None:
        """The head grows dynamic trees of `nodes` nodes (0: none) from the next request on, expanding
        `frontier` nodes per level, K levels deep; their graphs are captured on CUDA. fit: a default, fitted
        to the measured costs now and whenever they are measured again (fit_tree); else kept as it is."""
        if not 0 <= nodes <= TREE_NODES_MAX or frontier < 1:
            raise GenerationError(f"A dynamic tree holds 1..{TREE_NODES_MAX} nodes and expands at least one per "
                                  f"level (got {nodes} nodes, {frontier} per level).")
        if nodes and self.head_runner is None:
            raise GenerationError("Dynamic trees are grown by a draft head; load one with --head (torch runtime).")
        if nodes and not hasattr(self.target_runner, "capture_trees"):
            raise GenerationError(f"The {self.info.fast_path} runner verifies chains only: dynamic trees need the "
                                  "static-cache fast path (a GPU, --fast-path auto, static or compiled).")
        with self._lock:
            self.tree_drafter = None
            if nodes:
                frontier = min(frontier, nodes)
                drafter = self._drafters.get((nodes, frontier))
                if drafter is None:  # its graphs stay captured: switching back costs nothing
                    drafter = TreeDrafter(self.head_runner, frontier=frontier, nodes=nodes, max_depth=TREE_K_MAX)
                    drafter.warmup()
                    self.target_runner.capture_trees((*self.target_runner.tree_widths, *drafter.widths()),
                                                     compile=drafter.widths()[-1:])
                    self._drafters[(nodes, frontier)] = drafter
                self.tree_drafter = drafter
        if self.info.target_ms:  # costs measured already: this tree's rounds too
            with self._lock:
                measure_trees(self, reuse=True)
        self._fit_tree = fit and nodes > 0
        self.fit_tree()

    def tree(self, k: int, s: int) -> Tree:
        tree = self._trees.get((k, s))
        if tree is None:
            tree = self._trees[(k, s)] = sibling_tree(k, s, self.device)
        return tree

    def measure_costs(self, progress=None, rounds: int = 3) -> None:
        """The cost model's inputs, measured once at load (engine/decoding/costs.py): every verify width
        1..K_MAX+1 timed as the loop's own round, and each proposer's own cost through its propose().

        GPU: the median of 20 rounds per width and 5 timed proposals per proposer (about a second).
        CPU: forwards take tens to hundreds of ms and their speed drifts with the machine's memory
        bandwidth (right after load and next to other work it can be 2x slower for seconds), so
        `rounds` passes (an odd number: a median that drops an outlier) each time every width (a
        warm round, then a timed one: as a fixed K runs it) and every proposer, in turn, after a
        64-token context, and the median is kept: costs are measured side by side.
        ModelInfo.measure_s says what it took. Never fails a load: without figures the
        app and bench say nothing about costs, and adaptive K measures on its first request.
        """
        measure_costs(self, progress, rounds)
        self.fit_tree()

    def settle_costs(self, progress=None, keep_costs: bool = False) -> None:
        """The costs at load (cost_check.settle_costs): with `keep_costs`, the figures kept for this machine
        and pair when there are some (nothing measured before Ready), else measured and kept when they
        hold; disturbed figures are measured again after Ready (refresh_costs)."""
        settle_costs(self, progress, keep_costs)
        self.fit_tree()

    def refresh_costs(self, interrupted=None) -> bool:
        """One pass of measuring the costs again after Ready, when there is one to do (CostsInterrupted
        drops it when `interrupted()` says so); True when ModelInfo changed."""
        check = self.cost_check
        return check.step(self, interrupted) if check is not None and not check.done else False

    def measure_again(self) -> None:
        """On a CPU, one more pass of the cost measurement, pooled with those so far (costs.measure_again):
        a sweep measures beside its runs, as the machine's speed drifts."""
        measure_again(self)

    def prefill_estimate(self, part: str) -> float | None:
        """Prompt tokens per second of a part before it has read one, from the costs measured at load:
        the widest verify's rows per second (a prompt chunk is wider, so it reads at least as fast)."""
        if part == "target" and self.info.target_ms:
            width, ms = max(self.info.target_ms)
            return width * 1e3 / ms if ms > 0 else None
        ms = self.info.draft_ms if part == "draft" else self.info.head_ms if part == "head" else 0.0
        return 1e3 / ms if ms > 0 else None

    def step_costs(self, sampled: bool = False) -> StepCosts:
        """The measured costs as the adaptive controller reads them (measured now if they are missing);
        sampled: those of sampled rounds (temperature > 0), where they were measured."""
        measured = {c.source for c in self.info.proposer_costs}
        if len(self.info.target_ms) < K_MAX + 1 or not set(self.proposer_sources()) <= measured:
            self.measure_costs()
        target, costs = costs_at(self.info, sampled)
        if len(target) < K_MAX + 1:
            raise GenerationError("Adaptive K needs the forward costs, which could not be measured; choose a fixed K.")
        same = (self.info.tree_alternatives, self.info.tree_nodes) == (self.alternatives(), self.tree_nodes)
        trees = tree_costs_at(self.info, sampled) if same else {}
        drafting = dict(self.info.tree_draft_ms) if same and self.tree_nodes else {}
        return StepCosts((0.0, *(target[w] for w in range(1, K_MAX + 2))), costs, trees, drafting)

    # -- prompts ---------------------------------------------------------------------------
    def encode(self, request: GenerationRequest) -> list[int]:
        """The prompt ids: chat template for messages, raw text otherwise."""
        if request.messages:
            chat = [{"role": m.role, "content": m.content} for m in request.messages]
            if getattr(self.tokenizer, "chat_template", None):
                text = self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            else:
                text = "\n".join(f"{m['role']}: {m['content']}" for m in chat) + "\nassistant: "
        else:
            text = request.prompt or ""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: undecodable bytes smuggled in as text
            raise GenerationError("The prompt is not valid UTF-8 text.") from None
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise GenerationError("The prompt is empty.")
        return list(ids)

    def generate(self, request: GenerationRequest, cancel: threading.Event | None = None,
                 progress: ProgressCallback | None = None) -> Generation:
        """Validates the request now (so errors surface before any step) and returns the steps.

        cancel: checked between steps and between the prompt's chunks. progress: called (on the
        iterating thread) with each model's PrefillProgress as it reads the prompt."""
        if request.mode == "speculative" and request.k != K_AUTO and not 1 <= request.k <= K_MAX:
            raise GenerationError(f"K must be 1..{K_MAX}, or auto (got {request.k}).")
        if request.mode != "standard":
            if request.proposer == "head" and self.head_runner is None and self.target is None:
                # The runner brings its own model (llama.cpp): no hidden states for a head to read.
                raise GenerationError(f"The draft head cannot propose on the {self.target_runner.name} runtime: it "
                                      "reads the target's hidden states, which that runtime does not give. Load the "
                                      "models on the torch runtime (--runtime torch), or choose another proposer.")
            if request.proposer == "head" and self.head_runner is None:
                raise GenerationError(
                    "No draft head is loaded for this target. Train one with `specdec-studio distill "
                    "--target ... --out DIR` and load it with --head DIR, or choose another proposer."
                )
            if "draft" in request.proposer.kinds and self.draft_runner is None:
                raise GenerationError("Speculative decoding with a draft model needs a draft; load one first.")
        if request.max_new_tokens < 1:
            raise GenerationError("max_new_tokens must be at least 1.")
        s = request.sampling
        if s.temperature < 0 or not (0.0 < s.top_p <= 1.0) or s.top_k < 0:
            raise GenerationError("temperature must be >= 0, top_p in (0, 1], top_k >= 0.")
        prompt = self.encode(request)
        room = self.target_runner.max_length - len(prompt) - (widest(request) + 1)
        if room < 1:
            raise GenerationError(
                f"The prompt is {len(prompt)} tokens; the model's context holds "
                f"{self.target_runner.max_length}. Shorten the prompt or start a new chat."
            )
        return Generation(self, request, prompt, cancel, progress)

    def proposer_sources(self) -> tuple[DraftSource, ...]:
        """Every proposer this engine can run; each one's cost is measured at load."""
        return (("draft",) if self.draft_runner is not None else ()) + ("ngram",) + \
            (("head",) if self.head_runner is not None else ())

    def proposer(self, source: DraftSource, sampling: Sampling, generator: torch.Generator | None) -> Proposer:
        """One proposer over this engine's runners (engine/decoding/factory.py)."""
        return make_proposer(self, source, sampling, generator)

    def make_proposers(self, request: GenerationRequest, generator: torch.Generator | None) -> ProposerSet:
        """The proposers the request drafts from (engine/decoding/factory.py)."""
        return make_proposers(self, request, generator)

    def make_controller(self, request: GenerationRequest) -> KController:
        """FixedK for standard decoding (K = 0) and a fixed K; AdaptiveK for K_AUTO and auto mode."""
        if request.mode == "standard":
            return FixedK(0)
        if request.mode == "speculative" and request.k != K_AUTO:
            return FixedK(request.k)
        return AdaptiveK(self.step_costs(sampled=not request.sampling.greedy), self.tuning,
                         temperature=request.sampling.temperature)


def _eos_ids(tokenizer, model) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
