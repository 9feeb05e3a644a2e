"""The decoding loop: standard and speculative decoding behind one Iterator[Step] protocol."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import torch

from engine.decoding.control import AdaptiveK, FixedK, KController, StepCosts, TuningMemory
from engine.decoding.detok import Detokenizer
from engine.decoding.head import HeadProposer
from engine.decoding.proposers import DraftModelProposer, Proposal, Proposer, ProposerSet
from engine.decoding.sampling import accept_draft, display_probs, draw, process
from engine.errors import GenerationError, IncompatibleModelsError
from engine.heads.model import DraftHead
from engine.heads.runner import ALTERNATIVES, HeadRunner
from engine.limits import K_AUTO, K_MAX, TREE_K_MAX, widest_draft
from engine.measure.stats import summarize
from engine.runners import Runner, ids_tensor
from engine.runners.base import output_device
from engine.runners.tree import Tree, sibling_rows, sibling_tree
from engine.types import (
    Decision,
    DraftSource,
    GenerationRequest,
    ModelInfo,
    Sampling,
    Step,
    StopReason,
    Summary,
    TokenView,
)

log = logging.getLogger(__name__)

TREE_ALTERNATIVES = 2  # default next-best tokens per draft position on a GPU (bench/h200_head.py measures 0..3)


@dataclass
class _StepResult:
    """What one round decided, on the host, after the step's single device sync."""

    proposed: list[int]  # draft token ids
    q_shown: list[float]  # q(x) per draft token, as displayed
    p_shown: list[float]  # p(x) per draft token, as displayed
    accept_prob: list[float]  # min(1, p/q) per draft token
    accepted: int  # accepted prefix length
    added: int  # the target's token (correction, bonus or standard)
    added_p: float  # its displayed target probability
    draft_ms: float
    verify_ms: float
    prefill_ms: float = 0.0  # a proposer's one-off prefill before it drafted (Proposer.prepare), not drafting
    extra: int = -1  # a tree round: the target's token after the alternative it picked (-1: none)
    extra_p: float = 0.0  # its displayed target probability
    extra_row: int = 0  # the tree row of that alternative (runners/tree.py)


@dataclass
class _Launched:
    """One round's device work, queued; `_collect` reads its outcome with the round's one host sync.

    On CUDA nothing here has run yet when it is created: the outcome is copied into pinned host
    memory behind the round's kernels and `done` marks when it has landed.
    """

    outcome: torch.Tensor  # [4n + 3] float: drafts, q(x), p(x), accept prob, accepted, added, p(added)
    n: int  # draft tokens in this round
    proposal: Proposal | None  # None for a standard round
    decision: Decision  # what the K controller chose for this round
    done: torch.cuda.Event | None  # CUDA: recorded after the copy to the host
    marks: tuple  # CUDA: timing events (begin, prepared, drafted, verified); CPU: perf_counter times
    token: torch.Tensor | None = None  # standard round: its token [1] on the device, the next round's input
    tree: bool = False  # the drafts were verified as a tree (the outcome carries extra, extra_p, extra_row)


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
        self.target = target
        self.draft = draft
        if target_runner is None or (draft is not None and draft_runner is None):
            from engine.runners.eager import EagerRunner  # imports transformers: only for torch models

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
        # Next-best head tokens verified beside each head draft as a tree (runners/tree.py); None:
        # TREE_ALTERNATIVES where a tree pays (a GPU's verify costs nearly the same for a few more
        # rows), 0 on a CPU (forward cost grows with width) and on runners without tree forwards.
        self.tree_alternatives: int | None = None
        self._trees: dict[tuple[int, int], Tree] = {}  # (K, S) -> its sibling tree on the device

    @classmethod
    def from_pair(cls, pair, *, fast_path: str = "auto", progress=None, compile_k: int = 5,
                  head: str | None = "auto") -> Engine:
        """Builds runners for a LoadedPair (engine.models.store); the fast path when CUDA allows it.

        fast_path: "auto" (CUDA graphs where possible, else eager), "eager", "static" (graphs or
        an error), "compiled" (graphs of inductor-compiled forwards for K = compile_k: minutes of
        warm-up, fewer kernels per forward).
        head: "auto" (the shipped draft head trained for this target, if there is one), a head
        folder (refused when it was trained for another target), or None; the pair's own when
        load_pair(pack_cpu=True) resolved it.
        """
        from engine.heads.shards import resolve_head
        from engine.models.quant import quantized_kind

        target_runner = draft_runner = None
        name = "eager"
        notes: list[str] = []
        context = pair.plan.context if pair.plan is not None else None
        on_cpu = pair.target.device.type == "cpu"
        quantized = [m for m in (pair.target, pair.draft) if m is not None and quantized_kind(m)]
        if len(pair.info.devices) > 1 and head is not None and str(head) not in ("auto", "none"):
            # The head reads the target's input embeddings (first GPU) and output rows (last GPU) at once.
            raise IncompatibleModelsError("A draft head needs the target on one GPU; this target is split over "
                                          f"{', '.join(pair.info.devices)}. Load it without a head, or on one GPU.")
        if len(pair.info.devices) > 1:
            head = None  # "auto" too: a shipped head is skipped rather than failing the load
        # Before packing: the head gathers its output rows from the target's own output head (when
        # load_pair packed the target already, it resolved the head first).
        found = pair.head if getattr(pair, "head_resolved", False) else resolve_head(pair.target, head)
        layers = found[0].config.feature_layers if found else ()
        if fast_path in ("auto", "static") and on_cpu and not quantized:
            from engine.runners.cpu import try_pack

            if progress is not None:
                from engine.models.store import LoadProgress

                progress(LoadProgress("warmup", 0.5, "Packing weights for the CPU fast path (oneDNN)"))
            # In place: the pair's models are the engine's from now on (baselines load their own).
            packed = try_pack(pair.target)
            if packed and pair.draft is not None:
                try_pack(pair.draft)
            name = packed or name
        if fast_path != "eager" and not on_cpu:
            try:
                from engine.runners.graphs import build_runners

                target_runner, draft_runner, name = build_runners(
                    pair.target, pair.draft, progress=progress, max_length=context,
                    compile_k=compile_k if fast_path == "compiled" else None, hidden_layers=layers,
                    compile_tree=sibling_rows(compile_k, TREE_ALTERNATIVES) if found and compile_k <= TREE_K_MAX
                    else None,
                )
                notes += [f"{role}: {r.fallback_reason}" for role, r in (("target", target_runner),
                                                                          ("draft", draft_runner))
                          if r is not None and r.fallback_reason]
            except Exception as exc:  # any model the fast path cannot take falls back, loudly
                if fast_path in ("static", "compiled"):
                    raise
                log.warning("fast path unavailable, using eager decoding: %s", exc)
                target_runner = draft_runner = None
                name = "eager"
                notes.append(_first_line(exc))
        info = replace(pair.info, fast_path=name, fast_path_note="; ".join(notes))
        engine = cls(
            pair.target,
            pair.tokenizer,
            info,
            draft=pair.draft,
            vocab=pair.shared_vocab,
            target_runner=target_runner,
            draft_runner=draft_runner,
            max_length=context,
        )
        if found is not None:
            engine.attach_head(found[0], found[1].name, progress, compile_step=fast_path == "compiled")
        engine.measure_costs(progress)
        if progress is not None:
            from engine.models.store import LoadProgress

            progress(LoadProgress("warmup", 1.0, f"Ready ({name})"))
        return engine

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
            from engine.models.store import LoadProgress

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
        self.set_tree(self.tree_alternatives)  # the tree's graphs, where one pays

    def alternatives(self) -> int:
        """Next-best tokens a head proposal carries beside each draft (0: chains only)."""
        if self.head_runner is None or not hasattr(self.target_runner, "keep_path"):
            return 0
        if self.tree_alternatives is None:
            return TREE_ALTERNATIVES if self.device.type == "cuda" else 0
        return self.tree_alternatives

    def set_tree(self, alternatives: int | None) -> None:
        """Chooses the tree (None: the default for this device) and captures its graphs on CUDA."""
        if alternatives is not None and not 0 <= alternatives <= ALTERNATIVES:
            raise GenerationError(f"A tree keeps 0..{ALTERNATIVES} alternatives per draft token, not {alternatives}.")
        self.tree_alternatives = alternatives
        s = self.alternatives()
        capture = getattr(self.target_runner, "capture_trees", None)
        if s and capture is not None:
            with self._lock:
                capture(sibling_rows(k, s) for k in range(1, TREE_K_MAX + 1))
        if self.info.target_ms and s != self.info.tree_alternatives:  # costs measured already: this tree's too
            from engine.decoding.costs import measure_trees

            with self._lock:
                measure_trees(self)

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
        from engine.decoding.costs import measure_costs

        measure_costs(self, progress, rounds)

    def measure_again(self) -> None:
        """On a CPU, one more pass of the cost measurement, pooled with those so far (costs.measure_again):
        a sweep measures beside its runs, as the machine's speed drifts."""
        from engine.decoding.costs import measure_again

        measure_again(self)

    def step_costs(self, sampled: bool = False) -> StepCosts:
        """The measured costs as the adaptive controller reads them (measured now if they are missing);
        sampled: those of sampled rounds (temperature > 0), where they were measured."""
        from engine.measure.costmodel import costs_at, tree_costs_at

        measured = {c.source for c in self.info.proposer_costs}
        if len(self.info.target_ms) < K_MAX + 1 or not set(self.proposer_sources()) <= measured:
            self.measure_costs()
        target, costs = costs_at(self.info, sampled)
        if len(target) < K_MAX + 1:
            raise GenerationError("Adaptive K needs the forward costs, which could not be measured; choose a fixed K.")
        trees = tree_costs_at(self.info, sampled) if self.info.tree_alternatives == self.alternatives() else {}
        return StepCosts((0.0, *(target[w] for w in range(1, K_MAX + 2))), costs, trees)

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

    def generate(self, request: GenerationRequest, cancel: threading.Event | None = None) -> Generation:
        """Validates the request now (so errors surface before any step) and returns the steps."""
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
            if request.proposer in ("draft", "draft+ngram") and self.draft_runner is None:
                raise GenerationError("Speculative decoding with a draft model needs a draft; load one first.")
        if request.max_new_tokens < 1:
            raise GenerationError("max_new_tokens must be at least 1.")
        s = request.sampling
        if s.temperature < 0 or not (0.0 < s.top_p <= 1.0) or s.top_k < 0:
            raise GenerationError("temperature must be >= 0, top_p in (0, 1], top_k >= 0.")
        prompt = self.encode(request)
        room = self.target_runner.max_length - len(prompt) - (_widest_draft(request) + 1)
        if room < 1:
            raise GenerationError(
                f"The prompt is {len(prompt)} tokens; the model's context holds "
                f"{self.target_runner.max_length}. Shorten the prompt or start a new chat."
            )
        return Generation(self, request, prompt, cancel)

    def proposer_sources(self) -> tuple[DraftSource, ...]:
        """Every proposer this engine can run; each one's cost is measured at load."""
        return (("draft",) if self.draft_runner is not None else ()) + ("ngram",) + \
            (("head",) if self.head_runner is not None else ())

    def _part(self, source: str, sampling: Sampling, generator: torch.Generator | None) -> Proposer:
        if source == "draft":
            assert self.draft_runner is not None, "the draft proposer needs a draft model"
            return DraftModelProposer(self.draft_runner, sampling, self.vocab, generator)
        if source == "head":
            assert self.head_runner is not None, "generate() checks that a head is loaded"
            return HeadProposer(self.head_runner, self.target_runner, sampling, self.vocab, generator,
                                alternatives=self.alternatives())
        from engine.decoding.ngram import NgramProposer

        assert source == "ngram", f"unknown proposer {source!r}"
        return NgramProposer(device=self.device)

    def make_proposer(self, request: GenerationRequest, generator: torch.Generator | None) -> Proposer:
        if request.proposer != "draft+ngram":
            return self._part(request.proposer, request.sampling, generator)
        from engine.decoding.ngram import CombinedProposer, NgramProposer

        return CombinedProposer(NgramProposer(device=self.device), self._part("draft", request.sampling, generator))

    def make_proposers(self, request: GenerationRequest, generator: torch.Generator | None) -> ProposerSet:
        """Standard: none. Speculative: the request's proposer (draft+ngram by CombinedProposer's rule).
        Auto: each of the request's proposers on its own, and the draft head whenever one is loaded
        (auto picks what is fastest: on an H200 the head measured 1.55x where the 0.5B draft could
        not pay), the controller choosing one per step."""
        if request.mode == "standard":
            parts: tuple[Proposer, ...] = ()
        elif request.mode == "auto":
            sources = request.proposer.split("+")
            if self.head_runner is not None and "head" not in sources:
                sources.append("head")
            parts = tuple(self._part(s, request.sampling, generator) for s in sources)
        else:
            parts = (self.make_proposer(request, generator),)
        return ProposerSet(parts, self.device)

    def make_controller(self, request: GenerationRequest) -> KController:
        """FixedK for standard decoding (K = 0) and a fixed K; AdaptiveK for K_AUTO and auto mode."""
        if request.mode == "standard":
            return FixedK(0)
        if request.mode == "speculative" and request.k != K_AUTO:
            return FixedK(request.k)
        return AdaptiveK(self.step_costs(sampled=not request.sampling.greedy), self.tuning,
                         temperature=request.sampling.temperature)


def _widest_draft(request: GenerationRequest) -> int:
    """The most draft tokens one step of this request may verify."""
    return widest_draft(request.mode, request.k)


class Generation(Iterator[Step]):
    """The Steps of one request; `summary` is set once iteration ends."""

    def __init__(self, engine: Engine, request: GenerationRequest, prompt: list[int], cancel) -> None:
        self.engine = engine
        self.request = request
        self.prompt = prompt
        self.cancel = cancel or threading.Event()
        self.summary: Summary | None = None
        self.token_ids: list[int] = []  # committed tokens, EOS included
        self.tree_alternatives = 0  # alternatives beside each draft of its proposer (0: chains)
        self._steps: Iterator[Step] = self._run()

    def __next__(self) -> Step:
        return next(self._steps)

    def _run(self) -> Iterator[Step]:
        with self.engine._lock:
            yield from self._loop()

    def _loop(self) -> Iterator[Step]:
        eng, req = self.engine, self.request
        generator = torch.Generator(device=eng.device).manual_seed(req.sampling.seed)
        detok = Detokenizer(eng.tokenizer, self.prompt)
        target = eng.target_runner
        lookahead = eng.device.type == "cuda" if eng.lookahead is None else eng.lookahead
        max_new = min(req.max_new_tokens, target.max_length - len(self.prompt) - (_widest_draft(req) + 1))
        controller = eng.make_controller(req)  # chooses each round's K (0: a standard round)
        steps: list[Step] = []
        text = ""
        stop_reason: StopReason = "max_new_tokens" if max_new == req.max_new_tokens else "context_full"
        t0 = time.perf_counter()

        # 1. Prefill: both caches take the prompt except its last token, which every step feeds.
        target.reset()
        if len(self.prompt) > 1:
            target.prefill(ids_tensor(self.prompt[:-1], eng.device))
        proposers = eng.make_proposers(req, generator)  # none for standard decoding
        self.tree_alternatives = max((getattr(p, "alternatives", 0) for p in proposers.parts), default=0)
        proposers.start(self.prompt)
        pending = self.prompt[-1]
        draft_forwards = 0
        late_prefill_ms = 0.0  # a proposer's prompt prefill, deferred to its first draft (Proposer.prepare)
        prefilled = last_collect = time.perf_counter()
        # 2. Launch a round: propose (speculative) and verify with one target forward of width n+1.
        #    With lookahead, rounds are queued before the host describes the previous one, so the
        #    device computes while the host describes and the consumer takes each step. A standard
        #    round's input is the previous round's token, already on the device: two are kept
        #    queued, so the device never waits for the host. A speculative round needs the host's
        #    decision (how much was accepted), so it is queued once the previous one is committed.
        #    The controller picks each round's K first (K = 0: a standard round).
        depth = 2 if lookahead and proposers.queue_standard else 1  # rounds in flight
        queue: deque[_Launched] = deque()

        def top_up() -> None:
            while len(queue) < depth and len(self.token_ids) + len(queue) < max_new:
                if queue and queue[-1].proposal is not None:
                    return  # what follows a speculative round depends on how much it accepted
                room = max_new - len(self.token_ids) - len(queue)
                decision = controller.choose(proposers.offers(min(room, K_MAX)), room)
                if decision.k and queue:
                    return  # a speculative round starts from the committed state
                source = queue[-1].token if queue else pending
                queue.append(self._launch(proposers, decision, source, generator))

        if self.cancel.is_set():
            stop_reason = "cancelled"
        else:
            top_up()

        while queue:
            launched = queue.popleft()
            result, proposal = self._collect(launched)
            now = time.perf_counter()
            wall_ms, last_collect = (now - last_collect) * 1e3, now
            if not steps and eng.device.type == "cuda":  # the queued prefill ran inside it: unknown overhead
                wall_ms = result.prefill_ms + result.draft_ms + result.verify_ms
            # A deferred prompt prefill is prefill: not this step's drafting, overhead or wall time.
            late_prefill_ms += result.prefill_ms
            wall_ms -= result.prefill_ms
            if proposal is not None:
                draft_forwards += proposal.forwards
            # 3. Commit: accepted prefix + the target's token, cut at EOS or max_new_tokens.
            committed = result.proposed[: result.accepted] + [result.added]
            if result.extra >= 0:  # a tree round kept an alternative: the target's token after it too
                committed.append(result.extra)
            cut = len(committed)
            for i, tok in enumerate(committed):
                if tok in eng.eos_ids:
                    cut, stop_reason = i + 1, "eos"
                    break
            room = max_new - len(self.token_ids)
            if cut > room:
                cut, stop_reason = room, "max_new_tokens"
            committed = committed[:cut]
            # 4. Roll both caches back to exactly the committed prefix (minus the newest token).
            #    Standard rounds feed only committed tokens: nothing to roll back (and rounds
            #    queued behind this one have already moved the target's write position on).
            kept_draft = min(result.accepted, cut)
            if result.extra >= 0 and cut > result.accepted + 1:
                # The alternative is cached (the extra token after it is pending): move its slot and
                # hidden row next to the accepted chain.
                target.keep_path([*range(result.accepted + 1), result.extra_row])
            if proposal is not None:
                target.rollback(len(self.prompt) + len(self.token_ids) + cut - 1)
            proposers.commit(proposal, kept_draft, committed)
            controller.observe(launched.decision, len(result.proposed), result.accepted, result.draft_ms,
                               result.verify_ms, wall_ms, tree=launched.tree, extra=result.extra >= 0)
            self.token_ids += committed
            pending = committed[-1]
            done = stop_reason == "eos" or len(self.token_ids) >= max_new
            if lookahead and not done:
                top_up()
            # 5. Describe the step: texts, statuses, probabilities.
            overhead_ms = max(wall_ms - result.draft_ms - result.verify_ms, 0.0)
            step, piece = self._describe(len(steps), result, committed, kept_draft, launched, detok, t0, overhead_ms)
            text += piece
            hit = next((s for s in req.stop_strings if s and s in text), None)
            if hit is not None:
                # Text already streamed cannot be taken back: cut inside this step's text only.
                start = len(text) - len(step.text)
                cut_at = max(text.index(hit), start)
                step = _with_text(step, step.text[: cut_at - start])
                text, stop_reason, done = text[:cut_at], "stop_string", True
            if done:
                # The detokenizer still holds the bytes of a character the answer ended inside of.
                tail = detok.flush() if hit is None else ""
                step = replace(_with_text(step, step.text + tail), stop_reason=stop_reason)
                text += tail
            steps.append(step)
            yield step
            if done:
                break
            if self.cancel.is_set():  # rounds queued ahead are dropped (their cost is counted below)
                stop_reason = "cancelled"
                break
            top_up()
        if eng.device.type == "cuda":
            # A round queued ahead and then not needed (EOS, stop string, cancel) still runs:
            # the clock stops when the device is idle, so it counts here, not in the next request.
            torch.cuda.synchronize(eng.device)
        seconds = time.perf_counter() - t0
        controller.finish()
        self.summary = summarize(
            steps,
            mode=req.mode,
            k=req.k if req.mode == "speculative" else 0,
            prompt_tokens=len(self.prompt),
            seconds=seconds,
            stop_reason=stop_reason,
            draft_forwards=draft_forwards,
            prefill_s=prefilled - t0 + late_prefill_ms / 1e3,
        )
        # summarize() rebuilds text from the steps; a stop string cut keeps them consistent.
        assert self.summary.text == text, "step texts and generation text disagree"

    # -- one round: launch (queue the device work) and collect (the one host sync) ----------------
    def _launch(
        self, proposers: ProposerSet, decision: Decision, pending: int | torch.Tensor, generator: torch.Generator
    ) -> _Launched:
        """Queues one round of K = decision.k drafts. No host syncs in here: on CUDA it returns before the
        device has run it.

        pending: the token this round feeds first; for a standard round it may be the previous
        round's token still on the device ([1] long), so the round can be queued behind it.
        """
        eng, sampling = self.engine, self.request.sampling
        cuda = eng.device.type == "cuda"
        marks = [_mark(cuda, eng.device)]
        tree = False
        if decision.k == 0:  # a standard round: one target forward, one token
            ids = pending if isinstance(pending, torch.Tensor) else ids_tensor([pending], eng.device)
            logits = eng.target_runner.forward(ids)[0, : eng.vocab]  # [V]
            marks += [marks[0], marks[0]]  # no prefill, no draft phase
            if sampling.greedy:
                token = logits.argmax()
                p_shown = torch.softmax(logits, -1).gather(0, token.view(1))[0]
            else:
                probs = process(logits, sampling)  # [V]
                token = draw(probs.unsqueeze(0), generator)[0]
                p_shown = probs.gather(0, token.view(1))[0]
            outcome, n, proposal = torch.stack([torch.zeros((), device=eng.device), token.float(), p_shown]), 0, None
            next_input = token.view(1)
        else:
            next_input = None
            assert decision.source is not None, "a speculative round names its proposer"
            # The proposer's deferred prompt prefill, if any, gets its own mark: it is prefill, not drafting.
            marks.append(_mark(cuda, eng.device) if proposers.prepare(decision.source) else marks[0])
            proposal = proposers.propose(decision.source, decision.k)
            draft = proposal.tokens  # [n]
            n = draft.shape[0]
            marks.append(_mark(cuda, eng.device))
            alts = proposal.alts
            # A tree verifies point-mass drafts (q = None): a sampled chain's q needs the chain rule.
            tree = alts is not None and proposal.q is None and 0 < n <= TREE_K_MAX and \
                eng.target_runner.length + sibling_rows(n, alts.shape[1]) <= eng.target_runner.max_length
            if tree:
                outcome = self._verify_tree(pending, draft, alts, proposal, generator)
            else:
                ids = torch.cat([ids_tensor([pending], eng.device), draft])  # [n+1]
                logits = eng.target_runner.forward(ids)[:, : eng.vocab]  # [n+1, V]
                p = process(logits, sampling)  # [n+1, V]
                accepted, added, accept_prob = accept_draft(draft, proposal.q, p, sampling.greedy, generator)
                shown_p = display_probs(logits, p, sampling)  # [n+1, V]
                rows = torch.arange(n, device=eng.device)
                p_x = shown_p[rows, draft]  # [n]
                if proposal.q_display is not None:
                    q_x = proposal.q_display
                elif proposal.q is not None:
                    q_x = proposal.q[rows, draft]
                else:
                    q_x = torch.ones(n, device=eng.device)
                added_p = shown_p[accepted.view(1), added.view(1)]  # [1]
                outcome = torch.cat(
                    [draft.float(), q_x.float(), p_x.float(), accept_prob.float(),
                     torch.stack([accepted.float(), added.float()]), added_p.float()]
                )
        done = None
        if cuda:
            # Token ids stay exact in float32 (< 2**24). Pinned destination: the copy is queued too.
            outcome = torch.empty(outcome.shape, pin_memory=True).copy_(outcome, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(eng.device))
        marks.append(_mark(cuda, eng.device))
        return _Launched(outcome, n, proposal, decision, done, tuple(marks), next_input, tree=tree)

    def _verify_tree(self, pending: int, draft: torch.Tensor, alts: torch.Tensor, proposal: Proposal,
                     generator: torch.Generator | None) -> torch.Tensor:
        """Verify of a chain [n] with S alternatives per draft [n, S] as one tree forward.

        The drafts are point masses (the head's best tokens), so the acceptance rule is exact with
        q = one-hot: draft d is accepted with probability p_d(x_d) (greedy: when it is the target's
        argmax). At the first rejection the target's token `added` is drawn from p_d without x_d
        (the residual of a point mass; greedy: the argmax), after a fully accepted chain from the
        bonus row. Each output token is thus drawn from the target's law, whatever was drafted. When
        `added` is one of the alternatives at that depth, that alternative's own row of the same
        forward gives the target's next token too (`extra`, drawn from that row's law).
        Returns the round's outcome (the chain layout, then extra, its p and its row) with no host sync.
        """
        eng, sampling = self.engine, self.request.sampling
        n, s = draft.shape[0], alts.shape[1]
        tree = eng.tree(n, s)
        ids = torch.cat([ids_tensor([pending], eng.device), draft, alts.reshape(-1)])  # [1 + n(1 + S)]
        logits = eng.target_runner.forward(ids, tree)[:, : eng.vocab]  # [W, V]
        rows = torch.arange(n, device=eng.device)
        if sampling.greedy:
            best = logits.argmax(-1)  # [W] the target's token after each row
            ok = draft == best[:n]  # [n]
            accept_prob = ok.float()
            accepted = torch.cumprod(ok.long(), 0).sum()
            added = best.index_select(0, accepted.view(1))  # [1]
        else:  # the chain's rule with point masses (q = None), on the chain's rows of the tree forward
            chain = process(logits[: n + 1], sampling)  # [n + 1, V]
            accepted, added, accept_prob = accept_draft(draft, None, chain, False, generator)
            added = added.view(1)  # [1]
        beside = torch.cat([alts, alts.new_full((1, s), -1)]).index_select(0, accepted.view(1))[0]  # [S]
        hit = beside == added  # [S] (no alternative after a fully accepted chain: -1 never matches)
        row = torch.where(hit.any(), 1 + n + accepted * s + hit.long().argmax(), torch.zeros_like(accepted))
        if sampling.greedy:
            after = best.index_select(0, row.view(1))[0]
            row_law = logits.index_select(0, row.view(1)).softmax(-1)  # [1, V] what the hover shows
        else:
            row_law = process(logits.index_select(0, row.view(1)), sampling)  # [1, V]
            after = draw(row_law, generator)[0]  # drawn every round (no host sync), kept only on a hit
        extra = torch.where(hit.any(), after, torch.full_like(accepted, -1))
        # What the hover shows: under greedy the softmax of the chain's rows (and of the kept
        # alternative's row), when sampling the processed law; the other alternatives' rows never.
        shown = logits[: n + 1].softmax(-1) if sampling.greedy else chain  # [n + 1, V]
        p_x = shown[rows, draft]
        q_x = proposal.q_display if proposal.q_display is not None else torch.ones(n, device=eng.device)
        added_p = shown[accepted.view(1), added]  # [1]
        extra_p = row_law.gather(1, extra.clamp_min(0).view(1, 1))[0]  # [1]
        return torch.cat([draft.float(), q_x.float(), p_x.float(), accept_prob.float(),
                          torch.stack([accepted.float(), added[0].float()]), added_p.float(),
                          torch.stack([extra.float(), extra_p[0].float(), row.float()])])

    def _collect(self, launched: _Launched) -> tuple[_StepResult, Proposal | None]:
        """Waits for a launched round (the step's one host sync) and reads its outcome."""
        if launched.done is not None:
            launched.done.synchronize()
        values = launched.outcome.tolist()
        n = launched.n
        begin, prepared, drafted, verified = launched.marks
        if isinstance(begin, float):  # CPU: the work ran inside _launch, so host times are exact
            prefill_ms = (prepared - begin) * 1e3
            draft_ms, verify_ms = (drafted - prepared) * 1e3, (verified - drafted) * 1e3
        else:  # CUDA: device time between the events
            prefill_ms = begin.elapsed_time(prepared) if prepared is not begin else 0.0
            draft_ms = prepared.elapsed_time(drafted) if n else 0.0
            verify_ms = drafted.elapsed_time(verified)
        result = _StepResult(
            proposed=[int(x) for x in values[:n]],
            q_shown=values[n : 2 * n],
            p_shown=values[2 * n : 3 * n],
            accept_prob=values[3 * n : 4 * n],
            accepted=int(values[4 * n]),
            added=int(values[4 * n + 1]),
            added_p=values[4 * n + 2],
            draft_ms=draft_ms,
            verify_ms=verify_ms,
            prefill_ms=prefill_ms,
        )
        if launched.tree:
            result.extra, result.extra_p, result.extra_row = int(values[4 * n + 3]), values[4 * n + 4], \
                int(values[4 * n + 5])
        return result, launched.proposal

    def _describe(
        self,
        index: int,
        r: _StepResult,
        committed: list[int],
        kept_draft: int,
        launched: _Launched,
        detok: Detokenizer,
        t0: float,
        overhead_ms: float,
    ) -> tuple[Step, str]:
        """Builds the Step with one TokenView per shown token; returns it and its committed text."""
        proposal = launched.proposal
        speculative = proposal is not None
        n_shown = kept_draft if len(committed) <= r.accepted else len(r.proposed)
        proposed = r.proposed[:n_shown]
        views: list[TokenView] = []
        pieces: list[str] = []
        rejected: list[TokenView] = []
        for i, tok in enumerate(proposed):
            src = proposal.sources[i] if proposal is not None else None
            common = dict(token_id=tok, step=index, draft_pos=i, q=r.q_shown[i], p=r.p_shown[i],
                          accept_prob=r.accept_prob[i], source=src)
            if i < kept_draft:
                piece = detok.push(tok)
                pieces.append(piece)
                views.append(TokenView(text=piece, status="accepted", **common))
            else:
                rejected.append(TokenView(text=detok.peek(tok), status="rejected", **common))
        added: int | None = None
        status = None
        if len(committed) > kept_draft:
            added = committed[kept_draft]
            if not speculative or not r.proposed:
                status = "target"  # no draft this step: the target decoded on its own
            else:
                status = "bonus" if r.accepted == len(r.proposed) else "corrected"
        # Rejected tokens are shown before the correction that replaces them.
        views.extend(rejected)
        extra = committed[kept_draft + 1] if len(committed) > kept_draft + 1 else None
        if added is not None:
            piece = detok.push(added)
            pieces.append(piece)
            # A tree's alternative the target picked was drafted too: its source says so.
            views.append(
                TokenView(token_id=added, text=piece, status=status, step=index, draft_pos=None, q=None,
                          p=r.added_p, accept_prob=None, source=proposal.sources[0] if extra is not None else None)
            )
        if extra is not None:  # the target's token after that alternative, from the same forward
            piece = detok.push(extra)
            pieces.append(piece)
            views.append(TokenView(token_id=extra, text=piece, status="bonus", step=index, draft_pos=None, q=None,
                                   p=r.extra_p, accept_prob=None, source=None))
        text = "".join(pieces)
        step = Step(
            index=index,
            mode="speculative" if speculative else "standard",
            proposed=tuple(proposed),
            proposed_q=tuple(r.q_shown[:n_shown]),
            proposed_p=tuple(r.p_shown[:n_shown]),
            sources=tuple(proposal.sources[:n_shown]) if proposal is not None else (),
            accepted=kept_draft,
            added=added,
            added_status=status,
            tokens=tuple(views),
            text=text,
            new_tokens=len(committed),
            total_tokens=len(self.token_ids),
            draft_ms=r.draft_ms,
            verify_ms=r.verify_ms,
            elapsed_s=time.perf_counter() - t0,
            decision=launched.decision,
            overhead_ms=overhead_ms,
            extra=extra,
        )
        return step, text


def _with_text(step: Step, text: str) -> Step:
    """The step with `text`, its committed token views re-cut so their texts still add up to it.

    Text cut by a stop string leaves later views shorter or empty; text added by the final
    flush (the bytes of an unfinished character) goes to the last committed token, which ended it.
    """
    kept = [i for i, v in enumerate(step.tokens) if v.status != "rejected"]
    if not kept:
        return replace(step, text=text)
    views = list(step.tokens)
    rest = text
    for i in kept:
        piece, rest = rest[: len(views[i].text)], rest[len(views[i].text):]
        views[i] = replace(views[i], text=piece)
    if rest:
        views[kept[-1]] = replace(views[kept[-1]], text=views[kept[-1]].text + rest)
    return replace(step, text=text, tokens=tuple(views))


def _mark(cuda: bool, device: torch.device):
    """A point in a round's timeline: a recorded timing event on CUDA, the host clock elsewhere.

    Recorded on the stream of the engine's device, which need not be the current device (cuda:1,
    or the last GPU of a split target, where its logits and the draft live).
    """
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


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
