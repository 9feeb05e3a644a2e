"""Plain, immutable data that flows out of the engine: requests, steps, summaries, model info."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from engine.errors import GenerationError

# auto: speculative decoding whose controller picks the proposer and K (0 = a standard step) per step.
Mode = Literal["speculative", "standard", "auto"]
# How a token came to be; one palette entry per value (assets/palette.json).
TokenStatus = Literal["accepted", "rejected", "corrected", "bonus", "target"]
# Which proposer produced a draft token.
DraftSource = Literal["draft", "ngram", "head"]
StopReason = Literal["eos", "stop_string", "max_new_tokens", "cancelled", "context_full"]
MODES: tuple[Mode, ...] = ("auto", "speculative", "standard")
# Why a step drafted the K it did (engine/decoding/control.py); engine/measure/explain.py words it.
KReason = Literal[
    "standard",  # standard decoding was asked for
    "fixed",  # a fixed K was asked for
    "best",  # the K predicted fastest from measured costs and the acceptance measured so far
    "no_gain",  # no K is predicted to beat a standard step: the draft costs more than it saves
    "no_match",  # nothing to propose (no n-gram match), so a standard step
    "probe",  # a short draft after standard steps, to measure the acceptance again
]


class ProposerChoice(StrEnum):
    """Where a request's drafts come from; a str, so the settings' and the CLI's words compare equal."""

    DRAFT = "draft"  # the draft model
    NGRAM = "ngram"  # prompt lookup
    DRAFT_NGRAM = "draft+ngram"  # prompt lookup where the text repeats, the draft model otherwise
    HEAD = "head"  # the draft head trained on the target's hidden states

    @property
    def kinds(self) -> tuple[DraftSource, ...]:
        """The proposers it is made of, in the order auto mode offers them."""
        return _KINDS[self]


_KINDS: dict[ProposerChoice, tuple[DraftSource, ...]] = {
    ProposerChoice.DRAFT: ("draft",), ProposerChoice.NGRAM: ("ngram",),
    ProposerChoice.DRAFT_NGRAM: ("draft", "ngram"), ProposerChoice.HEAD: ("head",),
}
PROPOSERS: tuple[str, ...] = tuple(p.value for p in ProposerChoice)  # the words settings and the CLI accept


@dataclass(frozen=True)
class Message:
    role: Literal["system", "user", "assistant"]  # chat-template role
    content: str  # the message text


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 means greedy (argmax); > 0 samples
    top_k: int = 0  # keep the k most likely tokens; 0 disables
    top_p: float = 1.0  # nucleus mass to keep; 1.0 disables
    seed: int = 0  # seeds the generator used for every random draw of one generation

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class GenerationRequest:
    messages: tuple[Message, ...] = ()  # chat history; rendered with the target's chat template
    prompt: str | None = None  # raw text, used as-is (no template) when messages is empty
    mode: Mode = "speculative"  # speculative (draft + verify), standard (target only) or auto (the router)
    k: int = 5  # draft tokens per step (speculative only); K_AUTO (0): chosen per step (auto always is)
    sampling: Sampling = field(default_factory=Sampling)  # temperature / top-k / top-p / seed
    max_new_tokens: int = 128  # hard cap on generated tokens
    stop_strings: tuple[str, ...] = ()  # generation ends once the text contains one of these
    proposer: ProposerChoice = ProposerChoice.DRAFT  # where drafts come from; a word of PROPOSERS is converted
    request_id: int = 0  # set by the app so that every signal can name its request

    def __post_init__(self) -> None:
        if not isinstance(self.proposer, ProposerChoice):
            if self.proposer not in PROPOSERS:
                raise GenerationError(f"Unknown proposer {self.proposer!r}: use {', '.join(PROPOSERS)}.")
            object.__setattr__(self, "proposer", ProposerChoice(self.proposer))


@dataclass(frozen=True)
class TokenView:
    """One token as a person sees it: its text, how it came to be, and the numbers behind it."""

    token_id: int  # vocabulary id
    text: str  # text this token contributes ("" while a multi-byte character is incomplete)
    status: TokenStatus  # accepted / rejected / corrected / bonus / target
    step: int  # index of the Step that produced it
    draft_pos: int | None  # 0-based position inside the draft; None for corrected/bonus/target
    q: float | None  # draft probability of this token (processed distribution); None if not drafted
    p: float | None  # target probability of this token (processed distribution)
    accept_prob: float | None  # min(1, p/q) for drafted tokens; None otherwise
    source: DraftSource | None = None  # which proposer drafted it; None for target tokens
    # A tree round (engine/heads/tree.py): the token's rank among the drafter's choices after its parent
    # (0: its first choice, 1..: a branch); None for chains and target tokens.
    branch: int | None = None


@dataclass(frozen=True)
class Decision:
    """What the K controller chose for one step, and the numbers behind it (no words: the app says them)."""

    k: int  # draft tokens asked for; 0 = a standard step (the target alone)
    source: DraftSource | None  # the proposer asked to draft; None for a standard step
    reason: KReason  # why this K
    acceptance: float | None = None  # estimated per-token acceptance of the proposer weighed (None: not estimated)
    predicted_speedup: float | None = None  # predicted tokens/s of this choice over a standard step
    best_k: int = 0  # the best K > 0 weighed (for a standard step: what speculation would have drafted)
    best_speedup: float | None = None  # its predicted tokens/s over a standard step


@dataclass(frozen=True)
class Step:
    """One round of the decoding loop; standard decoding has one target token per step."""

    index: int  # 0-based step number within the generation
    mode: Mode  # the mode that produced this step
    proposed: tuple[int, ...]  # draft token ids proposed this step (empty for standard)
    proposed_q: tuple[float, ...]  # q(x) of each proposed token
    proposed_p: tuple[float, ...]  # p(x) of each proposed token
    sources: tuple[DraftSource, ...]  # proposer of each proposed token
    accepted: int  # how many of the proposed tokens the target accepted
    added: int | None  # the target's own token: correction or bonus (None if cut by a stop)
    added_status: TokenStatus | None  # "corrected", "bonus" or "target"
    tokens: tuple[TokenView, ...]  # display order: accepted, rejected, then the added token
    text: str  # text committed by this step (complete characters only)
    new_tokens: int  # tokens committed by this step (accepted + added, after stop cuts)
    total_tokens: int  # tokens committed so far in this generation
    draft_ms: float  # time spent proposing
    verify_ms: float  # time spent in the target forward and acceptance
    elapsed_s: float  # seconds since the generation started (prefill included)
    stop_reason: StopReason | None = None  # set on the last step only
    decision: Decision | None = None  # the K controller's choice for this step (None from engines without one)
    overhead_ms: float = 0.0  # wall time of the step outside drafting and verifying (host work, sync, consumer)
    # A tree of drafts (engine/runners/tree.py): `added` was one of the drafted alternatives, so the
    # target's token after it came from the same forward: committed after `added` (status "bonus").
    extra: int | None = None
    # A round verified as a tree: the draft tokens it verified and how deep they went (0, 0: a chain or
    # a standard step). A dynamic tree (engine/heads/tree.py) verifies its N nodes K levels deep.
    tree_width: int = 0
    tree_depth: int = 0
    # A walked dynamic tree: per shown draft position, every token drafted there under the path (the shown
    # one among them, the drafter's order). Sampling accepts one of them with the sum of their p.
    tree_children: tuple[tuple[int, ...], ...] = ()


# Which model is reading the prompt: the target, the draft model, or the draft head (its layers).
PrefillPart = Literal["target", "draft", "head"]


@dataclass(frozen=True)
class PrefillProgress:
    """How far one model has read the prompt (engine/decoding/prefill.py), reported between chunks."""

    part: PrefillPart  # the model reading it
    done: int  # prompt tokens in its cache so far
    total: int  # prompt tokens it reads in all (the prompt less its last token, which the first step feeds)


@dataclass(frozen=True)
class Summary:
    """What one generation did, as numbers."""

    mode: Mode  # mode of the generation
    k: int  # the request's draft length (0 for standard, and K_AUTO when chosen per step: see k_mean)
    prompt_tokens: int  # tokens in the rendered prompt
    new_tokens: int  # tokens generated
    seconds: float  # wall time, prefill included
    tokens_per_s: float  # new_tokens / seconds
    drafted: int  # draft tokens proposed in total
    accepted: int  # draft tokens accepted in total
    acceptance_rate: float  # accepted / drafted (0 when nothing was drafted)
    tokens_per_target_forward: float  # new tokens per verify/decode forward of the target
    per_position_acceptance: tuple[float, ...]  # P(accepted | reached) for draft positions 0..K-1
    accepted_length_histogram: tuple[int, ...]  # count of steps that accepted 0..K tokens
    target_forwards: int  # target forwards after prefill
    draft_forwards: int  # draft forwards after prefill
    stop_reason: StopReason  # why generation ended
    text: str  # the generated text
    k_mean: float = 0.0  # mean K asked for per step (standard steps count 0)
    standard_steps: int = 0  # steps the controller made standard (K = 0) in speculative or auto mode
    prefill_s: float = 0.0  # time to take the prompt into the caches
    first_token_s: float = 0.0  # seconds from the start until the first token was committed (0: none was)
    draft_s: float = 0.0  # time spent drafting (sum of the steps' draft_ms)
    verify_s: float = 0.0  # time spent in target forwards and acceptance (sum of verify_ms)
    overhead_s: float = 0.0  # the rest: seconds - prefill_s - draft_s - verify_s (host work, syncs, consumer)
    decision: Decision | None = None  # the controller's last decision: what it concluded for this answer
    drafter: DraftSource | None = None  # the proposer that drafted most of the draft tokens (None: none drafted)


@dataclass(frozen=True)
class ProposerCost:
    """What one proposer's drafting costs, measured by timing its own propose() (engine.measure.costmodel)."""

    source: DraftSource  # the proposer ("draft", "ngram", ...)
    per_token_ms: float  # each drafted token (a draft-model forward; ~0 for n-gram lookup)
    per_proposal_ms: float  # once per step that drafts (set-up, lookups), whatever K


@dataclass(frozen=True)
class ModelInfo:
    """What a loaded pair is, for status bars, exports and bench configs."""

    target_name: str  # short display name of the target
    draft_name: str | None  # short display name of the draft (None: no draft loaded)
    device: str  # "cpu" or "cuda[:n]"
    dtype: str  # "bfloat16" / "float32" / "float16"
    fast_path: str  # "eager" or the name of the accelerated path in use
    vocab_size: int  # shared vocabulary size compared on
    draft_ms: float = 0.0  # measured ms per 1-token draft forward at load (0: not measured / no draft)
    target_ms: tuple[tuple[int, float], ...] = ()  # measured (width, ms per target forward) at load, widths 1..K_MAX+1
    proposer_costs: tuple[ProposerCost, ...] = ()  # measured at load: what drafting costs, per proposer
    measure_s: float = 0.0  # seconds the cost measurement took at load
    target_precision: str = ""  # "int8" / "nf4" / a float dtype; "" means `dtype`
    draft_precision: str = ""  # the same for the draft
    devices: tuple[str, ...] = ()  # every device holding target weights, when it is split over several
    # torch: why part of the pair runs without CUDA graphs; llama.cpp: its kernels left off ("" when nothing to say)
    fast_path_note: str = ""
    head_name: str | None = None  # the draft head loaded for this target (None: none fits or none asked)
    head_ms: float = 0.0  # measured ms per draft token of the head at load (0: not measured / no head)
    # The same costs for sampled rounds (temperature > 0), measured apart: sampled drafts and the sampled
    # acceptance do more work per step. Empty (or a proposer missing): priced as greedy (costmodel.costs_at).
    sampled_costs: tuple[ProposerCost, ...] = ()  # per proposer, its propose() drawing its drafts
    sampled_target_ms: tuple[tuple[int, float], ...] = ()  # per verify width, sampled rounds (GPU only)
    # Greedy head rounds verified as trees (engine/runners/tree.py): per K, the round's verify ms with
    # `tree_alternatives` alternatives beside each draft, or of a dynamic tree of `tree_nodes` nodes K
    # levels deep (engine/heads/tree.py); empty when the engine drafts no trees.
    tree_ms: tuple[tuple[int, float], ...] = ()
    tree_alternatives: int = 0
    tree_nodes: int = 0
    # A dynamic tree's drafting per K, timed in its rounds (TreeDrafter.rehearse: catch-up, K levels, pick): a
    # level ranks F * F children, dearer than a chain step's head_ms. Empty for chains and sibling trees.
    tree_draft_ms: tuple[tuple[int, float], ...] = ()
    runtime: str = "torch"  # what runs the forwards: "torch" or "llamacpp"
    threads: int = 0  # CPU threads a one-row forward uses (llama.cpp, torch on a CPU); 0 = the runtime's own default
    threads_batch: int = 0  # CPU threads a wider forward (prompt, verify) uses; 0 = as `threads`
    threads_note: str = ""  # how the counts were chosen and how idle threads wait (cpu_threads.ThreadPolicy.describe)
    runtime_note: str = ""  # why this runtime, when it is not the one asked for (e.g. llama.cpp missing)
    # How far the forward costs above can be believed (engine/decoding/cost_check.py): "measured" (and
    # consistent), "kept" (measured on this machine at an earlier start; checked again after Ready),
    # "measuring" (part measured before Ready, the rest after it: no verdict yet),
    # "disturbed" (inconsistent or implausible: measured again, no verdict until then), "unsteady"
    # (stayed disturbed: no verdict); "" where nobody judged them.
    costs_state: str = ""
    costs_note: str = ""  # why they looked disturbed, or when the kept ones were measured


@dataclass(frozen=True)
class SweepRow:
    """One configuration of a sweep, measured over every prompt of it (engine.measure.sweep)."""

    mode: Mode  # "standard" (the baseline row of its temperature), "speculative" or "auto"
    proposer: str | None  # where drafts came from (a word of PROPOSERS); None for standard
    k: int  # the fixed K; K_AUTO (0) when chosen per step; 0 for standard
    temperature: float  # sampling temperature (0 = greedy)
    tokens_per_s: float  # total tokens / total seconds over the prompts
    speedup: float  # tok/s over standard decoding at the same temperature, measured in the same run
    acceptance: float  # accepted / drafted
    tokens_per_target_forward: float  # new tokens per target forward
    acceptance_by_position: tuple[float, ...]  # P(accepted | reached) per draft position
    drafting_share: float  # share of the wall time spent drafting
    predicted_speedup: float | None  # what the cost model predicts from its measured acceptance and overheads
    identical: int | None  # greedy: outputs identical to standard's; None when sampling
    compared: int  # outputs compared for identity (0 when sampling)
    runs: int  # timed generations behind the row
    k_mean: float = 0.0  # mean K chosen per step (equals k for a fixed K)
    spread: float = 0.0  # how far the speedup can be off from noise (engine.measure.verdict.speedup_spread)

    @property
    def label(self) -> str:
        """"standard", "draft K=3", "ngram K=auto", "auto draft+ngram" (the temperature is separate)."""
        if self.mode == "standard":
            return "standard"
        if self.mode == "auto":
            return f"auto {self.proposer}"
        return f"{self.proposer} K={self.k or 'auto'}"


# Which troubleshooting rule fired (engine/measure/diagnostics.py says it in words).
DiagnosisKind = Literal["position_one", "temperature", "draft_cost", "best_k", "memory", "category"]
# What the app can do about it with one click, if anything.
DiagnosisAction = Literal["apply_k", "lower_temperature", "use_auto", "none"]


@dataclass(frozen=True)
class Diagnosis:
    """A finding from this session's measured data, the number behind it and what to do."""

    kind: DiagnosisKind  # the rule that fired
    value: float  # the measured number behind it (an acceptance, a speedup, a share of memory)
    reference: float  # what it is compared with (the other positions, standard decoding, the limit)
    action: DiagnosisAction  # what applying it does
    k: int = 0  # for apply_k: the K to apply
    temperature: float = 0.0  # the temperature it concerns (temperature rule: the lower one)
    category: str = ""  # for category: the prompt category where speculation loses


@dataclass(frozen=True)
class TrainingProgress:
    """What a draft-head distillation is doing, for a progress bar and live loss/acceptance curves."""

    phase: str  # "load", "data", "train", "eval", "export" or "done"
    fraction: float  # of the whole time budget used so far, 0..1
    eta_s: float  # seconds left in the budget (or in this call, if it ends first)
    message: str  # one line for people
    # The log line just written, if any: kind "train" (step, loss, acc per draft step), "eval" (step,
    # acceptance per draft position), "data", "vocab", "export" or "call".
    record: dict | None = None


# --------------------------------------------------------------------------- memory plans
# The memory plan is computed by engine.models.plan before any weight loads; views draw it from these.

PlanKind = Literal["weights", "kv", "graphs", "activations", "runtime"]


@dataclass(frozen=True)
class PlanItem:
    """One line of a device's memory plan."""

    kind: PlanKind  # what the bytes hold
    model: str  # "target", "draft", or "" for what both share (runtime, activations)
    label: str  # what a person reads, e.g. "target weights (nf4)"
    bytes: int  # planned bytes


@dataclass(frozen=True)
class DevicePlan:
    """What one device will hold at the peak, against what it has."""

    device: str  # "cuda:0", "cuda:1", "cpu"
    items: tuple[PlanItem, ...]  # the planned lines, weights first
    capacity: int | None  # bytes this process may use there; None when unknown
    capacity_source: str  # "free memory", "given", "RAM available" or "unknown"

    @property
    def total(self) -> int:
        return sum(i.bytes for i in self.items)

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.total <= self.capacity


@dataclass(frozen=True)
class PlanChange:
    """A change to the chosen models and settings that makes the plan fit."""

    description: str  # what a person reads, e.g. "quantize the target to nf4"
    target_precision: str  # precision of the target after the change
    draft_precision: str  # precision of the draft after the change
    context: int  # context length after the change
    draft: str | None  # draft model spec after the change (None: the packaged default)
    with_draft: bool  # False when the change drops the draft model
    draft_name: str | None  # display name of another draft the change picks (None: the same draft)
    needed: int  # bytes the busiest device needs after the change


@dataclass(frozen=True)
class MemoryPlan:
    """A pair's planned memory on every device it uses, and what to change when it does not fit."""

    target_name: str  # display name of the target
    draft_name: str | None  # display name of the draft (None: no draft)
    target_precision: str  # "bfloat16", "int8", "nf4", ...
    draft_precision: str | None  # the draft's precision (None: no draft)
    context: int  # positions each KV cache holds
    runner: str  # the runner the engine will use for the target ("cuda-graphs", "static-eager", "eager", ...)
    devices: tuple[DevicePlan, ...]  # one per device used, the target's first layers first
    suggestion: PlanChange | None = None  # the cheapest change that fits (only when this does not)
    notes: tuple[str, ...] = ()  # caveats a person should read (sizes from a preset's config, offline, ...)
    target_layers: tuple[int, ...] = ()  # index into devices of each target layer (all 0 on one device)
    output_device: int = 0  # index into devices of the output head (the draft and the logits live there)

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices)

    @property
    def total(self) -> int:
        return sum(d.total for d in self.devices)
