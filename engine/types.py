"""Plain, immutable data that flows out of the engine: requests, steps, summaries, model info."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["speculative", "standard"]
# How a token came to be; one palette entry per value (assets/palette.json).
TokenStatus = Literal["accepted", "rejected", "corrected", "bonus", "target"]
# Which proposer produced a draft token.
DraftSource = Literal["draft", "ngram"]
Proposer = Literal["draft", "ngram", "draft+ngram"]
StopReason = Literal["eos", "stop_string", "max_new_tokens", "cancelled", "context_full"]
MODES: tuple[Mode, ...] = ("speculative", "standard")
PROPOSERS: tuple[Proposer, ...] = ("draft", "ngram", "draft+ngram")


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
    mode: Mode = "speculative"  # speculative (draft + verify) or standard (target only)
    k: int = 5  # draft tokens proposed per step (speculative only)
    sampling: Sampling = field(default_factory=Sampling)  # temperature / top-k / top-p / seed
    max_new_tokens: int = 128  # hard cap on generated tokens
    stop_strings: tuple[str, ...] = ()  # generation ends once the text contains one of these
    proposer: Proposer = "draft"  # where drafts come from (speculative only)
    request_id: int = 0  # set by the app so that every signal can name its request


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


@dataclass(frozen=True)
class Summary:
    """What one generation did, as numbers."""

    mode: Mode  # mode of the generation
    k: int  # draft length used (0 for standard)
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
    target_ms: tuple[tuple[int, float], ...] = ()  # measured (width, ms per target forward) at load
    runtime: str = "torch"  # what runs the forwards: "torch" or "llamacpp"
    threads: int = 0  # CPU threads a decode uses (llama.cpp); 0 = the runtime's own default
    runtime_note: str = ""  # why this runtime, when it is not the one asked for (e.g. llama.cpp missing)
