"""The OpenAI wire format: request bodies (validated), their engine requests, and response bodies.

Fields other clients send and this server does not use (user, logprobs off, presence_penalty 0, ...)
are accepted and ignored; fields that would change the answer and cannot be honoured (n > 1, echo,
token-id prompts, non-text content) are refused with a 400 that names them.

Every response carries llama-server's `timings` (prompt_n/ms/per_second, predicted_n/ms/per_second,
draft_n, draft_n_accepted) and a `specdec` block (mode, acceptance, tokens per target forward,
acceptance by draft position). Stream chunks add `specdec.tokens`: each token of the step with its
status (accepted/rejected/corrected/bonus/target), q/p, its proposer and, in a round verified as a draft
tree, its `branch` (its rank among the drafter's choices after its parent: 0 its first choice), and the
step's `tree_width` / `tree_depth` (0 for chains); OpenAI clients ignore unknown fields.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.limits import MAX_NEW_TOKENS
from engine.types import GenerationRequest, Message, Mode, ProposerChoice, Sampling, Step, StopReason, Summary

MAX_STOPS = 4  # as OpenAI: up to four stop sequences
MAX_STOP_CHARS = 256


class ApiError(Exception):
    """A request the server refuses, with the HTTP status and OpenAI's error `type` and `code`."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    stream: bool = False
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    stop: str | list[str] | None = None
    n: int = 1
    stream_options: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"at most {MAX_STOPS} stop strings of up to {MAX_STOP_CHARS} characters")
        return v

    @field_validator("n")
    @classmethod
    def _one(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n = 1 is supported (one answer per request)")
        return v

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionBody(_Body):
    prompt: str | list[str]
    echo: bool = False

    def text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ApiError(400, "prompt must be one string (batches of prompts are not supported)", param="prompt")
        return self.prompt[0]


@dataclass(frozen=True)
class Defaults:
    """What the server decodes with where a request does not say (the `serve` command's options)."""

    mode: Mode = "speculative"  # how every request decodes
    proposer: ProposerChoice = ProposerChoice.DRAFT  # where drafts come from
    k: int = 5  # draft tokens per step; 0 = chosen per step
    temperature: float = 0.0  # used when a request gives none (OpenAI's own default is 1)
    top_k: int = 0  # no OpenAI field: the server's choice for every request
    top_p: float = 1.0  # used when a request gives none
    seed: int = 0  # used when a request gives none
    max_tokens: int = 512  # answer length when a request gives none (the context may cut it shorter)


def to_request(body: ChatBody | CompletionBody, defaults: Defaults) -> GenerationRequest:
    """The engine request for a validated body."""
    if isinstance(body, CompletionBody):
        if body.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        messages: tuple[Message, ...] = ()
        prompt: str | None = body.text()
    else:
        messages = tuple(Message("system" if m.role == "developer" else m.role, m.text())  # type: ignore[arg-type]
                         for m in body.messages)
        prompt = None
    max_tokens = (body.max_completion_tokens if isinstance(body, ChatBody) else None) or body.max_tokens
    sampling = Sampling(temperature=defaults.temperature if body.temperature is None else body.temperature,
                        top_k=defaults.top_k, top_p=defaults.top_p if body.top_p is None else body.top_p,
                        seed=defaults.seed if body.seed is None else body.seed)
    # Stop strings are cut by the server (app/serve/stops.py), exactly, not by the engine's step cut.
    return GenerationRequest(messages=messages, prompt=prompt, mode=defaults.mode, k=defaults.k, sampling=sampling,
                             max_new_tokens=min(max_tokens or defaults.max_tokens, MAX_NEW_TOKENS),
                             proposer=defaults.proposer)


# --------------------------------------------------------------------------- responses

FINISH: dict[StopReason, str] = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length",
                                 "context_full": "length", "cancelled": "stop"}


def new_id(kind: Literal["chat", "text"]) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def timings(summary: Summary) -> dict[str, float | int]:
    """llama-server's `timings` object, from the engine's Summary."""
    prompt_ms = summary.prefill_s * 1e3
    predicted_ms = max(summary.seconds - summary.prefill_s, 0.0) * 1e3
    return {
        "prompt_n": summary.prompt_tokens, "prompt_ms": prompt_ms,
        "prompt_per_second": summary.prompt_tokens / (prompt_ms / 1e3) if prompt_ms > 0 else 0.0,
        "predicted_n": summary.new_tokens, "predicted_ms": predicted_ms,
        "predicted_per_second": summary.new_tokens / (predicted_ms / 1e3) if predicted_ms > 0 else 0.0,
        "draft_n": summary.drafted, "draft_n_accepted": summary.accepted,
    }


def speculative(summary: Summary) -> dict[str, Any]:
    """This server's own block: what speculation did for this answer."""
    return {"mode": summary.mode, "drafted": summary.drafted, "accepted": summary.accepted,
            "acceptance_rate": summary.acceptance_rate,
            "tokens_per_target_forward": summary.tokens_per_target_forward,
            "target_forwards": summary.target_forwards, "k_mean": summary.k_mean,
            "per_position_acceptance": list(summary.per_position_acceptance)}


def step_tokens(step: Step) -> dict[str, Any]:
    """A stream chunk's extension: the step's tokens with how each came to be (display order), and the draft
    tree the step verified (tree_width, tree_depth: 0 for a chain or a standard step)."""
    return {"step": step.index, "proposed": len(step.proposed), "accepted": step.accepted,
            "tree_width": step.tree_width, "tree_depth": step.tree_depth,
            "tokens": [{"id": t.token_id, "text": t.text, "status": t.status, "q": t.q, "p": t.p,
                        "draft_pos": t.draft_pos, "source": t.source, "branch": t.branch} for t in step.tokens]}


def chunk(kind: Literal["chat", "text"], rid: str, model: str, created: int, text: str | None,
          finish: str | None = None, *, role: bool = False, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk (chat.completion.chunk or text_completion)."""
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], **(extra or {})}


def full(kind: Literal["chat", "text"], rid: str, model: str, text: str, finish: str, prompt_tokens: int,
         completion_tokens: int, summary: Summary) -> dict[str, Any]:
    """A whole (non-streamed) answer."""
    if kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": finish, "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens), "timings": timings(summary),
            "specdec": speculative(summary)}
